//! `sieve bench --batch 1,4,16`: decode steps of B sequences at once
//! (`engine::Batch`), each sequence one token a step, with the full cache
//! at each `--depths` depth and, with `--generate` steps, with a bounded
//! cache of each `--policies` policy at `--budget` and `--chunk` (its
//! refreshes timed): aggregate tokens per second, per sequence, and the
//! step time, beside the first size (give 1 first). Each step is synchronous (recorded,
//! submitted, waited for), as the `synchronous` decode figure of a single
//! sequence is.

use anyhow::Result;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

use super::eviction;
use super::eviction::BenchPolicy;
use sieve::cache::FeedOutput;
use sieve::engine::{Batch, Engine, EngineOptions, SeqStep};
use sieve::kernels::sample::SamplingParams;
use sieve::model::Model;

/// What the sequences of a timed batch hold.
#[derive(Clone, Copy)]
pub enum Setup {
    /// The full cache, `depth` entries deep.
    Depth(usize),
    /// A bounded cache of `policy` at budget J and chunk h, filled with J
    /// tokens first: the timed steps refresh it every h steps.
    Evicting {
        policy: BenchPolicy,
        budget: usize,
        chunk: usize,
    },
}

impl Setup {
    fn describe(&self) -> String {
        match self {
            Setup::Depth(d) => format!("at depth {d}"),
            Setup::Evicting {
                policy,
                budget,
                chunk,
            } => format!("with {} (J {budget}, h {chunk})", policy.name()),
        }
    }

    fn json(&self) -> serde_json::Value {
        match *self {
            Setup::Depth(depth) => json!({"depth": depth}),
            Setup::Evicting {
                policy,
                budget,
                chunk,
            } => json!({"policy": policy.name(), "budget": budget, "chunk": chunk}),
        }
    }
}

/// The rows of the table and their JSON: each setup at each batch size.
pub fn sweep(
    model: &Arc<Model>,
    sizes: &[usize],
    setups: &[Setup],
    steps: usize,
) -> Result<Vec<serde_json::Value>> {
    let mut rows = vec![];
    if sizes.is_empty() || steps == 0 {
        return Ok(rows);
    }
    println!("| batched decode | aggregate tokens/s | tokens/s per sequence | ms/step | aggregate vs the first size |");
    println!("|---|---|---|---|---|");
    for setup in setups {
        let mut single = None;
        for &b in sizes {
            let seconds = time_steps(model, b, *setup, steps)?;
            let aggregate = (b * steps) as f64 / seconds;
            let ratio = aggregate / *single.get_or_insert(aggregate);
            println!(
                "| batch {b} {} | {aggregate:.2} | {:.2} | {:.1} | {ratio:.2}x |",
                setup.describe(),
                aggregate / b as f64,
                seconds * 1e3 / steps as f64
            );
            let mut row = json!({
                "batch": b, "steps": steps,
                "aggregate_tokens_per_second": aggregate,
                "per_sequence_tokens_per_second": aggregate / b as f64,
                "step_seconds": seconds / steps as f64,
                "aggregate_over_first_size": ratio,
            });
            if let (Some(row), serde_json::Value::Object(facts)) =
                (row.as_object_mut(), setup.json())
            {
                row.extend(facts);
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Tokens of a prompt read at once when an evicting sequence fills its cache.
const FILL_CHUNK: usize = 64;

/// Seconds for `steps` batched decode steps of `b` sequences set up as
/// `setup` (after one warm-up step), refreshes included. Decode cost does
/// not depend on the cached values: at a depth, the sequences start there
/// without a prompt.
fn time_steps(model: &Arc<Model>, b: usize, setup: Setup, steps: usize) -> Result<f64> {
    let vocab = model.config.vocab_size as u32;
    let id = |i: usize| ((i * 7919 + 13) % vocab as usize) as u32;
    let (mut caches, slots) = match setup {
        Setup::Depth(depth) => (vec![], depth + steps + 2),
        Setup::Evicting {
            policy,
            budget,
            chunk,
        } => {
            let caches = (0..b)
                .map(|_| eviction::cache_for(model, policy, budget, chunk))
                .collect::<Result<Vec<_>>>()?;
            (caches, budget + chunk)
        }
    };
    let mut batch = Batch::new(model.clone(), b.max(FILL_CHUNK), b, slots)?;
    let mut engines = vec![];
    for i in 0..b {
        let mut engine = match caches.get_mut(i) {
            None => batch.sequence(EngineOptions {
                max_slots: slots,
                max_tokens: 1,
                max_logit_rows: 1,
                ..Default::default()
            })?,
            Some(cache) => batch.sequence(cache.engine_options(slots, FILL_CHUNK, 1))?,
        };
        match (setup, caches.get_mut(i)) {
            (Setup::Evicting { budget, .. }, Some(cache)) => {
                // Its own prompt, read alone (not timed).
                let prompt: Vec<u32> = (0..budget).map(|t| id(t + 1000 * i)).collect();
                cache.feed(&mut engine, &prompt, 0, FeedOutput::None, |_, _| Ok(()))?;
            }
            (Setup::Depth(depth), _) => engine.n_cached = depth,
            _ => unreachable!("an evicting setup has a cache per sequence"),
        }
        engines.push(engine);
    }
    let depth = match setup {
        Setup::Depth(depth) => depth,
        Setup::Evicting { budget, .. } => budget,
    };
    let mut tokens: Vec<u32> = (0..b).map(|i| id(i * 31)).collect();
    let mut seconds = 0.0;
    for s in 0..=steps {
        let pos = [(depth + s) as u32];
        let t = Instant::now();
        for (cache, engine) in caches.iter_mut().zip(&mut engines) {
            cache.make_room(engine, pos[0])?;
        }
        let ids: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
        let mut work: Vec<(&mut Engine, SeqStep)> = engines
            .iter_mut()
            .zip(&ids)
            .map(|(e, ids)| {
                let step = SeqStep {
                    ids,
                    positions: &pos,
                    sample: Some((SamplingParams::default(), s as u32)),
                    logits: false,
                };
                (e, step)
            })
            .collect();
        let sampled = batch.step(&mut work)?;
        drop(work);
        for ((cache, engine), ids) in caches.iter_mut().zip(&engines).zip(&ids) {
            cache.record_step(engine, ids, &pos)?;
        }
        if s > 0 {
            seconds += t.elapsed().as_secs_f64();
        }
        tokens = sampled.into_iter().map(|t| t.unwrap_or(0)).collect();
    }
    Ok(seconds)
}
