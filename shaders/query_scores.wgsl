// query_scores.wgsl: eviction scores from the recent queries, kvpress's
// SnapKVPress and ExpectedAttentionPress (docs/POLICIES.md): every layer
// keeps its last queries in a ring (after RoPE for SnapKV, before it for
// Expected Attention), and at a refresh the window's queries score each
// entry: SnapKV by the attention they pay it, Expected Attention by the
// attention queries drawn from their mean and covariance, rotated as over
// the next positions, are expected to pay it, times ||v||.
//
//   keep       after (SnapKV) or before (Expected Attention) a layer's
//              RoPE: the step's query rows go to the ring, the query of
//              position p to ring row p % ring.
//              Dispatch (ceil(n_heads * hd4 / 64), n_tokens, 1).
//   snap_lse   per page: for window query t (positions last_pos - queries + 1
//              + t) and query head a, the log-sum-exp over the present slots
//              the query sees (key position <= its own; inside the layer's
//              sliding window) of scale * q.k, merged page by page (the
//              first page overwrites). One workgroup of 64 per TILE (8)
//              queries and query head: dispatch (ceil(queries / 8), n_heads, 1).
//   snap_mean  per page: m[a, i] = (1 / queries) * sum over the window
//              queries t that see slot i of exp(scale q_t.k_i - lse[t, a]),
//              for the slots before `end` (the entries older than the
//              window). Dispatch (ceil(slots in page before end / 64),
//              n_heads, 1).
//   Both, and ea_logits, read the window TILE rows at a time into
//   workgroup memory (8 KB: head_dim at most 256), so each key read from
//   the cache serves TILE queries.
//   snap_pool  per_head[l, h, i] = mean over h's query heads a of
//              (1 / kernel) * sum over t in i - kernel/2 ..= i + kernel/2,
//              0 <= t < end, of m[a, t] (avg_pool1d, zero padding counted).
//              Dispatch (ceil(end / 64), n_kv, 1).
//   ea_mean    Expected Attention: mu[a] = the mean of the window's queries
//              (scratch row `queries`). Dispatch (ceil(hd4 / 64), n_heads, 1).
//   ea_center  scratch row t < queries: Rbar (q_t - mu); row queries + 1:
//              Rbar mu, where Rbar rotates each pair (j, j + half_rot) by
//              the mean cos C_j and sin S_j over the future positions
//              (`rot`). Dispatch (ceil(hd4 / 64), queries + 1, n_heads).
//   ea_logits  per page: z[a, i] = scale (Rbar mu).k_i + scale^2 / (2
//              queries) sum_t ((Rbar (q_t - mu)).k_i)^2 (= scale mu'.k +
//              scale^2 k' Sigma' k / 2) for first <= i < end.
//              Dispatch (ceil(slots in page / 64), n_heads, 1).
//   ea_softmax lse[a] = (max, sum of exp) of z[a, first .. end]. One
//              workgroup of 64 per query head: dispatch (n_heads, 1, 1).
//   ea_combine per page: per_head[l, h, i] = mean over h's query heads of
//              softmax(z[a])[i] * ||v_i||, first <= i < end.
//              Dispatch (ceil(slots in page / 64), n_kv, 1).
//   top_up     per_head[l, h, i] = M + 1 for the slots outside first ..
//              end, M = the highest per_head[l, ., first .. end] of the
//              layer (kvpress's rule that keeps SnapKV's window and
//              Expected Attention's sinks). One workgroup: dispatch (1, 1, 1).
//   mean       score[i] = mean over l, h of per_head[l, h, i].
//              Dispatch (ceil(present / 64), 1, 1).
//
// Bindings (group 0):
//   0 step      uniform Step            (keep)
//   1 p         uniform QueryParams     (layer: this bind group's layer)
//   2 q         storage read  [row0 + n_tokens, src_stride4] vec4<f32>  queries from
//                             column 0 (after RoPE: `q`; before: `qkv`)
//   3 positions storage read  [row0 + n_tokens] u32  the step's positions
//   4 ring      storage rw    vec4<f32>: [n_layers, ring, n_heads * hd4] the ring,
//                             then Expected Attention's scratch [window + 2,
//                             n_heads, hd4] (the centered rotated window, the
//                             mean, the rotated mean)
//   5 count     uniform Window          (the refresh's present slots and queries)
//   6 kc        storage read  [page.len, n_kv * hd4] KvPacked  one page of the
//                             layer's key cache (kv prelude)
//   7 page      uniform Page  the slots kc holds
//   8 kpos      storage read  [slots, kpos_lists] u32  original positions of the cache
//                             slots in each keep list (KV head h's: list kpos_first +
//                             h * kpos_per_kv)
//   9 work      storage rw    f32: m [n_heads, slots], then the mean rotation
//                             [n_layers, head_dim] (C_j at j, S_j at half_rot + j),
//                             then lse [window, n_heads] (max, sum)
//  10 scores    storage rw    f32: per_head [n_layers, n_kv, slots], then the
//                             mean [slots]
//  11 vc        storage read  [page.len, n_kv * hd4] KvPacked  the same page of the
//                             layer's value cache (Expected Attention)
// (Eight storage buffers: WebGPU's default limit.)
// Per-invocation loop counts: hd4 (keep), page.len * hd4 * 8 / 64
// (snap_lse), queries * hd4 (snap_mean, ea_logits), kernel * heads per KV head
// (snap_pool), queries (ea_mean), slots / 64 (ea_softmax), hd4 * heads per
// KV head (ea_combine), n_kv * slots / 64 (top_up), n_layers * n_kv (mean).
struct QueryParams {
    n_heads: u32,
    n_kv: u32,
    hd4: u32,
    slots: u32,
    layer: u32,
    n_layers: u32,
    ring: u32,
    scale: f32,
    // The layer's sliding window (0: none).
    window: u32,
    kernel: u32,
    // Row stride of `q` in vec4.
    src_stride4: u32,
    // Half the layer's rotary dimensions (a multiple of 4; 0: no RoPE).
    half_rot: u32,
    // Where KV head h finds the slot positions (src/kernels/compact.rs,
    // Granularity): kpos[slot * kpos_lists + kpos_first + h * kpos_per_kv].
    kpos_lists: u32,
    kpos_first: u32,
    kpos_per_kv: u32,
    _p: u32,
}

