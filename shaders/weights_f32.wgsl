// weights_f32.wgsl: weight-format prelude for f32 weights (binding 2 `w`
// and `weight4(g)`, as in weights_f16.wgsl).
@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;

fn weight4(g: u32) -> vec4<f32> {
    return w[g];
}
