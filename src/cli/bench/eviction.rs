//! `sieve bench --policies`: refresh latency at given cache sizes and decode
//! speed with eviction against the full cache.

use anyhow::{bail, Result};
use serde_json::json;
use std::time::Instant;

use sieve::cache::{BoundedCache, CacheOptions, FeedOutput, Granularity};
use sieve::engine::{Engine, StepIds, Submitted};
use sieve::eviction::Policy;
use sieve::kernels::sample::SamplingParams;
use sieve::model::Model;

/// A `--policies` entry: a policy at a granularity, `name` (one kept set)
/// or `name@layer` / `name@head` (a set per layer or per (layer, KV head)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchPolicy {
    pub policy: Policy,
    pub granularity: Granularity,
}

impl BenchPolicy {
    pub fn parse(entry: &str) -> Result<Self> {
        let (name, granularity) = entry.split_once('@').unwrap_or((entry, "token"));
        Ok(BenchPolicy {
            policy: Policy::parse(name)?,
            granularity: Granularity::parse(granularity)?,
        })
    }

    /// As `--policies` names it.
    pub fn name(&self) -> String {
        match self.granularity {
            Granularity::Token => self.policy.name().to_string(),
            g => format!("{}@{}", self.policy.name(), g.name()),
        }
    }

    pub fn is_full(&self) -> bool {
        self.policy == Policy::Full
    }

    /// Its cache options at budget J and chunk h (recent 64, at most J / 4).
    pub fn options(&self, budget: usize, chunk: usize) -> CacheOptions {
        CacheOptions {
            recent: 64.min(budget / 4),
            granularity: self.granularity,
            ..CacheOptions::new(self.policy, budget, chunk)
        }
    }
}

pub fn cache_for(
    model: &Model,
    policy: BenchPolicy,
    budget: usize,
    chunk: usize,
) -> Result<BoundedCache> {
    BoundedCache::new(policy.options(budget, chunk), model.config.num_layers)
}

/// Time of one refresh at cache size C: the cache is filled by a real prefill
/// under the policy (so its state is real), and the second refresh is timed.
pub fn refresh(
    model: &std::sync::Arc<Model>,
    policies: &[BenchPolicy],
    sizes: &[usize],
    chunk: usize,
    step_ms: f64,
) -> Result<Vec<serde_json::Value>> {
    let mut out = vec![];
    if policies.is_empty() || sizes.iter().all(|&c| c == 0) {
        return Ok(out);
    }
    println!("| policy | cache size | refresh ms | x decode step ({step_ms:.1} ms) |");
    println!("|---|---|---|---|");
    let vocab = model.config.vocab_size;
    for &c in sizes.iter().filter(|&&c| c > 0) {
        if c <= chunk {
            anyhow::bail!("--refresh-sizes {c}: a cache size must exceed --chunk {chunk}");
        }
        let ids: Vec<u32> = (0..c).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        for &policy in policies.iter().filter(|p| !p.is_full()) {
            let mut cache = cache_for(model, policy, c - chunk, chunk)?;
            let mut e = Engine::new(model.clone(), cache.engine_options(c, 256, 1))?;
            // Fill to C, refresh once (the first use of each kernel pays for its
            // compilation), refill with h tokens, then time the second refresh.
            let more: Vec<u32> = ids[..chunk].to_vec();
            cache.feed(&mut e, &ids, 0, FeedOutput::None, |_, _| Ok(()))?;
            cache.feed(&mut e, &more, c as u32, FeedOutput::None, |_, _| Ok(()))?;
            e.sync()?;
            let t = Instant::now();
            cache.refresh(&mut e, (c + chunk) as u32)?;
            e.sync()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            println!(
                "| {} | {c} | {ms:.1} | {:.2} |",
                policy.name(),
                ms / step_ms
            );
            out.push(json!({"policy": policy.name(), "cache_size": c, "refresh_ms": ms, "decode_steps": ms / step_ms}));
        }
    }
    Ok(out)
}

