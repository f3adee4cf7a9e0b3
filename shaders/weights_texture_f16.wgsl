// weights_texture_f16.wgsl: f16 words (four values in a vec2<u32>) from the
// weights texture (after weights_texture.wgsl), two per texel: an even pair
// of words is one fetch.

fn w_at(g: u32) -> vec2<u32> {
    let t = w_texel(g >> 1u);
    return select(t.xy, t.zw, (g & 1u) == 1u);
}

fn w_at2(g: u32) -> array<vec2<u32>, 2> {
    if ((g & 1u) == 0u) {
        let t = w_texel(g >> 1u);
        return array<vec2<u32>, 2>(t.xy, t.zw);
    }
    return array<vec2<u32>, 2>(w_at(g), w_at(g + 1u));
}
