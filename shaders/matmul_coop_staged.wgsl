// matmul_coop_staged.wgsl: the `gpu` mat-mul for several tokens (prefill) on
// devices with cooperative matrices (tensor cores), for weights in a block
// format: y (+)= W x (+ bias) (needs a weight-format prelude; matmul_io.wgsl
// has the shared parameters, bindings and store). Needs SHADER_F16, SUBGROUP
// and EXPERIMENTAL_COOPERATIVE_MATRIX with the 16x16x16 f16 x f16 -> f32
// configuration, a fixed subgroup size and K a multiple of 32 (rows hold
// whole blocks, so every block format has it); src/device.rs picks it.
//
// matmul_coop.wgsl loads f16 weights into the matrix units straight from
// memory; a block format has to be dequantized first, so here both operands
// go through workgroup memory. As a GEMM, C = A B with A = W (rows x K),
// B = x^T (K x tokens) and C = y^T (see matmul_coop.wgsl). A workgroup of
// four subgroups (SUBGROUP_SIZE lanes each, an override constant set from
// the device profile) computes a 128-row x 64 * WIDE-token tile. WIDE is an
// override constant set by the launcher:
//   1 (`CoopStaged`): 128 x 64 tiles; subgroup s owns rows 32s .. 32s + 32
//     and all 64 tokens, as 2 x 4 accumulators of 16 x 16 (six matrix loads
//     from workgroup memory per 8 products);
//   2 (`CoopStagedWide`): 128 x 128 tiles; subgroup s owns rows
//     64 (s / 2) .. + 64 and tokens 64 (s % 2) .. + 64, as 4 x 4
//     accumulators (eight loads per 16 products, and each weight
//     dequantized once per 128 tokens, but half the workgroups and twice
//     the accumulator registers; `--kernels tuned` times both).
// K is walked 32 values at a time: all lanes dequantize that slice of W
// (128 rows x 32 values, through the prelude's `weight4`, eight adjacent
// lanes per row so loads are coalesced) and convert that slice of x
// (64 * WIDE tokens x 32 values) to f16 in workgroup memory (rows and
// tokens past the ends are zeros), then each subgroup multiplies its A
// tiles with its four B tiles, twice (K_STRIDE, below, pads the staged rows
// for `CoopStagedPadded` and `CoopStagedPrefetch`; PREFETCH issues the next
// slice's loads before the products, for `CoopStagedPrefetch` and
// `CoopStagedTokensFast`). Values are rounded to f16 on the way
// in (weights and activations; a lane holds its loads in f16), with f32
// accumulation. With BUFFERS = 2 (`CoopStagedDouble`, below) the slices
// are double-buffered: each step's loads are issued before the products of
// the step before, and staged into the other buffer after them, so one
// barrier per K step instead of two; with X_F16 x comes from its f16 copy
// (x_f16.wgsl, once per product), loaded without a conversion. The epilogue goes
// through workgroup memory one accumulator at a time, so bias, residual and
// the row and token bounds are applied per element by `store`.
//
// Bindings (group 0): as matmul_io.wgsl, with
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
//   7 x16   storage read  [ceil(n / 32) * 32, k/4] vec4<f16>: x in f16
//           (X_F16 only; a dummy otherwise)
// Workgroup memory: (128 + 64 WIDE) K_STRIDE BUFFERS halves and 4 KiB of
// accumulator tiles: 12 KiB + 4 (`CoopStaged`) to 40 KiB + 4
// (`CoopStagedDouble`: past what WebGPU promises, within what tensor-core
// GPUs have; `Gpu::pipeline` checks).
// Dispatch: (ceil(rows / 128), ceil(n / (64 * WIDE)), 1), or with
// TOKENS_FAST (below, `CoopStagedTokensFast`) the two swapped.
enable f16;
enable subgroups;
enable wgpu_cooperative_matrix;

@group(0) @binding(7) var<storage, read> x16: array<vec4<f16>>;

override SUBGROUP_SIZE: u32 = 32u;
// 1 or 2: tiles of 64 * WIDE tokens (see above).
override WIDE: u32 = 1u;
// Slice buffers: 1, or 2 (double-buffered, see above).
override BUFFERS: u32 = 1u;
// Whether x is read from x16, already in f16 (`CoopStagedDouble`).
override X_F16: bool = false;

// Values of K staged at a time.
const K_STEP: u32 = 32u;
// Halves from one staged row to the next: K_STEP (32, today's `CoopStaged`),
// or K_STEP + 8 (40, `CoopStagedPadded`): with rows 64 bytes apart the 16
// rows of a matrix load fall on two sets of 8 banks (8-way conflicts);
// 80 bytes apart they spread over all 32 (rows stay 16-byte aligned).
override K_STRIDE: u32 = 32u;

