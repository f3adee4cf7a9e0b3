// key_scores.wgsl: the key-only eviction scores of kvpress's KnormPress and
// KeyDiffPress, per (layer, KV head, cache slot), computed where the keys
// are (the cache, after RoPE), at a refresh:
//   knorm    s = -||k||
//   keydiff  s = -cos(k, anchor), anchor = sum over the present slots of
//            k / max(||k||, 1e-12) (kvpress: the mean of the normalized
//            keys; the cosine does not see the 1/n)
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
// Per-invocation loop counts: hd4 (norms, cosine), page.len / 64 (anchor),
// n_layers * n_kv (mean).
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
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> count: Count;
@group(0) @binding(1) var<uniform> p: KeyParams;
@group(0) @binding(2) var<storage, read> kc: array<KvPacked>;
@group(0) @binding(3) var<storage, read_write> norm: array<f32>;
@group(0) @binding(4) var<storage, read_write> anchor: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> per_head: array<f32>;
@group(0) @binding(6) var<storage, read_write> score: array<f32>;
@group(0) @binding(7) var<uniform> page: Page;

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