struct Window {
    // Present slots.
    n: u32,
    // Slots first .. end are scored (SnapKV: those older than the window's
    // queries; Expected Attention: those after the sinks).
    first: u32,
    end: u32,
    // Window queries, the newest at position last_pos.
    queries: u32,
    last_pos: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: QueryParams;
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> positions: array<u32>;
@group(0) @binding(4) var<storage, read_write> ring: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> count: Window;
@group(0) @binding(6) var<storage, read> kc: array<KvPacked>;
@group(0) @binding(7) var<uniform> page: Page;
@group(0) @binding(8) var<storage, read> kpos: array<u32>;
@group(0) @binding(9) var<storage, read_write> work: array<f32>;
@group(0) @binding(10) var<storage, read_write> scores: array<f32>;
@group(0) @binding(11) var<storage, read> vc: array<KvPacked>;

// m[a, i] (the first part of `work`).
fn m_at(a: u32, i: u32) -> u32 {
    return a * p.slots + i;
}

// Where the mean rotation starts in `work`, and lse[at].
fn rot_base() -> u32 {
    return p.n_heads * p.slots;
}

fn lse_base() -> u32 {
    return rot_base() + p.n_layers * p.hd4 * 4u;
}

fn lse_get(at: u32) -> vec2<f32> {
    let b = lse_base() + 2u * at;
    return vec2<f32>(work[b], work[b + 1u]);
}

fn lse_set(at: u32, v: vec2<f32>) {
    let b = lse_base() + 2u * at;
    work[b] = v.x;
    work[b + 1u] = v.y;
}

// Four consecutive floats of `work` from `at`.
fn work4(at: u32) -> vec4<f32> {
    return vec4<f32>(work[at], work[at + 1u], work[at + 2u], work[at + 3u]);
}

fn mean_at(i: u32) -> u32 {
    return p.n_layers * p.n_kv * p.slots + i;
}

var<workgroup> partial: array<vec2<f32>, 64>;

@compute @workgroup_size(64)
fn keep(@builtin(global_invocation_id) gid: vec3<u32>) {
    let width = p.n_heads * p.hd4;
    let c = gid.x;
    let t = gid.y;
    if (c >= width || t >= step.n_tokens) {
        return;
    }
    let row = step.row0 + t;
    let at = (p.layer * p.ring + positions[row] % p.ring) * width + c;
    ring[at] = q[row * p.src_stride4 + c];
}

// Window query t's position.
fn query_position(t: u32) -> u32 {
    return count.last_pos + 1u + t - count.queries;
}

// Slots of the bound page below `limit`.
fn page_below(limit: u32) -> u32 {
    if (limit <= page.first) {
        return 0u;
    }
    return min(page.len, limit - page.first);
}

// (max, sum of exp(x - max)) of two such pairs together.
fn merge(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let top = max(a.x, b.x);
    if (top == -3.4e38) {
        return vec2<f32>(top, 0.0);
    }
    return vec2<f32>(top, a.y * exp(a.x - top) + b.y * exp(b.x - top));
}

// `merge` of every invocation's `acc` over the workgroup.
fn merge_workgroup(lid: u32, acc: vec2<f32>) -> vec2<f32> {
    partial[lid] = acc;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            partial[lid] = merge(partial[lid], partial[lid + stride]);
        }
        workgroupBarrier();
    }
    return partial[0];
}

