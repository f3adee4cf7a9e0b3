// weights_texture_u32.wgsl: u32 words from the weights texture (the block
// formats; after weights_texture.wgsl), four per texel.

fn w_at(i: u32) -> u32 {
    return w_texel(i >> 2u)[i & 3u];
}

fn w_at2(i: u32) -> array<u32, 2> {
    return array<u32, 2>(w_at(i), w_at(i + 1u));
}
