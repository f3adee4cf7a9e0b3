// weights_f16.wgsl: weight-format prelude for f16 weights (see src/shaders.rs
// and src/quant.rs). Every weight prelude reads one row part of a [rows, k]
// matrix with its rows back to back through `w_at(i)` and `w_at2(i)` (its
// word i, and words i and i + 1, of type `WWord`, which the prelude names;
// weights_buffer.wgsl or weights_texture*.wgsl declare binding 2 and define
// them), and defines
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
alias WWord = vec2<u32>;

fn unpack4(v: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
}

fn weight4(g: u32) -> vec4<f32> {
    return unpack4(w_at(g));
}

// weight4(g) and weight4(g + 1) (one texel fetch where g is even and the
// weights are in a texture).
fn weight8(g: u32) -> array<vec4<f32>, 2> {
    let v = w_at2(g);
    return array<vec4<f32>, 2>(unpack4(v[0]), unpack4(v[1]));
}
