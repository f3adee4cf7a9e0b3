//! The bounded cache against ../shared/golden/eviction (an independent
//! implementation of SPEC.md sections 3 and 4 on the tiny models: J = 48,
//! h = 16, sinks 4, recent 8, the length-300 sequence), and its mechanics.
//!
//! Logit tolerance 1e-3, as for the full-cache golden data: the eviction runs
//! use the same float32 reference (noise ~7e-5), and an exact schedule adds
//! no error of its own. Kept sets must match exactly for `window`, whose
//! scores (positions) have no ties.

mod common;
use common::*;
use sieve::cache::{BoundedCache, CacheOptions, FeedOutput};
use sieve::engine::Engine;
use sieve::eviction::Policy;
use sieve::formats::WeightFormat;
use sieve::model::{LoadOptions, Model};
use std::sync::Arc;

fn load(name: &str) -> Arc<Model> {
    let opts = LoadOptions {
        dtype: Some(WeightFormat::F32),
        ..Default::default()
    };
    Model::load(&golden_dir().join(name), &opts).unwrap()
}

fn settings(name: &str) -> serde_json::Value {
    let p = golden_dir()
        .join("eviction")
        .join(name)
        .join("settings.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Runs `ids` through a bounded cache; returns the logits of every position and the cache.
fn run(
    model: &Arc<Model>,
    ids: &[u32],
    opts: CacheOptions,
    step: usize,
) -> (Vec<f32>, BoundedCache) {
    run_cache(
        model,
        ids,
        BoundedCache::new(opts, model.config.num_layers).unwrap(),
        step,
    )
}

/// As [`run`], with a cache made by the caller.
fn run_cache(
    model: &Arc<Model>,
    ids: &[u32],
    mut cache: BoundedCache,
    step: usize,
) -> (Vec<f32>, BoundedCache) {
    cache.record = true;
    let mut e = Engine::new(model.clone(), cache.engine_options(ids.len(), step, step)).unwrap();
    let vocab = model.config.vocab_size;
    let mut logits = vec![0.0; ids.len() * vocab];
    cache
        .feed(&mut e, ids, 0, FeedOutput::All, |first, l| {
            logits[first * vocab..first * vocab + l.len()].copy_from_slice(l);
            Ok(())
        })
        .unwrap();
    (logits, cache)
}

fn input_ids(settings: &serde_json::Value) -> Vec<u32> {
    let ids = settings["input_ids"].as_array().unwrap();
    ids.iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

fn golden_opts(s: &serde_json::Value, policy: Policy) -> CacheOptions {
    let u = |k: &str| s[k].as_u64().unwrap() as usize;
    CacheOptions {
        sinks: u("sinks"),
        recent: u("recent"),
        ..CacheOptions::new(policy, u("J"), u("h"))
    }
}

/// Runs `policy` on both tiny models and compares with the reference: refresh
/// positions, every trace field (scores within `score_tol`), kept sets, and
/// the logits of all 300 positions.
fn check_against_reference(policy: Policy, file: &str, score_tol: f64) {
    check_against_reference_with(policy, file, score_tol, false)
}

fn check_against_reference_with(policy: Policy, file: &str, score_tol: f64, materialize: bool) {
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let s = settings(name);
        let model = load(name);
        let ids = input_ids(&s);
        let opts = CacheOptions {
            materialize,
            ..golden_opts(&s, policy)
        };
        let (logits, cache) = run(&model, &ids, opts, 64);
        let dir = golden_dir().join("eviction").join(name);
        let before: Vec<u32> = cache.trace.iter().map(|r| r.before_position).collect();
        let want_before: Vec<u32> = s["refresh_before_positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(before, want_before, "{name} {file}: refresh positions");
        let kept: Vec<Vec<u32>> = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{file}.kept.json"))).unwrap(),
        )
        .unwrap();
        let got: Vec<Vec<u32>> = cache.trace.iter().map(|r| r.kept.clone()).collect();
        assert_eq!(got, kept, "{name} {file}: kept sets");
        // The trace has the layout of the reference's scores.json: compare record by record.
        let records: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{file}.scores.json"))).unwrap(),
        )
        .unwrap();
        let ours = serde_json::to_value(&cache.trace).unwrap();
        let mut worst = 0.0f64;
        for (k, (want, got)) in records
            .as_array()
            .unwrap()
            .iter()
            .zip(ours.as_array().unwrap())
            .enumerate()
        {
            for field in [
                "refresh",
                "before_position",
                "present",
                "protected",
                "unprotected",
                "kept",
            ] {
                assert_eq!(
                    want[field], got[field],
                    "{name} {file} refresh {k}: field {field}"
                );
            }
            let (ws, gs) = (
                want["scores"].as_array().unwrap(),
                got["scores"].as_array().unwrap(),
            );
            assert_eq!(ws.len(), gs.len());
            for (w, g) in ws.iter().zip(gs) {
                worst = worst.max((w.as_f64().unwrap() - g.as_f64().unwrap()).abs());
            }
        }
        assert!(worst <= score_tol, "{name} {file}: scores max |d| {worst}");
        let g = Npz::open(&dir.join(format!("{file}.logits.npz")));
        let (_, want) = g.f32("logits");
        let d = max_abs_diff(&logits, want);
        eprintln!("{name} {file}: scores max |d| {worst:.2e}, logits max |d| {d:.2e} over all 300 positions");
        assert!(d <= 1e-3, "{name} {file}: logits max |d| {d}");
        // After the last token the cache holds J + (300 - 288) entries.
        assert_eq!(cache.slots.len(), 48 + 12);
    }
}

/// `epikv-robust` (docs/POLICIES.md) has no independent reference: through
/// the engine on both tiny models it keeps SPEC EpiKV's schedule, protected
/// entries and cache size, scores every unprotected entry with a finite
/// value, and ranks differently from SPEC EpiKV somewhere (the statistics
/// change, not only the name).
#[test]
fn epikv_robust_runs_the_spec_schedule_with_its_own_scores() {
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let s = settings(name);
        let model = load(name);
        let ids = input_ids(&s);
        let (_, spec) = run(&model, &ids, golden_opts(&s, Policy::Epikv), 64);
        let (_, robust) = run(&model, &ids, golden_opts(&s, Policy::EpikvRobust), 64);
        assert_eq!(spec.trace.len(), robust.trace.len(), "{name}");
        let mut scores_differ = false;
        for (a, b) in spec.trace.iter().zip(&robust.trace) {
            assert_eq!(a.before_position, b.before_position, "{name}");
            assert_eq!(
                a.present, b.present,
                "{name}: the same entries before refresh"
            );
            assert_eq!(a.protected, b.protected, "{name}");
            assert_eq!(a.kept.len(), b.kept.len(), "{name}");
            assert_eq!(b.scores.len(), b.unprotected.len(), "{name}");
            assert!(b.scores.iter().all(|x| x.is_finite()), "{name}");
            scores_differ |= a.scores != b.scores;
            if a.kept != b.kept {
                // Different kept sets lead to different caches afterwards.
                break;
            }
        }
        assert!(scores_differ, "{name}: robust scores equal SPEC EpiKV's");
        assert_eq!(robust.slots.len(), spec.slots.len(), "{name}");
    }
}

