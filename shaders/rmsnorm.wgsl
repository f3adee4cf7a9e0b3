// rmsnorm.wgsl: y = x / sqrt(mean(x^2) + eps) * w, in f32; with ACCUMULATE,
// y += that (a sandwich norm of a layer output into the residual, Gemma 3).
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform NormParams
//   2 w     storage read  [dim/4] vec4<f32>
//   3 x     storage read  [rows, dim/4] vec4<f32>
//   4 y     storage rw    [rows, dim/4] vec4<f32>
// Dispatch: (rows, 1, 1), rows = step_rows(step, p.count_sel); one workgroup per row.
// Input row r is read from row r + (in_row_sel == 1 ? step.logit_row0 : 0), so the
// final norm can produce just the rows whose logits are wanted.
struct NormParams {
    dim4: u32,
    eps: f32,
    in_row_sel: u32,
    count_sel: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: NormParams;
@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<vec4<f32>>;

// An override constant: the norm is added to y instead of replacing it.
override ACCUMULATE: bool = false;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    if (row >= step_rows(step, p.count_sel)) {
        return;
    }
    var in_row = row;
    if (p.in_row_sel == 1u) {
        in_row = row + step.logit_row0;
    }
    let base_in = in_row * p.dim4;
    var ss = 0.0;
    for (var i = lid; i < bounded(p.dim4); i += WG) {
        let v = x[base_in + i];
        ss += dot(v, v);
    }
    partial[lid] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    let inv = inverseSqrt(partial[0] / f32(p.dim4 * 4u) + p.eps);
    let base_out = row * p.dim4;
    for (var i = lid; i < bounded(p.dim4); i += WG) {
        let v = x[base_in + i] * inv * w[i];
        if (ACCUMULATE) {
            y[base_out + i] += v;
        } else {
            y[base_out + i] = v;
        }
    }
}