/// Decode speed generating `n` tokens with each policy at budget J, against the
/// full cache, from the same short prompt (refreshes included in the time):
/// one step at a time, and with each step submitted ahead of the last one's
/// token where the cache has room without a refresh (as `Session::generate`
/// does), in alternating order. Both give the same tokens; a difference is an
/// error.
pub fn decode(
    model: &std::sync::Arc<Model>,
    policies: &[BenchPolicy],
    budget: usize,
    chunk: usize,
    n: usize,
) -> Result<Vec<serde_json::Value>> {
    let mut out = vec![];
    if n == 0 || policies.is_empty() {
        return Ok(out);
    }
    println!("| policy | budget | generated | decode tok/s, one step at a time | submitted ahead | ratio |");
    println!("|---|---|---|---|---|---|");
    let prompt: Vec<u32> = (0..32)
        .map(|i| ((i * 7919 + 13) % model.config.vocab_size) as u32)
        .collect();
    for (k, &policy) in policies.iter().enumerate() {
        let mut cache = cache_for(model, policy, budget, chunk)?;
        let mut e = Engine::new(
            model.clone(),
            cache.engine_options(prompt.len() + n + 1, 256, 1),
        )?;
        let mut timed = |ahead: bool| -> Result<(f64, Vec<u32>)> {
            cache.reset(&mut e);
            let first = cache
                .feed(&mut e, &prompt, 0, GREEDY, |_, _| Ok(()))?
                .unwrap_or(0);
            let t = Instant::now();
            let ids = generate(&mut cache, &mut e, first, prompt.len() as u32, n, ahead)?;
            Ok((n as f64 / t.elapsed().as_secs_f64(), ids))
        };
        // The first run warms up what the second finds warm: alternate.
        let ((one_tps, one_ids), (ahead_tps, ahead_ids)) = if k % 2 == 0 {
            (timed(false)?, timed(true)?)
        } else {
            let ahead = timed(true)?;
            (timed(false)?, ahead)
        };
        if one_ids != ahead_ids {
            bail!(
                "policy {}: decode with steps submitted ahead gave other tokens than one step at a time",
                policy.name()
            );
        }
        let j = if policy.is_full() {
            "-".to_string()
        } else {
            budget.to_string()
        };
        println!(
            "| {} | {j} | {n} | {one_tps:.2} | {ahead_tps:.2} | {:.2} |",
            policy.name(),
            ahead_tps / one_tps
        );
        out.push(
            json!({"policy": policy.name(), "budget": budget, "generated": n,
            "tokens_per_second": one_tps, "tokens_per_second_ahead": ahead_tps}),
        );
    }
    Ok(out)
}

const GREEDY: FeedOutput = FeedOutput::Sample(SamplingParams::GREEDY, 0);

/// Greedy decode of `n` tokens, feeding `first` at `position` first; with
/// `ahead`, each step is submitted before the previous one's token is read
/// back wherever no refresh comes between them.
fn generate(
    cache: &mut BoundedCache,
    e: &mut Engine,
    first: u32,
    position: u32,
    n: usize,
    ahead: bool,
) -> Result<Vec<u32>> {
    let mut ids = vec![first];
    let mut in_flight: Option<Submitted> = None;
    for i in 0..n {
        let (next, pos) = (ids[i], position + i as u32);
        let fed = match in_flight.take() {
            Some(step) => step,
            None if ahead => {
                cache.make_room(e, pos)?;
                e.submit(StepIds::Host(&[next]), &[pos], GREEDY.step_output(1))?
            }
            None => {
                let t = cache.feed(e, &[next], pos, GREEDY, |_, _| Ok(()))?;
                ids.push(t.unwrap_or(0));
                continue;
            }
        };
        if ahead && i + 1 < n && e.can_chain() && cache.fits_without_refresh(e, 1) {
            let out = GREEDY.step_output(1);
            in_flight = Some(e.submit(StepIds::LastSampled, &[pos + 1], out)?);
        }
        let sampled = e.complete(fed)?;
        cache.record_fed(e, next, pos)?;
        ids.push(sampled.unwrap_or(0));
    }
    Ok(ids)
}
