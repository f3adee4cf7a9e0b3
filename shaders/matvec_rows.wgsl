// matvec_rows.wgsl: the workgroup shape and lane loops both `gpu` mat-vecs
// share (included after matmul_io.wgsl by matvec_workgroup.wgsl and
// matvec_subgroup.wgsl; the weights come from the format prelude: `weight4`,
// `dot32` and `QUANTIZED`).
//
// A workgroup of LANES lanes (64, 128 or 256) takes ROWS consecutive rows
// (1 to 16): override constants set per weight matrix by the launcher
// (128 and 2 by the fixed rule; with `--kernels tuned`, what `auto` picks on
// a GPU, the fastest pair on that device, timed when the engine is built,
// see src/kernels/tune.rs). Each load of x serves all ROWS rows, so more
// rows per workgroup means fewer passes over x (which the fused RMSNorm and
// SwiGLU make costlier) but fewer workgroups to fill the device with; more
// lanes per row mean fewer loads per lane and more reduction.
//
// This lane's partial sums of rows r0 .. r0 + ROWS (clamped to the part) of
// W x, with x scaled by `inv` and the norm weights when the norm is fused.
// Float weights go four values (one packed word) at a time; quantized ones a
// block of 32 values at a time where a row has a block for every lane (K of
// 32 * LANES and more: 4,096 with 128 lanes), else also a word at a time, so
// that short rows (K = 2,048 would leave half of 128 lanes without a block)
// keep every lane loading.
// `QUANTIZED` is a constant of the prelude and K uniform: no divergence.

override LANES: u32 = 128u;
override ROWS: u32 = 2u;
// The largest ROWS: the size of the per-lane accumulators.
const ROWS_MAX: u32 = 16u;
// Loads per row each lane issues before the sums that use them: 2 or 4
// packed words (STEPS), or STEPS / 2 quantized blocks (at least one). A
// third override constant of the launcher: more loads in flight hide more
// of memory's latency, at the cost of registers.
override STEPS: u32 = 2u;
const STEPS_MAX: u32 = 4u;


// The first packed group of row r0 + i, clamped to the part's last row (the
// sums of rows past it are computed and not stored).
fn row_start(r0: u32, i: u32) -> u32 {
    return w_row(min(r0 + i, p.rows - 1u), p.k4);
}

fn lane_sums(r0: u32, lane: u32, inv: f32) -> array<f32, ROWS_MAX> {
    if (QUANTIZED && p.k4 >= LANES * 8u) {
        return lane_block_sums(r0, lane, inv);
    }
    return lane_word_sums(r0, lane, inv);
}

// Packed words k = lane, lane + LANES, ..., STEPS loads per row in flight
// per iteration, adjacent lanes reading adjacent words.
fn lane_word_sums(r0: u32, lane: u32, inv: f32) -> array<f32, ROWS_MAX> {
    var acc: array<f32, ROWS_MAX>;
    var k = lane;
    for (; k + (STEPS - 1u) * LANES < bounded(p.k4); k += STEPS * LANES) {
        var xs: array<vec4<f32>, STEPS_MAX>;
        for (var u = 0u; u < STEPS; u++) {
            xs[u] = x_normed(k + u * LANES, inv);
        }
        for (var i = 0u; i < ROWS; i++) {
            let w0 = row_start(r0, i) + k;
            var ws: array<vec4<f32>, STEPS_MAX>;
            for (var u = 0u; u < STEPS; u++) {
                ws[u] = weight4(w0 + u * LANES);
            }
            for (var u = 0u; u < STEPS; u++) {
                acc[i] += dot(ws[u], xs[u]);
            }
        }
    }
    for (; k < bounded(p.k4); k += LANES) {
        let xa = x_normed(k, inv);
        for (var i = 0u; i < ROWS; i++) {
            acc[i] += dot(weight4(row_start(r0, i) + k), xa);
        }
    }
    return acc;
}

// Quantized weights: whole 32-value blocks b = lane, lane + LANES, ...
// through the prelude's `dot32`, so each lane reads a block's quant words
// once and applies its scale (and offset) once, where `weight4` would read
// the scale and a shared quant word again for every four values (and a
// K-quant's packed 6-bit scales, too). Adjacent lanes read adjacent blocks.
// Rows hold whole blocks, so k4 is a multiple of 8. With STEPS = 4 each
// iteration takes two blocks a row, LANES blocks apart; a second block
// past the row's end reads the last block again (clamped, so that its
// loads need no branch and can be issued with the first's) and counts 0.
fn lane_block_sums(r0: u32, lane: u32, inv: f32) -> array<f32, ROWS_MAX> {
    var acc: array<f32, ROWS_MAX>;
    // STEPS is 2 or 4 (the launcher checks): one or two blocks a row.
    for (var k = lane * 8u; k < bounded(p.k4); k += LANES * 8u * (STEPS / 2u)) {
        let xa = block_x(k, inv);
        if (STEPS == 4u) {
            let kb = min(k + LANES * 8u, p.k4 - 8u);
            let second = select(0.0, 1.0, k + LANES * 8u < p.k4);
            let xb = block_x(kb, inv);
            for (var i = 0u; i < ROWS; i++) {
                let w0 = row_start(r0, i);
                acc[i] += dot32(w0 + k, xa.xs, xa.sx) + second * dot32(w0 + kb, xb.xs, xb.sx);
            }
        } else {
            for (var i = 0u; i < ROWS; i++) {
                acc[i] += dot32(row_start(r0, i) + k, xa.xs, xa.sx);
            }
        }
    }
    return acc;
}

// One block's 32 values of x (eight vec4) and their sums per half block.
struct BlockX {
    xs: array<vec4<f32>, 8>,
    sx: vec2<f32>,
}

fn block_x(k: u32, inv: f32) -> BlockX {
    let one = vec4<f32>(1.0);
    var b: BlockX;
    for (var i = 0u; i < 8u; i++) {
        b.xs[i] = x_normed(k + i, inv);
    }
    b.sx = vec2<f32>(
        dot(b.xs[0] + b.xs[1] + b.xs[2] + b.xs[3], one),
        dot(b.xs[4] + b.xs[5] + b.xs[6] + b.xs[7], one),
    );
    return b;
}
