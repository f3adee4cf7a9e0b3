// common.wgsl: prepended to every kernel (see src/shaders.rs).
//
// `Step` is the per-forward-step uniform shared by all kernels of one submission:
//   n_tokens   tokens processed in this step (prefill chunk length, 1 when decoding)
//   start_slot cache slot of the first of those tokens (= entries cached before the step)
//   logit_row0 first row (within the step) whose logits are computed
//   n_logits   number of rows whose logits are computed
//   row0       first activation row of these tokens, for the kernels that
//              work on one sequence's rows of a step shared by several
//              (RoPE and cache append, attention, attention weights: row
//              row0 + t of q, qkv, pos, out and lse is token t); 0 for one
//              sequence, and ignored by the kernels that take every row
struct Step {
    n_tokens: u32,
    start_slot: u32,
    logit_row0: u32,
    n_logits: u32,
    row0: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

// `Page` says which cache slots a bound per-slot buffer holds: a long KV cache
// is split into pages that each fit one storage binding (src/kernels/paging.rs);
// row 0 of the bound page is slot `first`, and it holds `len` slots.
struct Page {
    first: u32,
    len: u32,
    _p0: u32,
    _p1: u32,
}

// Loop bounds. Every loop in shaders/ counts up by 1, halves a positive
// constant down to zero, or counts up in larger steps: a constant, a
// workgroup size set as an override constant (LANES, SUBGROUP_SIZE; the
// host compiles without the counters only constants from 1 to the
// invocation limit: `Gpu::pipeline`) or the dispatch width (clamped where
// it is used). No loop body changes its counter. A
// loop of the last kind whose bound is read from a buffer takes it through
// `bounded`, or says at the loop why it is small, so its counter cannot
// wrap past 2^32 whatever a caller writes into the buffers: every loop
// ends. That is what makes it sound to compile sieve's kernels without
// wgpu's loop counters (SIEVE_LOOP_BOUNDING=0; docs/ARCHITECTURE.md).
// tests/shaders.rs checks every loop header against this rule.
const LOOP_LIMIT: u32 = 0x40000000u; // 2^30, far above any tensor size here

fn bounded(n: u32) -> u32 {
    return min(n, LOOP_LIMIT);
}

// Kernels that can run on either all step rows or only the logit rows select
// their row count with a `count_sel` parameter: 0 = n_tokens, 1 = n_logits.
fn step_rows(s: Step, count_sel: u32) -> u32 {
    if (count_sel == 1u) {
        return s.n_logits;
    }
    return s.n_tokens;
}