#[test]
fn window_matches_the_reference() {
    check_against_reference(Policy::Window, "window", 0.0);
}

/// EpiKV scores are z-scores of order 1, computed by the reference in float64
/// from float32 hidden states; ours from GPU float32 states whose per-layer
/// error is ~4e-6 of the layer's scale (measured: scores max |d| 1.1e-5). 1e-4
/// allows for that and stays below the smallest gap between a kept and an
/// evicted score in the reference (4.3e-5 in tiny-qwen2 is the one exception,
/// which the exact kept-set comparison covers).
#[test]
fn epikv_matches_the_reference() {
    check_against_reference(Policy::Epikv, "epikv", 1e-4);
}

/// H2O's scores are sums of up to ~250 weights each (max 8.1), so float32
/// summation order matters at ~1e-5; the closest kept/evicted pair in the
/// reference is 0.023 apart.
#[test]
fn h2o_matches_the_reference() {
    check_against_reference(Policy::H2o, "h2o", 1e-4);
}

/// `--materialize` holds the weight matrix as eager attention does; the
/// numbers must not change.
#[test]
fn materialized_h2o_and_tova_match_the_reference() {
    check_against_reference_with(Policy::H2o, "h2o", 1e-4, true);
    check_against_reference_with(Policy::Tova, "tova", 2e-6, true);
}

/// TOVA's scores are single weights (at most 0.12); the reference's closest
/// kept/evicted pair is 8.3e-6 apart, so the scores must agree to ~1e-6 for
/// the kept sets to match exactly.
#[test]
fn tova_matches_the_reference() {
    check_against_reference(Policy::Tova, "tova", 2e-6);
}

/// CCS scores are logits (|score| up to 14) from a pass through the last layer
/// (or all layers); float32 error ~1e-4 on them, as for ordinary logits
/// (measured: 6e-5 fast, 8e-5 full). The closest kept/evicted pair in the
/// reference is 4.1e-4 apart (ccs, tiny-llama-gqa), 1.7e-3 for ccs-full.
#[test]
fn ccs_matches_the_reference() {
    check_against_reference(Policy::Ccs, "ccs", 2e-4);
}

