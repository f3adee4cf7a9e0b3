// attention.wgsl: causal grouped-query attention over the KV cache without a
// score matrix, split over key chunks (flash-decoding style) and merged.
//
// Every entry point works in key chunks of CHUNK cache slots, for two reasons:
// long contexts get parallelism across workgroups, and no invocation runs more
// than ~20k loop iterations (lavapipe silently stops a shader invocation after
// 65535 loop iterations in total; see docs/ARCHITECTURE.md).
//
//   prefill_partial  many queries: invocation = one query row of one head; it
//                    streams the chunk's keys with an online softmax (running
//                    max, running sum, rescaled accumulator, in tiles of BK keys).
//                    Dispatch (ceil(n_tokens / 64), n_heads, n_chunks).
//   anticausal_partial  the counter-causal pass of the CCS policies: query t is
//                    the cached entry in slot qslot[t] and attends only the
//                    entries after it (slots qslot[t]+1 .. n_keys-1, where
//                    n_keys = start_slot + n_tokens is the number of entries
//                    present). Dispatch as prefill_partial.
//   decode_partial   one query: workgroup = one KV head x one chunk; it scores all
//                    query heads of the KV group against the chunk (keys read once
//                    per group). Dispatch (n_chunks, n_kv, 1).
//   merge            combines the chunks of each (query, head).
//                    Dispatch (n_tokens, n_heads, 1), 32 invocations each.
// n_chunks = ceil((step.start_slot + step.n_tokens) / CHUNK).
// The cache may be split into pages (src/kernels/paging.rs) of a multiple of
// CHUNK slots: the partial kernels see one page at a time, chunk c of the
// dispatch being chunk page.first / CHUNK + c of the whole cache; they are
// dispatched once per page with keys, over that page's chunks only.
// Query t of the step sits in slot step.start_slot + t and attends slots 0 ..= that slot.
//
// Bindings (group 0), all entry points (declared in attention_io.wgsl):
//   0 step  uniform Step
//   1 p     uniform AttnParams
//   2 q     storage read  [row0 + n_tokens, n_heads * head_dim/4] vec4<f32> (after RoPE)
//   3 kc    storage read  [page.len, n_kv * head_dim/4] KvPacked  one page of the key cache
//   4 vc    storage read  [page.len, n_kv * head_dim/4] KvPacked  the same page of the values
// (KvPacked: four values in the cache's format, from the kv_f16/kv_f32 prelude)
//   5 part  storage rw    [n_tokens, n_heads, n_chunks, head_dim/4 + 1] vec4<f32>
//                         (accumulator, then (max, sum, 0, 0))
//   6 out   storage rw    [row0 + n_tokens, n_heads * head_dim/4] vec4<f32>
//   7 lse   storage rw    [row0 + n_tokens, n_heads] f32  log-sum-exp of the scaled scores
//   8 qslot storage read  [n_tokens] u32  (anticausal_partial only) each query's own slot
//   9 page  uniform Page  the slots kc/vc hold (page.first a multiple of CHUNK)
//  10 kpos  storage read  [slots, kpos_lists] u32  original positions of the cache slots in each
//                         keep list (a query's: its own slot's; slot_pos in attention_io.wgsl)
// With a sliding window (p.window > 0) a key counts only within the window
// of its query (in_window); chunks with no key in it leave (NEG, 0).
// Limits: head_dim <= 128 (a multiple of 4), n_heads / n_kv <= 8; the wide
// build (attention_heads_wide.wgsl) takes head_dim <= 256, n_heads / n_kv <= 4.
// Workgroup memory: 12 KiB (decode_partial).
// One query row t of head h over the keys (cache slots) k_begin..k_end of chunk c,
// all within the bound page.
// `query_pos`: the query's original position (for the window).
fn partial_row(t: u32, h: u32, c: u32, k_begin: u32, k_end: u32, query_pos: u32) {
    let kvh = h / (p.n_heads / p.n_kv);
    let hd4 = HD4; // p.hd4
    let kv_stride = p.n_kv * hd4;
    let base = part_base(t, h, c);

    var qv: array<vec4<f32>, HD4_MAX>;
    var acc: array<vec4<f32>, HD4_MAX>;
    let qbase = (row(t) * p.n_heads + h) * hd4;
    for (var d = 0u; d < hd4; d++) {
        qv[d] = q[qbase + d] * p.scale;
        acc[d] = vec4<f32>(0.0);
    }
    var m = NEG;
    var l = 0.0;
    for (var k0 = k_begin; k0 < bounded(k_end); k0 += BK) {
        let n = min(BK, k_end - k0);
        var s: array<f32, BK>;
        var tile_max = NEG;
        for (var j = 0u; j < n; j++) {
            let kb = (k0 + j - page.first) * kv_stride + kvh * hd4;
            var dotv = 0.0;
            for (var d = 0u; d < hd4; d++) {
                dotv += dot(qv[d], unpack_kv(kc[kb + d]));
            }
            s[j] = select(NEG, dotv, in_window(query_pos, k0 + j, kvh));
            tile_max = max(tile_max, s[j]);
        }
        let m_new = max(m, tile_max);
        let corr = exp(m - m_new);
        l *= corr;
        for (var d = 0u; d < hd4; d++) {
            acc[d] *= corr;
        }
        for (var j = 0u; j < n; j++) {
            // A key outside the window weighs 0, also while every key so
            // far was outside (m_new still NEG).
            let pj = select(0.0, exp(s[j] - m_new), s[j] > NEG);
            l += pj;
            let vb = (k0 + j - page.first) * kv_stride + kvh * hd4;
            for (var d = 0u; d < hd4; d++) {
                acc[d] += pj * unpack_kv(vc[vb + d]);
            }
        }
        m = m_new;
    }
    // A chunk with no keys for this row leaves (NEG, 0): it adds nothing.
    for (var d = 0u; d < hd4; d++) {
        part[base + d] = acc[d];
    }
    part[base + hd4] = vec4<f32>(m, l, 0.0, 0.0);
}

