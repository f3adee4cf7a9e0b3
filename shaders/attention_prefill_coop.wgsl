// attention_prefill_coop.wgsl: attention partials for many queries (prefill,
// and the counter-causal pass of the CCS policies) on the matrix units
// (tensor cores) (needs a KV-format prelude; attention_io.wgsl has the
// parameters, bindings and partials layout; attention.wgsl's `merge`
// combines the chunks). Needs SHADER_F16, SUBGROUP and
// EXPERIMENTAL_COOPERATIVE_MATRIX with the 16x16x16 f16 x f16 -> f32
// configuration, a fixed subgroup size, and head_dim a multiple of 16
// (src/device.rs and src/kernels/attention.rs pick it: a `tuned` candidate).
//
// attention_prefill.wgsl scores and sums on the lanes' f32 units. Here a
// workgroup of four subgroups (SUBGROUP_SIZE lanes each, an override
// constant set from the device profile) takes 64 queries of one head over
// one key chunk, 16 queries per subgroup, and walks the chunk 16 keys at a
// time: the queries (scaled), keys and values go to workgroup memory as f16,
// and each subgroup computes its 16 x 16 scores S = Q K^T with head_dim / 16
// matrix products and its share of P V with one product per 16 columns of
// the head, accumulating in f32. The softmax needs each score, which a
// cooperative matrix does not expose, so S goes through workgroup memory,
// where lanes (one per query row) mask it and take its exponentials. To keep
// the output accumulators in the matrix units (they cannot be rescaled
// there either), the chunk is walked twice: first for each query's maximum
// score, then with that maximum fixed for P = exp(S - max) (rounded to f16),
// the sums and P V. The scores are computed twice (a third more products)
// and no accumulator is ever rescaled. Values are rounded to f16 on the way
// in (queries after the scale, keys, values, and the weights P), with f32
// accumulation and f32 softmax; an f32 cache holding values past f16's range
// (65,504) is not for this kernel.
//
// Entry points (Dispatch, as attention.wgsl's: (ceil(n_tokens / 64),
// n_heads, n_chunks of the page)):
//   prefill_partial     query t sits in slot start_slot + t and attends slots
//                       0 ..= start_slot + t (causal);
//   anticausal_partial  query t is the entry in slot qslot[t] and attends the
//                       slots after it among the start_slot + n_tokens present.
// Bindings (group 0): as attention_io.wgsl.
// Workgroup memory: 31,232 bytes.
enable f16;
enable subgroups;
enable wgpu_cooperative_matrix;

override SUBGROUP_SIZE: u32 = 32u;

const QB: u32 = 64u;           // queries per workgroup, 16 per subgroup
const KT: u32 = 16u;           // keys per tile
const HD_MAX: u32 = 128u;      // 4 x HD4_MAX: the row stride of the tiles

// Query qi's head_dim values at qi * HD_MAX (row-major), scaled.
var<workgroup> q_tile: array<f16, 8192>;
// Key (value) j of the tile at j * HD_MAX: K^T column-major, V row-major.
var<workgroup> k_tile: array<f16, 2048>;
var<workgroup> v_tile: array<f16, 2048>;
// Per subgroup s, 16 x 16 column-major at 256 s: (query i, key j) at
// 256 s + 16 j + i. Scores, then 16 output columns in the epilogue.
var<workgroup> s_tile: array<f32, 1024>;
// The weights P in the same layout, as f16.
var<workgroup> p_tile: array<f16, 1024>;
// Each query's maximum score and sum of weights.
var<workgroup> row_m: array<f32, 64>;
var<workgroup> row_l: array<f32, 64>;

// Keys (and values) k0 .. k0 + KT of KV head kvh into the tiles; rows past
// k_hi are zeros (masked, and zero weights times zero values).
fn stage_keys(k0: u32, k_hi: u32, kvh: u32, lane: u32, with_values: bool) {
    let kv_stride = p.n_kv * HD4;
    for (var e = lane; e < KT * HD4_MAX; e += 4u * SUBGROUP_SIZE) {
        let j = e / HD4_MAX;
        let d = e % HD4_MAX;
        if (d < HD4) {
            var kv = vec4<f32>(0.0);
            var vv = vec4<f32>(0.0);
            let live = k0 + j < k_hi;
            let at = (k0 + j - page.first) * kv_stride + kvh * HD4 + d;
            if (live) {
                kv = unpack_kv(kc[at]);
            }
            let o = j * HD_MAX + d * 4u;
            k_tile[o] = f16(kv.x);
            k_tile[o + 1u] = f16(kv.y);
            k_tile[o + 2u] = f16(kv.z);
            k_tile[o + 3u] = f16(kv.w);
            if (with_values) {
                if (live) {
                    vv = unpack_kv(vc[at]);
                }
                v_tile[o] = f16(vv.x);
                v_tile[o + 1u] = f16(vv.y);
                v_tile[o + 2u] = f16(vv.z);
                v_tile[o + 3u] = f16(vv.w);
            }
        }
    }
}

