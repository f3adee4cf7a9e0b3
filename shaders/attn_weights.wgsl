// attn_weights.wgsl: attention weights received by each cache entry, for the
// H2O and TOVA policies, recomputed from each query row's log-sum-exp (which the
// attention kernels already produce), so no score matrix is ever stored:
// w(t, a, i) = exp(q_{t,a} . k_i * scale - lse_{t,a}).
//
//   accumulate  after a layer's attention: cell[a, i] += sum over the step's
//               query rows t that see slot i (t >= i - start_slot; mode 1: only
//               the last row) of w(t, a, i).
//               Dispatch per page (ceil(keys in page / 64), n_heads, 1).
//   reduce      after the last layer: score[i] = (mode 0 and i < start_slot ?
//               score[i] : 0) + sum_a cell[a, i] / (layers * heads); cell := 0.
//               Dispatch (ceil((start_slot + n_tokens) / 64), 1, 1).
// mode 0 (h2o): every query counts and sums persist, new slots start at 0;
// mode 1 (tova): only the newest query, overwritten every step.
//
// `--materialize` (eager attention's memory, to reproduce the memory wall of
// attention-scored eviction; same numbers):
//   materialize           writes every weight into matrix[a, t, i] (0 where
//                         slot i is not visible to row t), as eager attention
//                         holds its probability matrix.
//                         Dispatch per page (ceil(keys in page / 64), n_tokens, n_heads).
//   accumulate_materialized  as accumulate, summing rows of the matrix (which
//                         covers every slot: no page). Dispatch as reduce, n_heads for y.
//
// Bindings (group 0):
//   0 step   uniform Step
//   1 p      uniform WeightParams
//   2 q      storage read  [row0 + n_tokens, n_heads * head_dim/4] vec4<f32> (after RoPE)
//   3 kc     storage read  [page.len, n_kv * head_dim/4] KvPacked  one page of the key cache (kv prelude)
//   4 lse    storage read  [row0 + n_tokens, n_heads] f32
//   5 cell   storage rw    [n_heads, slots] f32  (zero between steps)
//   6 score  storage rw    [slots] f32
//   7 matrix storage rw    [n_heads, max_tokens, slots] f32 (materialize only; a
//                          dummy otherwise)
//   8 page   uniform Page  the slots kc holds
//   9 kpos   storage read  [slots, kpos_lists] u32  original positions of the cache slots in
//                          each keep list (window only; query row t's is its own slot's,
//                          start_slot + t; KV head h's list: kpos_first + h * kpos_per_kv)
// With a sliding window (p.window > 0) a slot outside a row's window gets
// weight 0 from it, as the attention kernels mask it.
// accumulate and materialize cover one page's slots (gid.x = slot - page.first)
// and are dispatched once per page holding slots below start_slot + n_tokens,
// with ceil(keys in that page / 64) for x; reduce covers every slot.
// Per-invocation loop count: n_tokens * head_dim/4 (under lavapipe's 65535 limit
// for steps of up to 2048 tokens at head_dim 128).
struct WeightParams {
    n_heads: u32,
    n_kv: u32,
    hd4: u32,
    scale: f32,
    mode: u32,
    slots: u32,
    n_layers: u32,
    max_tokens: u32,
    window: u32,
    kpos_lists: u32,
    kpos_first: u32,
    kpos_per_kv: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: WeightParams;
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kc: array<KvPacked>;
@group(0) @binding(4) var<storage, read> lse: array<f32>;
@group(0) @binding(5) var<storage, read_write> cell: array<f32>;
@group(0) @binding(6) var<storage, read_write> score: array<f32>;
@group(0) @binding(7) var<storage, read_write> matrix: array<f32>;
@group(0) @binding(8) var<uniform> page: Page;
@group(0) @binding(9) var<storage, read> kpos: array<u32>;

// Rows of the step that count for slot i: from the first row that sees it
// (causal by slot), or only the last row in mode 1.
fn first_row(i: u32) -> u32 {
    if (p.mode == 1u) {
        return step.n_tokens - 1u;
    }
    if (i > step.start_slot) {
        return i - step.start_slot;
    }
    return 0u;
}

// Weight of query row t, head a on the entry in slot i (within the bound page).
fn weight(t: u32, a: u32, i: u32) -> f32 {
    let kvh = a / (p.n_heads / p.n_kv);
    if (p.window > 0u) {
        let list = p.kpos_first + kvh * p.kpos_per_kv;
        let qp = kpos[(step.start_slot + t) * p.kpos_lists + list];
        let kp = kpos[i * p.kpos_lists + list];
        if (max(qp, kp) - min(qp, kp) >= p.window) {
            return 0.0;
        }
    }
    let kb = (i - page.first) * p.n_kv * p.hd4 + kvh * p.hd4;
    let qb = ((step.row0 + t) * p.n_heads + a) * p.hd4;
    var s = 0.0;
    for (var d = 0u; d < p.hd4; d++) {
        s += dot(q[qb + d], unpack_kv(kc[kb + d]));
    }
    return exp(s * p.scale - lse[(step.row0 + t) * p.n_heads + a]);
}

@compute @workgroup_size(64)
fn accumulate(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = page.first + gid.x;
    let a = gid.y;
    let n_keys = min(step.start_slot + step.n_tokens, page.first + page.len);
    if (i >= n_keys || a >= p.n_heads) {
        return;
    }
    var sum = 0.0;
    for (var t = first_row(i); t < step.n_tokens; t++) {
        sum += weight(t, a, i);
    }
    cell[a * p.slots + i] += sum;
}

@compute @workgroup_size(64)
fn materialize(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = page.first + gid.x;
    let t = gid.y;
    let a = gid.z;
    let n_keys = min(step.start_slot + step.n_tokens, page.first + page.len);
    if (i >= n_keys || t >= step.n_tokens) {
        return;
    }
    var w = 0.0;
    if (i <= step.start_slot + t) {
        w = weight(t, a, i);
    }
    matrix[(a * p.max_tokens + t) * p.slots + i] = w;
}

@compute @workgroup_size(64)
fn accumulate_materialized(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let a = gid.y;
    if (i >= step.start_slot + step.n_tokens || a >= p.n_heads) {
        return;
    }
    var sum = 0.0;
    for (var t = first_row(i); t < step.n_tokens; t++) {
        sum += matrix[(a * p.max_tokens + t) * p.slots + i];
    }
    cell[a * p.slots + i] += sum;
}

@compute @workgroup_size(64)
fn reduce(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= step.start_slot + step.n_tokens) {
        return;
    }
    var total = 0.0;
    for (var a = 0u; a < p.n_heads; a++) {
        total += cell[a * p.slots + i];
        cell[a * p.slots + i] = 0.0;
    }
    var base = 0.0;
    if (p.mode == 0u && i < step.start_slot) {
        base = score[i];
    }
    score[i] = base + total / f32(p.n_layers * p.n_heads);
}
