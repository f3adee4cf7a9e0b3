// matmul_coop.wgsl: the `gpu` mat-mul for several tokens (prefill) on devices
// with cooperative matrices (tensor cores): y (+)= W x (+ bias), W in f16
// (matmul_io.wgsl has the shared parameters, bindings and store). Needs
// SHADER_F16 and EXPERIMENTAL_COOPERATIVE_MATRIX with the 16x16x16 f16 x f16
// -> f32 configuration, a fixed subgroup size, rows a multiple of 64 and K a
// multiple of 64 (src/device.rs picks matmul_tiled.wgsl otherwise).
//
// As a GEMM, C = A B with A = W (rows x K, row-major, stride K), B = x^T
// (K x tokens: token t's values are contiguous, so B is column-major with
// stride K) and C = y^T (stored column-major into y). One workgroup is one
// subgroup (SUBGROUP_SIZE lanes, an override constant set from the device
// profile) and computes a 64-row x 32-token tile as 4 x 2 accumulators of
// 16 x 16. K is walked 64 values at a time: the lanes convert that slice of
// x (32 tokens x 64 values) to f16 in workgroup memory (tokens past n are
// zeros), then for each 16-value step load the four A tiles straight from
// memory and multiply them with the two B tiles (X_STRIDE, below, pads the
// staged rows for `CoopPadded` and `CoopTokensFast`). With X_F16 (below,
// `CoopX16`) x comes in f16 already (x_f16.wgsl, once per product) and the
// B tiles load straight from it too: no staging, no barrier in the K loop.
// The epilogue goes through workgroup memory one accumulator at a time, so
// bias, residual and the token bound are applied per element by `store`.
//
// Bindings (group 0): as matmul_io.wgsl, with
//   2 w     storage read  [rows, k] f16
//   7 x16   storage read  [ceil(n / 32) * 32, k] f16: x in f16 (X_F16 only;
//           a dummy otherwise). Its rows past n are read (into products
//           whose tokens `store` drops), so it holds whole 32-token tiles.
// Dispatch: (rows / 64, ceil(n / 32), 1), or with TOKENS_FAST (below,
// `CoopTokensFast`, `CoopX16`) (ceil(n / 32), rows / 64, 1).
enable f16;
enable wgpu_cooperative_matrix;

@group(0) @binding(2) var<storage, read> w: array<f16>;
@group(0) @binding(7) var<storage, read> x16: array<f16>;

override SUBGROUP_SIZE: u32 = 32u;

// Halves from one token's staged values to the next: 64 (`Coop`), or 72
// (`CoopPadded`): 128 bytes apart, the 16 tokens of a matrix load all
// start on bank 0 (16-way conflicts); 144 bytes apart they spread over the
// banks (and stay 16-byte aligned).
override X_STRIDE: u32 = 64u;

// Which grid axis walks the tokens: with TOKENS_FAST, workgroups next to
// each other in launch order share their weight rows, so a weight tile is
// read from memory once and served from L2 to every token tile; else they
// share their tokens, and each weight tile comes again for each token tile
// after all rows have passed (the whole matrix, far larger than L2).
override TOKENS_FAST: bool = false;

// Whether x is read from x16, already in f16 (`CoopX16`), rather than
// from x in f32, rounded and staged by each workgroup.
override X_F16: bool = false;

// B slice: token t's 64 values at t * X_STRIDE (column-major).
var<workgroup> x_slice: array<f16, 32u * X_STRIDE>;
// One 16 x 16 accumulator, column-major: (row i, token j) at j * 16 + i.
var<workgroup> c_tile: array<f32, 256>;

