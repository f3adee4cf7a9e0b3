// embed.wgsl: token embedding lookup (needs a weight-format prelude).
//
// Bindings (group 0):
//   0 step   uniform Step
//   1 p      uniform EmbedParams
//   2 w      storage read  [rows_in_part, hidden] weights (the format prelude)  (one part of the table)
//   3 ids    storage read  [n_tokens] u32
//   4 x      storage rw    [n_tokens, hidden/4] vec4<f32>
// Dispatch: (ceil(hidden/4 / 64), n_tokens, 1). A table too large for one binding
// is split into row parts; each part's dispatch writes only the tokens it holds.
struct EmbedParams {
    hidden4: u32,
    row_begin: u32,
    row_end: u32,
    _pad: u32,
}

// An override constant: every row is multiplied by it (Gemma's sqrt(hidden)).
override SCALE: f32 = 1.0;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: EmbedParams;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> x: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.hidden4 || t >= step.n_tokens) {
        return;
    }
    let id = ids[t];
    if (id < p.row_begin || id >= p.row_end) {
        return;
    }
    x[t * p.hidden4 + i] = weight4(w_row(id - p.row_begin, p.hidden4) + i) * SCALE;
}
