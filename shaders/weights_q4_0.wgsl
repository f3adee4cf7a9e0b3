// weights_q4_0.wgsl: weight-format prelude for Q4_0 (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Groups of 8 blocks of 32 values in 9 vec4<u32> words (144 bytes, as many
// as llama.cpp's eight 18-byte blocks): word 0 holds the 8 scales d (f16;
// block 2i in the low half of component i, block 2i + 1 in the high), word
// 1 + j the quants of block j, value 8i + n in nibble n of component i.
// x = d * (q - 8). A lane reads a block's 32 quants with one 16-byte load
// (the 20-byte blocks before took five 4-byte loads), adjacent blocks from
// adjacent addresses. Rows start at whole groups (W_ROW_ALIGN: 64 groups of
// four values, 256 values), the last group of a row padded with zero blocks.
alias WWord = vec4<u32>;
const W_ROW_ALIGN: u32 = 64u;

// Word i of the part as u32 words (for the block helpers).
fn w_u32(i: u32) -> u32 {
    return w_at(i >> 2u)[i & 3u];
}

// The scale and the quant words of flat block b (group b / 8, slot b % 8).
fn block_scale(b: u32) -> f32 {
    let pair = w_at((b >> 3u) * 9u)[(b >> 1u) & 3u];
    return unpack2x16float(pair)[b & 1u];
}

fn block_quants(b: u32) -> vec4<u32> {
    return w_at((b >> 3u) * 9u + 1u + (b & 7u));
}

fn weight4(g: u32) -> vec4<f32> {
    let b = g >> 3u;
    let q = block_quants(b)[(g >> 1u) & 3u] >> ((g & 1u) * 16u);
    return block_scale(b) * (vec4<f32>(fields4(q, 4u)) - 8.0);
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let b = g >> 3u;
    let q = block_quants(b);
    let s = nibbles_dot(q.x, 0u, xs[0], xs[1]) + nibbles_dot(q.y, 0u, xs[2], xs[3])
        + nibbles_dot(q.z, 0u, xs[4], xs[5]) + nibbles_dot(q.w, 0u, xs[6], xs[7]);
    return block_scale(b) * (s - 8.0 * (sx.x + sx.y));
}

fn dot32_q8(g: u32, xa: vec4<u32>, xb: vec4<u32>, ds: vec4<f32>) -> f32 {
    let b = g >> 3u;
    let s = nibble_block_dot_q8(block_quants(b), 0u, xa, xb);
    return block_scale(b) * (ds.x * f32(s) - 8.0 * (ds.y + ds.z));
}