// Whether each step's global loads are issued before the step before it
// multiplies (`CoopStagedPrefetch`), so that their latency hides behind
// the matrix products, at the cost of holding them in registers; else
// each step loads, stages and multiplies in turn.
override PREFETCH: bool = false;
// Which grid axis walks the tokens (as in matmul_coop.wgsl: with
// TOKENS_FAST, neighbours in launch order share their weight rows).
override TOKENS_FAST: bool = false;
// The most vec4 loads one lane makes per step: (1,024 + 512 * WIDE) / lanes,
// with at least 4 lanes per subgroup (16 lanes a workgroup; lavapipe's
// narrowest, which the emulated tests run; matrix units come in subgroups
// of 16 and more, where the unrolled loops use 24 or fewer, 32 with
// WIDE = 2).
const SLICE_LOADS_MAX: u32 = 128u;

// A slice: row r's K_STEP values at r * K_STRIDE (row-major); buffer b
// from w_slice_at(b).
var<workgroup> w_slice: array<f16, 128u * K_STRIDE * BUFFERS>;
// B slice: token t's K_STEP values at t * K_STRIDE (column-major); buffer
// b from x_slice_at(b).
var<workgroup> x_slice: array<f16, 64u * WIDE * K_STRIDE * BUFFERS>;

fn w_slice_at(buf: u32) -> u32 {
    return buf * 128u * K_STRIDE;
}

fn x_slice_at(buf: u32) -> u32 {
    return buf * 64u * WIDE * K_STRIDE;
}
// One 16 x 16 accumulator per subgroup, column-major: (row i, token j) at
// 256 s + j * 16 + i.
var<workgroup> c_tiles: array<f32, 1024>;

// This lane's share of one step's slices, as loaded and rounded to f16:
// element e = lane + i * lanes, W's 1,024 (row e / 8, packed group e % 8)
// first, then x's 512 * WIDE (token (e - 1024) / 8); rows and tokens past
// the ends are zeros. Lanes divide 1,024, so each i is W's or x's for
// every lane.
struct Slices {
    v: array<vec4<f16>, SLICE_LOADS_MAX>,
}

fn load_slices(k0: u32, lane: u32, row0: u32, tok0: u32, n: u32) -> Slices {
    let lanes = 4u * SUBGROUP_SIZE;
    var s: Slices;
    for (var i = 0u; i < (1024u + 512u * WIDE) / lanes; i++) {
        let e = lane + i * lanes;
        s.v[i] = vec4<f16>(0.0);
        if (e < 1024u) {
            if (row0 + e / 8u < p.rows) {
                s.v[i] = vec4<f16>(weight4(w_row(row0 + e / 8u, p.k4) + k0 + e % 8u));
            }
        } else if (tok0 + (e - 1024u) / 8u < n) {
            let at = (tok0 + (e - 1024u) / 8u) * p.k4 + k0 + e % 8u;
            if (X_F16) {
                s.v[i] = x16[at];
            } else {
                s.v[i] = vec4<f16>(x[at]);
            }
        }
    }
    return s;
}

// Stores a step's slices into slice buffer `buf` of workgroup memory (rows
// K_STRIDE apart).
fn stage_slices(s: Slices, lane: u32, buf: u32) {
    let lanes = 4u * SUBGROUP_SIZE;
    var sv = s;
    for (var i = 0u; i < (1024u + 512u * WIDE) / lanes; i++) {
        let e = lane + i * lanes;
        let v = sv.v[i];
        if (e < 1024u) {
            let at = w_slice_at(buf) + (e / 8u) * K_STRIDE + (e % 8u) * 4u;
            w_slice[at] = v.x;
            w_slice[at + 1u] = v.y;
            w_slice[at + 2u] = v.z;
            w_slice[at + 3u] = v.w;
        } else {
            let at = x_slice_at(buf) + ((e - 1024u) / 8u) * K_STRIDE + (e % 8u) * 4u;
            x_slice[at] = v.x;
            x_slice[at + 1u] = v.y;
            x_slice[at + 2u] = v.z;
            x_slice[at + 3u] = v.w;
        }
    }
}

