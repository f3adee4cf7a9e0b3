// attention_decode.wgsl: the `gpu` decode attention partial: one query over
// one key chunk for every query head of one KV group (needs a KV-format
// prelude; attention_io.wgsl has the parameters, bindings and partials
// layout, and attention.wgsl's `merge` combines the chunks as for the `cpu`
// variant, `decode_partial` there).
//
// The `cpu` variant suits llvmpipe: 64 lanes, each scoring four keys, then
// a softmax and a value sum that run serially over the chunk's 256 keys on
// a few lanes. On a GPU those serial loops leave most lanes idle. Here a
// workgroup of 256 lanes does every phase in parallel:
//   scores   lane j scores key j of the chunk against all heads of the group
//            (each key row is loaded once per group);
//   softmax  lane = (head g, segment of 8 keys): per-head max and sum by
//            tree reductions over the 32 segments in workgroup memory;
//   values   lane = (4-value column d, key slice s of 8): each lane sums 32
//            keys for all heads (the 32 columns of a value row are read by
//            adjacent lanes), then the 8 slices are added per head.
//
// Bindings (group 0): as attention_io.wgsl.
// Dispatch: (n_chunks of the page, n_kv, 1), as decode_partial.
// Workgroup memory: 16,448 bytes.

var<workgroup> qs: array<vec4<f32>, 256>;  // GMAX * HD4_MAX, scaled queries
var<workgroup> sc: array<f32, 2048>;       // GMAX * CHUNK scores, then weights
var<workgroup> red: array<vec4<f32>, 256>; // reduction scratch
var<workgroup> ml: array<vec2<f32>, GMAX>; // per head (max, sum)

@compute @workgroup_size(256)
fn decode_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = page.first / CHUNK + wid.x;
    let kvh = wid.y;
    let g_n = GROUP; // p.n_heads / p.n_kv
    let hd4 = p.hd4;
    let kv_stride = p.n_kv * hd4;
    let n_keys = step.start_slot + 1u;
    let k0 = c * CHUNK;

    if (lid < g_n * hd4) {
        qs[lid] = q[kvh * g_n * hd4 + lid] * p.scale;
    }
    workgroupBarrier();

    // Scores: lane j takes key k0 + j.
    let slot = k0 + lid;
    var s_own: array<f32, GMAX>;
    for (var g = 0u; g < GMAX; g++) {
        s_own[g] = NEG;
    }
    // g_n is the override constant GROUP (attention_io.wgsl): the head
    // loops below have a constant trip count, so s_own and acc can stay in
    // registers.
    if (slot < n_keys) {
        for (var g = 0u; g < g_n; g++) {
            s_own[g] = 0.0;
        }
        let kb = (slot - page.first) * kv_stride + kvh * hd4;
        for (var d = 0u; d < hd4; d++) {
            let kv = unpack_kv(kc[kb + d]);
            for (var g = 0u; g < g_n; g++) {
                s_own[g] += dot(qs[g * hd4 + d], kv);
            }
        }
    }
    for (var g = 0u; g < g_n; g++) {
        sc[g * CHUNK + lid] = s_own[g];
    }
    workgroupBarrier();

    // Softmax statistics: lane = head g (lid % 8) x segment (lid / 8) of 8 keys.
    let g = lid % GMAX;
    let seg = lid / GMAX;
    let in_group = g < g_n;
    var m_part = NEG;
    if (in_group) {
        for (var j = seg * 8u; j < seg * 8u + 8u; j++) {
            m_part = max(m_part, sc[g * CHUNK + j]);
        }
    }
    red[lid].x = m_part;
    workgroupBarrier();
    for (var span = 16u; span > 0u; span /= 2u) {
        if (seg < span) {
            red[lid].x = max(red[lid].x, red[lid + span * GMAX].x);
        }
        workgroupBarrier();
    }
    let m = red[g].x;
    workgroupBarrier();
    var l_part = 0.0;
    if (in_group) {
        for (var j = seg * 8u; j < seg * 8u + 8u; j++) {
            // Keys past n_keys score NEG: their weight is exp(NEG - m) = 0
            // (all-NEG chunks do not occur: a dispatched chunk holds a key).
            let e = exp(sc[g * CHUNK + j] - m);
            sc[g * CHUNK + j] = e;
            l_part += e;
        }
    }
    red[lid].x = l_part;
    workgroupBarrier();
    for (var span = 16u; span > 0u; span /= 2u) {
        if (seg < span) {
            red[lid].x += red[lid + span * GMAX].x;
        }
        workgroupBarrier();
    }
    if (lid < g_n) {
        ml[lid] = vec2<f32>(m, red[lid].x);
    }
    workgroupBarrier();

    // Values: lane = column d (lid % 32) x key slice s (lid / 32).
    let d = lid % HD4_MAX;
    let s = lid / HD4_MAX;
    let n_valid = min(CHUNK, n_keys - k0);
    var acc: array<vec4<f32>, GMAX>;
    for (var h = 0u; h < GMAX; h++) {
        acc[h] = vec4<f32>(0.0);
    }
    if (d < hd4) {
        for (var j = s; j < n_valid; j += 8u) {
            let v = unpack_kv(vc[(k0 + j - page.first) * kv_stride + kvh * hd4 + d]);
            for (var h = 0u; h < g_n; h++) {
                acc[h] += sc[h * CHUNK + j] * v;
            }
        }
    }
    for (var h = 0u; h < g_n; h++) {
        red[lid] = acc[h];
        workgroupBarrier();
        if (s == 0u && d < hd4) {
            var total = red[d];
            for (var k = 1u; k < 8u; k++) {
                total += red[k * HD4_MAX + d];
            }
            part[part_base(0u, kvh * g_n + h, c) + d] = total;
        }
        workgroupBarrier();
    }
    if (lid < g_n) {
        part[part_base(0u, kvh * g_n + lid, c) + hd4] = vec4<f32>(ml[lid].x, ml[lid].y, 0.0, 0.0);
    }
}
