// weights_q4_k.wgsl: weight-format prelude for Q4_K (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Super-blocks of 256 values in 36 words: word 0 holds d (low half) and dmin
// (high half) as f16, words 1..3 the 12 bytes of 6-bit scales and mins of
// the eight sub-blocks of 32 (packed as llama.cpp's get_scale_min_k4 reads
// them), words 4..35 the 4-bit quants, value 8i + n in nibble n of word
// 4 + i. x = d * scale * q - dmin * min.
alias WWord = u32;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 6u) * 36u;
    let j = g & 63u;
    let sm = k_scale_min(base, j >> 3u);
    let lo = w_at(base + 4u + (j >> 1u)) >> ((j & 1u) * 16u);
    let q = fields4(lo, 4u);
    return vec4<f32>(q) * sm.x - sm.y;
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let base = (g >> 6u) * 36u;
    let j = (g >> 3u) & 7u;
    let s = nibble_block_dot(base + 4u + 4u * j, 0u, xs);
    let sm = k_scale_min(base, j);
    return sm.x * s - sm.y * (sx.x + sx.y);
}

fn dot32_q8(g: u32, xa: vec4<u32>, xb: vec4<u32>, ds: vec4<f32>) -> f32 {
    let base = (g >> 6u) * 36u;
    let j = (g >> 3u) & 7u;
    let s = nibble_block_dot_q8(w_words4(base + 4u + 4u * j), 0u, xa, xb);
    let sm = k_scale_min(base, j);
    return sm.x * ds.x * f32(s) - sm.y * (ds.y + ds.z);
}
