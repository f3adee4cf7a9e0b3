// weights_q4_0.wgsl: weight-format prelude for Q4_0 (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Blocks of 32 values in 5 words: word 0 holds d (f16, low half), words 1..4
// the 4-bit quants, value 8i + n in nibble n of word 1 + i. x = d * (q - 8).
alias WWord = u32;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 3u) * 5u;
    let d = unpack2x16float(w_at(base)).x;
    let q = w_at(base + 1u + ((g >> 1u) & 3u)) >> ((g & 1u) * 16u);
    return d * (vec4<f32>(fields4(q, 4u)) - 8.0);
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let base = (g >> 3u) * 5u;
    let s = nibble_block_dot(base + 1u, 0u, xs);
    return unpack2x16float(w_at(base)).x * (s - 8.0 * (sx.x + sx.y));
}
