// epikv_delta.wgsl: the epiphany signal of EpiKV, computed inside the forward
// pass right after a tracked layer: g(t) = || h(t) - h(t-1) ||_2 for each token
// of the step, where h is the residual stream after that layer and h(t-1) is the
// previous position of the sequence (the last token of the previous step for
// the first row). g = 0 at position 0.
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform DeltaParams   (hidden/4, column of this layer in g, tracked layers)
//   2 x     storage read  [row0 + n_tokens, hidden/4] vec4<f32>  residual after the layer
//   3 pos   storage read  [row0 + n_tokens] u32                  positions of the step
// (row row0 + t of x and pos is token t: a sequence's rows of a shared step)
//   4 prev  storage rw    [hidden/4] vec4<f32>            h of the position before the step
//   5 g     storage rw    [n_tokens, n_tracked] f32
// Entry points and Dispatch:
//   delta     one workgroup per token: (n_tokens, 1, 1)
//   save_last copies the step's last row into prev, for the next step: (1, 1, 1).
//             A separate dispatch, so that no workgroup of `delta` can read prev
//             after it is overwritten.
struct DeltaParams {
    hidden4: u32,
    column: u32,
    n_tracked: u32,
    _p0: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: DeltaParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;
@group(0) @binding(4) var<storage, read_write> prev: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> g: array<f32>;

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    if (t >= step.n_tokens) {
        return;
    }
    var ss = 0.0;
    for (var i = lid; i < bounded(p.hidden4); i += 64u) {
        var before: vec4<f32>;
        if (t == 0u) {
            before = prev[i];
        } else {
            before = x[(step.row0 + t - 1u) * p.hidden4 + i];
        }
        let d = x[(step.row0 + t) * p.hidden4 + i] - before;
        ss += dot(d, d);
    }
    partial[lid] = ss;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s / 2u) {
        if (lid < s) {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        g[t * p.n_tracked + p.column] = select(sqrt(partial[0]), 0.0, pos[step.row0 + t] == 0u);
    }
}

@compute @workgroup_size(64)
fn save_last(@builtin(local_invocation_index) lid: u32) {
    let last = step.row0 + step.n_tokens - 1u;
    for (var i = lid; i < bounded(p.hidden4); i += 64u) {
        prev[i] = x[last * p.hidden4 + i];
    }
}
