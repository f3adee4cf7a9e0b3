// weights_f16.wgsl: weight-format prelude for f16 weights (see src/shaders.rs
// and src/quant.rs). Every weight prelude declares binding 2, `w`, one row
// part of a [rows, k] matrix with its rows back to back, and
// `weight4(g)`: the four values 4g .. 4g + 3 of the part (flat group g, so
// row r's group i is g = r * k/4 + i), and
// `dot32(g, xs, sx)`: sum over i < 8 of dot(weight4(g + i), xs[i]), for g a
// row's first group plus a multiple of 8 (with a quantized format, 32 values
// of one block, as rows hold whole blocks), where
// sx = (xs[0] + .. + xs[3], xs[4] + .. + xs[7]) summed over components; the
// quantized formats compute it on whole quant words, one scale per block, the
// block's offset applied once through sx; and
// `QUANTIZED`: whether the format is made of blocks (rows then hold whole
// 32-value blocks), from weights_floats.wgsl or weights_blocks.wgsl.
//
// Four consecutive f16 values packed in two u32 words; unpack2x16float is
// core WGSL, so this works with or without the SHADER_F16 feature.
@group(0) @binding(2) var<storage, read> w: array<vec2<u32>>;

fn weight4(g: u32) -> vec4<f32> {
    let v = w[g];
    return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
}
