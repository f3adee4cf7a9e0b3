//! A KV cache split into pages (what a long context needs when one layer's
//! keys or values exceed a storage binding of the device) computes exactly
//! what a cache in one buffer per layer computes: the same logits at every
//! position, prefill steps that straddle page boundaries, single-token decode
//! steps, and, with eviction, the same kept sets after compactions that move
//! entries between pages, for every policy.
//!
//! Pages hold whole key chunks, so the attention kernels do the same
//! arithmetic in the same order either way: the tolerance is 1e-6.

mod common;
use common::*;
use sieve::cache::{BoundedCache, CacheOptions, FeedOutput};
use sieve::engine::Engine;
use sieve::eviction::Policy;
use sieve::formats::{KvFormat, WeightFormat};
use sieve::gpu::GpuOptions;
use sieve::model::{LoadOptions, Model};
use std::sync::Arc;

const PREFILL: usize = 700;
const DECODE: usize = 40;
/// Slots per page in the paged runs (the smallest a page can be: one key chunk).
const PAGE: usize = 256;

fn load(name: &str, kv: KvFormat) -> Arc<Model> {
    load_with(name, GpuOptions::default(), kv)
}

fn load_with(name: &str, gpu: GpuOptions, kv: KvFormat) -> Arc<Model> {
    let opts = LoadOptions {
        dtype: Some(WeightFormat::F32),
        kv_dtype: Some(kv),
        gpu,
        ..Default::default()
    };
    Model::load(&golden_dir().join(name), &opts).unwrap()
}

/// A sequence of PREFILL + DECODE token ids from the model's vocabulary.
fn tokens(vocab: usize) -> Vec<u32> {
    (0..PREFILL + DECODE)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect()
}

