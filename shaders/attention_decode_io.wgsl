// attention_decode_io.wgsl: what the two `gpu` decode attention partials
// share (attention_decode.wgsl, attention_decode_lanes.wgsl; included after
// attention_io.wgsl, src/shaders.rs): their workgroup memory, the query load,
// and every phase after the scores. They differ only in how they score the
// chunk's keys. The split-key kernel (attention_decode_split.wgsl) takes the
// query load, the chunk a workgroup works on and the reduction arrays from
// here, not the phases. One workgroup of CHUNK lanes (256, or 64 for the
// short-chunk kernel; attention_io.wgsl) per (key chunk, KV head), as the
// merge in attention.wgsl expects:
//   softmax  lane = (head g, segment of GMAX keys): per-head max and sum by
//            tree reductions over the CHUNK / GMAX segments in workgroup
//            memory (GMAX x segments = CHUNK lanes);
//   values   lane = (4-value column d, key slice s of CHUNK / HD4_MAX): each
//            lane sums CHUNK / SLICES keys for all heads (the columns of a
//            value row are read by adjacent lanes), VALUE_BATCH rows loaded
//            at a time, then the slices are added per head.
// Both kernels have a wide build (attention_heads_wide.wgsl in place of
// attention_heads.wgsl: heads of 256, up to 4 query heads per KV head;
// src/shaders.rs), whose arrays are no larger.
// Workgroup memory: 16,384 bytes (16 KiB: what WebGPU and Vulkan promise).

// Value rows each lane loads at once in the value phase (1 to
// VALUE_BATCH_MAX): an override constant set by the launcher, 1 for
// `Parallel` and `LanesPerKey`, 8 for `ParallelBatched`.
override VALUE_BATCH: u32 = 1u;
const VALUE_BATCH_MAX: u32 = 8u;
// Key slices of the value phase: lanes / columns.
override SLICES: u32 = CHUNK / HD4_MAX;

var<workgroup> qs: array<vec4<f32>, 256>;  // GMAX * HD4_MAX, scaled queries
var<workgroup> sc: array<f32, 2048>;       // GMAX * CHUNK scores, then weights
var<workgroup> red: array<vec4<f32>, 256>; // reduction scratch

// What a decode workgroup works on: key chunk c of the cache, KV head kvh,
// for a query that attends slots 0 .. n_keys - 1 (with a window, those
// whose original positions are within it of query_pos, the query's).
struct DecodeChunk {
    c: u32,
    kvh: u32,
    n_keys: u32,
    query_pos: u32,
}

fn decode_chunk(wid: vec3<u32>) -> DecodeChunk {
    var query_pos = 0u;
    if (p.window > 0u) {
        query_pos = slot_pos(step.start_slot, 0u);
    }
    return DecodeChunk(page.first / CHUNK + wid.x, wid.y, step.start_slot + 1u, query_pos);
}

// Whether the query sees the key in `slot`: a slot it attends (`&&` reads
// kpos only for those), within its window.
fn key_seen(ch: DecodeChunk, slot: u32) -> bool {
    return slot < ch.n_keys && in_window(ch.query_pos, slot, ch.kvh);
}

// Index in kc and vc of word d (four values) of KV head kvh in the row of
// `slot` (a slot of this page).
fn kv_word(slot: u32, kvh: u32, d: u32) -> u32 {
    return (slot - page.first) * p.n_kv * p.hd4 + kvh * p.hd4 + d;
}

// The scaled queries of KV head kvh's GROUP heads into qs, by a workgroup
// of `lanes` lanes (CHUNK, or the split-key kernel's 64).
fn load_group_queries(kvh: u32, lid: u32, lanes: u32) {
    let n = GROUP * p.hd4;
    for (var i = lid; i < n; i += lanes) { // loop bound: n <= 256
        qs[i] = q[row(0u) * p.n_heads * p.hd4 + kvh * n + i] * p.scale;
    }
    workgroupBarrier();
}

