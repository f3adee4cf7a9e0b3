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
use sieve::model::{LoadOptions, Model};
use sieve::shaders::WeightFormat;
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
    let mut cache = BoundedCache::new(opts, model.config.num_layers).unwrap();
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

#[test]
fn budget_larger_than_the_sequence_reproduces_the_full_cache() {
    let model = load("tiny-llama-gqa");
    let g = Npz::open(&golden_dir().join("tiny-llama-gqa/golden_len300.npz"));
    let ids = g.ids("input_ids");
    let (full, _) = run(&model, &ids, CacheOptions::new(Policy::Full, 400, 16), 64);
    for policy in [Policy::Window, Policy::Random] {
        let (got, cache) = run(&model, &ids, CacheOptions::new(policy, 400, 16), 64);
        assert!(cache.trace.is_empty());
        assert_eq!(got, full, "{policy:?} with a budget above the sequence");
    }
    let (_, want) = g.f32("logits");
    let vocab = 512;
    for (i, &p) in g.ids("logits_positions").iter().enumerate() {
        let d = max_abs_diff(
            &full[p as usize * vocab..][..vocab],
            &want[i * vocab..][..vocab],
        );
        assert!(d <= 1e-3);
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
