// weights_texture_u32x4.wgsl: vec4<u32> words (one texel each) from the
// weights texture (Q4_0's; after weights_texture.wgsl).

fn w_at(i: u32) -> vec4<u32> {
    return w_texel(i);
}

fn w_at2(i: u32) -> array<vec4<u32>, 2> {
    return array<vec4<u32>, 2>(w_at(i), w_at(i + 1u));
}
