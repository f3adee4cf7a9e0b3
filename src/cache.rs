//! The bounded KV cache: budget J, chunk h, protected sinks and recent entries,
//! and the exact refresh schedule of SPEC.md section 3.
//!
//! Think of tokens as appended one at a time: when a token arrives and the
//! cache holds C = J + h entries, a refresh scores the unprotected entries,
//! keeps the J best (protected ones included) and compacts the cache in place
//! on the GPU; then the token is appended. [`BoundedCache::feed`] batches this
//! exactly: the first C tokens as one batch, then batches of h, each preceded by
//! a refresh (batches larger than the engine's step are split into steps, which
//! gives the same result because attention is causal).

use crate::error::{bail_kind, ErrorKind};
use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::engine::{Engine, EngineOptions, Signals, StepOutput};
use crate::eviction::{Policy, PolicyParams, RefreshContext, Scorer, Slot};
pub use crate::kernels::compact::Granularity;
use crate::kernels::sample::SamplingParams;

/// Settings of a bounded cache (`--budget`, `--chunk`, `--sinks`, `--recent`, `--policy`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheOptions {
    /// J: entries kept after a refresh.
    pub budget: usize,
    /// h: tokens processed between refreshes.
    pub chunk: usize,
    /// Entries at positions 0..sinks are always kept.
    pub sinks: usize,
    /// The `recent` newest entries are always kept.
    pub recent: usize,
    pub policy: Policy,
    /// Seed of the `random` policy.
    pub seed: u64,
    /// EpiKV rolling z-score window W.
    pub epikv_window: usize,
    /// EpiKV: average z over whole layer bands instead of two representative layers.
    pub epikv_bands: bool,
    /// EpiKV: explicit (A, B) layers, 1-based.
    pub epikv_layers: Option<(usize, usize)>,
    /// H2O/TOVA: hold the full attention weight matrix as eager attention does.
    pub materialize: bool,
    /// LagKV's partition size (kvpress's `lag_size`).
    pub lag_size: usize,
    /// SnapKV's observation window (kvpress's `window_size`).
    pub snapkv_window: usize,
    /// Expected Attention's query window.
    pub ea_window: usize,
    /// Expected Attention's future positions (kvpress's `n_future_positions`).
    pub ea_future: usize,
    /// One kept set for the cache, or one per layer or per (layer, KV head).
    pub granularity: Granularity,
}

/// The largest LagKV partition: each workgroup ranks a partition in
/// lag^2 / 64 steps per invocation.
pub const MAX_LAG: usize = 4096;

impl CacheOptions {
    pub fn new(policy: Policy, budget: usize, chunk: usize) -> Self {
        CacheOptions {
            budget,
            chunk,
            sinks: 4,
            recent: 64,
            policy,
            seed: 0,
            epikv_window: 128,
            epikv_bands: false,
            epikv_layers: None,
            materialize: false,
            lag_size: 128,
            snapkv_window: 64,
            ea_window: 64,
            ea_future: 512,
            granularity: Granularity::Token,
        }
    }

    /// kvpress's compression of a prompt whose context is its first
    /// `n_context` tokens and whose question and answer take `after` more:
    /// these options (policy, sinks, recent, parameters) with the budget
    /// (1 - `ratio`) x `n_context` and a chunk that makes the cache fill
    /// exactly with the context, so the context is read whole and cut
    /// once, when the question's first token arrives. kvpress never
    /// compresses again while answering: a ratio that leaves too little
    /// room for the question and answer is refused.
    pub fn compressing(self, ratio: f64, n_context: usize, after: usize) -> Result<Self> {
        if !(ratio > 0.0 && ratio < 1.0) {
            bail!("compression ratio {ratio} is not between 0 and 1 (exclusive)");
        }
        let budget = ((n_context as f64) * (1.0 - ratio)).floor().max(1.0) as usize;
        let chunk = n_context.saturating_sub(budget).max(1);
        if after > chunk {
            bail!(
                "compression ratio {ratio}: cutting the {n_context}-token context to {budget} leaves room for {chunk} more tokens; the question and answer need {after} (a larger ratio, a longer context or fewer new tokens)"
            );
        }
        let opts = CacheOptions {
            budget,
            chunk,
            ..self
        };
        opts.validate()
            .with_context(|| format!("compression ratio {ratio} on a {n_context}-token context"))?;
        Ok(opts)
    }

