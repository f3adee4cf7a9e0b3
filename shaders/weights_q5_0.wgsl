// weights_q5_0.wgsl: weight-format prelude for Q5_0 (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Blocks of 32 values in 6 words: word 0 holds d (f16, low half), word 1 the
// fifth bits (value v in bit v), words 2..5 the low four bits, value 8i + n
// in nibble n of word 2 + i. x = d * (q - 16).
alias WWord = u32;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 3u) * 6u;
    let d = unpack2x16float(w_at(base)).x;
    let lo = w_at(base + 2u + ((g >> 1u) & 3u)) >> ((g & 1u) * 16u);
    let hi = w_at(base + 1u) >> ((g & 7u) * 4u);
    let q = fields4(lo, 4u);
    let h = fields4(hi, 1u) << vec4<u32>(4u);
    return d * (vec4<f32>(q | h) - 16.0);
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let base = (g >> 3u) * 6u;
    let high = w_at(base + 1u);
    let s = nibble_block_dot(base + 2u, high, xs);
    return unpack2x16float(w_at(base)).x * (s - 16.0 * (sx.x + sx.y));
}

fn dot32_q8(g: u32, xa: vec4<u32>, xb: vec4<u32>, ds: vec4<f32>) -> f32 {
    let base = (g >> 3u) * 6u;
    let s = nibble_block_dot_q8(w_words4(base + 2u), w_at(base + 1u), xa, xb);
    return unpack2x16float(w_at(base)).x * (ds.x * f32(s) - 16.0 * (ds.y + ds.z));
}
