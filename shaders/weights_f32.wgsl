// weights_f32.wgsl: weight-format prelude for f32 weights (`weight4(g)`
// and `weight8(g)`, as in weights_f16.wgsl).
alias WWord = vec4<f32>;

fn weight4(g: u32) -> vec4<f32> {
    return w_at(g);
}

// weight4(g) and weight4(g + 1).
fn weight8(g: u32) -> array<vec4<f32>, 2> {
    let v = w_at2(g);
    return array<vec4<f32>, 2>(v[0], v[1]);
}
