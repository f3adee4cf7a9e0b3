//! `sieve bench --context N`: decode speed and GPU memory at long contexts,
//! with the full cache (N entries) and with each policy at each budget J (the
//! cache holds J + h entries whatever N is). With `--materialize`, h2o and
//! tova also run with eager attention's materialized weight matrix, the
//! memory wall the EpiKV paper reports; a configuration that does not fit
//! becomes a row with its error, and the sweep goes on.

use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

use super::eviction::BenchPolicy;
use super::BenchArgs;
use sieve::cache::{BoundedCache, CacheOptions, FeedOutput};
use sieve::engine::{Engine, EngineOptions, StepOutput};
use sieve::eviction::Policy;
use sieve::kernels::sample::SamplingParams;
use sieve::model::Model;

/// One measured configuration.
struct Measured {
    tokens_per_second: f64,
    gpu_bytes: u64,
}

fn ids(model: &Model, n: usize, offset: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (((i + offset) * 7919 + 13) % model.config.vocab_size) as u32)
        .collect()
}

/// Decode at depth n with the full cache (decode cost does not depend on the
/// cached values, so the cache is not prefilled).
fn full_cache(model: &Arc<Model>, n: usize, steps: usize) -> Result<Measured> {
    let mut e = Engine::new(
        model.clone(),
        EngineOptions {
            max_slots: n + steps + 1,
            max_tokens: 1,
            max_logit_rows: 1,
            ..Default::default()
        },
    )?;
    e.n_cached = n;
    let mut tok = 1;
    let mut time = 0.0;
    for s in 0..=steps {
        let t = Instant::now();
        let out = StepOutput {
            sample: Some((SamplingParams::default(), s as u32)),
            ..StepOutput::last(1)
        };
        tok = e.step(&[tok], &[(n + s) as u32], out)?.unwrap_or(0);
        if s > 0 {
            time += t.elapsed().as_secs_f64();
        }
    }
    Ok(Measured {
        tokens_per_second: steps as f64 / time,
        gpu_bytes: model.weight_bytes + e.buffer_bytes,
    })
}

/// A bounded cache at budget J: filled by a real prefill of J + h tokens at
/// positions n - (J + h) .. n, then `steps` decode steps (refreshes included).
fn bounded(
    model: &Arc<Model>,
    opts: CacheOptions,
    n: usize,
    fill_step: usize,
    steps: usize,
) -> Result<Measured> {
    let mut cache = BoundedCache::new(opts, model.config.num_layers)?;
    let c = opts.capacity();
    let mut e = Engine::new(model.clone(), cache.engine_options(c, fill_step, 1))?;
    let first = n.saturating_sub(c);
    cache.feed(
        &mut e,
        &ids(model, c, 0),
        first as u32,
        FeedOutput::None,
        |_, _| Ok(()),
    )?;
    e.sync()?;
    let mut tok = 1;
    let t = Instant::now();
    for s in 0..steps {
        let out = FeedOutput::Sample(SamplingParams::default(), s as u32);
        let pos = (first + c + s) as u32;
        tok = cache
            .feed(&mut e, &[tok], pos, out, |_, _| Ok(()))?
            .unwrap_or(0);
    }
    Ok(Measured {
        tokens_per_second: steps as f64 / t.elapsed().as_secs_f64(),
        gpu_bytes: model.weight_bytes + e.buffer_bytes,
    })
}

fn row(n: usize, policy: &str, budget: Option<usize>, result: Result<Measured>) -> Value {
    let b = budget.map_or("-".to_string(), |b| b.to_string());
    match result {
        Ok(m) => {
            println!(
                "| {n} | {policy} | {b} | {:.2} | {:.1} | {:.1} | |",
                m.tokens_per_second,
                1e3 / m.tokens_per_second,
                m.gpu_bytes as f64 / 1048576.0
            );
            json!({"context": n, "policy": policy, "budget": budget,
                   "tokens_per_second": m.tokens_per_second, "gpu_buffer_bytes": m.gpu_bytes})
        }
        Err(e) => {
            let msg = format!("{e:#}");
            println!("| {n} | {policy} | {b} | - | - | - | error: {msg} |");
            json!({"context": n, "policy": policy, "budget": budget, "error": msg})
        }
    }
}

pub fn sweep(model: &Arc<Model>, policies: &[BenchPolicy], a: &BenchArgs) -> Result<Vec<Value>> {
    let mut out = vec![];
    if a.context.is_empty() {
        return Ok(out);
    }
    println!("| context | policy | budget | decode tok/s | ms/token | GPU buffers (MiB) | note |");
    println!("|---|---|---|---|---|---|---|");
    let steps = a.decode_steps.max(1);
    for &n in &a.context {
        out.push(row(n, "full", None, full_cache(model, n, steps)));
        for &policy in policies.iter().filter(|p| !p.is_full()) {
            let eager = matches!(policy.policy, Policy::H2o | Policy::Tova) && a.materialize;
            for materialize in [false, true].into_iter().filter(|m| !m || eager) {
                for &j in &a.context_budgets {
                    if j + a.chunk > n {
                        continue; // the budget holds the whole context
                    }
                    let opts = CacheOptions {
                        materialize,
                        ..policy.options(j, a.chunk)
                    };
                    // Decode long enough for at least two refreshes.
                    let decode = steps.max(2 * a.chunk + 1);
                    let name = if materialize {
                        format!("{} (materialized)", policy.name())
                    } else {
                        policy.name()
                    };
                    let r = bounded(model, opts, n, a.fill_step, decode);
                    out.push(row(n, &name, Some(j), r));
                }
            }
        }
    }
    Ok(out)
}
