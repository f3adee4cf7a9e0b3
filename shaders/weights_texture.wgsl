// weights_texture.wgsl: the weights binding as a texture (the `cpu` kernel
// set; see src/shaders.rs and `WeightStore` in src/weights.rs), followed by
// one of weights_texture_u32.wgsl, _f16.wgsl or _f32.wgsl, which give the
// prelude's words (`w_at(i)`, `w_at2(i)`) from texels.
//
// Why: Mesa's lavapipe (22.3) loads a storage buffer one lane at a time
// (an offset it cannot prove uniform costs a loop over the SIMD lanes with
// a store and reload of the whole vector per lane), but fetches texels with
// vector code (docs/ARCHITECTURE.md, "lavapipe facts"; what it gives:
// BENCHMARKS.md, "Weights in textures").
//
// Binding (group 0):
//   2 w  texture_2d<u32>, Rgba32Uint: the part's bytes in order, 16 per
//        texel, WEIGHT_TEXTURE_WIDTH texels per texture row (the last row
//        padded with zeros)
@group(0) @binding(2) var w: texture_2d<u32>;

// log2 of the texels per texture row (src/weights.rs: WEIGHT_TEXTURE_WIDTH).
const W_TEXTURE_SHIFT: u32 = 12u;

// Texel t: bytes 16t .. 16t + 15 of the part.
fn w_texel(t: u32) -> vec4<u32> {
    let width = 1u << W_TEXTURE_SHIFT;
    return textureLoad(w, vec2<u32>(t & (width - 1u), t >> W_TEXTURE_SHIFT), 0);
}