    /// What the policy's scorer takes of these options.
    pub fn policy_params(&self) -> PolicyParams {
        PolicyParams {
            seed: self.seed,
            epikv_window: self.epikv_window,
            epikv_bands: self.epikv_bands,
            epikv_layers: self.epikv_layers,
            sinks: self.sinks,
            lag_size: self.lag_size,
            snapkv_window: self.snapkv_window,
            ea_window: self.ea_window,
            ea_future: self.ea_future,
        }
    }

    /// C = J + h, the most entries the cache ever holds.
    pub fn capacity(&self) -> usize {
        self.budget + self.chunk
    }

    pub fn validate(&self) -> Result<()> {
        if self.chunk == 0 {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "cache chunk must be at least 1 (tokens processed between refreshes)"
            );
        }
        let protected = self
            .sinks
            .checked_add(self.recent)
            .filter(|&p| p < usize::MAX);
        let Some(protected) = protected else {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "cache sinks {} + recent {} overflows; each is a count of cache entries",
                self.sinks,
                self.recent
            );
        };
        if self.budget.checked_add(self.chunk).is_none() {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "cache budget {} + chunk {} overflows; the cache holds budget + chunk entries",
                self.budget,
                self.chunk
            );
        }
        use crate::kernels::query_scores::{MAX_FUTURE, MAX_WINDOW};
        let bounded = [
            ("lag_size (LagKV's partition)", self.lag_size, MAX_LAG),
            ("snapkv_window (queries)", self.snapkv_window, MAX_WINDOW),
            ("ea_window (queries)", self.ea_window, MAX_WINDOW),
            ("ea_future (positions)", self.ea_future, MAX_FUTURE),
        ];
        for (name, value, most) in bounded {
            if !(1..=most).contains(&value) {
                bail_kind!(
                    ErrorKind::InvalidOptions,
                    "cache {name} is {value}; it must be 1 to {most}"
                );
            }
        }
        // SnapKV scores the entries older than its window with one range
        // of slots for every keep list: the window's positions must be
        // present in each, which they are when the window lies within the
        // protected recent entries and the chunk since the last refresh.
        let snap_reach = self.recent.saturating_add(self.chunk);
        if self.policy == Policy::Snapkv
            && self.granularity != Granularity::Token
            && self.snapkv_window > snap_reach
        {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "cache snapkv_window {} exceeds recent {} + chunk {}: at granularity {} every keep list must hold the window's entries",
                self.snapkv_window,
                self.recent,
                self.chunk,
                self.granularity.name()
            );
        }
        if self.budget <= protected {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "cache budget {} must exceed sinks {} + recent {} (the protected entries), so that the policy ranks at least one entry",
                self.budget,
                self.sinks,
                self.recent
            );
        }
        Ok(())
    }
}

/// One refresh, in the layout of ../shared/golden/eviction/*.scores.json.
#[derive(Clone, Debug, Serialize)]
pub struct RefreshRecord {
    pub refresh: usize,
    pub before_position: u32,
    pub present: Vec<u32>,
    pub protected: Vec<u32>,
    pub unprotected: Vec<u32>,
    pub scores: Vec<f64>,
    pub kept: Vec<u32>,
    /// At layer or head granularity, each keep list's kept positions
    /// (`present`, `unprotected`, `scores` and `kept` are then list 0's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_lists: Option<Vec<Vec<u32>>>,
}

/// What `feed` computes for the tokens it processes.
#[derive(Clone, Copy, Debug)]
pub enum FeedOutput {
    /// Nothing (prefill of a prompt whose logits are not needed).
    None,
    /// Logits of every token: `on_logits` gets (index of the first token of the
    /// step within the fed tokens, `[n, vocab]` logits).
    All,
    /// Logits of the last fed token only (read with `Engine::read_logits(1)`).
    Last,
    /// Sample a token after the last fed token.
    Sample(SamplingParams, u32),
}

