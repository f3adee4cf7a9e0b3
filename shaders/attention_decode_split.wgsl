// attention_decode_split.wgsl: split-key flash decoding, the `gpu` decode
// attention for long depths (`AttnDecodeVariant::SplitKey`), and its merge
// (needs a KV-format prelude; attention_io.wgsl has the parameters,
// bindings and partials layout, attention_decode_io.wgsl the query load and
// the chunk a workgroup works on).
//
// decode_partial: a workgroup of 64 lanes takes one split of CHUNK keys
// (an override constant, 128, 512 or 2,048: the tuner times each at each
// depth, so the number of splits, depth / CHUNK per KV head, is sized for
// the device by timing; wgpu reports no count of compute units) for every
// query head of one KV head, so each key and value row is read once for
// all GROUP heads. Eight adjacent lanes of one subgroup share a key: lane t
// takes the 4-value columns t % 8, t % 8 + 8, ... of its key's row, so the
// eight read consecutive words of the row (coalesced; the row is used by
// those lanes alone, so staging it in workgroup memory would buy nothing
// for its barriers), and the workgroup's eight key groups take keys
// kg, kg + 8, ... of the split. The partial dot products are summed with
// three subgroup shuffles; each key group keeps an online softmax per head
// (running max, sum and value accumulator of its columns), so the key loop
// has no barrier. At the end the eight key groups' states are combined per
// head in workgroup memory and written as the split's partials. At
// head_dim 64 each lane holds two columns: every lane loads, scores and sums
// values (where the partial kernels leave half their value lanes idle).
//
// merge: one workgroup of 256 lanes per (query, head): the splits' maxima
// reduced by lanes over splits, then lane (column d, slice s) sums the
// weighted accumulators of splits s, s + slices, ..., and the slices are
// added (attention.wgsl's merge runs one lane per column over every split).
//
// A sliding window hides keys as in attention_decode.wgsl (key_seen).
//
// Bindings (group 0): as attention_io.wgsl.
// Dispatch: decode_partial (n_chunks of the page in chunks of CHUNK, n_kv,
// 1), as attention_decode.wgsl; merge (n_tokens, n_heads, 1).
// Workgroup memory: decode_partial 12,800 bytes (qs 4,096, group_acc
// 8,192, group_ml 512), merge 12,288 (attention_decode_io.wgsl's red and
// sc).
// Extensions: `subgroups` (wgpu's SUBGROUP feature; blanked for naga,
// `shaders::naga_source`), with subgroups of one size, a power of two of
// at least 8 lanes, in a workgroup (as attention_decode_lanes.wgsl, whose
// start-up check this kernel has too: `attention::check_decode_variant`).

enable subgroups;

const KEY_LANES: u32 = 8u;
const SPLIT_LANES: u32 = 64u;
const KEY_GROUPS: u32 = 8u; // SPLIT_LANES / KEY_LANES
// Columns per lane: 4, or 8 in the wide build (heads of 256).
const COLS_MAX: u32 = HD4_MAX / KEY_LANES;
const ACC_MAX: u32 = GMAX * COLS_MAX;
const MERGE_LANES: u32 = 256u;

var<workgroup> group_ml: array<vec2<f32>, 64>;   // KEY_GROUPS x GMAX (max, sum)
var<workgroup> group_acc: array<vec4<f32>, 512>; // KEY_GROUPS x HD4_MAX, one head's

