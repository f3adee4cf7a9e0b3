//! Teacher-forced fidelity: one document through the full cache and through
//! every (policy, budget) at once, compared position by position.
//!
//! The runs advance in lockstep, h tokens at a time, so the reference
//! distributions of only one chunk are ever held (h x vocab), whatever the
//! document's length. Each run has its own engine and cache; runs step
//! together in batches (`engine::Batch`), reading the weights once.

use anyhow::{bail, Result};
use std::sync::Arc;

use super::metrics::{argmax, log_softmax, FidelitySums};
use crate::cache::{BoundedCache, CacheOptions, FeedOutput};
use crate::engine::{Batch, Engine, SeqStep};
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

/// One run (the full cache, or a configuration): its cache and engine,
/// its last chunk's logits, the first position it is compared at, and its
/// sums so far.
struct Run {
    cache: BoundedCache,
    engine: Engine,
    rows: Vec<f32>,
    first_compared: usize,
    sums: FidelitySums,
}

/// Runs `tokens` through the full cache and every config; returns the sums of
/// the metrics over the positions t >= C = J + h of each config (none when the
/// document is not longer than C). Up to `batch` runs (the full one counts)
/// step together (`engine::Batch`: the weights read once for all of them;
/// 1: each alone). `progress` gets the number of tokens fed (over all runs,
/// and the oracles' first pass) after every chunk.
pub fn fidelity_document(
    model: &Arc<Model>,
    tokens: &[u32],
    base: &CacheOptions,
    configs: &[RunConfig],
    batch: usize,
    mut progress: impl FnMut(usize),
) -> Result<Vec<FidelitySums>> {
    let h = base.chunk;
    if h == 0 {
        bail!("--chunk must be at least 1");
    }
    let vocab = model.config.vocab_size;
    let layers = model.config.num_layers;
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
    let group = batch.clamp(1, configs.len() + 1);
    let mut caches = vec![BoundedCache::new(
        CacheOptions::new(Policy::Full, 0, h),
        layers,
    )?];
    for c in configs {
        let opts = c.cache_options(base);
        opts.validate()?;
        caches.push(match (c.policy, &future) {
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
        });
    }
    // A bounded cache takes J + h slots, more than a short document's.
    let slots = caches
        .iter()
        .map(|c| c.capacity().unwrap_or(tokens.len()))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut stepper = Batch::new(model.clone(), h * group, h * group, slots)?;
    let mut runs = caches
        .into_iter()
        .map(|cache| {
            let engine = stepper.sequence(cache.engine_options(tokens.len(), h, h))?;
            Ok(Run {
                // Before its first refresh a run is the full run: no logits
                // to compute or read back (the last layer's norm and the LM
                // head are a fifth of SmolLM2's weights).
                first_compared: cache.capacity().unwrap_or(0),
                cache,
                engine,
                rows: vec![0f32; h * vocab],
                sums: FidelitySums::default(),
            })
        })
        .collect::<Result<Vec<Run>>>()?;
    for (piece_index, piece) in tokens.chunks(h).enumerate() {
        let p0 = piece_index * h;
        for together in runs.chunks_mut(group) {
            feed_together(&mut stepper, together, piece, p0, vocab)?;
        }
        let (full, runs) = runs.split_first_mut().expect("the full run is first");
        // Reference log-probabilities, computed once for every run.
        let reference: Vec<(Vec<f64>, usize)> = (0..piece.len())
            .map(|i| {
                let row = &full.rows[i * vocab..(i + 1) * vocab];
                (log_softmax(row), argmax(row))
            })
            .collect();
        // Each run's comparison (two exponentials per vocabulary entry and
        // position) on a thread of its own.
        std::thread::scope(|scope| {
            for run in runs.iter_mut() {
                if p0 + piece.len() <= run.first_compared {
                    continue;
                }
                let (rows, sums, first) = (&run.rows, &mut run.sums, run.first_compared);
                let reference = &reference;
                scope.spawn(move || {
                    for (i, (lp, top)) in reference.iter().enumerate() {
                        let t = p0 + i;
                        if t >= first {
                            let row = &rows[i * vocab..(i + 1) * vocab];
                            sums.add_reference(lp, *top, row, tokens.get(t + 1).copied());
                        }
                    }
                });
            }
        });
        progress(piece.len() * (1 + runs.len()));
    }
    Ok(runs.into_iter().skip(1).map(|r| r.sums).collect())
}

/// The most runs that step together with chunk `h`: each keeps the
/// logits of its h rows, and those of a step fit one storage binding; at
/// most `cap`.
pub fn runs_that_fit(model: &Model, h: usize, cap: usize) -> usize {
    let run = (h.max(1) * model.config.vocab_size * 4) as u64;
    ((model.gpu.max_binding / run) as usize).clamp(1, cap.max(1))
}

/// Feeds `piece` (at positions `p0..`) to every run of `runs` in batched
/// steps, each following its refresh schedule (a refresh can fall inside
/// the piece: that run then takes it in two steps), keeping the logits of
/// the rows it is compared at.
fn feed_together(
    batch: &mut Batch,
    runs: &mut [Run],
    piece: &[u32],
    p0: usize,
    vocab: usize,
) -> Result<()> {
    let mut fed = vec![0usize; runs.len()];
    while fed.iter().any(|&f| f < piece.len()) {
        // (run, first token of the piece, tokens, whose logits are kept)
        let mut parts = vec![];
        for (i, run) in runs.iter_mut().enumerate() {
            if fed[i] == piece.len() {
                continue;
            }
            run.cache.make_room(&mut run.engine, (p0 + fed[i]) as u32)?;
            let n = (piece.len() - fed[i])
                .min(run.cache.room(&run.engine))
                .min(run.engine.max_step_tokens());
            if n == 0 {
                bail!("run {i} has no cache room at position {}", p0 + fed[i]);
            }
            let logits = p0 + fed[i] + n > run.first_compared;
            parts.push((i, fed[i], n, logits));
        }
        let positions: Vec<Vec<u32>> = parts
            .iter()
            .map(|&(_, f, n, _)| ((p0 + f) as u32..(p0 + f + n) as u32).collect())
            .collect();
        {
            let mut engines: Vec<Option<&mut Engine>> =
                runs.iter_mut().map(|r| Some(&mut r.engine)).collect();
            let mut work: Vec<(&mut Engine, SeqStep)> = parts
                .iter()
                .zip(&positions)
                .map(|(&(i, f, n, logits), pos)| {
                    let engine = engines[i].take().expect("one part per run");
                    let step = SeqStep {
                        ids: &piece[f..f + n],
                        positions: pos,
                        sample: None,
                        logits,
                    };
                    (engine, step)
                })
                .collect();
            batch.step(&mut work)?;
        }
        let mut row0 = 0;
        for (&(i, f, n, logits), pos) in parts.iter().zip(&positions) {
            let run = &mut runs[i];
            if logits {
                let rows = batch.read_logits(row0..row0 + n)?;
                run.rows[f * vocab..(f + n) * vocab].copy_from_slice(&rows);
            }
            run.cache.record_step(&run.engine, &piece[f..f + n], pos)?;
            fed[i] += n;
            row0 += n;
        }
    }
    Ok(())
}