impl FeedOutput {
    /// The engine's output for a step of `n` tokens that ends the feed.
    pub fn step_output(self, n: usize) -> StepOutput {
        match self {
            FeedOutput::None => StepOutput::NONE,
            FeedOutput::All => StepOutput {
                logit_row0: 0,
                n_logits: n,
                sample: None,
            },
            FeedOutput::Last => StepOutput::last(n),
            FeedOutput::Sample(params, counter) => StepOutput {
                sample: Some((params, counter)),
                ..StepOutput::last(n)
            },
        }
    }

    /// The engine's output for a step of `n` tokens before the feed's last.
    fn before_last(self, n: usize) -> StepOutput {
        match self {
            FeedOutput::All => self.step_output(n),
            _ => StepOutput::NONE,
        }
    }
}

pub struct BoundedCache {
    pub opts: CacheOptions,
    scorer: Option<Box<dyn Scorer>>,
    /// The entries in the cache, in slot order: those of keep list 0 at
    /// layer or head granularity.
    pub slots: Vec<Slot>,
    /// At layer or head granularity, the positions of each keep list's
    /// entries in slot order (list 0's are `slots`'); empty at token
    /// granularity. Every list holds as many entries, the newest and the
    /// sinks in the same slots.
    pub lists: Vec<Vec<u32>>,
    /// Tokens fed since the last reset, evicted ones included.
    fed: usize,
    /// Every refresh so far (kept only when `record` is on).
    pub trace: Vec<RefreshRecord>,
    pub record: bool,
    refreshes: usize,
    /// The model's layers, to build the policy's scorer afresh on `reset`;
    /// None for a cache given its scorer (`with_scorer`).
    num_layers: Option<usize>,
}

impl BoundedCache {
    /// A cache for a model of `num_layers` layers.
    pub fn new(opts: CacheOptions, num_layers: usize) -> Result<Self> {
        let scorer = if opts.policy == Policy::Full {
            None
        } else {
            opts.validate()?;
            Some(opts.policy.scorer(&opts.policy_params(), num_layers)?)
        };
        Ok(BoundedCache {
            opts,
            scorer,
            slots: vec![],
            lists: vec![],
            fed: 0,
            trace: vec![],
            record: false,
            refreshes: 0,
            num_layers: Some(num_layers),
        })
    }

    /// A cache ranking with `scorer` instead of the policy's own (the oracles,
    /// whose scorer holds the document's future).
    pub fn with_scorer(opts: CacheOptions, scorer: Box<dyn Scorer>) -> Result<Self> {
        opts.validate()?;
        Ok(BoundedCache {
            opts,
            scorer: Some(scorer),
            slots: vec![],
            lists: vec![],
            fed: 0,
            trace: vec![],
            record: false,
            refreshes: 0,
            num_layers: None,
        })
    }

    /// Entries the engine must hold: C for an evicting policy, None for `full`.
    pub fn capacity(&self) -> Option<usize> {
        self.scorer.as_ref().map(|_| self.opts.capacity())
    }

    /// Engine options for this cache: C slots for an evicting policy (else
    /// `full_slots`), the compaction budget, and what the policy needs
    /// computed. `full_slots` is the context the caller states (a session's
    /// max_context, an evaluation's sequence), which is also the farthest
    /// position an evicting engine is taken to reach (LongRoPE's choice of
    /// factors, so that a bounded run and the full one it is compared with
    /// rotate alike).
    pub fn engine_options(
        &self,
        full_slots: usize,
        max_tokens: usize,
        max_logit_rows: usize,
    ) -> EngineOptions {
        let slots = self.capacity().unwrap_or(full_slots);
        EngineOptions {
            max_slots: slots,
            max_tokens: max_tokens.min(slots).max(1),
            max_logit_rows,
            max_keep: self.capacity().map(|_| self.opts.budget),
            granularity: match self.capacity() {
                Some(_) => self.opts.granularity,
                None => Granularity::Token,
            },
            max_position: Some(full_slots),
            signals: Signals {
                materialize: self.opts.materialize,
                ..self.scorer.as_ref().map(|s| s.needs()).unwrap_or_default()
            },
            ..Default::default()
        }
    }