fn store_tile(
    c: coop_mat16x16<f32, C>,
    sg: u32,
    row: u32,
    tok: u32,
    sg_lane: u32,
    n: u32,
) {
    coopStore(c, &c_tiles[sg * 256u], 16u);
    workgroupBarrier();
    for (var e = sg_lane; e < 256u; e += SUBGROUP_SIZE) {
        let t = tok + e / 16u;
        let r = row + e % 16u;
        if (t < n && r < p.rows) {
            store(t, r, c_tiles[sg * 256u + e]);
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(4 * SUBGROUP_SIZE)
fn matmul(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let n = step_rows(step, p.count_sel);
    let lanes = 4u * SUBGROUP_SIZE;
    let tokens = 64u * WIDE;
    let tile = select(wg.xy, wg.yx, TOKENS_FAST);
    let row0 = tile.x * 128u;
    let tok0 = tile.y * tokens;
    // No early return: the dispatch covers exactly the tiles, and
    // cooperative operations and barriers must stay in uniform control flow
    // (WIDE is an override constant: uniform).
    // This subgroup's rows and tokens within the tile.
    let a_row = (sg / WIDE) * 32u * WIDE;
    let b_tok = (sg % WIDE) * 64u;
    // Row tiles 0 and 1 always, 2 and 3 with WIDE = 2.
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c22 = coop_mat16x16<f32, C>();
    var c23 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();
    var c32 = coop_mat16x16<f32, C>();
    var c33 = coop_mat16x16<f32, C>();
    var next: Slices;
    if (PREFETCH || BUFFERS == 2u) {
        next = load_slices(0u, lane, row0, tok0, n);
    }
    // Double-buffered: the first step's slices staged before the loop.
    if (BUFFERS == 2u) {
        stage_slices(next, lane, 0u);
        workgroupBarrier();
    }
    var buf = 0u;
    for (var k0 = 0u; k0 < bounded(p.k4); k0 += K_STEP / 4u) {
        // 128 rows x 8 packed groups of W, 64 * WIDE tokens x 8 vec4 of x.
        let more = k0 + K_STEP / 4u < p.k4;
        if (BUFFERS == 1u) {
            var cur: Slices;
            if (PREFETCH) {
                cur = next;
            } else {
                cur = load_slices(k0, lane, row0, tok0, n);
            }
            stage_slices(cur, lane, 0u);
            workgroupBarrier();
        }
        // The next step's loads, in flight during this step's products.
        if ((PREFETCH || BUFFERS == 2u) && more) {
            next = load_slices(k0 + K_STEP / 4u, lane, row0, tok0, n);
        }
        let wb = w_slice_at(buf);
        let xb = x_slice_at(buf);
        for (var kk = 0u; kk < K_STEP; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&w_slice[wb + a_row * K_STRIDE + kk], K_STRIDE);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&w_slice[wb + (a_row + 16u) * K_STRIDE + kk], K_STRIDE);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&x_slice[xb + b_tok * K_STRIDE + kk], K_STRIDE);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&x_slice[xb + (b_tok + 16u) * K_STRIDE + kk], K_STRIDE);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&x_slice[xb + (b_tok + 32u) * K_STRIDE + kk], K_STRIDE);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&x_slice[xb + (b_tok + 48u) * K_STRIDE + kk], K_STRIDE);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
            if (WIDE == 2u) {
                let a2 = coopLoadT<coop_mat16x16<f16, A>>(&w_slice[wb + (a_row + 32u) * K_STRIDE + kk], K_STRIDE);
                let a3 = coopLoadT<coop_mat16x16<f16, A>>(&w_slice[wb + (a_row + 48u) * K_STRIDE + kk], K_STRIDE);
                c20 = coopMultiplyAdd(a2, b0, c20);
                c21 = coopMultiplyAdd(a2, b1, c21);
                c22 = coopMultiplyAdd(a2, b2, c22);
                c23 = coopMultiplyAdd(a2, b3, c23);
                c30 = coopMultiplyAdd(a3, b0, c30);
                c31 = coopMultiplyAdd(a3, b1, c31);
                c32 = coopMultiplyAdd(a3, b2, c32);
                c33 = coopMultiplyAdd(a3, b3, c33);
            }
        }
        // Double-buffered: the next step's slices go into the other
        // buffer, which no subgroup reads in this step, so one barrier
        // serves both (single: the products finish before the next stage).
        if (BUFFERS == 2u && more) {
            stage_slices(next, lane, 1u - buf);
        }
        workgroupBarrier();
        buf = (buf + 1u) % BUFFERS;
    }
    let r0 = row0 + a_row;
    let t0 = tok0 + b_tok;
    store_tile(c00, sg, r0, t0, sg_lane, n);
    store_tile(c01, sg, r0, t0 + 16u, sg_lane, n);
    store_tile(c02, sg, r0, t0 + 32u, sg_lane, n);
    store_tile(c03, sg, r0, t0 + 48u, sg_lane, n);
    store_tile(c10, sg, r0 + 16u, t0, sg_lane, n);
    store_tile(c11, sg, r0 + 16u, t0 + 16u, sg_lane, n);
    store_tile(c12, sg, r0 + 16u, t0 + 32u, sg_lane, n);
    store_tile(c13, sg, r0 + 16u, t0 + 48u, sg_lane, n);
    if (WIDE == 2u) {
        store_tile(c20, sg, r0 + 32u, t0, sg_lane, n);
        store_tile(c21, sg, r0 + 32u, t0 + 16u, sg_lane, n);
        store_tile(c22, sg, r0 + 32u, t0 + 32u, sg_lane, n);
        store_tile(c23, sg, r0 + 32u, t0 + 48u, sg_lane, n);
        store_tile(c30, sg, r0 + 48u, t0, sg_lane, n);
        store_tile(c31, sg, r0 + 48u, t0 + 16u, sg_lane, n);
        store_tile(c32, sg, r0 + 48u, t0 + 32u, sg_lane, n);
        store_tile(c33, sg, r0 + 48u, t0 + 48u, sg_lane, n);
    }
}
