// weights_words.wgsl: for the block formats whose prelude reads u32 words
// (every one but Q4_0; appended before weights_blocks.wgsl, see
// src/shaders.rs): the word the block helpers read, and rows back to back.

fn w_u32(i: u32) -> u32 {
    return w_at(i);
}

// Rows start right after each other (weights_rows.wgsl).
const W_ROW_ALIGN: u32 = 1u;