    /// Keeps the first `n` entries of a full cache and forgets the rest (a
    /// prompt that shares only them with what it holds). A bounded cache
    /// cannot: its entries are not the first ones.
    pub fn truncate(&mut self, engine: &mut Engine, n: usize) -> Result<()> {
        if self.capacity().is_some() || n > self.slots.len() || engine.n_cached != self.slots.len()
        {
            bail!(
                "only a full cache in step with its engine can keep its first {n} of {} entries",
                self.slots.len()
            );
        }
        self.slots.truncate(n);
        self.fed = n;
        engine.n_cached = n;
        Ok(())
    }

    /// Forgets the contents (and the engine's), and what the policy learnt
    /// from them (EpiKV's rolling statistics, the sink guards' jumps): its
    /// scorer is built afresh (a scorer given to `with_scorer` is kept).
    pub fn reset(&mut self, engine: &mut Engine) {
        engine.reset();
        self.slots.clear();
        self.lists.clear();
        self.fed = 0;
        self.trace.clear();
        self.refreshes = 0;
        if let (Some(layers), Some(_)) = (self.num_layers, &self.scorer) {
            // It was built from these options in `new`, so it builds again.
            if let Ok(fresh) = self.opts.policy.scorer(&self.opts.policy_params(), layers) {
                self.scorer = Some(fresh);
            }
        }
    }

    /// Scores, ranks and compacts: the cache goes from C entries to J (in
    /// each keep list).
    pub fn refresh(&mut self, engine: &mut Engine, before_position: u32) -> Result<()> {
        let o = self.opts;
        let n = self.slots.len();
        let recent_from = n.saturating_sub(o.recent);
        // The same slots in every list: the sinks are never evicted and the
        // newest entries were appended to all.
        let protected: Vec<usize> = (0..n)
            .filter(|&i| (self.slots[i].position as usize) < o.sinks || i >= recent_from)
            .collect();
        let unprotected: Vec<usize> = (0..n).filter(|i| !protected.contains(i)).collect();
        let ctx = RefreshContext {
            refresh: self.refreshes,
            before_position,
            present: &self.slots,
            unprotected: &unprotected,
        };
        if engine.opts.granularity != o.granularity {
            bail!(
                "the engine keeps sets per {:?}, the cache per {:?}: build the engine with BoundedCache::engine_options",
                engine.opts.granularity,
                o.granularity
            );
        }
        let scorer = self.scorer.as_mut().context("refresh without a scorer")?;
        let n_lists = engine.keep_lists();
        // Each list's scores of its unprotected entries: one set for all
        // (a policy that scores tokens, or token granularity), or each
        // (layer, KV head)'s own scores, averaged over a layer's heads at
        // layer granularity.
        let heads = match o.granularity {
            Granularity::Token => None,
            _ => scorer.score_heads(engine, &ctx)?,
        };
        let list_scores: Vec<Vec<f64>> = match heads {
            None => vec![scorer.score(engine, &ctx)?],
            Some(per_head) => {
                let cells = per_head.len() / n.max(1);
                if per_head.len() != cells * n || !cells.is_multiple_of(n_lists) {
                    bail!(
                        "policy {} returned {} scores per head for {n} entries and {n_lists} lists",
                        o.policy.name(),
                        per_head.len()
                    );
                }
                let per_list = cells / n_lists;
                (0..n_lists)
                    .map(|l| {
                        let rows = &per_head[l * per_list * n..(l + 1) * per_list * n];
                        (unprotected.iter())
                            .map(|&i| {
                                let sum: f64 = (0..per_list).map(|h| rows[h * n + i] as f64).sum();
                                sum / per_list as f64
                            })
                            .collect()
                    })
                    .collect()
            }
        };
        for scores in &list_scores {
            if scores.len() != unprotected.len() {
                bail!(
                    "policy {} returned {} scores for {} entries",
                    o.policy.name(),
                    scores.len(),
                    unprotected.len()
                );
            }
        }
        let n_keep = o
            .budget
            .saturating_sub(protected.len())
            .min(unprotected.len());
        let list_positions = |l: usize| -> Vec<u32> {
            match self.lists.get(l) {
                Some(p) => p.clone(),
                None => self.slots.iter().map(|s| s.position).collect(),
            }
        };
        // Each list's kept slots (one list's scores serve them all).
        let keeps: Vec<Vec<usize>> = (0..n_lists)
            .map(|l| {
                let scores = &list_scores[l.min(list_scores.len() - 1)];
                keep_best(&protected, &unprotected, scores, &list_positions(l), n_keep)
            })
            .collect();
        let keep_slots: Vec<Vec<u32>> = (keeps.iter())
            .map(|k| k.iter().map(|&i| i as u32).collect())
            .collect();
        let lists: Vec<&[u32]> = keep_slots.iter().map(|k| k.as_slice()).collect();
        engine.compact_lists(&lists)?;
        let keep = &keeps[0];
        if self.record {
            let pos = |v: &[usize]| {
                v.iter()
                    .map(|&i| self.slots[i].position)
                    .collect::<Vec<u32>>()
            };
            self.trace.push(RefreshRecord {
                refresh: self.refreshes,
                before_position,
                present: pos(&(0..n).collect::<Vec<_>>()),
                protected: pos(&protected),
                unprotected: pos(&unprotected),
                scores: list_scores[0].clone(),
                kept: pos(keep),
                kept_lists: (o.granularity != Granularity::Token).then(|| {
                    (keeps.iter().enumerate())
                        .map(|(l, k)| {
                            let p = list_positions(l);
                            k.iter().map(|&i| p[i]).collect()
                        })
                        .collect()
                }),
            });
        }
        if o.granularity != Granularity::Token {
            self.lists = (keeps.iter().enumerate())
                .map(|(l, k)| {
                    let p = list_positions(l);
                    k.iter().map(|&i| p[i]).collect()
                })
                .collect();
        }
        self.slots = keep.iter().map(|&i| self.slots[i]).collect();
        self.refreshes += 1;
        Ok(())
    }