@compute @workgroup_size(64)
fn prefill_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x * 64u + lid;
    if (t >= step.n_tokens) {
        return;
    }
    // Causal: query t sits in slot start_slot + t.
    let c = page.first / CHUNK + wid.z;
    let k_begin = c * CHUNK;
    let k_end = min(k_begin + CHUNK, step.start_slot + t + 1u);
    partial_row(t, wid.y, c, k_begin, max(k_begin, k_end), slot_pos(step.start_slot + t, 0u));
}

@compute @workgroup_size(64)
fn anticausal_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x * 64u + lid;
    if (t >= step.n_tokens) {
        return;
    }
    // Anti-causal: query t is the entry in cache slot qslot[t] and attends the
    // slots after it, up to the n_keys = start_slot + n_tokens present entries.
    let c = page.first / CHUNK + wid.z;
    let chunk_begin = c * CHUNK;
    let k_begin = max(chunk_begin, qslot[t] + 1u);
    let k_end = min(chunk_begin + CHUNK, step.start_slot + step.n_tokens);
    // The query's position: its own slot's (read only with a window), in
    // its KV head's keep list.
    var query_pos = 0u;
    if (p.window > 0u) {
        query_pos = slot_pos(qslot[t], wid.y / (p.n_heads / p.n_kv));
    }
    partial_row(t, wid.y, c, k_begin, max(k_begin, k_end), query_pos);
}

var<workgroup> qs: array<vec4<f32>, 256>;  // GMAX * HD4_MAX
var<workgroup> sc: array<f32, 2048>;       // GMAX * CHUNK
var<workgroup> ml: array<vec2<f32>, GMAX>;

