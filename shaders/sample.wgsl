// sample.wgsl: picks the next token on the GPU from one row of logits, so only
// the chosen id returns to the host. One workgroup of 256 invocations.
// Order: the allowed set (a constraint's mask), the repetition penalty
// (Hugging Face's), the presence and frequency penalties (OpenAI's, over the
// tokens sampled since `counts` was cleared), temperature, top-k, top-p.
// temperature == 0 means greedy (argmax; ties go to the lowest id).
// Top-k and top-p thresholds are found by bisection on the logit value (no sort);
// ties at a threshold keep all tied tokens. A token outside the allowed set is
// never chosen; the host never passes an empty set. The chosen id is also
// marked in `seen` for the repetition penalty of later steps and counted in
// `counts`. A row holding a NaN or an infinity yields NONFINITE (0xffffffff)
// instead of a token, and marks nothing.
// With p.top_logprobs > 0 it also reports log-probabilities under the
// distribution it sampled from (after the allowed set, the penalties and the
// temperature; before top-k and top-p): the chosen token's, and the
// p.top_logprobs - 1 most likely tokens' (ties to the lower id; allowed ones
// only, id 0xffffffff past the last).
//
// Bindings (group 0):
//   0 p       uniform SampleParams
//   1 logits  storage read  [rows, vocab] f32  (row p.row is used)
//   2 seen    storage rw    [ceil(vocab/32)] u32 bitmask of tokens seen so far
//   3 result  storage rw    [4 + 2 * MAX_TOP] u32: the token; then, with
//                           top_logprobs: the log of the normalizer, the
//                           token's log-probability, the count n of top
//                           entries, n (id, log-probability) pairs (f32 bits)
//   4 allowed storage read  [ceil(vocab/32)] u32 bitmask of the tokens that may
//                           be chosen (all ones without a constraint)
//   5 counts  storage rw    [vocab] u32 times each token was chosen
// Dispatch: (1, 1, 1).
struct SampleParams {
    vocab: u32,
    row: u32,
    top_k: u32,        // 0 = off
    seed: u32,
    temperature: f32,  // 0 = greedy
    top_p: f32,        // 1 = off
    rep_penalty: f32,  // 1 = off
    counter: u32,      // step number, mixed into the random stream
    presence: f32,     // 0 = off
    frequency: f32,    // 0 = off
    top_logprobs: u32, // 0 = off, else 1 + the number of top entries
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: SampleParams;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> seen: array<u32>;
@group(0) @binding(3) var<storage, read_write> result: array<u32>;
@group(0) @binding(4) var<storage, read> allowed: array<u32>;
@group(0) @binding(5) var<storage, read_write> counts: array<u32>;

const WG: u32 = 256u;
const NEG: f32 = -3.0e38;
// 30 halvings of the logit range; also keeps the per-invocation loop count
// under lavapipe's 65535 limit for vocabularies up to ~200k (about 190k with
// top-k, top-p and 20 top log-probabilities; sample.rs checks 151,936).
const ITERS: u32 = 30u;

var<workgroup> red_f: array<f32, WG>;
var<workgroup> red_i: array<u32, WG>;
var<workgroup> chosen: u32;
// Set when any logit of the row is NaN or infinite. Cleared explicitly at the
// start: lavapipe was seen to keep it from an earlier dispatch.
var<workgroup> nonfinite: atomic<u32>;

const NONFINITE: u32 = 0xffffffffu;
// The most top entries reported (OpenAI's limit).
const MAX_TOP: u32 = 20u;
var<workgroup> top_ids: array<u32, MAX_TOP>;

// NaN or infinity, by the exponent bits: WGSL lets implementations assume
// finite floats, so comparisons such as x != x may be folded away.
fn is_nonfinite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// A token's logit as sampling sees it: NEG outside the allowed set (it then
// adds no mass, and never beats an allowed token), else after the penalties
// and the temperature.
fn adjusted(v: u32) -> f32 {
    if (((allowed[v / 32u] >> (v % 32u)) & 1u) == 0u) {
        return NEG;
    }
    var x = logits[p.row * p.vocab + v];
    if (p.rep_penalty != 1.0 && ((seen[v / 32u] >> (v % 32u)) & 1u) == 1u) {
        if (x > 0.0) {
            x = x / p.rep_penalty;
        } else {
            x = x * p.rep_penalty;
        }
    }
    if (p.presence != 0.0 || p.frequency != 0.0) {
        let c = counts[v];
        if (c > 0u) {
            x -= p.frequency * f32(c) + p.presence;
        }
    }
    if (p.temperature > 0.0) {
        x = x / p.temperature;
    }
    return x;
}

fn reduce_sum(v: f32, lid: u32) -> f32 {
    workgroupBarrier();
    red_f[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            red_f[lid] += red_f[lid + s];
        }
        workgroupBarrier();
    }
    // workgroupUniformLoad makes the result uniform, so callers may branch on it
    // around barriers.
    return workgroupUniformLoad(&red_f[0]);
}