// Subgroup sg's scores of the staged keys, into its part of s_tile.
fn scores(sg: u32) {
    var s = coop_mat16x16<f32, C>();
    for (var db = 0u; db < HD4 / 4u; db++) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&q_tile[sg * 16u * HD_MAX + db * 16u], HD_MAX);
        let b = coopLoad<coop_mat16x16<f16, B>>(&k_tile[db * 16u], HD_MAX);
        s = coopMultiplyAdd(a, b, s);
    }
    coopStore(s, &s_tile[sg * 256u], 16u);
}

// Output columns 16 db .. 16 db + 16 of subgroup sg's queries, to `part`.
fn store_columns(o: coop_mat16x16<f32, C>, db: u32, t0: u32, h: u32, c: u32, sg: u32, sg_lane: u32) {
    coopStore(o, &s_tile[sg * 256u], 16u);
    workgroupBarrier();
    for (var e = sg_lane; e < 64u; e += SUBGROUP_SIZE) {
        let i = e % 16u;
        let c4 = e / 16u;
        let t = t0 + sg * 16u + i;
        if (t < step.n_tokens) {
            let b = sg * 256u + c4 * 64u + i;
            let v = vec4<f32>(s_tile[b], s_tile[b + 16u], s_tile[b + 32u], s_tile[b + 48u]);
            part[part_base(t, h, c) + db * 4u + c4] = v;
        }
    }
    workgroupBarrier();
}

