// weights_texture_f32.wgsl: f32 words (four values) from the weights texture
// (after weights_texture.wgsl), one per texel.

fn w_at(g: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(w_texel(g));
}

fn w_at2(g: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(w_at(g), w_at(g + 1u));
}
