// weights_q5_k.wgsl: weight-format prelude for Q5_K (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Super-blocks of 256 values in 44 words: words 0..3 as Q4_K (d, dmin, 12
// bytes of 6-bit scales and mins), words 4..11 the fifth bits (value v in
// bit v % 32 of word 4 + v / 32), words 12..43 the low four bits, value
// 8i + n in nibble n of word 12 + i. x = d * scale * q - dmin * min.
alias WWord = u32;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 6u) * 44u;
    let j = g & 63u;
    let sm = k_scale_min(base, j >> 3u);
    let lo = w_at(base + 12u + (j >> 1u)) >> ((j & 1u) * 16u);
    let hi = w_at(base + 4u + (j >> 3u)) >> ((j & 7u) * 4u);
    let q = fields4(lo, 4u);
    let h = fields4(hi, 1u) << vec4<u32>(4u);
    return vec4<f32>(q | h) * sm.x - sm.y;
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let base = (g >> 6u) * 44u;
    let j = (g >> 3u) & 7u;
    let high = w_at(base + 4u + j);
    let s = nibble_block_dot(base + 12u + 4u * j, high, xs);
    let sm = k_scale_min(base, j);
    return sm.x * s - sm.y * (sx.x + sx.y);
}

fn dot32_q8(g: u32, xa: vec4<u32>, xb: vec4<u32>, ds: vec4<f32>) -> f32 {
    let base = (g >> 6u) * 44u;
    let j = (g >> 3u) & 7u;
    let s = nibble_block_dot_q8(w_words4(base + 12u + 4u * j), w_at(base + 4u + j), xa, xb);
    let sm = k_scale_min(base, j);
    return sm.x * ds.x * f32(s) - sm.y * (ds.y + ds.z);
}
