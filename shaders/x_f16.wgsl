// x_f16.wgsl: copies the input x of the tensor-core mat-muls that read it
// in f16 (matmul_coop.wgsl and matmul_coop_staged.wgsl with X_F16,
// `CoopX16`, `CoopStagedDouble`) into f16, once per product, before the
// product reads it.
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
// Bindings (group 0): as x_copy_io.wgsl, with
//   3 x16   storage rw    [n, k4] vec2<u32>: x[t * k4 + k] as four f16
// Dispatch: (ceil(k4 / 64), n, 1).

@group(0) @binding(3) var<storage, read_write> x16: array<vec2<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (!copies(gid)) {
        return;
    }
    let i = gid.y * p.k4 + gid.x;
    let v = x[i];
    x16[i] = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}