// Window queries are read TILE at a time into `qtile` (one query head's
// rows): every key a lane loads then serves TILE queries, which cuts the
// key-cache reads TILE-fold (head_dim at most 4 x QTILE_VEC4 / TILE).
const TILE: u32 = 8u;
const QTILE_VEC4: u32 = 512u;
var<workgroup> qtile: array<vec4<f32>, QTILE_VEC4>;

// Loads rows t0 .. t0 + TILE of query head a into `qtile` (u * hd4 + d),
// zeros past the window: the window's queries from the ring, or with
// `centered` Expected Attention's centered rotated rows from the scratch.
// The whole workgroup calls it.
fn load_tile(lid: u32, t0: u32, a: u32, centered: bool) {
    workgroupBarrier();
    for (var c = lid; c < bounded(TILE * p.hd4); c += 64u) {
        let t = t0 + c / p.hd4;
        var v = vec4<f32>(0.0);
        if (t < count.queries && a < p.n_heads) {
            let row = select(ring_row(t) + a * p.hd4, scratch_at(t, a), centered);
            v = ring[row + c % p.hd4];
        }
        qtile[c] = v;
    }
    workgroupBarrier();
}

// scale * q.k for the TILE queries in `qtile` and the key at vec4 `kb` of
// the bound page.
fn tile_logits(kb: u32) -> array<f32, TILE> {
    var s: array<f32, TILE>;
    for (var d = 0u; d < bounded(p.hd4); d++) {
        let k = unpack_kv(kc[kb + d]);
        for (var u = 0u; u < TILE; u++) {
            s[u] += dot(qtile[u * p.hd4 + d], k);
        }
    }
    for (var u = 0u; u < TILE; u++) {
        s[u] *= p.scale;
    }
    return s;
}

// Whether the query at position qp sees the key at position kp.
fn sees(qp: u32, kp: u32) -> bool {
    return kp <= qp && (p.window == 0u || qp - kp < p.window);
}

// The key position of slot i for query head a's KV head.
fn key_position(a: u32, i: u32) -> u32 {
    let kvh = a / (p.n_heads / p.n_kv);
    return kpos[i * p.kpos_lists + p.kpos_first + kvh * p.kpos_per_kv];
}

// The vec4 where slot i's key for query head a starts in the bound page.
fn key_base(a: u32, i: u32) -> u32 {
    let kvh = a / (p.n_heads / p.n_kv);
    return (i - page.first) * p.n_kv * p.hd4 + kvh * p.hd4;
}

