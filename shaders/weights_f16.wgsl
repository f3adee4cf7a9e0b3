// weights_f16.wgsl: weight-format prelude for f16 weights (see src/shaders.rs).
// Four consecutive f16 values packed in two u32 words; unpack2x16float is core
// WGSL, so this works with or without the SHADER_F16 feature.
alias WPacked = vec2<u32>;

fn unpack_w(p: WPacked) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(p.x), unpack2x16float(p.y));
}
