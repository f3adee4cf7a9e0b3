//! Teacher-forced fidelity: one document through the full cache and through
//! every (policy, budget) at once, compared position by position.
//!
//! The runs advance in lockstep, h tokens at a time, so the reference
//! distributions of only one chunk are ever held (h x vocab), whatever the
//! document's length. Each run has its own engine and cache; the weights are
//! shared.

use anyhow::{bail, Result};
use std::sync::Arc;

use super::metrics::{argmax, log_softmax, FidelitySums};
use crate::cache::{BoundedCache, CacheOptions, FeedOutput};
use crate::engine::Engine;
use crate::eviction::oracle::{FutureAttention, Horizon, Oracle};
use crate::eviction::Policy;
use crate::kernels::attn_weights::WeightMode;
use crate::model::Model;

/// One configuration under test.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunConfig {
    pub policy: Policy,
    pub budget: usize,
}

impl RunConfig {
    /// The cache options: `base` (chunk, sinks, recent, policy settings) with
    /// this policy and budget.
    pub fn cache_options(&self, base: &CacheOptions) -> CacheOptions {
        CacheOptions {
            policy: self.policy,
            budget: self.budget,
            ..*base
        }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The step of the oracles' record that puts a row at every refresh of
/// chunk `h` and each of `budgets` (refreshes fall at J + h + k h, so every
/// gcd(h, J) positions); 0 for no budgets.
pub fn refresh_step(budgets: &[usize], h: usize) -> usize {
    match budgets.iter().fold(0, |g, &j| gcd(g, j)) {
        0 => 0,
        g => gcd(g, h),
    }
}

/// The first pass of the oracles: `tokens` through the full cache, `step`
/// tokens at a time, with H2O's accumulated attention weights (averaged over
/// layers and heads) read after every step.
pub fn record_future_attention(
    model: &Arc<Model>,
    tokens: &[u32],
    step: usize,
) -> Result<FutureAttention> {
    if step == 0 {
        bail!("the oracle's record step must be at least 1");
    }
    let layers = model.config.num_layers;
    let mut cache = BoundedCache::new(CacheOptions::new(Policy::Full, 0, step), layers)?;
    let mut opts = cache.engine_options(tokens.len(), step, 1);
    opts.signals.attention_weights = Some(WeightMode::Cumulative);
    let mut engine = Engine::new(model.clone(), opts)?;
    let mut cumulative = vec![vec![0f32; tokens.len()]];
    for (k, piece) in tokens.chunks(step).enumerate() {
        cache.feed(
            &mut engine,
            piece,
            (k * step) as u32,
            FeedOutput::None,
            |_, _| Ok(()),
        )?;
        let mut row = engine.read_slot_attention(k * step + piece.len())?;
        row.resize(tokens.len(), 0.0);
        cumulative.push(row);
    }
    Ok(FutureAttention {
        step,
        len: tokens.len(),
        cumulative,
    })
}

/// One configuration's cache and engine, its last chunk's logits and its
/// sums so far.
struct Run {
    cache: BoundedCache,
    engine: Engine,
    rows: Vec<f32>,
    sums: FidelitySums,
}

/// Runs `tokens` through the full cache and every config; returns the sums of
/// the metrics over the positions t >= C = J + h of each config (none when the
/// document is not longer than C). `progress` gets the number of tokens fed
/// (over all runs, and the oracles' first pass) after every chunk.
pub fn fidelity_document(
    model: &Arc<Model>,
    tokens: &[u32],
    base: &CacheOptions,
    configs: &[RunConfig],
    mut progress: impl FnMut(usize),
) -> Result<Vec<FidelitySums>> {
    let h = base.chunk;
    if h == 0 {
        bail!("--chunk must be at least 1");
    }
    let vocab = model.config.vocab_size;
    let layers = model.config.num_layers;
    let mut full_cache = BoundedCache::new(CacheOptions::new(Policy::Full, 0, h), layers)?;
    let mut full = Engine::new(model.clone(), full_cache.engine_options(tokens.len(), h, h))?;
    // The oracles' first pass, with a row at every refresh of every budget.
    let oracle_budgets: Vec<usize> = configs
        .iter()
        .filter(|c| c.policy.needs_future())
        .map(|c| c.budget)
        .collect();
    let future = match refresh_step(&oracle_budgets, h) {
        0 => None,
        step => Some(Arc::new(record_future_attention(model, tokens, step)?)),
    };
    if future.is_some() {
        progress(tokens.len());
    }
    let mut runs = vec![];
    for c in configs {
        let opts = c.cache_options(base);
        opts.validate()?;
        let cache = match (c.policy, &future) {
            (Policy::Oracle | Policy::OracleRest, Some(future)) => {
                let horizon = match c.policy {
                    Policy::Oracle => Horizon::Next(h),
                    _ => Horizon::Rest,
                };
                let oracle = Oracle {
                    future: future.clone(),
                    horizon,
                };
                BoundedCache::with_scorer(opts, Box::new(oracle))?
            }
            _ => BoundedCache::new(opts, layers)?,
        };
        let engine = Engine::new(model.clone(), cache.engine_options(tokens.len(), h, h))?;
        runs.push(Run {
            cache,
            engine,
            rows: vec![0f32; h * vocab],
            sums: FidelitySums::default(),
        });
    }
    let mut full_rows = vec![0f32; h * vocab];
    for (piece_index, piece) in tokens.chunks(h).enumerate() {
        let p0 = piece_index * h;
        full_cache.feed(&mut full, piece, p0 as u32, FeedOutput::All, |first, l| {
            full_rows[first * vocab..first * vocab + l.len()].copy_from_slice(l);
            Ok(())
        })?;
        // Reference log-probabilities, computed once for every run.
        let reference: Vec<(Vec<f64>, usize)> = (0..piece.len())
            .map(|i| {
                let row = &full_rows[i * vocab..(i + 1) * vocab];
                (log_softmax(row), argmax(row))
            })
            .collect();
        // Each run's comparison (two exponentials per vocabulary entry and
        // position) goes to a thread of its own while the GPU runs the next
        // configuration (on a fast GPU it could otherwise rival the runs).
        std::thread::scope(|scope| -> Result<()> {
            for run in runs.iter_mut() {
                let Run {
                    cache,
                    engine,
                    rows,
                    sums,
                } = run;
                // Before its first refresh a run is the full run: no logits
                // to compute or read back (the last layer's norm and the LM
                // head are a fifth of SmolLM2's weights).
                let first_compared = cache.opts.capacity();
                if p0 + piece.len() <= first_compared {
                    cache.feed(engine, piece, p0 as u32, FeedOutput::None, |_, _| Ok(()))?;
                    continue;
                }
                cache.feed(engine, piece, p0 as u32, FeedOutput::All, |first, l| {
                    rows[first * vocab..first * vocab + l.len()].copy_from_slice(l);
                    Ok(())
                })?;
                let (rows, reference) = (&*rows, &reference);
                scope.spawn(move || {
                    for (i, (lp, top)) in reference.iter().enumerate() {
                        let t = p0 + i;
                        if t >= first_compared {
                            let row = &rows[i * vocab..(i + 1) * vocab];
                            sums.add_reference(lp, *top, row, tokens.get(t + 1).copied());
                        }
                    }
                });
            }
            Ok(())
        })?;
        progress(piece.len() * (1 + runs.len()));
    }
    Ok(runs.into_iter().map(|r| r.sums).collect())
}