/// The sink guard with its real ratio (2) finds no sink in the tiny models
/// (random weights: no pair of jumps reaches 1.2 times the median), so
/// `window-sinks` and `ccs-sinks` must reproduce the reference's window and
/// CCS runs exactly: the guard passes the inner policy's needs (the
/// counter-causal pass) and scores through. `window_sinks_matches_a_cpu_reference`
/// checks what it does when it finds one.
#[test]
fn sink_guards_without_sinks_are_their_inner_policy() {
    check_against_reference(Policy::WindowSinks, "window", 0.0);
    check_against_reference(Policy::CcsSinks, "ccs", 2e-4);
}

#[test]
fn ccs_full_matches_the_reference() {
    check_against_reference(Policy::CcsFull, "ccs-full", 2e-4);
}

#[test]
fn batching_does_not_change_the_result() {
    let s = settings("tiny-qwen2");
    let model = load("tiny-qwen2");
    let ids = input_ids(&s);
    let (a, ca) = run(&model, &ids, golden_opts(&s, Policy::Random), 64);
    let (b, cb) = run(&model, &ids, golden_opts(&s, Policy::Random), 5);
    let ka: Vec<_> = ca.trace.iter().map(|r| r.kept.clone()).collect();
    let kb: Vec<_> = cb.trace.iter().map(|r| r.kept.clone()).collect();
    assert_eq!(
        ka, kb,
        "random keeps the same entries whatever the step size"
    );
    assert!(max_abs_diff(&a, &b) <= 1e-4);
    // Every refresh keeps exactly J entries, the protected ones among them.
    for r in &ca.trace {
        assert_eq!(r.kept.len(), 48);
        assert!(r.protected.iter().all(|p| r.kept.contains(p)));
    }
}

/// A bounded cache that never refreshes is the full cache, bit for bit, in
/// every family (Qwen3's q/k norms, SmolLM3's NoPE layers, Phi-3's LongRoPE:
/// both runs state the same context, so both take the short factors), and
/// the full cache run in chunks matches transformers.
#[test]
fn budget_larger_than_the_sequence_reproduces_the_full_cache() {
    for name in [
        "tiny-llama-gqa",
        "tiny-qwen3",
        "tiny-smollm3",
        "tiny-phi3",
        "tiny-gemma3",
    ] {
        let model = load(name);
        let g = Npz::open(&golden_dir().join(name).join("golden_len300.npz"));
        let ids = g.ids("input_ids");
        let (full, _) = run(&model, &ids, CacheOptions::new(Policy::Full, 400, 16), 64);
        for policy in [Policy::Window, Policy::Random] {
            let (got, cache) = run(&model, &ids, CacheOptions::new(policy, 400, 16), 64);
            assert!(cache.trace.is_empty());
            assert_eq!(
                got, full,
                "{name}: {policy:?} with a budget above the sequence"
            );
        }
        let (_, want) = g.f32("logits");
        let vocab = 512;
        for (i, &p) in g.ids("logits_positions").iter().enumerate() {
            let d = max_abs_diff(
                &full[p as usize * vocab..][..vocab],
                &want[i * vocab..][..vocab],
            );
            assert!(d <= 1e-3, "{name} position {p}: {d}");
        }
    }
}

/// Generation far past the budget: the cache never holds more than J + h
/// entries, positions keep counting, and GPU memory does not grow.
#[test]
fn long_generation_stays_within_the_budget() {
    use sieve::session::{GenerateOptions, Session, SessionOptions};
    let model = load("tiny-llama-gqa");
    let tok = Arc::new(
        sieve::tokenizer::Tokenizer::load(&golden_dir().join("smollm2-135m"), &[]).unwrap(),
    );
    let opts = CacheOptions {
        recent: 8,
        ..CacheOptions::new(Policy::Window, 48, 16)
    };
    let mut s = Session::new(
        model,
        tok,
        SessionOptions {
            max_context: 0,
            prefill_chunk: 32,
            cache: Some(opts),
        },
    )
    .unwrap();
    s.cache().record = true;
    let before = s.memory();
    let prompt: Vec<u32> = (0..100).map(|i| (i * 37 % 512) as u32).collect();
    let gen = GenerateOptions {
        max_new_tokens: 400,
        stop_at_eos: false,
        ..Default::default()
    };
    let out = s.generate(&prompt, &gen, |_| true).unwrap();
    assert_eq!(out.ids.len(), 400);
    let cache = s.cache();
    assert!(cache.slots.len() <= 64, "{} entries", cache.slots.len());
    assert_eq!(
        cache.slots.last().unwrap().position,
        100 + 400 - 1,
        "every emitted token is fed (the cache holds the visible history)"
    );
    // Refreshes before positions 64, 80, ... while prefilling and decoding.
    let before_pos: Vec<u32> = cache.trace.iter().map(|r| r.before_position).collect();
    assert_eq!(
        before_pos,
        (0..)
            .map(|k| 64 + 16 * k)
            .take(before_pos.len())
            .collect::<Vec<u32>>()
    );
    assert_eq!(before_pos.len(), (499 - 64) / 16 + 1);
    let after = s.memory();
    assert_eq!(
        (before.weights, before.buffers),
        (after.weights, after.buffers)
    );
}

