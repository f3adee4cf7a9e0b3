// x_copy_io.wgsl: what the two copies of a product's input share
// (x_texture.wgsl, x_f16.wgsl; included after common.wgsl, src/shaders.rs):
// their parameters and input, and the invocation's element.
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform XCopyParams
//   2 x     storage read  [n, k4] vec4<f32>
//   3 the copy (declared by each kernel)
// n = step_rows(step, p.count_sel).
// Dispatch: (ceil(k4 / 64), n, 1).

struct XCopyParams {
    k4: u32,
    count_sel: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: XCopyParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

// Whether invocation `gid` copies an element: group k of token t.
fn copies(gid: vec3<u32>) -> bool {
    return gid.x < p.k4 && gid.y < step_rows(step, p.count_sel);
}