fn store_tile(c: coop_mat16x16<f32, C>, row: u32, tok: u32, lane: u32, n: u32) {
    coopStore(c, &c_tile[0], 16u);
    workgroupBarrier();
    for (var e = lane; e < 256u; e += SUBGROUP_SIZE) {
        let t = tok + e / 16u;
        if (t < n) {
            store(t, row + e % 16u, c_tile[e]);
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(SUBGROUP_SIZE)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let n = step_rows(step, p.count_sel);
    let tile = select(wg.xy, wg.yx, TOKENS_FAST);
    let row0 = tile.x * 64u;
    let tok0 = tile.y * 32u;
    // No early return: the dispatch covers exactly rows / 64 x ceil(n / 32)
    // tiles, and cooperative operations must stay in uniform control flow.
    let k_len = bounded(p.k4 * 4u);
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < k_len; k0 += 64u) { // loop bound: k_len = bounded(..)
        if (X_F16) {
            // Token t's values at t * k_len of x16: B column-major, stride K.
            // (The products below repeat the staged path's: WGSL cannot
            // choose between pointers into two address spaces, and a
            // cooperative matrix is not declared without a value here.)
            for (var kk = 0u; kk < 64u; kk += 16u) {
                let b_at = tok0 * k_len + k0 + kk;
                let b0 = coopLoad<coop_mat16x16<f16, B>>(&x16[b_at], k_len);
                let b1 = coopLoad<coop_mat16x16<f16, B>>(&x16[b_at + 16u * k_len], k_len);
                let a_at = row0 * k_len + k0 + kk;
                let a0 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at], k_len);
                let a1 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at + 16u * k_len], k_len);
                let a2 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at + 32u * k_len], k_len);
                let a3 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at + 48u * k_len], k_len);
                c00 = coopMultiplyAdd(a0, b0, c00);
                c01 = coopMultiplyAdd(a0, b1, c01);
                c10 = coopMultiplyAdd(a1, b0, c10);
                c11 = coopMultiplyAdd(a1, b1, c11);
                c20 = coopMultiplyAdd(a2, b0, c20);
                c21 = coopMultiplyAdd(a2, b1, c21);
                c30 = coopMultiplyAdd(a3, b0, c30);
                c31 = coopMultiplyAdd(a3, b1, c31);
            }
            continue;
        }
        // 32 tokens x 16 vec4 of x.
        for (var e = lane; e < 512u; e += SUBGROUP_SIZE) {
            let t = e / 16u;
            let q = e % 16u;
            var v = vec4<f32>(0.0);
            if (tok0 + t < n) {
                v = x[(tok0 + t) * p.k4 + k0 / 4u + q];
            }
            let at = t * X_STRIDE + q * 4u;
            x_slice[at] = f16(v.x);
            x_slice[at + 1u] = f16(v.y);
            x_slice[at + 2u] = f16(v.z);
            x_slice[at + 3u] = f16(v.w);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 64u; kk += 16u) {
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&x_slice[kk], X_STRIDE);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&x_slice[16u * X_STRIDE + kk], X_STRIDE);
            let a_at = row0 * k_len + k0 + kk;
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at], k_len);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at + 16u * k_len], k_len);
            let a2 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at + 32u * k_len], k_len);
            let a3 = coopLoadT<coop_mat16x16<f16, A>>(&w[a_at + 48u * k_len], k_len);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c20 = coopMultiplyAdd(a2, b0, c20);
            c21 = coopMultiplyAdd(a2, b1, c21);
            c30 = coopMultiplyAdd(a3, b0, c30);
            c31 = coopMultiplyAdd(a3, b1, c31);
        }
        workgroupBarrier();
    }
    store_tile(c00, row0, tok0, lane, n);
    store_tile(c01, row0, tok0 + 16u, lane, n);
    store_tile(c10, row0 + 16u, tok0, lane, n);
    store_tile(c11, row0 + 16u, tok0 + 16u, lane, n);
    store_tile(c20, row0 + 32u, tok0, lane, n);
    store_tile(c21, row0 + 32u, tok0 + 16u, lane, n);
    store_tile(c30, row0 + 48u, tok0, lane, n);
    store_tile(c31, row0 + 48u, tok0 + 16u, lane, n);
}