/// y = W x (+ b) for a `[rows, cols]` row-major W.
fn cpu_matvec(w: &[f32], b: Option<&[f32]>, x: &[f32]) -> Vec<f32> {
    let cols = x.len();
    w.chunks(cols)
        .enumerate()
        .map(|(r, row)| {
            let dot: f64 = row.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
            dot as f32 + b.map_or(0.0, |b| b[r])
        })
        .collect()
}

fn cpu_rmsnorm(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| (*v as f64 * inv) as f32 * w)
        .collect()
}

/// RoPE of one head (Hugging Face's rotate-half layout) at `pos`: its first
/// `rope.rotary_dim` dimensions, in f64 from the layer's frequencies.
fn cpu_rope(x: &mut [f32], pos: u32, rope: &sieve::kernels::rope_kv::Rope) {
    let half = rope.rotary_dim / 2;
    let factor = rope.attention_factor as f64;
    for i in 0..half {
        let angle = pos as f64 * rope.inv_freq[i] as f64;
        let (s, c) = angle.sin_cos();
        let (s, c) = (s * factor, c * factor);
        let (a, b) = (x[i] as f64, x[i + half] as f64);
        x[i] = (a * c - b * s) as f32;
        x[i + half] = (b * c + a * s) as f32;
    }
}

