// x_texture.wgsl: copies the input x of a `cpu` mat-vec or mat-mul
// (matmul.wgsl) into a texture before the product reads it.
//
// Why: on lavapipe a storage-buffer load costs a loop over the SIMD lanes
// while a texel fetch is vector code (docs/ARCHITECTURE.md, "lavapipe
// facts"), and the `cpu` products read each x value once per four or eight
// weight rows; this copy reads it once.
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform XCopyParams
//   2 x     storage read  [n, k4] vec4<f32>
//   3 xt    texture_storage_2d<rgba32uint, write>, at least k4 x n texels:
//           texel (k, t) holds the bits of x[t * k4 + k]
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
@group(0) @binding(3) var xt: texture_storage_2d<rgba32uint, write>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = gid.x;
    let t = gid.y;
    if (k >= p.k4 || t >= step_rows(step, p.count_sel)) {
        return;
    }
    textureStore(xt, vec2<u32>(k, t), bitcast<vec4<u32>>(x[t * p.k4 + k]));
}