fn reduce_min(v: f32, lid: u32) -> f32 {
    workgroupBarrier();
    red_f[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            red_f[lid] = min(red_f[lid], red_f[lid + s]);
        }
        workgroupBarrier();
    }
    // workgroupUniformLoad makes the result uniform, so callers may branch on it
    // around barriers.
    return workgroupUniformLoad(&red_f[0]);
}

// Sum over the vocabulary of exp(x - m) for x >= thr (or the count when as_count).
fn mass_above(thr: f32, m: f32, as_count: bool, lid: u32) -> f32 {
    var s = 0.0;
    for (var v = lid; v < bounded(p.vocab); v += WG) {
        let x = adjusted(v);
        if (x >= thr) {
            if (as_count) {
                s += 1.0;
            } else {
                s += exp(x - m);
            }
        }
    }
    return reduce_sum(s, lid);
}

fn pcg(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32) {
    // Argmax (needed by every mode: greedy, and the fallback of sampling).
    var best = NEG;
    var best_i = 0u;
    if (lid == 0u) {
        atomicStore(&nonfinite, 0u);
    }
    workgroupBarrier();
    var bad = 0u;
    for (var v = lid; v < bounded(p.vocab); v += WG) {
        let x = adjusted(v);
        if (is_nonfinite(logits[p.row * p.vocab + v])) {
            bad = 1u;
        }
        if (x > best) {
            best = x;
            best_i = v;
        }
    }
    if (bad != 0u) {
        atomicOr(&nonfinite, 1u);
    }
    let arg = reduce_argmax(best, best_i, lid);
    // The winner's value, left by the reduction (nothing writes red_f
    // before the next barrier).
    let m = red_f[0];
    if (lid == 0u) {
        chosen = arg;
    }

    if (p.temperature > 0.0) {
        // Top-k threshold: the largest value with at least k tokens at or above it.
        // Fewer than k allowed tokens: no threshold (all of them stay).
        var thr = NEG;
        if (p.top_k > 0u && p.top_k < p.vocab) {
            var hi = m;
            if (mass_above(hi, m, true, lid) < f32(p.top_k)) {
                // The lowest allowed value: every allowed token is at or above it.
                var low = m;
                for (var v = lid; v < bounded(p.vocab); v += WG) {
                    let x = adjusted(v);
                    if (x > NEG) {
                        low = min(low, x);
                    }
                }
                var lo = reduce_min(low, lid);
                if (mass_above(lo, m, true, lid) >= f32(p.top_k)) {
                    for (var it = 0u; it < ITERS; it++) {
                        let mid = 0.5 * (lo + hi);
                        if (mass_above(mid, m, true, lid) >= f32(p.top_k)) {
                            lo = mid;
                        } else {
                            hi = mid;
                        }
                    }
                    thr = lo;
                }
            } else {
                thr = hi;
            }
        }
        // Top-p threshold: the largest value whose set keeps at least top_p of the mass.
        if (p.top_p < 1.0) {
            let total = mass_above(thr, m, false, lid);
            var lo = max(thr, m - 80.0);
            var hi = m;
            for (var it = 0u; it < ITERS; it++) {
                let mid = 0.5 * (lo + hi);
                if (mass_above(mid, m, false, lid) >= p.top_p * total) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            thr = max(thr, lo);
        }
        // Inverse-CDF draw over contiguous slices of the vocabulary.
        let per = (p.vocab + WG - 1u) / WG;
        let begin = min(lid * per, p.vocab);
        let end = min(begin + per, p.vocab);
        var s = 0.0;
        for (var v = begin; v < end; v++) {
            let x = adjusted(v);
            if (x >= thr) {
                s += exp(x - m);
            }
        }
        workgroupBarrier();
        red_f[lid] = s;
        workgroupBarrier();
        if (lid == 0u) {
            var z = 0.0;
            for (var i = 0u; i < WG; i++) {
                z += red_f[i];
            }
            let r = f32(pcg(p.seed ^ pcg(p.counter)) >> 8u) / 16777216.0;
            var u = r * z;
            for (var i = 0u; i < WG; i++) {
                if (u < red_f[i]) {
                    let b = min(i * per, p.vocab);
                    let e = min(b + per, p.vocab);
                    for (var v = b; v < e; v++) {
                        let x = adjusted(v);
                        if (x >= thr) {
                            let w = exp(x - m);
                            if (u < w) {
                                chosen = v;
                                break;
                            }
                            u -= w;
                        }
                    }
                    break;
                }
                u -= red_f[i];
            }
        }
    }
    workgroupBarrier();
    // Before the choice is marked in `seen` and `counts`, which `adjusted`
    // reads.
    if (p.top_logprobs > 0u) {
        report_logprobs(m, lid);
    }
    if (lid == 0u) {
        if (atomicLoad(&nonfinite) != 0u) {
            result[0] = NONFINITE;
            return;
        }
        let c = chosen;
        result[0] = c;
        seen[c / 32u] = seen[c / 32u] | (1u << (c % 32u));
        counts[c] += 1u;
    }
}

// The reduction's winner of (value, id) pairs: the larger value, then the
// lower id.
fn reduce_argmax(x: f32, i: u32, lid: u32) -> u32 {
    workgroupBarrier();
    red_f[lid] = x;
    red_i[lid] = i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            let o = red_f[lid + s];
            let oi = red_i[lid + s];
            if (o > red_f[lid] || (o == red_f[lid] && oi < red_i[lid])) {
                red_f[lid] = o;
                red_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    return workgroupUniformLoad(&red_i[0]);
}

// Writes result[1..]: the log of the normalizer of the adjusted logits,
// the chosen token's log-probability and the top entries.
fn report_logprobs(m: f32, lid: u32) {
    var mass = 0.0;
    for (var v = lid; v < bounded(p.vocab); v += WG) {
        mass += exp(adjusted(v) - m);
    }
    let lse = m + log(reduce_sum(mass, lid));
    let n_top = min(p.top_logprobs - 1u, MAX_TOP);
    // Entry k is the best (value, id) after entry k - 1 in the order
    // (value descending, id ascending): one pass over the vocabulary per
    // entry, so n_top * vocab / WG iterations per invocation (lavapipe ends
    // an invocation after 65,535).
    var prev_x = 3.4e38;
    var prev_i = 0u;
    for (var k = 0u; k < n_top; k++) {
        var best = NEG;
        var best_i = NONFINITE;
        for (var v = lid; v < bounded(p.vocab); v += WG) {
            let x = adjusted(v);
            let after = x < prev_x || (x == prev_x && v > prev_i);
            if (after && x > NEG && (x > best || (x == best && v < best_i))) {
                best = x;
                best_i = v;
            }
        }
        let i = reduce_argmax(best, best_i, lid);
        if (lid == 0u) {
            top_ids[k] = i;
        }
        if (i == NONFINITE) {
            prev_x = NEG;
        } else {
            prev_x = adjusted(i);
        }
        prev_i = i;
    }
    if (lid == 0u) {
        result[1] = bitcast<u32>(lse);
        result[2] = bitcast<u32>(adjusted(chosen) - lse);
        result[3] = n_top;
        for (var k = 0u; k < n_top; k++) {
            let i = top_ids[k];
            result[4u + 2u * k] = i;
            var lp = NEG;
            if (i != NONFINITE) {
                lp = adjusted(i) - lse;
            }
            result[5u + 2u * k] = bitcast<u32>(lp);
        }
    }
}
