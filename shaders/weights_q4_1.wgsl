// weights_q4_1.wgsl: weight-format prelude for Q4_1 (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Blocks of 32 values in 5 words: word 0 holds d (low half) and m (high
// half) as f16, words 1..4 the 4-bit quants, value 8i + n in nibble n of
// word 1 + i. x = d * q + m.
alias WWord = u32;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 3u) * 5u;
    let dm = unpack2x16float(w_at(base));
    let q = w_at(base + 1u + ((g >> 1u) & 3u)) >> ((g & 1u) * 16u);
    return vec4<f32>(fields4(q, 4u)) * dm.x + dm.y;
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let base = (g >> 3u) * 5u;
    let s = nibble_block_dot(base + 1u, 0u, xs);
    let dm = unpack2x16float(w_at(base));
    return dm.x * s + dm.y * (sx.x + sx.y);
}

fn dot32_q8(g: u32, xa: vec4<u32>, xb: vec4<u32>, ds: vec4<f32>) -> f32 {
    let base = (g >> 3u) * 5u;
    let s = nibble_block_dot_q8(w_words4(base + 1u), 0u, xa, xb);
    let dm = unpack2x16float(w_at(base));
    return dm.x * ds.x * f32(s) + dm.y * (ds.y + ds.z);
}
