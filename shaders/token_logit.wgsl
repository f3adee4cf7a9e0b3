// token_logit.wgsl: one LM-head logit per row, for the row's own token:
// out[t] = dot(x[t], E[ids[t]]) (needs a weight-format prelude). The counter-
// causal score reads one LM-head row per entry, never the whole vocabulary.
//
// Bindings (group 0):
//   0 step   uniform Step          (n_tokens rows)
//   1 p      uniform TokenParams   (hidden/4, rows of this table part)
//   2 w      storage read  [rows_in_part, hidden] weights (the format prelude)  one row part of the LM head
//   3 ids    storage read  [n_tokens] u32
//   4 x      storage read  [n_tokens, hidden/4] vec4<f32>
//   5 out    storage rw    [n_tokens] f32
// Dispatch: (n_tokens, 1, 1), once per table part; rows whose token is in
// another part are left to that part's dispatch.
struct TokenParams {
    hidden4: u32,
    row_begin: u32,
    row_end: u32,
    _p0: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: TokenParams;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    if (t >= step.n_tokens) {
        return;
    }
    let id = ids[t];
    if (id < p.row_begin || id >= p.row_end) {
        return;
    }
    var s = 0.0;
    for (var i = lid; i < bounded(p.hidden4); i += 64u) {
        s += dot(weight4(w_row(id - p.row_begin, p.hidden4) + i), x[t * p.hidden4 + i]);
    }
    partial[lid] = s;
    workgroupBarrier();
    for (var k = 32u; k > 0u; k = k / 2u) {
        if (lid < k) {
            partial[lid] += partial[lid + k];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out[t] = partial[0];
    }
}
