// x_f16.wgsl: copies the input x of the tensor-core mat-mul that reads it
// in f16 (matmul_coop.wgsl with X_F16, `CoopX16`) into f16, once per
// product, before the product reads it.
//
// Why: matmul_coop.wgsl otherwise reads x in f32 and rounds it to f16 in
// every row-tile workgroup (rows / 64 times per product), staging it in
// workgroup memory between two barriers per K step. From this copy it
// loads its B tiles straight from memory (half the bytes, served from L2
// to the row tiles), with no workgroup memory or barrier in its K loop.
// Core WGSL (pack2x16float): no f16 extension needed here. Values past
// f16's range become indeterminate, as in the kernels that round x to f16
// themselves.
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform XCopyParams (as x_texture.wgsl)
//   2 x     storage read  [n, k4] vec4<f32>
//   3 x16   storage rw    [n, k4] vec2<u32>: x[t * k4 + k] as four f16
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
@group(0) @binding(3) var<storage, read_write> x16: array<vec2<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = gid.x;
    let t = gid.y;
    if (k >= p.k4 || t >= step_rows(step, p.count_sel)) {
        return;
    }
    let v = x[t * p.k4 + k];
    x16[t * p.k4 + k] = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}
