// attention_prefill.wgsl: the `gpu` attention partials for many queries
// (prefill, and the counter-causal pass of the CCS policies) (needs a
// KV-format prelude; attention_io.wgsl has the parameters, bindings and
// partials layout; attention.wgsl's `merge` combines the chunks).
//
// The `cpu` variant gives each lane one query and the whole head: its query
// and accumulator (2 x head_dim floats) overflow a GPU's registers, and 64
// lanes per (query block, head, chunk) leave most of the card idle. Here a
// workgroup of 256 lanes takes 64 queries of one head over one key chunk,
// four lanes per query, each lane holding every fourth 4-value column of the
// query and the accumulator (at most 8 vec4 each). Keys and values go
// through workgroup memory 8 keys at a time (loaded once for the 64 queries,
// coalesced); each lane scores its columns, the four partial scores of a
// query are added through workgroup memory, and the online softmax (running
// max and sum, rescaled accumulator) runs on all four lanes alike.
//
// Entry points (Dispatch, as attention.wgsl's: (ceil(n_tokens / 64),
// n_heads, n_chunks of the page)):
//   prefill_partial     query t sits in slot start_slot + t and attends slots
//                       0 ..= start_slot + t (causal);
//   anticausal_partial  query t is the entry in slot qslot[t] and attends the
//                       slots after it among the start_slot + n_tokens present.
// A sliding window (AttnParams.window) hides the keys whose original
// positions (kpos) are not within it of the query's, as in attention.wgsl.
// Bindings (group 0): as attention_io.wgsl.
// Workgroup memory: 16,384 bytes. A wide build (attention_heads_wide.wgsl in
// place of attention_heads.wgsl, src/shaders.rs) takes heads of 256 with
// tiles of 4 keys, in the same arrays.

const TK: u32 = 256u / HD4_MAX; // keys per tile: 8, or 4 in the wide build
const COLS: u32 = HD4_MAX / 4u; // 4-value columns per lane: 8, or 16

var<workgroup> k_tile: array<vec4<f32>, 256>;   // TK x HD4_MAX
var<workgroup> v_tile: array<vec4<f32>, 256>;
var<workgroup> dots: array<f32, 2048>;          // 64 queries x 4 lanes x TK (8)

// Query lane of 64 x 4, for keys [k_lo, k_hi) of the chunk the workgroup
// loops over; this lane's query attends [own_lo, own_hi), within the window
// of `query_slot`'s original position.
fn tiled_partial(t0: u32, lid: u32, h: u32, c: u32, k_lo: u32, k_hi: u32, own_lo: u32, own_hi: u32, query_slot: u32) {
    let qi = lid / 4u;
    let r = lid % 4u;
    let t = t0 + qi;
    let live = t < step.n_tokens;
    let kvh = h / (p.n_heads / p.n_kv);
    let hd4 = p.hd4;
    let kv_stride = p.n_kv * hd4;

    var qv: array<vec4<f32>, COLS>;
    var acc: array<vec4<f32>, COLS>;
    for (var i = 0u; i < COLS; i++) {
        let d = r + 4u * i;
        qv[i] = vec4<f32>(0.0);
        if (live && d < hd4) {
            qv[i] = q[(row(t) * p.n_heads + h) * hd4 + d] * p.scale;
        }
        acc[i] = vec4<f32>(0.0);
    }
    var query_pos = 0u;
    if (p.window > 0u) {
        query_pos = slot_pos(query_slot, kvh);
    }
    var m = NEG;
    var l = 0.0;
    for (var k0 = k_lo; k0 < bounded(k_hi); k0 += TK) {
        // Stage TK keys and values (rows past k_hi are zeros, never used).
        for (var e = lid; e < TK * HD4_MAX; e += 256u) {
            let j = e / HD4_MAX;
            let d = e % HD4_MAX;
            var kv = vec4<f32>(0.0);
            var vv = vec4<f32>(0.0);
            if (k0 + j < k_hi && d < hd4) {
                let at = (k0 + j - page.first) * kv_stride + kvh * hd4 + d;
                kv = unpack_kv(kc[at]);
                vv = unpack_kv(vc[at]);
            }
            k_tile[e] = kv;
            v_tile[e] = vv;
        }
        workgroupBarrier();
        for (var j = 0u; j < TK; j++) {
            var s = 0.0;
            for (var i = 0u; i < COLS; i++) {
                s += dot(qv[i], k_tile[j * HD4_MAX + r + 4u * i]);
            }
            dots[(qi * 4u + r) * TK + j] = s;
        }
        workgroupBarrier();
        var sj: array<f32, TK>;
        var tile_max = NEG;
        for (var j = 0u; j < TK; j++) {
            let b = qi * 4u * TK + j;
            let key = k0 + j;
            let valid = key >= own_lo && key < own_hi && in_window(query_pos, key, kvh);
            sj[j] = select(NEG, dots[b] + dots[b + TK] + dots[b + 2u * TK] + dots[b + 3u * TK], valid);
            tile_max = max(tile_max, sj[j]);
        }
        if (tile_max > NEG) {
            let m_new = max(m, tile_max);
            let corr = exp(m - m_new);
            l *= corr;
            for (var i = 0u; i < COLS; i++) {
                acc[i] *= corr;
            }
            for (var j = 0u; j < TK; j++) {
                // Masked keys score NEG: weight 0.
                let pj = select(0.0, exp(sj[j] - m_new), sj[j] > NEG);
                l += pj;
                for (var i = 0u; i < COLS; i++) {
                    acc[i] += pj * v_tile[j * HD4_MAX + r + 4u * i];
                }
            }
            m = m_new;
        }
        workgroupBarrier();
    }
    if (live) {
        let base = part_base(t, h, c);
        for (var i = 0u; i < COLS; i++) {
            let d = r + 4u * i;
            if (d < hd4) {
                part[base + d] = acc[i];
            }
        }
        // A chunk with no keys for this query leaves (NEG, 0): it adds nothing.
        if (r == 0u) {
            part[base + hd4] = vec4<f32>(m, l, 0.0, 0.0);
        }
    }
}

@compute @workgroup_size(256)
fn prefill_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t0 = wid.x * 64u;
    let c = page.first / CHUNK + wid.z;
    let chunk_begin = c * CHUNK;
    // The workgroup's last query bounds the keys any of its queries sees.
    let t_last = min(t0 + 63u, step.n_tokens - 1u);
    let k_hi = min(chunk_begin + CHUNK, step.start_slot + t_last + 1u);
    let t = t0 + lid / 4u;
    // Lanes past the last query (t_last) compute nothing they keep.
    let query_slot = step.start_slot + min(t, t_last);
    tiled_partial(t0, lid, wid.y, c, chunk_begin, k_hi, chunk_begin, step.start_slot + t + 1u, query_slot);
}

@compute @workgroup_size(256)
fn anticausal_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t0 = wid.x * 64u;
    let c = page.first / CHUNK + wid.z;
    let chunk_begin = c * CHUNK;
    let n_present = step.start_slot + step.n_tokens;
    let k_hi = min(chunk_begin + CHUNK, n_present);
    let t = min(t0 + lid / 4u, step.n_tokens - 1u);
    tiled_partial(t0, lid, wid.y, c, chunk_begin, k_hi, qslot[t] + 1u, n_present, qslot[t]);
}