// One workgroup per TILE window queries and query head: each lane takes
// every 64th slot of the page and keeps a (max, sum) per query.
@compute @workgroup_size(64)
fn snap_lse(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let t0 = wid.x * TILE;
    let a = wid.y;
    load_tile(lid, t0, a, false);
    var acc: array<vec2<f32>, TILE>;
    for (var u = 0u; u < TILE; u++) {
        acc[u] = vec2<f32>(-3.4e38, 0.0);
    }
    if (a < p.n_heads) {
        for (var j = lid; j < bounded(page_below(count.n)); j += 64u) {
            let i = page.first + j;
            let kp = key_position(a, i);
            let s = tile_logits(key_base(a, i));
            for (var u = 0u; u < TILE; u++) {
                if (sees(query_position(t0 + u), kp)) {
                    acc[u] = merge(acc[u], vec2<f32>(s[u], 1.0));
                }
            }
        }
    }
    for (var u = 0u; u < TILE; u++) {
        let total = merge_workgroup(lid, acc[u]);
        let t = t0 + u;
        if (lid == 0u && t < count.queries && a < p.n_heads) {
            let at = t * p.n_heads + a;
            if (page.first == 0u) {
                lse_set(at, total);
            } else {
                lse_set(at, merge(lse_get(at), total));
            }
        }
        // merge_workgroup's next call overwrites `partial`.
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn snap_mean(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let a = gid.y;
    let live = gid.x < page_below(count.end) && a < p.n_heads;
    let i = page.first + gid.x;
    var kp = 0u;
    var kb = 0u;
    if (live) {
        kp = key_position(a, i);
        kb = key_base(a, i);
    }
    var sum = 0.0;
    for (var t0 = 0u; t0 < bounded(count.queries); t0 += TILE) {
        load_tile(lid, t0, a, false);
        if (live) {
            let s = tile_logits(kb);
            for (var u = 0u; u < TILE; u++) {
                let t = t0 + u;
                if (t < count.queries && sees(query_position(t), kp)) {
                    let l = lse_get(t * p.n_heads + a);
                    sum += exp(s[u] - l.x) / l.y;
                }
            }
        }
    }
    if (live) {
        work[m_at(a, i)] = sum / f32(count.queries);
    }
}

fn cell(h: u32, i: u32) -> u32 {
    return (p.layer * p.n_kv + h) * p.slots + i;
}

@compute @workgroup_size(64)
fn snap_pool(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let h = gid.y;
    if (i >= count.end || h >= p.n_kv) {
        return;
    }
    let group = p.n_heads / p.n_kv;
    let half_ = p.kernel / 2u;
    var sum = 0.0;
    for (var g = 0u; g < bounded(group); g++) {
        let a = h * group + g;
        for (var k = 0u; k < bounded(p.kernel); k++) {
            // t = i + k - half_, inside 0 .. end.
            if (i + k >= half_ && i + k - half_ < count.end) {
                sum += work[m_at(a, i + k - half_)];
            }
        }
    }
    scores[cell(h, i)] = sum / f32(p.kernel * group);
}

@compute @workgroup_size(64)
fn top_up(@builtin(local_invocation_index) lid: u32) {
    var top = -3.4e38;
    let span = count.end - count.first;
    for (var c = lid; c < bounded(p.n_kv * span); c += 64u) {
        top = max(top, scores[cell(c / span, count.first + c % span)]);
    }
    partial[lid] = vec2<f32>(top, 0.0);
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            partial[lid] = max(partial[lid], partial[lid + stride]);
        }
        workgroupBarrier();
    }
    // No scored slot: the others score 1.
    let raised = select(partial[0].x + 1.0, 1.0, span == 0u);
    for (var c = lid; c < bounded(p.n_kv * count.n); c += 64u) {
        let i = c % count.n;
        if (i < count.first || i >= count.end) {
            scores[cell(c / count.n, i)] = raised;
        }
    }
}

// Expected Attention.

fn ring_row(t: u32) -> u32 {
    return (p.layer * p.ring + query_position(t) % p.ring) * p.n_heads * p.hd4;
}

// Scratch row t of query head a: after the ring.
fn scratch_at(t: u32, a: u32) -> u32 {
    return (p.n_layers * p.ring + t) * p.n_heads * p.hd4 + a * p.hd4;
}

@compute @workgroup_size(64)
fn ea_mean(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d = gid.x;
    let a = gid.y;
    if (d >= p.hd4 || a >= p.n_heads) {
        return;
    }
    var sum = vec4<f32>(0.0);
    for (var t = 0u; t < bounded(count.queries); t++) {
        sum += ring[ring_row(t) + a * p.hd4 + d];
    }
    ring[scratch_at(count.queries, a) + d] = sum / f32(count.queries);
}

