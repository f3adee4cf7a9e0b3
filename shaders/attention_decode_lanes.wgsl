// attention_decode_lanes.wgsl: a `gpu` decode attention partial that reads
// key rows coalesced: one query over one key chunk for every query head of
// one KV group (needs a KV-format prelude; attention_io.wgsl has the
// parameters, bindings and partials layout, attention_decode_io.wgsl the
// phases after the scores, which it shares with attention_decode.wgsl).
//
// attention_decode.wgsl scores one key per lane, so the lanes of one load
// read 32 rows n_kv * head_dim values apart (2 KiB in a Llama-3-8B f16
// cache): a load touches a memory sector per lane and uses a quarter of
// each. Here eight adjacent lanes share a key: lane t (numbered by subgroup
// and lane in it) takes key t / 8 of each round of 32 keys and the head's
// 4-value columns t % 8, t % 8 + 8, ..., so the eight read consecutive
// words of the row; their partial dot products are summed with three
// subgroup shuffles. Eight rounds cover the chunk's 256 keys.
//
// A sliding window hides keys as in attention_decode.wgsl (key_seen).
//
// Bindings (group 0): as attention_io.wgsl.
// Dispatch: (n_chunks of the page, n_kv, 1), as decode_partial.
// Workgroup memory: 16,384 bytes (attention_decode_io.wgsl).
// Extensions: `subgroups` (wgpu's SUBGROUP feature; blanked for naga,
// `shaders::naga_source`), with subgroups of one size, a power of two
// of at least 8 lanes, in a workgroup (a lane's number below counts
// 256 / num_subgroups lanes per subgroup, whatever size the adapter
// reports). Because
// Vulkan does not promise full subgroups unless a pipeline asks (wgpu does
// not), a device whose `tuned` set would time this kernel first runs it
// once against the CPU reference (`attention::check_decode_variant`).

enable subgroups;

const KEY_LANES: u32 = 8u;
const ROUND_KEYS: u32 = 32u; // 256 lanes / KEY_LANES

@compute @workgroup_size(256)
fn decode_partial(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) n_sg: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let ch = decode_chunk(wid);
    load_group_queries(ch.kvh, lid, CHUNK);

    // The eight lanes of a key are consecutive lanes of one subgroup.
    let t = sg * (256u / n_sg) + sg_lane;
    let col0 = t % KEY_LANES;
    // HD4 and GROUP are override constants: constant trip counts, so s
    // stays in registers.
    let cols_per_lane = (HD4 + KEY_LANES - 1u) / KEY_LANES;
    for (var round = 0u; round < CHUNK / ROUND_KEYS; round++) {
        let j = round * ROUND_KEYS + t / KEY_LANES;
        let slot = ch.c * CHUNK + j;
        var s: array<f32, GMAX>;
        for (var g = 0u; g < GMAX; g++) {
            s[g] = 0.0;
        }
        let seen = key_seen(ch, slot);
        if (seen) {
            for (var i = 0u; i < cols_per_lane; i++) {
                let d = col0 + i * KEY_LANES;
                if (d < HD4) {
                    let kv = unpack_kv(kc[kv_word(slot, ch.kvh, d)]);
                    for (var g = 0u; g < GROUP; g++) {
                        s[g] += dot(qs[g * HD4 + d], kv);
                    }
                }
            }
        }
        // Every lane takes part in the shuffles (keys past the last too).
        for (var g = 0u; g < GROUP; g++) {
            var v = s[g];
            v += subgroupShuffleXor(v, 1u);
            v += subgroupShuffleXor(v, 2u);
            v += subgroupShuffleXor(v, 4u);
            if (col0 == 0u) {
                sc[g * CHUNK + j] = select(NEG, v, seen);
            }
        }
    }
    workgroupBarrier();
    finish_chunk(ch, lid);
}
