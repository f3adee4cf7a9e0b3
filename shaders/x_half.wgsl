// x_half.wgsl: a product's input x written once per token in f16, for the
// mat-vec that reads it so (matvec_subgroup.wgsl built with matmul_x16.wgsl,
// `HalfX`): the norm or SwiGLU that writes x folded in here, once per token,
// where the f32-x mat-vecs fold it into every workgroup (each reads x twice
// for it), and half the bytes for every workgroup's reads of x. Core WGSL
// (pack2x16float): no f16 extension needed. Values past f16's range
// (65,504) become indeterminate: the tuner offers the kernel for f16
// weights only, whose products round that way on the matrix units too.
//
// Bindings (group 0): as x_input.wgsl, with
//   4 xh    storage rw    [n, k4] vec2<u32>: values 4k .. 4k + 3 of token t
//                         at xh[t * k4 + k], as four f16
// Dispatch: (ceil(k4 / 64), n, 1): lane l of workgroup g takes values
// 4 (64 g + l) .. of token id.y.

@group(0) @binding(4) var<storage, read_write> xh: array<vec2<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = wg.y;
    if (t >= step_rows(step, p.count_sel)) {
        return;
    }
    let inv = token_scale(t, lane);
    let k = wg.x * WG + lane;
    if (k >= p.k4) {
        return;
    }
    let v = x_value4(t, k, inv);
    xh[t * p.k4 + k] = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}