// Rbar x at vec4 d of a head whose vec4s are `x(d)`.
fn rotated(d: u32, x: vec4<f32>, partner: vec4<f32>) -> vec4<f32> {
    let h4 = p.half_rot / 4u;
    // This layer's C_j from rb, S_j from rb + half_rot.
    let rb = rot_base() + p.layer * p.hd4 * 4u;
    if (d < h4) {
        // (Rbar x)_j = C_j x_j - S_j x_{j + half}
        return work4(rb + 4u * d) * x - work4(rb + p.half_rot + 4u * d) * partner;
    }
    if (d < 2u * h4) {
        // (Rbar x)_{j + half} = S_j x_j + C_j x_{j + half}
        let j = d - h4;
        return work4(rb + p.half_rot + 4u * j) * partner + work4(rb + 4u * j) * x;
    }
    return x;
}

@compute @workgroup_size(64)
fn ea_center(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d = gid.x;
    let t = gid.y;
    let a = gid.z;
    if (d >= p.hd4 || t > count.queries || a >= p.n_heads) {
        return;
    }
    let h4 = p.half_rot / 4u;
    // The vec4 that d pairs with (itself outside the rotary part).
    var pd = d;
    if (d < h4) {
        pd = d + h4;
    } else if (d < 2u * h4) {
        pd = d - h4;
    }
    let mean = scratch_at(count.queries, a);
    if (t == count.queries) {
        let out = scratch_at(count.queries + 1u, a);
        ring[out + d] = rotated(d, ring[mean + d], ring[mean + pd]);
        return;
    }
    let row = ring_row(t) + a * p.hd4;
    let x = ring[row + d] - ring[mean + d];
    let partner = ring[row + pd] - ring[mean + pd];
    ring[scratch_at(t, a) + d] = rotated(d, x, partner);
}

@compute @workgroup_size(64)
fn ea_logits(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let a = gid.y;
    let i = page.first + gid.x;
    let live = gid.x < page_below(count.end) && i >= count.first && a < p.n_heads;
    var kb = 0u;
    var linear = 0.0;
    if (live) {
        kb = key_base(a, i);
        let mb = scratch_at(count.queries + 1u, a);
        for (var d = 0u; d < bounded(p.hd4); d++) {
            linear += dot(ring[mb + d], unpack_kv(kc[kb + d]));
        }
    }
    // The centered rotated rows, TILE at a time (rows past the window are
    // zero and add nothing): scale^2 sum_t (c_t.k)^2.
    var quadratic = 0.0;
    for (var t0 = 0u; t0 < bounded(count.queries); t0 += TILE) {
        load_tile(lid, t0, a, true);
        if (live) {
            let s = tile_logits(kb);
            for (var u = 0u; u < TILE; u++) {
                quadratic += s[u] * s[u];
            }
        }
    }
    if (live) {
        let z = p.scale * linear + quadratic / (2.0 * f32(count.queries));
        work[m_at(a, i)] = z;
    }
}

@compute @workgroup_size(64)
fn ea_softmax(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let a = wid.x;
    if (a >= p.n_heads) {
        return;
    }
    var acc = vec2<f32>(-3.4e38, 0.0);
    for (var i = count.first + lid; i < bounded(count.end); i += 64u) {
        acc = merge(acc, vec2<f32>(work[m_at(a, i)], 1.0));
    }
    let total = merge_workgroup(lid, acc);
    if (lid == 0u) {
        lse_set(a, total);
    }
}

@compute @workgroup_size(64)
fn ea_combine(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.y;
    let i = page.first + gid.x;
    if (gid.x >= page_below(count.end) || i < count.first || h >= p.n_kv) {
        return;
    }
    let vb = (i - page.first) * p.n_kv * p.hd4 + h * p.hd4;
    var vv = 0.0;
    for (var d = 0u; d < bounded(p.hd4); d++) {
        let v = unpack_kv(vc[vb + d]);
        vv += dot(v, v);
    }
    let group = p.n_heads / p.n_kv;
    var sum = 0.0;
    for (var g = 0u; g < bounded(group); g++) {
        let a = h * group + g;
        let s = lse_get(a);
        sum += exp(work[m_at(a, i)] - s.x) / s.y;
    }
    scores[cell(h, i)] = sum / f32(group) * sqrt(vv);
}

@compute @workgroup_size(64)
fn mean(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= count.n) {
        return;
    }
    let cells = p.n_layers * p.n_kv;
    var total = 0.0;
    for (var c = 0u; c < bounded(cells); c++) {
        total += scores[c * p.slots + i];
    }
    scores[mean_at(i)] = total / f32(cells);
}
