//! `sieve bench --batch 1,4,16`: decode steps of B sequences at once
//! (`engine::Batch`), each sequence one token a step, at each `--depths`
//! depth: aggregate tokens per second, per sequence, and the step time,
//! beside the first size (give 1 first). Each step is synchronous (recorded,
//! submitted, waited for), as the `synchronous` decode figure of a single
//! sequence is.

use anyhow::Result;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

use sieve::engine::{Batch, Engine, EngineOptions, SeqStep};
use sieve::kernels::sample::SamplingParams;
use sieve::model::Model;

/// The rows of the table and their JSON.
pub fn sweep(
    model: &Arc<Model>,
    sizes: &[usize],
    depths: &[usize],
    steps: usize,
) -> Result<Vec<serde_json::Value>> {
    let mut rows = vec![];
    if sizes.is_empty() {
        return Ok(rows);
    }
    println!("| batched decode | aggregate tokens/s | tokens/s per sequence | ms/step | aggregate vs the first size |");
    println!("|---|---|---|---|---|");
    for &depth in depths {
        let mut single = None;
        for &b in sizes {
            let seconds = time_steps(model, b, depth, steps)?;
            let aggregate = (b * steps) as f64 / seconds;
            let ratio = aggregate / *single.get_or_insert(aggregate);
            println!(
                "| batch {b} at depth {depth} | {aggregate:.2} | {:.2} | {:.1} | {ratio:.2}x |",
                aggregate / b as f64,
                seconds * 1e3 / steps as f64
            );
            rows.push(json!({
                "batch": b, "depth": depth, "steps": steps,
                "aggregate_tokens_per_second": aggregate,
                "per_sequence_tokens_per_second": aggregate / b as f64,
                "step_seconds": seconds / steps as f64,
                "aggregate_over_first_size": ratio,
            }));
        }
    }
    Ok(rows)
}

/// Seconds for `steps` batched decode steps of `b` sequences at cache
/// depth `depth` (after one warm-up step). Decode cost does not depend on
/// the cached values: the sequences start at that depth without a prompt.
fn time_steps(model: &Arc<Model>, b: usize, depth: usize, steps: usize) -> Result<f64> {
    let slots = depth + steps + 2;
    let mut batch = Batch::new(model.clone(), b, b, slots)?;
    let opts = EngineOptions {
        max_slots: slots,
        max_tokens: 1,
        max_logit_rows: 1,
        ..Default::default()
    };
    let mut engines = (0..b)
        .map(|_| batch.sequence(opts.clone()))
        .collect::<Result<Vec<Engine>>>()?;
    for e in &mut engines {
        e.n_cached = depth;
    }
    let vocab = model.config.vocab_size as u32;
    let mut tokens: Vec<u32> = (0..b as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut seconds = 0.0;
    for s in 0..=steps {
        let pos = [(depth + s) as u32];
        let ids: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
        let mut work: Vec<(&mut Engine, SeqStep)> = engines
            .iter_mut()
            .zip(&ids)
            .map(|(e, ids)| {
                let step = SeqStep {
                    ids,
                    positions: &pos,
                    sample: Some((SamplingParams::default(), s as u32)),
                };
                (e, step)
            })
            .collect();
        let t = Instant::now();
        let sampled = batch.step(&mut work)?;
        if s > 0 {
            seconds += t.elapsed().as_secs_f64();
        }
        tokens = sampled.into_iter().map(|t| t.unwrap_or(0)).collect();
    }
    Ok(seconds)
}
