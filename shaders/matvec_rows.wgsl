// matvec_rows.wgsl: the lane loops both `gpu` mat-vecs share (included after
// matmul_io.wgsl by matvec_workgroup.wgsl and matvec_subgroup.wgsl, which
// declare LANES; the weights come from the format prelude: `weight4`,
// `dot32` and `QUANTIZED`).
//
// This lane's partial sums of rows r0 and r0 + 1 (clamped to the part) of
// W x, with x scaled by `inv` and the norm weights when the norm is fused.
// Float weights go four values (one packed word) at a time; quantized ones a
// block of 32 values at a time where a row has a block for every lane (K of
// 4,096 and more), else also a word at a time, so that short rows (K = 2,048
// would leave half the lanes without a block) keep every lane loading.
// `QUANTIZED` is a constant of the prelude and K uniform: no divergence.
fn lane_sums(r0: u32, lane: u32, inv: f32) -> vec2<f32> {
    if (QUANTIZED && p.k4 >= LANES * 8u) {
        return lane_block_sums(r0, lane, inv);
    }
    return lane_word_sums(r0, lane, inv);
}

// Packed words k = lane, lane + LANES, ..., two loads per row in flight per
// iteration, adjacent lanes reading adjacent words.
fn lane_word_sums(r0: u32, lane: u32, inv: f32) -> vec2<f32> {
    let w0 = r0 * p.k4;
    let w1 = min(r0 + 1u, p.rows - 1u) * p.k4;
    var acc = vec2<f32>(0.0);
    var k = lane;
    for (; k + LANES < p.k4; k += 2u * LANES) {
        let xa = x_normed(k, inv);
        let xb = x_normed(k + LANES, inv);
        acc += vec2<f32>(dot(weight4(w0 + k), xa), dot(weight4(w1 + k), xa));
        acc += vec2<f32>(
            dot(weight4(w0 + k + LANES), xb),
            dot(weight4(w1 + k + LANES), xb),
        );
    }
    if (k < p.k4) {
        let xa = x_normed(k, inv);
        acc += vec2<f32>(dot(weight4(w0 + k), xa), dot(weight4(w1 + k), xa));
    }
    return acc;
}

// Quantized weights: whole 32-value blocks b = lane, lane + LANES, ...
// through the prelude's `dot32`, so each lane reads a block's quant words
// once and applies its scale (and offset) once, where `weight4` would read
// the scale and a shared quant word again for every four values (and a
// K-quant's packed 6-bit scales, too). Adjacent lanes read adjacent blocks.
// Rows hold whole blocks, so k4 is a multiple of 8.
fn lane_block_sums(r0: u32, lane: u32, inv: f32) -> vec2<f32> {
    let w0 = r0 * p.k4;
    let w1 = min(r0 + 1u, p.rows - 1u) * p.k4;
    let one = vec4<f32>(1.0);
    var acc = vec2<f32>(0.0);
    var xs: array<vec4<f32>, 8>;
    for (var k = lane * 8u; k < p.k4; k += LANES * 8u) {
        for (var i = 0u; i < 8u; i++) {
            xs[i] = x_normed(k + i, inv);
        }
        let sx = vec2<f32>(
            dot(xs[0] + xs[1] + xs[2] + xs[3], one),
            dot(xs[4] + xs[5] + xs[6] + xs[7], one),
        );
        acc += vec2<f32>(dot32(w0 + k, xs, sx), dot32(w1 + k, xs, sx));
    }
    return acc;
}