    /// Processes `tokens` at `first_position..` following the refresh schedule.
    /// Returns the sampled token for `FeedOutput::Sample`.
    pub fn feed(
        &mut self,
        engine: &mut Engine,
        tokens: &[u32],
        first_position: u32,
        out: FeedOutput,
        mut on_logits: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<Option<u32>> {
        let mut done = 0;
        let mut sampled = None;
        while done < tokens.len() {
            let room = match self.capacity() {
                Some(c) => {
                    self.make_room(engine, first_position + done as u32)?;
                    c - self.slots.len()
                }
                None => engine.opts.max_slots.saturating_sub(self.slots.len()),
            };
            if room == 0 {
                bail_kind!(
                    ErrorKind::PromptTooLong,
                    "the context is full: {} tokens in a cache of {} (a bounded cache with a KV budget evicts; or a longer max_context)",
                    self.slots.len(),
                    engine.opts.max_slots
                );
            }
            let n = room.min(engine.max_step_tokens()).min(tokens.len() - done);
            let ids = &tokens[done..done + n];
            let pos: Vec<u32> = (0..n as u32)
                .map(|j| first_position + done as u32 + j)
                .collect();
            let last = done + n == tokens.len();
            let step_out = if last {
                out.step_output(n)
            } else {
                out.before_last(n)
            };
            sampled = engine.step(ids, &pos, step_out)?;
            if let Some(scorer) = self.scorer.as_mut() {
                scorer.observe(engine, &pos)?;
            }
            if let FeedOutput::All = out {
                on_logits(done, &engine.read_logits(n)?)?;
            }
            self.append(ids, &pos);
            self.fed += n;
            done += n;
        }
        Ok(sampled)
    }

    /// Refreshes when the cache is full (C entries), before the token at
    /// `before_position` arrives, as `feed` does; every step fed must have
    /// completed (the policy scores what they wrote).
    pub fn make_room(&mut self, engine: &mut Engine, before_position: u32) -> Result<()> {
        match self.capacity() {
            Some(c) if self.slots.len() >= c => self.refresh(engine, before_position),
            _ => Ok(()),
        }
    }

    /// Whether the engine holds exactly this cache's entries and `tokens`
    /// tokens were fed since the reset. False after a step that ran but was
    /// not recorded (it failed on its logits or signals), or after a chunk
    /// that failed part way, some of its steps fed.
    pub fn in_step_with(&self, engine: &Engine, tokens: usize) -> bool {
        engine.n_cached == self.slots.len() && self.fed == tokens
    }

    /// Whether `n` more tokens fit the engine's cache without a refresh,
    /// counting the steps it has in flight: where a decode step can be
    /// submitted ahead (`Engine::submit`, `StepIds::LastSampled`) behind
    /// the one in flight; otherwise it waits, and `make_room` comes first.
    pub fn fits_without_refresh(&self, engine: &Engine, n: usize) -> bool {
        self.capacity().is_none_or(|c| engine.n_cached + n <= c)
    }

    /// Records a one-token step that ran outside `feed` (a decode step
    /// submitted ahead, `Engine::submit`, once completed), in order: the
    /// entry joins the cache and the policy observes the step, as in `feed`.
    pub fn record_fed(&mut self, engine: &Engine, token: u32, position: u32) -> Result<()> {
        self.record_step(engine, &[token], &[position])
    }

    /// Records a step of `tokens` at `positions` that ran outside `feed`
    /// (a batched step, `engine::Batch`), as `feed` records its steps.
    pub fn record_step(
        &mut self,
        engine: &Engine,
        tokens: &[u32],
        positions: &[u32],
    ) -> Result<()> {
        self.append(tokens, positions);
        self.fed += tokens.len();
        match self.scorer.as_mut() {
            Some(scorer) => scorer.observe(engine, positions),
            None => Ok(()),
        }
    }

    /// The entries of a step join every keep list.
    fn append(&mut self, tokens: &[u32], positions: &[u32]) {
        self.slots.extend(
            tokens
                .iter()
                .zip(positions)
                .map(|(&token, &position)| Slot { position, token }),
        );
        for list in &mut self.lists {
            list.extend_from_slice(positions);
        }
    }

    /// Tokens that fit the cache now (after `make_room`): its capacity, or
    /// the engine's slots for the full cache, less what it holds.
    pub fn room(&self, engine: &Engine) -> usize {
        let capacity = self.capacity().unwrap_or(engine.opts.max_slots);
        capacity.saturating_sub(self.slots.len())
    }

    /// Writes the refresh records as JSON (atomically).
    pub fn write_trace(&self, path: &std::path::Path) -> Result<()> {
        crate::files::write_atomic(path, serde_json::to_string(&self.trace)?.as_bytes())
    }
}

/// The kept entries (indices, ascending) of one keep list: the protected
/// ones and the `n_keep` best unprotected, ranked by score descending, then
/// the later position first (ties keep the later entry).
fn keep_best(
    protected: &[usize],
    unprotected: &[usize],
    scores: &[f64],
    positions: &[u32],
    n_keep: usize,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..unprotected.len()).collect();
    order.sort_by(|&a, &b| {
        scores[b]
            .partial_cmp(&scores[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(positions[unprotected[b]].cmp(&positions[unprotected[a]]))
    });
    let mut keep: Vec<usize> = protected.to_vec();
    keep.extend(order[..n_keep].iter().map(|&i| unprotected[i]));
    keep.sort_unstable();
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_errors_name_the_option() {
        let mut o = CacheOptions::new(Policy::Window, 68, 16);
        assert!(o.validate().unwrap_err().to_string().contains("budget 68"));
        o.budget = 69;
        assert!(o.validate().is_ok());
        o.chunk = 0;
        assert!(o.validate().unwrap_err().to_string().contains("chunk"));
        assert!(Policy::parse("lru")
            .unwrap_err()
            .to_string()
            .contains("known: full, window"));
    }
}