// From the scores in sc (head g's key j at g * CHUNK + j; NEG for keys the
// query does not see: past the last, outside its window) to the chunk's partials of its KV head's query heads: the
// softmax statistics, the weighted value sums, and (max, sum) per head.
fn finish_chunk(ch: DecodeChunk, lid: u32) {
    let g_n = GROUP; // p.n_heads / p.n_kv
    let hd4 = p.hd4;
    let c = ch.c;
    let kvh = ch.kvh;
    let k0 = c * CHUNK;

    // Softmax statistics: lane = head g (lid % GMAX) x segment (lid / GMAX)
    // of GMAX keys, CHUNK / GMAX segments.
    let g = lid % GMAX;
    let seg = lid / GMAX;
    let in_group = g < g_n;
    var m_part = NEG;
    if (in_group) {
        for (var j = seg * GMAX; j < seg * GMAX + GMAX; j++) {
            m_part = max(m_part, sc[g * CHUNK + j]);
        }
    }
    red[lid].x = m_part;
    workgroupBarrier();
    for (var span = CHUNK / (2u * GMAX); span > 0u; span /= 2u) {
        if (seg < span) {
            red[lid].x = max(red[lid].x, red[lid + span * GMAX].x);
        }
        workgroupBarrier();
    }
    let m = red[g].x;
    workgroupBarrier();
    var l_part = 0.0;
    if (in_group) {
        for (var j = seg * GMAX; j < seg * GMAX + GMAX; j++) {
            // Unseen keys weigh 0, also in a chunk with none seen (m NEG:
            // a chunk wholly outside the window leaves (NEG, 0), which the
            // merge weighs 0).
            let s = sc[g * CHUNK + j];
            let e = select(0.0, exp(s - m), s > NEG);
            sc[g * CHUNK + j] = e;
            l_part += e;
        }
    }
    red[lid].x = l_part;
    workgroupBarrier();
    for (var span = CHUNK / (2u * GMAX); span > 0u; span /= 2u) {
        if (seg < span) {
            red[lid].x += red[lid + span * GMAX].x;
        }
        workgroupBarrier();
    }
    // Each head's (max, sum) goes straight to its partial (lane g < GMAX holds
    // head g's max in m and, after the reduction, its sum in red[g]), so no
    // workgroup array keeps them: 16 KiB in all, what Vulkan and WebGPU promise.
    if (lid < g_n) {
        part[part_base(0u, kvh * g_n + lid, c) + hd4] = vec4<f32>(m, red[lid].x, 0.0, 0.0);
    }
    workgroupBarrier();

    // Values: lane = column d (lid % HD4_MAX) x key slice s (lid / HD4_MAX)
    // of the CHUNK / HD4_MAX slices (SLICES); slice s takes keys s,
    // s + SLICES, ...
    let d = lid % HD4_MAX;
    let s = lid / HD4_MAX;
    let n_valid = min(CHUNK, ch.n_keys - k0);
    var acc: array<vec4<f32>, GMAX>;
    for (var h = 0u; h < GMAX; h++) {
        acc[h] = vec4<f32>(0.0);
    }
    if (d < hd4) {
        // VALUE_BATCH rows of the slice at a time: their loads are issued
        // together, before the sums that use them (one row at a time, each
        // lane waits for memory once per key).
        var j = s;
        for (; j + SLICES * (VALUE_BATCH - 1u) < n_valid; j += SLICES * VALUE_BATCH) { // loop bound: n_valid <= CHUNK
            var vs: array<vec4<f32>, VALUE_BATCH_MAX>;
            for (var u = 0u; u < VALUE_BATCH; u++) {
                vs[u] = unpack_kv(vc[kv_word(k0 + j + SLICES * u, kvh, d)]);
            }
            for (var u = 0u; u < VALUE_BATCH; u++) {
                for (var h = 0u; h < g_n; h++) {
                    acc[h] += sc[h * CHUNK + j + SLICES * u] * vs[u];
                }
            }
        }
        for (; j < n_valid; j += SLICES) { // loop bound: n_valid <= CHUNK
            let v = unpack_kv(vc[kv_word(k0 + j, kvh, d)]);
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
            for (var k = 1u; k < SLICES; k++) {
                total += red[k * HD4_MAX + d];
            }
            part[part_base(0u, kvh * g_n + h, c) + d] = total;
        }
        workgroupBarrier();
    }
}
