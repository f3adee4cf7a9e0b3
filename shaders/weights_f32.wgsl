// weights_f32.wgsl: weight-format prelude for f32 weights (see src/shaders.rs).
alias WPacked = vec4<f32>;

fn unpack_w(p: WPacked) -> vec4<f32> {
    return p;
}