// The workgroup's 64 queries from t0, head h, over keys [k_lo, k_hi) of
// chunk c; query t attends [own_lo(t), own_hi(t)) (`anticausal`: after its
// own slot, else causal).
fn coop_partial(
    t0: u32,
    h: u32,
    c: u32,
    k_lo: u32,
    k_hi: u32,
    lane: u32,
    sg: u32,
    sg_lane: u32,
    anticausal: bool,
) {
    let kvh = h / (p.n_heads / p.n_kv);
    let n_present = step.start_slot + step.n_tokens;
    for (var e = lane; e < QB * HD4_MAX; e += 4u * SUBGROUP_SIZE) {
        let qi = e / HD4_MAX;
        let d = e % HD4_MAX;
        if (d < HD4) {
            var v = vec4<f32>(0.0);
            if (t0 + qi < step.n_tokens) {
                v = q[(row(t0 + qi) * p.n_heads + h) * HD4 + d] * p.scale;
            }
            let at = qi * HD_MAX + d * 4u;
            q_tile[at] = f16(v.x);
            q_tile[at + 1u] = f16(v.y);
            q_tile[at + 2u] = f16(v.z);
            q_tile[at + 3u] = f16(v.w);
        }
    }
    for (var r = lane; r < QB; r += 4u * SUBGROUP_SIZE) {
        row_m[r] = NEG;
        row_l[r] = 0.0;
    }
    workgroupBarrier();
    // Pass 1: each query's maximum score over its keys in the chunk.
    for (var k0 = k_lo; k0 < bounded(k_hi); k0 += KT) {
        stage_keys(k0, k_hi, kvh, lane, false);
        workgroupBarrier();
        scores(sg);
        workgroupBarrier();
        for (var i = sg_lane; i < 16u; i += SUBGROUP_SIZE) {
            let row = sg * 16u + i;
            let range = own_keys(t0 + row, anticausal, n_present);
            var m = row_m[row];
            for (var j = 0u; j < KT; j++) {
                let key = k0 + j;
                if (key >= range.x && key < range.y) {
                    m = max(m, s_tile[sg * 256u + j * 16u + i]);
                }
            }
            row_m[row] = m;
        }
        workgroupBarrier();
    }
    // Pass 2: weights against that maximum, their sums, and P V.
    var o0 = coop_mat16x16<f32, C>();
    var o1 = coop_mat16x16<f32, C>();
    var o2 = coop_mat16x16<f32, C>();
    var o3 = coop_mat16x16<f32, C>();
    var o4 = coop_mat16x16<f32, C>();
    var o5 = coop_mat16x16<f32, C>();
    var o6 = coop_mat16x16<f32, C>();
    var o7 = coop_mat16x16<f32, C>();
    for (var k0 = k_lo; k0 < bounded(k_hi); k0 += KT) {
        stage_keys(k0, k_hi, kvh, lane, true);
        workgroupBarrier();
        scores(sg);
        workgroupBarrier();
        for (var i = sg_lane; i < 16u; i += SUBGROUP_SIZE) {
            let row = sg * 16u + i;
            let range = own_keys(t0 + row, anticausal, n_present);
            let m = row_m[row];
            var l = row_l[row];
            for (var j = 0u; j < KT; j++) {
                let key = k0 + j;
                var w = 0.0;
                if (key >= range.x && key < range.y) {
                    w = exp(s_tile[sg * 256u + j * 16u + i] - m);
                }
                l += w;
                p_tile[sg * 256u + j * 16u + i] = f16(w);
            }
            row_l[row] = l;
        }
        workgroupBarrier();
        // One statement per 16 output columns: cooperative matrices are
        // not indexed at run time (HD4 is a constant: the dead ones go).
        let pm = coopLoad<coop_mat16x16<f16, A>>(&p_tile[sg * 256u], 16u);
        o0 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[0u], HD_MAX), o0);
        if (HD4 > 4u) {
            o1 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[16u], HD_MAX), o1);
        }
        if (HD4 > 8u) {
            o2 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[32u], HD_MAX), o2);
        }
        if (HD4 > 12u) {
            o3 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[48u], HD_MAX), o3);
        }
        if (HD4 > 16u) {
            o4 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[64u], HD_MAX), o4);
        }
        if (HD4 > 20u) {
            o5 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[80u], HD_MAX), o5);
        }
        if (HD4 > 24u) {
            o6 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[96u], HD_MAX), o6);
        }
        if (HD4 > 28u) {
            o7 = coopMultiplyAdd(pm, coopLoadT<coop_mat16x16<f16, B>>(&v_tile[112u], HD_MAX), o7);
        }
        workgroupBarrier();
    }
    store_columns(o0, 0u, t0, h, c, sg, sg_lane);
    if (HD4 > 4u) {
        store_columns(o1, 1u, t0, h, c, sg, sg_lane);
    }
    if (HD4 > 8u) {
        store_columns(o2, 2u, t0, h, c, sg, sg_lane);
    }
    if (HD4 > 12u) {
        store_columns(o3, 3u, t0, h, c, sg, sg_lane);
    }
    if (HD4 > 16u) {
        store_columns(o4, 4u, t0, h, c, sg, sg_lane);
    }
    if (HD4 > 20u) {
        store_columns(o5, 5u, t0, h, c, sg, sg_lane);
    }
    if (HD4 > 24u) {
        store_columns(o6, 6u, t0, h, c, sg, sg_lane);
    }
    if (HD4 > 28u) {
        store_columns(o7, 7u, t0, h, c, sg, sg_lane);
    }
    // A chunk with no keys for a query leaves (NEG, 0): it adds nothing.
    for (var r = lane; r < QB; r += 4u * SUBGROUP_SIZE) {
        if (t0 + r < step.n_tokens) {
            part[part_base(t0 + r, h, c) + HD4] = vec4<f32>(row_m[r], row_l[r], 0.0, 0.0);
        }
    }
}

// The keys query t attends: [x, y).
fn own_keys(t: u32, anticausal: bool, n_present: u32) -> vec2<u32> {
    if (anticausal) {
        return vec2<u32>(qslot[min(t, step.n_tokens - 1u)] + 1u, n_present);
    }
    return vec2<u32>(0u, step.start_slot + t + 1u);
}

@compute @workgroup_size(4 * SUBGROUP_SIZE)
fn prefill_partial(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let t0 = wid.x * QB;
    let c = page.first / CHUNK + wid.z;
    let chunk_begin = c * CHUNK;
    // The workgroup's last query bounds the keys any of its queries sees.
    let t_last = min(t0 + QB - 1u, step.n_tokens - 1u);
    let k_hi = min(chunk_begin + CHUNK, step.start_slot + t_last + 1u);
    coop_partial(t0, wid.y, c, chunk_begin, k_hi, lid, sg, sg_lane, false);
}

@compute @workgroup_size(4 * SUBGROUP_SIZE)
fn anticausal_partial(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let t0 = wid.x * QB;
    let c = page.first / CHUNK + wid.z;
    let chunk_begin = c * CHUNK;
    let k_hi = min(chunk_begin + CHUNK, step.start_slot + step.n_tokens);
    coop_partial(t0, wid.y, c, chunk_begin, k_hi, lid, sg, sg_lane, true);
}
