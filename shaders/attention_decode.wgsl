// attention_decode.wgsl: the `gpu` decode attention partial: one query over
// one key chunk for every query head of one KV group (needs a KV-format
// prelude; attention_io.wgsl has the parameters, bindings and partials
// layout, attention_decode_io.wgsl the phases after the scores, and
// attention.wgsl's `merge` combines the chunks as for the `cpu` variant,
// `decode_partial` there).
//
// The `cpu` variant suits llvmpipe: 64 lanes, each scoring four keys, then
// a softmax and a value sum that run serially over the chunk's 256 keys on
// a few lanes. On a GPU those serial loops leave most lanes idle. Here a
// workgroup of one lane per key does every phase in parallel; it scores with one
// key per lane: lane j scores key j of the chunk against all heads of the
// group (each key row is loaded once per group, but the lanes of a load
// read rows n_kv * head_dim values apart; attention_decode_lanes.wgsl reads
// them coalesced, with subgroup operations).
//
// A workgroup has CHUNK lanes (attention_io.wgsl): 256 (`Parallel`,
// `ParallelBatched`), or 64 (`ParallelShort`: four times the workgroups at
// a given depth, each with a quarter of the work; its partials and merge
// count chunks of 64).
//
// A sliding window (AttnParams.window) hides the keys whose original
// positions (kpos) are not within it of the query's (key_seen,
// attention_decode_io.wgsl), as in attention.wgsl.
//
// Bindings (group 0): as attention_io.wgsl.
// Dispatch: (n_chunks of the page, n_kv, 1), as decode_partial, with
// n_chunks counted in chunks of CHUNK.
// Workgroup memory: 16,384 bytes (attention_decode_io.wgsl).

@compute @workgroup_size(CHUNK)
fn decode_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let ch = decode_chunk(wid);
    load_group_queries(ch.kvh, lid, CHUNK);

    // Scores: lane j takes key c * CHUNK + j. GROUP and HD4
    // (attention_io.wgsl) are override constants: the loops have constant
    // trip counts, so s_own can stay in registers and the query reads have
    // constant offsets.
    let slot = ch.c * CHUNK + lid;
    var s_own: array<f32, GMAX>;
    for (var g = 0u; g < GMAX; g++) {
        s_own[g] = NEG;
    }
    if (key_seen(ch, slot)) {
        for (var g = 0u; g < GROUP; g++) {
            s_own[g] = 0.0;
        }
        for (var d = 0u; d < HD4; d++) {
            let kv = unpack_kv(kc[kv_word(slot, ch.kvh, d)]);
            for (var g = 0u; g < GROUP; g++) {
                s_own[g] += dot(qs[g * HD4 + d], kv);
            }
        }
    }
    for (var g = 0u; g < GROUP; g++) {
        sc[g * CHUNK + lid] = s_own[g];
    }
    workgroupBarrier();
    finish_chunk(ch, lid);
}