@compute @workgroup_size(64)
fn decode_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = page.first / CHUNK + wid.x;
    let kvh = wid.y;
    let g_n = GROUP; // p.n_heads / p.n_kv
    let hd4 = HD4; // p.hd4: constant trip counts, constant offsets into qs
    let kv_stride = p.n_kv * hd4;
    let n_keys = step.start_slot + 1u;
    let k0 = c * CHUNK;
    var query_pos = 0u;
    if (p.window > 0u) {
        query_pos = slot_pos(step.start_slot, 0u);
    }

    for (var i = lid; i < bounded(g_n * hd4); i += 64u) {
        qs[i] = q[row(0u) * p.n_heads * hd4 + kvh * g_n * hd4 + i] * p.scale;
    }
    workgroupBarrier();
    for (var j = lid; j < CHUNK; j += 64u) {
        let slot = k0 + j;
        // Each key vector is loaded once and scored against every head of the group.
        var sg: array<f32, GMAX>;
        for (var g = 0u; g < g_n; g++) {
            sg[g] = 0.0;
        }
        let seen = slot < n_keys && in_window(query_pos, slot, kvh);
        if (seen) {
            let kb = (slot - page.first) * kv_stride + kvh * hd4;
            for (var d = 0u; d < hd4; d++) {
                let kv = unpack_kv(kc[kb + d]);
                for (var g = 0u; g < g_n; g++) {
                    sg[g] += dot(qs[g * hd4 + d], kv);
                }
            }
        }
        for (var g = 0u; g < g_n; g++) {
            sc[g * CHUNK + j] = select(NEG, sg[g], seen);
        }
    }
    workgroupBarrier();
    if (lid < g_n) {
        var m = NEG;
        for (var j = 0u; j < CHUNK; j++) {
            m = max(m, sc[lid * CHUNK + j]);
        }
        var l = 0.0;
        for (var j = 0u; j < CHUNK; j++) {
            // Unseen keys weigh 0, also in a chunk with none seen (m NEG).
            let e = select(0.0, exp(sc[lid * CHUNK + j] - m), sc[lid * CHUNK + j] > NEG);
            sc[lid * CHUNK + j] = e;
            l += e;
        }
        ml[lid] = vec2<f32>(m, l);
    }
    workgroupBarrier();
    let n_valid = min(CHUNK, n_keys - k0);
    // Each value vector is loaded once and accumulated for every head of the group.
    for (var d = lid; d < bounded(hd4); d += 64u) {
        var acc: array<vec4<f32>, GMAX>;
        for (var g = 0u; g < g_n; g++) {
            acc[g] = vec4<f32>(0.0);
        }
        for (var j = 0u; j < n_valid; j++) {
            let v = unpack_kv(vc[(k0 + j - page.first) * kv_stride + kvh * hd4 + d]);
            for (var g = 0u; g < g_n; g++) {
                acc[g] += sc[g * CHUNK + j] * v;
            }
        }
        for (var g = 0u; g < g_n; g++) {
            part[part_base(0u, kvh * g_n + g, c) + d] = acc[g];
        }
    }
    if (lid < g_n) {
        part[part_base(0u, kvh * g_n + lid, c) + hd4] = vec4<f32>(ml[lid].x, ml[lid].y, 0.0, 0.0);
    }
}

@compute @workgroup_size(32)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let h = wid.y;
    let hd4 = p.hd4;
    let nc = n_chunks();
    var m = NEG;
    for (var c = 0u; c < nc; c++) {
        m = max(m, part[part_base(t, h, c) + hd4].x);
    }
    var l = 0.0;
    for (var c = 0u; c < nc; c++) {
        let s = part[part_base(t, h, c) + hd4];
        l += s.y * exp(s.x - m);
    }
    for (var d = lid; d < bounded(hd4); d += 32u) {
        var a = vec4<f32>(0.0);
        for (var c = 0u; c < nc; c++) {
            let b = part_base(t, h, c);
            a += part[b + d] * exp(part[b + hd4].x - m);
        }
        out[(row(t) * p.n_heads + h) * hd4 + d] = a / l;
    }
    if (lid == 0u) {
        lse[row(t) * p.n_heads + h] = m + log(l);
    }
}