/// The fast counter-causal logit of entry `i` (SPEC.md 4.2) on the host,
/// from `hidden` (`[n, hidden]`, the residual stream entering the last
/// layer at positions 0..n, all cached): with `own_residual` false, the
/// `ccs-context` variant (docs/POLICIES.md), r_i = W_o(attn) alone. The
/// last layer as its family describes it: tensors by role (fused q|k|v and
/// gate|up split here), biases, q/k norms, its RoPE.
fn cpu_counter_causal_logit(
    store: &sieve::weights::TensorStore,
    c: &sieve::config::ModelConfig,
    hidden: &[f32],
    ids: &[u32],
    i: usize,
    own_residual: bool,
) -> f32 {
    use sieve::family::Role;
    let hs = c.hidden_size;
    let d = c.head_dim;
    let last = c.num_layers - 1;
    let spec = &c.layers[last];
    let t = |role: Role| store.read(&c.family.required(role, last)).unwrap().data;
    let eps = c.rms_norm_eps;
    let row = |p: usize| &hidden[p * hs..(p + 1) * hs];
    let (qd, kd) = (c.num_heads * d, c.num_kv_heads * d);
    let (wq, wk, wv) = match c.family.tensor(Role::Qkv, last) {
        Some(_) => {
            let w = t(Role::Qkv);
            let (q, rest) = w.split_at(qd * hs);
            let (k, v) = rest.split_at(kd * hs);
            (q.to_vec(), k.to_vec(), v.to_vec())
        }
        None => (t(Role::Q), t(Role::K), t(Role::V)),
    };
    let bias = |role| spec.qkv_bias.then(|| t(role));
    let (bq, bk, bv) = (bias(Role::QBias), bias(Role::KBias), bias(Role::VBias));
    let head_norms = spec.qk_norm.then(|| (t(Role::QNorm), t(Role::KNorm)));
    let attn_norm = t(Role::AttnNorm);
    let n = hidden.len() / hs;
    let xn = |p: usize| cpu_rmsnorm(row(p), &attn_norm, eps);
    // q/k norm, then RoPE, head by head.
    let place = |x: &mut [f32], pos: usize, norm: Option<&Vec<f32>>| {
        for h in x.chunks_mut(d) {
            if let Some(w) = norm {
                let normed = cpu_rmsnorm(h, w, eps);
                h.copy_from_slice(&normed);
            }
            cpu_rope(h, pos as u32, &spec.rope);
        }
    };
    let mut q = cpu_matvec(&wq, bq.as_deref(), &xn(i));
    place(&mut q, i, head_norms.as_ref().map(|n| &n.0));
    // Keys and values of the entries after i.
    let later: Vec<(Vec<f32>, Vec<f32>)> = (i + 1..n)
        .map(|j| {
            let mut k = cpu_matvec(&wk, bk.as_deref(), &xn(j));
            place(&mut k, j, head_norms.as_ref().map(|n| &n.1));
            (k, cpu_matvec(&wv, bv.as_deref(), &xn(j)))
        })
        .collect();
    let group = c.num_heads / c.num_kv_heads;
    let mut attn = vec![0f32; c.num_heads * d];
    for h in 0..c.num_heads {
        let kv = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let logits: Vec<f64> = later
            .iter()
            .map(|(k, _)| {
                let dot: f64 = qh
                    .iter()
                    .zip(&k[kv * d..(kv + 1) * d])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                dot / (d as f64).sqrt()
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        for ((_, v), l) in later.iter().zip(&logits) {
            let p = (l - m).exp() / z;
            for e in 0..d {
                attn[h * d + e] += (p * v[kv * d + e] as f64) as f32;
            }
        }
    }
    let o_bias = spec.o_bias.then(|| t(Role::OBias));
    let o = cpu_matvec(&t(Role::O), o_bias.as_deref(), &attn);
    let mut r: Vec<f32> = if own_residual {
        row(i).iter().zip(&o).map(|(a, b)| a + b).collect()
    } else {
        o
    };
    let m = cpu_rmsnorm(&r, &t(Role::MlpNorm), eps);
    let (wg, wu) = match c.family.tensor(Role::GateUp, last) {
        Some(_) => {
            let w = t(Role::GateUp);
            let (g, u) = w.split_at(c.intermediate_size * hs);
            (g.to_vec(), u.to_vec())
        }
        None => (t(Role::Gate), t(Role::Up)),
    };
    let gate = cpu_matvec(&wg, None, &m);
    let up = cpu_matvec(&wu, None, &m);
    let act: Vec<f32> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    for (r, dn) in r.iter_mut().zip(cpu_matvec(&t(Role::Down), None, &act)) {
        *r += dn;
    }
    let f = cpu_rmsnorm(&r, &t(Role::FinalNorm), eps);
    let head = if c.tie_word_embeddings {
        t(Role::Embed)
    } else {
        t(Role::LmHead)
    };
    let e = &head[ids[i] as usize * hs..(ids[i] as usize + 1) * hs];
    f.iter().zip(e).map(|(a, b)| a * b).sum()
}

/// `ccs` and `ccs-context` through the engine against the host reference,
/// on the tiny model of every family (GQA, Qwen2's q/k/v biases, Qwen3's
/// q/k norms, SmolLM3's last layer without RoPE, Phi-3's fused tensors,
/// partial rotary and LongRoPE), for entries early, in the middle and next
/// to last (one later entry): the reference takes the engine's own residual
/// stream entering the last layer, so the check is of the counter-causal
/// pass alone. The two modes must differ (the residual path is dropped in
/// one) and each must match its own reference.
#[test]
fn ccs_context_matches_a_cpu_reference() {
    use sieve::engine::CcsMode;
    for name in [
        "tiny-qwen2",
        "tiny-llama-gqa",
        "tiny-qwen3",
        "tiny-smollm3",
        "tiny-phi3",
    ] {
        let model = load(name);
        let store = sieve::weights::TensorStore::open(&golden_dir().join(name)).unwrap();
        let c = &model.config;
        let prompt = Npz::open(&golden_dir().join(name).join("golden_len064.npz")).ids("input_ids");
        let ids = &prompt[..40];
        let n = ids.len();
        let mut got = vec![];
        for mode in [CcsMode::Fast, CcsMode::FastContext] {
            let signals = sieve::engine::Signals {
                counter_causal: Some(mode),
                ..Default::default()
            };
            let (mut e, _) = fed_engine(&model, ids, n, signals, |e| e.set_capture(true));
            let hidden = e.read_hidden(c.num_layers - 1, n).unwrap();
            let entries: Vec<(u32, u32, u32)> = [0usize, 5, 17, n - 2]
                .iter()
                .map(|&i| (i as u32, i as u32, ids[i]))
                .collect();
            let logits = e.counter_causal_logits(&entries).unwrap();
            for (&(i, _, _), &l) in entries.iter().zip(&logits) {
                let own_residual = mode == CcsMode::Fast;
                let want =
                    cpu_counter_causal_logit(&store, c, &hidden, ids, i as usize, own_residual);
                assert!(
                    (l - want).abs() <= 1e-3 * want.abs().max(1.0),
                    "{name} {mode:?} entry {i}: engine {l}, host {want}"
                );
            }
            got.push(logits);
        }
        assert!(
            max_abs_diff(&got[0], &got[1]) > 1e-2,
            "{name}: ccs and ccs-context agree: {got:?}"
        );
    }
}

/// The hybrids at their first refresh, where every run holds the same
/// entries: each score is the mean of its parts' rank fractions (ties share
/// a rank), the parts' scores taken from their own runs' traces.
#[test]
fn hybrids_are_rank_means_of_their_parts() {
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let model = load(name);
        let s = settings(name);
        let ids = input_ids(&s);
        let last = model.config.num_layers;
        // EpiKV's own layers, then `--epikv-layers` with A after B and with
        // A = B: the hybrid's engine tracks its parts' layers sorted and
        // without repeats, and the EpiKV part must still read its own.
        for layers in [None, Some((last, 1)), Some((1, 1))] {
            let name = format!("{name} (EpiKV layers {layers:?})");
            hybrid_scores_are_rank_means(&model, &s, &ids, layers, &name);
        }
    }
}

fn hybrid_scores_are_rank_means(
    model: &Arc<Model>,
    s: &serde_json::Value,
    ids: &[u32],
    layers: Option<(usize, usize)>,
    name: &str,
) {
    use sieve::eviction::hybrid::rank_fractions;
    let first_scores = |p: Policy| -> (Vec<u32>, Vec<f64>) {
        let opts = CacheOptions {
            epikv_layers: layers,
            ..golden_opts(s, p)
        };
        let (_, cache) = run(model, ids, opts, 16);
        let r = &cache.trace[0];
        (r.unprotected.clone(), r.scores.clone())
    };
    let (positions, robust) = first_scores(Policy::EpikvRobust);
    let (_, tova) = first_scores(Policy::Tova);
    let recency: Vec<f64> = positions.iter().map(|&p| p as f64).collect();
    for (hybrid, other) in [(Policy::EpikvRecency, &recency), (Policy::EpikvTova, &tova)] {
        let (got_positions, got) = first_scores(hybrid);
        assert_eq!(got_positions, positions, "{name} {hybrid:?}");
        let (a, b) = (rank_fractions(&robust), rank_fractions(other));
        for (k, g) in got.iter().enumerate() {
            let want = (a[k] + b[k]) / 2.0;
            assert!(
                (g - want).abs() < 1e-12,
                "{name} {hybrid:?} entry {k}: {g} vs {want}"
            );
        }
        // Not just one part's ranking.
        assert!(got.iter().zip(&a).any(|(g, a)| (g - a).abs() > 1e-6));
    }
}

/// The sink guard (`window-sinks`, docs/POLICIES.md) against a host
/// reference built on the independent implementation's g at EpiKV's layer A
/// (golden epikv.trace.npz, float64 from the reference's hidden states).
/// Before the first refresh every run is the full-cache run, so there that
/// g is the guard's own: the host detects the sinks by the guard's rule, and
/// the first refresh must score them `f64::MAX` and every other entry by its
/// position, and keep the protected entries plus the best-ranked. Later
/// refreshes (whose hidden states depend on what was evicted) must score
/// each entry `f64::MAX` or its position and keep by that ranking. The tiny
/// models have random weights and no massive activations, so the test takes
/// the ratio from their own g, in the widest gap among the largest pair
/// ratios, so that float32 g cannot flip a decision.
#[test]
fn window_sinks_matches_a_cpu_reference() {
    use sieve::eviction::epikv::{bands, median};
    use sieve::eviction::sinks::SinkGuard;
    let mut rescued = 0;
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let s = settings(name);
        let model = load(name);
        let ids = input_ids(&s);
        let opts = golden_opts(&s, Policy::WindowSinks);
        let layer = bands(model.config.num_layers, false, None).0[0];
        let npz = Npz::open(
            &golden_dir()
                .join("eviction")
                .join(name)
                .join("epikv.trace.npz"),
        );
        assert_eq!(npz.ids("layers")[0] as usize, layer, "{name}: layer A");
        let (shape, g) = npz.f32("g");
        let g: Vec<f64> = g[..shape[1]].iter().map(|&v| v as f64).collect();
        // The pair ratio of every position t >= sinks whose g(t + 1) is known
        // at the first refresh: min(g(t), g(t + 1)) over the median of
        // g(max(sinks, t + 2 - W) ..= t + 1).
        let (first, w) = (opts.sinks, opts.epikv_window);
        let first_refresh = opts.capacity();
        let ratios: Vec<(u32, f64)> = (first..first_refresh - 1)
            .map(|t| {
                let mut window = g[first.max((t + 2).saturating_sub(w))..=t + 1].to_vec();
                (t as u32, g[t].min(g[t + 1]) / median(&mut window))
            })
            .collect();
        let mut sorted: Vec<f64> = ratios.iter().map(|r| r.1).collect();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let gap = |i: usize| sorted[i] / sorted[i + 1];
        let k = (0..5).max_by(|&i, &j| gap(i).total_cmp(&gap(j))).unwrap();
        assert!(gap(k) > 1.01, "{name}: no clear gap");
        let ratio = (sorted[k] * sorted[k + 1]).sqrt();
        let sinks: Vec<u32> = ratios.iter().filter(|r| r.1 > ratio).map(|r| r.0).collect();
        eprintln!("{name}: ratio {ratio:.3}, sinks at the first refresh {sinks:?}");
        let guard = SinkGuard::new(
            Policy::Window
                .scorer(&opts.policy_params(), model.config.num_layers)
                .unwrap(),
            layer,
            ratio,
            first as u32,
            w,
        )
        .unwrap();
        let cache = BoundedCache::with_scorer(opts, Box::new(guard)).unwrap();
        let (_, cache) = run_cache(&model, &ids, cache, 16);
        for r in &cache.trace {
            let is_sink = |p: u32| match r.refresh {
                0 => sinks.contains(&p),
                _ => r.scores[r.unprotected.iter().position(|&q| q == p).unwrap()] == f64::MAX,
            };
            let want: Vec<f64> = r
                .unprotected
                .iter()
                .map(|&p| if is_sink(p) { f64::MAX } else { p as f64 })
                .collect();
            assert_eq!(r.scores, want, "{name} refresh {}: scores", r.refresh);
            let mut order = r.unprotected.clone();
            order.sort_by(|a, b| is_sink(*b).cmp(&is_sink(*a)).then(b.cmp(a)));
            let n_keep = opts.budget - r.protected.len();
            let mut kept: Vec<u32> = r.protected.clone();
            kept.extend(&order[..n_keep.min(order.len())]);
            kept.sort_unstable();
            assert_eq!(r.kept, kept, "{name} refresh {}: kept", r.refresh);
        }
        assert!(!sinks.is_empty(), "{name}: no sink detected");
        // The window evicts the oldest unprotected entries at the first refresh.
        let window_evicts = first_refresh - opts.budget + first;
        rescued += sinks
            .iter()
            .filter(|&&p| (p as usize) < window_evicts && cache.trace[0].kept.contains(&p))
            .count();
    }
    assert!(rescued > 0, "no sink that the window evicts was kept");
}

