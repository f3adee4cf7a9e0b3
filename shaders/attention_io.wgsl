// attention_io.wgsl: what the attention kernels share (included by
// attention.wgsl, attention_prefill.wgsl and, with attention_decode_io.wgsl
// after it, the two `gpu` decode kernels, after the KV-format prelude; see
// src/shaders.rs): parameters, bindings, the key chunk and the layout of the
// per-chunk partials that the merge pass combines.
//
// Bindings (group 0), all entry points:
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
//  10 kpos  storage read  [slots, kpos_lists] u32  each cache slot's original position in each
//                         keep list (read only with a window; query t's is its own slot's,
//                         start_slot + t, written before the step runs, the same in every list)
// Limits: head_dim <= 4 x HD4_MAX (a multiple of 4), n_heads / n_kv <= GMAX:
// 128 and 8, or in the wide builds (attention.wgsl, the decode kernels, the
// tiled prefill) 256 and 4 (attention_heads.wgsl, attention_heads_wide.wgsl).
struct AttnParams {
    n_heads: u32,
    n_kv: u32,
    hd4: u32,
    scale: f32,
    // Sliding window: a key is seen only where its original position is
    // less than `window` from the query's (either side: the counter-causal
    // pass looks ahead); 0: no window.
    window: u32,
    // Where KV head h's slot positions are: kpos[slot * kpos_lists +
    // kpos_first + h * kpos_per_kv] (the cache may keep a set of entries
    // per layer or per KV head: src/kernels/compact.rs, Granularity).
    kpos_lists: u32,
    kpos_first: u32,
    kpos_per_kv: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: AttnParams;
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kc: array<KvPacked>;
@group(0) @binding(4) var<storage, read> vc: array<KvPacked>;
@group(0) @binding(5) var<storage, read_write> part: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> lse: array<f32>;
@group(0) @binding(8) var<storage, read> qslot: array<u32>;
@group(0) @binding(9) var<uniform> page: Page;
@group(0) @binding(10) var<storage, read> kpos: array<u32>;

// Cache slots per key chunk: 256 for every kernel (and the layout of the
// partials), but for the short-chunk decode kernel (`ParallelShort`,
// attention_decode.wgsl), whose partials and merge the launcher builds with
// CHUNK = 64: at a few thousand keys, 256-key chunks leave fewer
// workgroups than a large GPU has cores. An override constant, not a
// const, for that one pair; pages hold whole chunks of 256, so of 64 too.
// At most 256 (the decode kernels' workgroup arrays), a multiple of 32;
// but the split-key decode (attention_decode_split.wgsl), whose lanes loop
// over its chunk, takes the longer chunks its launcher sets (up to 2,048,
// where the cache's pages hold whole chunks of them).
override CHUNK: u32 = 256u;
const BK: u32 = 16u;
const NEG: f32 = -3.0e38;

// Query heads per KV head (n_heads / n_kv, 1 to GMAX): an override constant
// the launcher sets for the decode kernels, whose per-head loops then have a
// constant trip count (unrolled, their per-head sums stay in registers); the
// other entry points do not read it.
override GROUP: u32 = 1u;
// head_dim / 4 (1 to HD4_MAX; HD4_MAX and GMAX come from
// attention_heads.wgsl or its wide build), the same way, for the row-per-lane partials
// and every decode kernel (on lavapipe a workgroup-memory read of the
// queries at a constant offset is one load, at a run-time offset a loop over
// the SIMD lanes: docs/ARCHITECTURE.md, "lavapipe facts").
override HD4: u32 = HD4_MAX;

// Row of query t in q, out and lse: its sequence's rows start at step.row0.
fn row(t: u32) -> u32 {
    return step.row0 + t;
}

// The original position of the entry in cache slot `slot` of KV head kvh.
fn slot_pos(slot: u32, kvh: u32) -> u32 {
    return kpos[slot * p.kpos_lists + p.kpos_first + kvh * p.kpos_per_kv];
}

// Whether the key in cache slot `slot` of KV head kvh is within the window
// of a query at original position `query_pos` (always, without a window).
fn in_window(query_pos: u32, slot: u32, kvh: u32) -> bool {
    if (p.window == 0u) {
        return true;
    }
    let key_pos = slot_pos(slot, kvh);
    return max(query_pos, key_pos) - min(query_pos, key_pos) < p.window;
}

fn n_chunks() -> u32 {
    return (step.start_slot + step.n_tokens + CHUNK - 1u) / CHUNK;
}

// Index of the (max, sum) entry of query t, head h, chunk c in `part`.
fn part_base(t: u32, h: u32, c: u32) -> u32 {
    return ((t * p.n_heads + h) * n_chunks() + c) * (p.hd4 + 1u);
}