/// Logits of every position (prefill in steps of 100, then one token per
/// step) and the kept positions of every refresh.
fn run(model: &Arc<Model>, opts: CacheOptions, page: Option<usize>) -> (Vec<f32>, Vec<Vec<u32>>) {
    let ids = tokens(model.config.vocab_size);
    let mut cache = BoundedCache::new(opts, model.config.num_layers).unwrap();
    cache.record = true;
    let mut eo = cache.engine_options(ids.len(), 100, 100);
    eo.kv_page_slots = page;
    let mut e = Engine::new(model.clone(), eo).unwrap();
    let vocab = model.config.vocab_size;
    let mut logits = vec![0.0; ids.len() * vocab];
    cache
        .feed(&mut e, &ids[..PREFILL], 0, FeedOutput::All, |first, l| {
            logits[first * vocab..first * vocab + l.len()].copy_from_slice(l);
            Ok(())
        })
        .unwrap();
    for i in PREFILL..ids.len() {
        cache
            .feed(&mut e, &ids[i..i + 1], i as u32, FeedOutput::All, |_, l| {
                logits[i * vocab..(i + 1) * vocab].copy_from_slice(l);
                Ok(())
            })
            .unwrap();
    }
    let kept = cache.trace.iter().map(|r| r.kept.clone()).collect();
    (logits, kept)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The tiny model of every family.
const EVERY_FAMILY: &[&str] = &[
    "tiny-llama-gqa",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-smollm3",
    "tiny-phi3",
    "tiny-gemma3",
];

/// For the policies: GQA, Qwen2's biases and Qwen3's q/k norms, which the
/// policies' signals read; paging itself does not depend on the family
/// (every family pages its full cache in `full_cache_over_three_pages`).
const POLICY_FAMILIES: &[&str] = &["tiny-llama-gqa", "tiny-qwen2", "tiny-qwen3"];

/// Runs the tiny models of `families` with and without pages; returns the
/// fewest refreshes any made.
fn same_with_pages(opts: CacheOptions, what: &str, kv: KvFormat, families: &[&str]) -> usize {
    let mut refreshes = usize::MAX;
    for &name in families {
        let model = load(name, kv);
        let (want, want_kept) = run(&model, opts, None);
        let (got, got_kept) = run(&model, opts, Some(PAGE));
        assert!(want.iter().all(|x| x.is_finite()), "{name} {what}");
        assert_eq!(got_kept, want_kept, "{name} {what}: kept sets");
        let d = max_abs_diff(&got, &want);
        assert!(d <= 1e-6, "{name} {what}: logits differ by {d}");
        refreshes = refreshes.min(want_kept.len());
    }
    refreshes
}

#[test]
fn full_cache_over_three_pages() {
    for kv in [KvFormat::F32, KvFormat::F16] {
        same_with_pages(
            CacheOptions::new(Policy::Full, 0, 1),
            "full cache",
            kv,
            EVERY_FAMILY,
        );
    }
}

/// Budget 500 and chunk 64: the cache holds 564 entries in three pages, and
/// every refresh moves kept entries from later pages into earlier ones.
#[test]
fn every_policy_with_compaction_across_pages() {
    for (name, policy) in Policy::ALL {
        // Variants (docs/POLICIES.md) score from the same engine signals and
        // kernels as the SPEC policies, so paging has nothing new to show.
        if policy == Policy::Full || !policy.is_spec() {
            continue;
        }
        let opts = CacheOptions {
            sinks: 4,
            recent: 32,
            ..CacheOptions::new(policy, 500, 64)
        };
        let refreshes = same_with_pages(opts, name, KvFormat::F32, POLICY_FAMILIES);
        assert!(refreshes >= 3, "{name}: {refreshes} refreshes");
    }
    // Compaction moves f16 rows (half the bytes) just the same.
    let opts = CacheOptions {
        sinks: 4,
        recent: 32,
        ..CacheOptions::new(Policy::H2o, 500, 64)
    };
    same_with_pages(opts, "h2o, f16 KV", KvFormat::F16, POLICY_FAMILIES);
    // The materialized attention matrix covers every slot; its kernels read the keys page by page.
    let opts = CacheOptions {
        sinks: 4,
        recent: 32,
        materialize: true,
        ..CacheOptions::new(Policy::H2o, 500, 64)
    };
    same_with_pages(opts, "h2o materialized", KvFormat::F32, POLICY_FAMILIES);
}

/// On a device whose storage bindings hold 96 KiB, a 2,100-token context of
/// the tiny Llama (256-byte key rows) is held in nine pages of 256 slots per
/// layer's keys, found from the device's limit alone. Deep in
/// the context, the attention partials of a 16-token step no longer fit one
/// binding either, so those steps take fewer tokens. The logits match a run
/// on the same device model with unlimited bindings.
#[test]
fn small_bindings_split_the_cache_and_shorten_deep_steps() {
    const N: usize = 2100;
    let run_on = |gpu: GpuOptions| -> (Vec<f32>, usize) {
        let model = load_with("tiny-llama-gqa", gpu, KvFormat::F32);
        let vocab = model.config.vocab_size;
        let ids: Vec<u32> = (0..N).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        let mut cache = BoundedCache::new(CacheOptions::new(Policy::Full, 0, 1), 3).unwrap();
        let mut e = Engine::new(model.clone(), cache.engine_options(N, 16, 16)).unwrap();
        let mut logits = vec![0.0; N * vocab];
        cache
            .feed(&mut e, &ids, 0, FeedOutput::All, |first, l| {
                logits[first * vocab..first * vocab + l.len()].copy_from_slice(l);
                Ok(())
            })
            .unwrap();
        e.n_cached = N - 16;
        (logits, e.max_step_tokens())
    };
    let (want, deep_unlimited) = run_on(GpuOptions::default());
    let (got, deep_small) = run_on(GpuOptions {
        max_binding_override: Some(96 * 1024),
        ..Default::default()
    });
    assert_eq!(deep_unlimited, 16);
    assert!(deep_small < 16, "deep steps take {deep_small} tokens");
    let d = max_abs_diff(&got, &want);
    assert!(d <= 1e-5, "logits differ by {d}");
}

/// The f16 cache holds the same slots in half the bytes: the engines differ
/// by exactly half of the f32 cache (3 layers x keys and values).
#[test]
fn f16_cache_takes_half_the_bytes() {
    let bytes = |kv: KvFormat| {
        let model = load("tiny-llama-gqa", kv);
        let cache = BoundedCache::new(CacheOptions::new(Policy::Full, 0, 1), 3).unwrap();
        let e = Engine::new(model, cache.engine_options(1024, 16, 1)).unwrap();
        e.buffer_bytes
    };
    let f32_cache = 1024 * 3 * 2 * (2 * 32 * 4) as u64;
    assert_eq!(bytes(KvFormat::F32) - bytes(KvFormat::F16), f32_cache / 2);
}