/// Sliding-window layers mask by original position, so evictions do not
/// move their windows: tiny-gemma3 with every layer sliding (window 16),
/// through a cache that keeps the 32 most recent entries (no sinks) and
/// compacts every 16 tokens, gives what the full cache gives, while the
/// real tiny-gemma3 (its last layer attends fully) does not.
#[test]
fn window_layers_see_the_same_keys_after_evictions() {
    let src = golden_dir().join("tiny-gemma3");
    let dir = std::env::temp_dir().join(format!("sieve-gemma3-all-sliding-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["layer_types"] = serde_json::json!(vec!["sliding_attention"; 6]);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let ids = Npz::open(&src.join("golden_len300.npz")).ids("input_ids");
    let opts = LoadOptions {
        dtype: Some(WeightFormat::F32),
        ..Default::default()
    };
    let keep_recent = CacheOptions {
        sinks: 0,
        recent: 16,
        ..CacheOptions::new(Policy::Window, 32, 16)
    };
    for (model, sliding_only) in [
        (Model::load(&dir, &opts).unwrap(), true),
        (load("tiny-gemma3"), false),
    ] {
        let (full, _) = run(&model, &ids, CacheOptions::new(Policy::Full, 0, 16), 16);
        let (bounded, cache) = run(&model, &ids, keep_recent, 16);
        assert!(cache.trace.len() > 10, "the cache compacted");
        let d = max_abs_diff(&full, &bounded);
        eprintln!("all layers sliding: {sliding_only}: max |d| {d:.2e}");
        if sliding_only {
            assert!(d < 1e-4, "windows moved with the evictions: {d}");
        } else {
            assert!(d > 1e-2, "the full layer should see the evictions: {d}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A bounded run's first refresh `r` (nothing evicted before it) against
/// the engine's scores `want` of every slot of a full-cache run: each
/// unprotected entry's score equal, and not rising with position
/// throughout (the policy ranks otherwise than the window).
fn check_refresh_scores(r: &sieve::cache::RefreshRecord, want: &[f32], what: &str) {
    assert_eq!(r.present.len(), want.len(), "{what}");
    for (&p, &got) in r.unprotected.iter().zip(&r.scores) {
        let w = want[p as usize] as f64;
        assert!(
            (got - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{what} position {p}: {got} vs {w}"
        );
    }
    let by_position = r.scores.windows(2).all(|w| w[0] <= w[1]);
    assert!(!by_position, "{what}: scores rise with position");
}

/// `knorm`, `keydiff` and `lagkv` (kvpress's cache-only presses, docs/POLICIES.md):
/// at the first refresh of a bounded run on both tiny models, every
/// unprotected entry's score is the one the engine computes from a
/// full-cache run's keys over the same tokens (the kernel's own test checks
/// the formula against a CPU reference), and the scores rank the entries
/// otherwise than by position.
#[test]
fn key_policies_score_the_cached_keys() {
    use sieve::kernels::key_scores::KeyScore;
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let model = load(name);
        let s = settings(name);
        let ids = input_ids(&s);
        // LagKV in partitions of 16: at the refresh's 64 entries two are
        // ranked, the rest score 1.
        let lag = KeyScore::Lag { sinks: 4, lag: 16 };
        for (policy, kind) in [
            (Policy::Knorm, KeyScore::Norm),
            (Policy::Keydiff, KeyScore::Diff),
            (Policy::Lagkv, lag),
        ] {
            let opts = CacheOptions {
                lag_size: 16,
                ..golden_opts(&s, policy)
            };
            let (_, cache) = run(&model, &ids, opts, 16);
            let r = &cache.trace[0];
            let n = r.before_position as usize;
            let signals = sieve::engine::Signals {
                key_scores: Some(kind),
                ..Default::default()
            };
            let (e, _) = fed_engine(&model, &ids[..n], n, signals, |_| {});
            let want = e.key_scores().unwrap();
            check_refresh_scores(r, &want, &format!("{name} {policy:?}"));
            let per_head = e.read_key_scores_per_head(n).unwrap();
            let cells = per_head.len() / n;
            assert_eq!(cells, model.config.num_layers * model.config.num_kv_heads);
        }
    }
}

/// `snapkv` and `expected-attention` (kvpress's SnapKVPress and
/// ExpectedAttentionPress, docs/POLICIES.md): at the first refresh of a
/// bounded run on both tiny models (windows of 16 queries), every
/// unprotected entry's score is the engine's score of a full-cache run over
/// the same tokens with the window of the 16 newest queries (Expected
/// Attention's after the sinks' positions); SnapKV's window entries score
/// above every other (the kernels' own tests check the formulas against a
/// CPU reference, tests/kvpress.rs against kvpress).
#[test]
fn query_policies_score_from_the_newest_queries() {
    use sieve::kernels::query_scores::{ExpectedAttention, QueryPolicy, QueryWindow, SnapKv};
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let model = load(name);
        let s = settings(name);
        let ids = input_ids(&s);
        let sinks = s["sinks"].as_u64().unwrap() as u32;
        let snapkv = QueryPolicy::SnapKv(SnapKv {
            window: 16,
            kernel: 5,
        });
        let expected = QueryPolicy::ExpectedAttention(ExpectedAttention {
            window: 16,
            future: 512,
        });
        for (policy, kind) in [
            (Policy::Snapkv, snapkv),
            (Policy::ExpectedAttention, expected),
        ] {
            let opts = CacheOptions {
                snapkv_window: 16,
                ea_window: 16,
                recent: 4,
                ..golden_opts(&s, policy)
            };
            let (_, cache) = run(&model, &ids, opts, 16);
            let r = &cache.trace[0];
            let n = r.before_position;
            let signals = sieve::engine::Signals {
                queries: Some(kind),
                ..Default::default()
            };
            let (e, _) = fed_engine(&model, &ids[..n as usize], 16, signals, |_| {});
            let (first, end) = match kind {
                QueryPolicy::SnapKv(_) => (0, n - 16),
                QueryPolicy::ExpectedAttention(_) => (sinks, n),
            };
            let w = QueryWindow {
                n,
                first,
                end,
                queries: 16,
                last_pos: n - 1,
                _p: [0; 3],
            };
            let want = e.query_scores(w).unwrap();
            check_refresh_scores(r, &want, &format!("{name} {policy:?}"));
            if policy == Policy::Snapkv {
                let scores = || r.unprotected.iter().zip(&r.scores);
                let older =
                    (scores().filter(|(&p, _)| p < end).map(|(_, &s)| s)).fold(f64::MIN, f64::max);
                let window =
                    (scores().filter(|(&p, _)| p >= end).map(|(_, &s)| s)).fold(f64::MAX, f64::min);
                assert!(window > older, "{name}: window {window} vs older {older}");
            }
        }
    }
}