@compute @workgroup_size(64)
fn decode_partial(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) n_sg: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let ch = decode_chunk(wid);
    load_group_queries(ch.kvh, lid, SPLIT_LANES);

    // The eight lanes of a key are consecutive lanes of one subgroup.
    let t = sg * (SPLIT_LANES / n_sg) + sg_lane;
    let col0 = t % KEY_LANES;
    let kg = t / KEY_LANES;
    // HD4 and GROUP are override constants: constant trip counts, so the
    // per-head state stays in registers.
    let cols = (HD4 + KEY_LANES - 1u) / KEY_LANES;
    var m: array<f32, GMAX>;
    var l: array<f32, GMAX>;
    var acc: array<vec4<f32>, ACC_MAX>;
    for (var g = 0u; g < GMAX; g++) {
        m[g] = NEG;
    }

    let k0 = ch.c * CHUNK;
    let rounds = (min(CHUNK, ch.n_keys - k0) + KEY_GROUPS - 1u) / KEY_GROUPS;
    // The same trip count for every lane (the shuffles need them all).
    for (var r = 0u; r < rounds; r++) { // loop bound: rounds <= CHUNK / KEY_GROUPS
        let slot = k0 + r * KEY_GROUPS + kg;
        let seen = key_seen(ch, slot);
        var s: array<f32, GMAX>;
        for (var g = 0u; g < GMAX; g++) {
            s[g] = 0.0;
        }
        var vw: array<vec4<f32>, COLS_MAX>;
        if (seen) {
            // Keys and values loaded together: both in flight at once.
            for (var i = 0u; i < cols; i++) {
                let d = col0 + i * KEY_LANES;
                if (d < HD4) {
                    let kw = unpack_kv(kc[kv_word(slot, ch.kvh, d)]);
                    vw[i] = unpack_kv(vc[kv_word(slot, ch.kvh, d)]);
                    for (var g = 0u; g < GROUP; g++) {
                        s[g] += dot(qs[g * HD4 + d], kw);
                    }
                }
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            s[g] += subgroupShuffleXor(s[g], 1u);
            s[g] += subgroupShuffleXor(s[g], 2u);
            s[g] += subgroupShuffleXor(s[g], 4u);
        }
        if (seen) {
            for (var g = 0u; g < GROUP; g++) {
                let m_new = max(m[g], s[g]);
                let rescale = exp(m[g] - m_new);
                let e = exp(s[g] - m_new);
                l[g] = l[g] * rescale + e;
                for (var i = 0u; i < cols; i++) {
                    acc[g * COLS_MAX + i] = acc[g * COLS_MAX + i] * rescale + e * vw[i];
                }
                m[g] = m_new;
            }
        }
    }

    // The key groups' states, combined per head. A group that saw no key
    // holds (NEG, 0) and zero sums, which weigh 0 (or nothing, where no
    // group saw one: the split's partial is (NEG, 0), which the merge
    // weighs 0).
    if (col0 == 0u) {
        for (var g = 0u; g < GROUP; g++) {
            group_ml[kg * GMAX + g] = vec2<f32>(m[g], l[g]);
        }
    }
    workgroupBarrier();
    for (var g = 0u; g < GROUP; g++) {
        var m_all = NEG;
        for (var k = 0u; k < KEY_GROUPS; k++) {
            m_all = max(m_all, group_ml[k * GMAX + g].x);
        }
        let f = exp(m[g] - m_all);
        for (var i = 0u; i < cols; i++) {
            let d = col0 + i * KEY_LANES;
            if (d < HD4) {
                group_acc[kg * HD4_MAX + d] = acc[g * COLS_MAX + i] * f;
            }
        }
        workgroupBarrier();
        let base = part_base(0u, ch.kvh * GROUP + g, ch.c);
        if (lid < HD4) {
            var total = vec4<f32>(0.0);
            for (var k = 0u; k < KEY_GROUPS; k++) {
                total += group_acc[k * HD4_MAX + lid];
            }
            part[base + lid] = total;
        }
        if (lid == 0u) {
            var l_all = 0.0;
            for (var k = 0u; k < KEY_GROUPS; k++) {
                let ml = group_ml[k * GMAX + g];
                l_all += ml.y * exp(ml.x - m_all);
            }
            part[base + HD4] = vec4<f32>(m_all, l_all, 0.0, 0.0);
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let h = wid.y;
    let nc = n_chunks();
    // The splits' maxima: lanes over splits, then a tree in sc.
    var m_lane = NEG;
    for (var c = lid; c < nc; c += MERGE_LANES) { // loop bound: nc, the step's splits
        m_lane = max(m_lane, part[part_base(t, h, c) + HD4].x);
    }
    sc[lid] = m_lane;
    workgroupBarrier();
    for (var span = MERGE_LANES / 2u; span > 0u; span /= 2u) {
        if (lid < span) {
            sc[lid] = max(sc[lid], sc[lid + span]);
        }
        workgroupBarrier();
    }
    let m = sc[0];
    // Lane (column d, slice s): slice s weighs splits s, s + slices, ...
    // (HD4 is an override constant, so slices is one: at least 4).
    let slices = MERGE_LANES / HD4;
    let d = lid % HD4;
    let s = lid / HD4;
    var a = vec4<f32>(0.0);
    var l = 0.0;
    if (s < slices) {
        for (var c = s; c < nc; c += MERGE_LANES / HD4) { // loop bound: nc; a step of at least 4
            let b = part_base(t, h, c);
            let ml = part[b + HD4];
            let w = exp(ml.x - m);
            a += part[b + d] * w;
            l += ml.y * w;
        }
    }
    // Every column's lanes sum the same splits' sums: each column has l.
    red[lid] = a;
    sc[MERGE_LANES + lid] = l;
    workgroupBarrier();
    if (lid < HD4) {
        var total = vec4<f32>(0.0);
        var l_all = 0.0;
        for (var k = 0u; k < slices; k++) {
            total += red[k * HD4 + lid];
            l_all += sc[MERGE_LANES + k * HD4 + lid];
        }
        out[(row(t) * p.n_heads + h) * HD4 + lid] = total / l_all;
        if (lid == 0u) {
            lse[row(t) * p.n_heads + h] = m + log(l_all);
        }
    }
}
