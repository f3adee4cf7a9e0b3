// key_scores.wgsl: the cache-only eviction scores of kvpress's KnormPress,
// KeyDiffPress and LagKVPress, per (layer, KV head, cache slot), computed
// where the keys and values are (the cache, keys after RoPE), at a refresh:
//   knorm    s = -||k||
//   keydiff  s = -cos(k, anchor), anchor = sum over the present slots of
//            k / max(||k||, 1e-12) (kvpress: the mean of the normalized
//            keys; the cosine does not see the 1/n)
//   lagkv    mode 2 (docs/POLICIES.md): the present slots after `sinks` in
//            partitions of `lag`; each slot of partition m scored by the
//            spread of its keys and values scaled to the per-channel range
//            of partition m + 1, as its rank in partition m / lag; the
//            sinks and the last full partition plus the rest score 1
//            (fewer than sinks + 2 lag present: 1 for the sinks, then
//            (i - sinks) / (n - sinks)).
// then `mean` averages a slot's scores over every (layer, KV head) for the
// cache's one kept set of positions (token granularity).
//
//   norms    per page: norm[l, h, i] = ||k_i||; mode 0 (knorm) also writes
//            per_head[l, h, i] = -norm. Dispatch (ceil(present slots in
//            page / 64), n_kv, 1).
//   anchor_sum  per page: anchor[l, h] (+)= sum over the page's present slots
//            of k / max(norm, 1e-12); the first page (page.first == 0)
//            overwrites, the later ones add. One workgroup of 64 per
//            (vec4 of the head, head): dispatch (hd4, n_kv, 1).
//   cosine   per page: per_head[l, h, i] = -dot(k, a) / max(||k|| ||a||, 1e-8).
//            Dispatch as norms.
//   lag_range  per page: lag_ranges[l, h, m] = per channel min and max of keys
//            and values over partition m's slots in the page (the page
//            holding the partition's first slot overwrites, later pages
//            combine). One workgroup of 64 per (partition, head): dispatch
//            (partitions, n_kv, 1).
//   lag_sigma  per page: sigma[l, h, k|v, i] = unbiased std over the channels
//            of (x - lo) / (hi - lo) against partition m + 1's range (a
//            channel with hi == lo counts 0; kvpress would give NaN); slots
//            scoring 1 (or the short rule) write per_head directly.
//            Dispatch as norms.
//   lag_rank per layer: for each scored partition, the softmax of sigma over
//            it for keys and for values, their mean, and per_head = its rank
//            in the partition (ties by slot) / lag. One workgroup of 64 per
//            (partition, head): dispatch (partitions - 1, n_kv, 1).
//   mean     score[i] = mean over l, h of per_head[l, h, i].
//            Dispatch (ceil(present / 64), 1, 1).
//
// Bindings (group 0):
//   0 count     uniform Count        (n: present slots)
//   1 p         uniform KeyParams    (layer: this bind group's layer)
//   2 kc        storage read  [page.len, n_kv * hd4] KvPacked  one page of the
//                             layer's key cache (kv prelude)
//   3 norm      storage rw    [n_layers, n_kv, slots] f32
//   4 anchor    storage rw    [n_layers, n_kv, hd4] vec4<f32>
//   5 per_head  storage rw    [n_layers, n_kv, slots] f32
//   6 score     storage rw    [slots] f32
//   7 page      uniform Page  the slots kc holds
//   8 vc        storage read  [page.len, n_kv * hd4] KvPacked  the same page of
//                             the layer's value cache (lagkv)
//   9 lag_ranges storage rw    [n_layers, n_kv, parts, 4, hd4] vec4<f32>  key
//                             min, key max, value min, value max (lagkv)
//  10 sigma     storage rw    [n_layers, n_kv, 2, slots] f32  (lagkv)
// Per-invocation loop counts: hd4 (norms, cosine, lag_sigma), page.len / 64
// (anchor), n_layers * n_kv (mean), lag * hd4 / 64 (lag_range), lag * lag /
// 64 (lag_rank).
struct Count {
    n: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

struct KeyParams {
    n_kv: u32,
    hd4: u32,
    slots: u32,
    layer: u32,
    n_layers: u32,
    mode: u32,
    sinks: u32,
    lag: u32,
    parts: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> count: Count;
@group(0) @binding(1) var<uniform> p: KeyParams;
@group(0) @binding(2) var<storage, read> kc: array<KvPacked>;
@group(0) @binding(3) var<storage, read_write> norm: array<f32>;
@group(0) @binding(4) var<storage, read_write> anchor: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> per_head: array<f32>;
@group(0) @binding(6) var<storage, read_write> score: array<f32>;
@group(0) @binding(7) var<uniform> page: Page;
@group(0) @binding(8) var<storage, read> vc: array<KvPacked>;
@group(0) @binding(9) var<storage, read_write> lag_ranges: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> sigma: array<f32>;

const NORMALIZE_EPS: f32 = 1e-12; // torch.nn.functional.normalize
const COSINE_EPS: f32 = 1e-8; // torch.nn.functional.cosine_similarity

var<workgroup> partial: array<vec4<f32>, 64>;

// Slots of the bound page that hold present entries.
fn page_present() -> u32 {
    if (count.n <= page.first) {
        return 0u;
    }
    return min(page.len, count.n - page.first);
}

fn cell(h: u32, i: u32) -> u32 {
    return (p.layer * p.n_kv + h) * p.slots + i;
}

fn key_base(i: u32, h: u32) -> u32 {
    return (i - page.first) * p.n_kv * p.hd4 + h * p.hd4;
}

@compute @workgroup_size(64)
fn norms(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.y;
    if (gid.x >= page_present() || h >= p.n_kv) {
        return;
    }
    let i = page.first + gid.x;
    let kb = key_base(i, h);
    var s = 0.0;
    for (var d = 0u; d < bounded(p.hd4); d++) {
        let k = unpack_kv(kc[kb + d]);
        s += dot(k, k);
    }
    let n = sqrt(s);
    norm[cell(h, i)] = n;
    if (p.mode == 0u) {
        per_head[cell(h, i)] = -n;
    }
}

@compute @workgroup_size(64)
fn anchor_sum(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let d = wid.x;
    let h = wid.y;
    let present = page_present();
    var acc = vec4<f32>(0.0);
    for (var j = lid; j < bounded(present); j += 64u) {
        let i = page.first + j;
        let k = unpack_kv(kc[key_base(i, h) + d]);
        acc += k / max(norm[cell(h, i)], NORMALIZE_EPS);
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let at = (p.layer * p.n_kv + h) * p.hd4 + d;
        if (page.first == 0u) {
            anchor[at] = partial[0];
        } else {
            anchor[at] += partial[0];
        }
    }
}

@compute @workgroup_size(64)
fn cosine(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.y;
    if (gid.x >= page_present() || h >= p.n_kv) {
        return;
    }
    let i = page.first + gid.x;
    let kb = key_base(i, h);
    let ab = (p.layer * p.n_kv + h) * p.hd4;
    var ka = 0.0;
    var aa = 0.0;
    for (var d = 0u; d < bounded(p.hd4); d++) {
        let a = anchor[ab + d];
        ka += dot(unpack_kv(kc[kb + d]), a);
        aa += dot(a, a);
    }
    per_head[cell(h, i)] = -ka / max(norm[cell(h, i)] * sqrt(aa), COSINE_EPS);
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
        total += per_head[c * p.slots + i];
    }
    score[i] = total / f32(cells);
}

// LagKV's layout of the present slots: whether fewer than sinks + 2 lag are
// present (the short rule), and the end of the last full partition.
fn lag_short() -> bool {
    return count.n < p.sinks + 2u * p.lag;
}

fn lag_end() -> u32 {
    return p.sinks + (count.n - p.sinks) / p.lag * p.lag;
}

fn lag_parts() -> u32 {
    return (lag_end() - p.sinks) / p.lag;
}

fn range_at(h: u32, m: u32, which: u32) -> u32 {
    return (((p.layer * p.n_kv + h) * p.parts + m) * 4u + which) * p.hd4;
}

fn sigma_at(h: u32, which: u32, i: u32) -> u32 {
    return ((p.layer * p.n_kv + h) * 2u + which) * p.slots + i;
}

@compute @workgroup_size(64)
fn lag_range(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let m = wid.x;
    let h = wid.y;
    // Partition 0 is never a reference.
    if (lag_short() || m == 0u || m >= lag_parts() || h >= p.n_kv) {
        return;
    }
    let start = p.sinks + m * p.lag;
    let first = max(start, page.first);
    let last = min(start + p.lag, page.first + page_present());
    if (first >= last) {
        return;
    }
    let opens = start >= page.first;
    for (var d = lid; d < bounded(p.hd4); d += 64u) {
        var k_lo = vec4<f32>(3.4e38);
        var k_hi = vec4<f32>(-3.4e38);
        var v_lo = vec4<f32>(3.4e38);
        var v_hi = vec4<f32>(-3.4e38);
        for (var i = first; i < bounded(last); i++) {
            let k = unpack_kv(kc[key_base(i, h) + d]);
            let v = unpack_kv(vc[key_base(i, h) + d]);
            k_lo = min(k_lo, k);
            k_hi = max(k_hi, k);
            v_lo = min(v_lo, v);
            v_hi = max(v_hi, v);
        }
        let at = range_at(h, m, 0u) + d;
        let hd4 = p.hd4;
        if (!opens) {
            k_lo = min(k_lo, lag_ranges[at]);
            k_hi = max(k_hi, lag_ranges[at + hd4]);
            v_lo = min(v_lo, lag_ranges[at + 2u * hd4]);
            v_hi = max(v_hi, lag_ranges[at + 3u * hd4]);
        }
        lag_ranges[at] = k_lo;
        lag_ranges[at + hd4] = k_hi;
        lag_ranges[at + 2u * hd4] = v_lo;
        lag_ranges[at + 3u * hd4] = v_hi;
    }
}

// Channel vec4 d of slot i's key (`which` 0) or value (2) scaled to the
// reference partition's range starting at `r` (a channel with hi == lo
// counts 0).
fn scaled(i: u32, h: u32, r: u32, which: u32, d: u32) -> vec4<f32> {
    var x: vec4<f32>;
    if (which == 0u) {
        x = unpack_kv(kc[key_base(i, h) + d]);
    } else {
        x = unpack_kv(vc[key_base(i, h) + d]);
    }
    let lo = lag_ranges[r + d];
    let width = lag_ranges[r + p.hd4 + d] - lo;
    return select((x - lo) / width, vec4<f32>(0.0), width == vec4<f32>(0.0));
}

// The unbiased std over the head's channels of `scaled` (torch.std).
fn scaled_std(i: u32, h: u32, r: u32, which: u32) -> f32 {
    var total = 0.0;
    for (var d = 0u; d < bounded(p.hd4); d++) {
        total += dot(scaled(i, h, r, which, d), vec4<f32>(1.0));
    }
    let channels = f32(p.hd4 * 4u);
    let mean = total / channels;
    var squares = 0.0;
    for (var d = 0u; d < bounded(p.hd4); d++) {
        let c = scaled(i, h, r, which, d) - mean;
        squares += dot(c, c);
    }
    return sqrt(squares / (channels - 1.0));
}

@compute @workgroup_size(64)
fn lag_sigma(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.y;
    if (gid.x >= page_present() || h >= p.n_kv) {
        return;
    }
    let i = page.first + gid.x;
    if (lag_short()) {
        if (i < p.sinks) {
            per_head[cell(h, i)] = 1.0;
        } else {
            per_head[cell(h, i)] = f32(i - p.sinks) / f32(count.n - p.sinks);
        }
        return;
    }
    if (i < p.sinks || i >= lag_end() - p.lag) {
        per_head[cell(h, i)] = 1.0;
        return;
    }
    let reference = (i - p.sinks) / p.lag + 1u;
    sigma[sigma_at(h, 0u, i)] = scaled_std(i, h, range_at(h, reference, 0u), 0u);
    sigma[sigma_at(h, 1u, i)] = scaled_std(i, h, range_at(h, reference, 2u), 2u);
}

// partial[lid].xy reduced over the workgroup: the max (`take_max`) or sum.
fn reduce_pair(lid: u32, take_max: bool) -> vec2<f32> {
    for (var stride = 32u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            let a = partial[lid];
            let b = partial[lid + stride];
            partial[lid] = select(a + b, max(a, b), take_max);
        }
        workgroupBarrier();
    }
    let r = partial[0].xy;
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(64)
fn lag_rank(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let m = wid.x;
    let h = wid.y;
    if (lag_short() || m + 1u >= lag_parts() || h >= p.n_kv) {
        return;
    }
    let start = p.sinks + m * p.lag;
    var top = vec2<f32>(-3.4e38);
    for (var j = lid; j < bounded(p.lag); j += 64u) {
        let i = start + j;
        top = max(top, vec2<f32>(sigma[sigma_at(h, 0u, i)], sigma[sigma_at(h, 1u, i)]));
    }
    partial[lid] = vec4<f32>(top, 0.0, 0.0);
    workgroupBarrier();
    top = reduce_pair(lid, true);
    var total = vec2<f32>(0.0);
    for (var j = lid; j < bounded(p.lag); j += 64u) {
        let i = start + j;
        let s = vec2<f32>(sigma[sigma_at(h, 0u, i)], sigma[sigma_at(h, 1u, i)]);
        total += exp(s - top);
    }
    partial[lid] = vec4<f32>(total, 0.0, 0.0);
    workgroupBarrier();
    total = reduce_pair(lid, false);
    // Each invocation overwrites its own slots' key sigma with the mean
    // softmax, which the ranking below reads for every slot.
    for (var j = lid; j < bounded(p.lag); j += 64u) {
        let i = start + j;
        let s = vec2<f32>(sigma[sigma_at(h, 0u, i)], sigma[sigma_at(h, 1u, i)]);
        let w = exp(s - top) / total;
        sigma[sigma_at(h, 0u, i)] = (w.x + w.y) * 0.5;
    }
    storageBarrier();
    for (var j = lid; j < bounded(p.lag); j += 64u) {
        let x = sigma[sigma_at(h, 0u, start + j)];
        var rank = 0u;
        for (var t = 0u; t < bounded(p.lag); t++) {
            let y = sigma[sigma_at(h, 0u, start + t)];
            if (y < x || (y == x && t < j)) {
                rank++;
            }
        }
        per_head[cell(h, start + j)] = f32(rank) / f32(p.lag);
    }
}
