//! Many generations on one model, stepped together (continuous batching):
//! sequences join and leave between steps, each step carries one token of
//! every decoding sequence and, with the tokens left of the step's budget,
//! prompt chunks, the shortest prompt first (so a long prompt stalls
//! neither the others' decoding nor a short request's first token), and
//! every sequence keeps its own bounded cache, policy,
//! sampling, stop strings, callback and cancel token. The steps are
//! `engine::Batch` steps: the weights are read once for all sequences.
//!
//! ```no_run
//! use sieve::scheduler::{Scheduler, SchedulerOptions};
//! use sieve::session::{GenerateOptions, Llm};
//! use sieve::tokenizer::Message;
//! let llm = Llm::load(std::path::Path::new("models/smollm2-135m-instruct"), &Default::default())?;
//! let mut scheduler = Scheduler::new(&llm, SchedulerOptions::default())?;
//! for question in ["What is the capital of France?", "Name a prime number."] {
//!     let prompt = llm.chat_prompt(&[Message::new("user", question)])?;
//!     scheduler.add(&prompt, GenerateOptions::default(), None, |piece| {
//!         print!("{piece}");
//!         true
//!     })?;
//! }
//! for (id, generation) in scheduler.run()? {
//!     eprintln!("{id:?}: {} tokens", generation.stats.generated_tokens);
//! }
//! # anyhow::Ok(())
//! ```

use anyhow::Context;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use web_time::Instant;

use crate::cache::{BoundedCache, CacheOptions};
use crate::constraint::ConstraintState;
use crate::engine::{Batch, Engine, EngineOptions, KvCache, SeqStep};
use crate::error::{bail_kind, Error, ErrorKind, Result};
use crate::eviction::Policy;
use crate::kernels::sample::TokenLogprobs;
use crate::model::Model;
use crate::session::{
    CancelToken, GenerateOptions, Generation, GenerationStats, Llm, StopReason, StopText,
};
use crate::tokenizer::Tokenizer;

/// Sizes of a scheduler, fixed when it is made: its KV pool holds
/// `max_sequences` caches of `max_context` slots, allocated once, each lent
/// to one sequence after another.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerOptions {
    /// Most sequences at once.
    pub max_sequences: usize,
    /// Tokens of one step in all (one per decoding sequence, the rest for a
    /// prompt chunk); at least `max_sequences`.
    pub step_tokens: usize,
    /// Cache slots of a sequence with the full cache (its longest context);
    /// a sequence with a bounded cache takes budget + chunk slots, at most
    /// this many.
    pub max_context: usize,
    /// The cache of a sequence added without one of its own (None: full).
    pub cache: Option<CacheOptions>,
    /// Keep a finished sequence's cache (until its place in the pool is
    /// needed) for a later prompt that continues it, such as the next turn
    /// of a conversation: only the new part is fed. The prompt must begin
    /// with all the cache was fed, with the same cache options; when no
    /// cache of the pool is free, a full cache also serves a prompt that
    /// shares only a prefix with it (cut to that prefix).
    pub reuse: bool,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions {
            max_sequences: 8,
            step_tokens: 256,
            max_context: 4096,
            cache: None,
            reuse: false,
        }
    }
}

impl SchedulerOptions {
    /// The most sequences of `max_context` slots whose KV pool fits this
    /// device beside the model's weights (by `Gpu::memory_ceiling`, a bound
    /// rather than the free memory), at most `cap`.
    pub fn sequences_that_fit(model: &Model, max_context: usize, cap: usize) -> usize {
        let one = slot_bytes(model) * max_context.max(1) as u128;
        let free = (model.gpu.memory_ceiling() as u128).saturating_sub(model.weight_bytes as u128);
        (free / one).min(cap as u128) as usize
    }
}

/// A sequence of a [`Scheduler`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceId(pub u64);

/// Many generations stepped together on one model. `Send`: it can live on
/// a worker thread that steps it while requests come and go.
pub struct Scheduler {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    opts: SchedulerOptions,
    batch: Batch,
    /// The KV pool: one cache per sequence the scheduler holds, and
    /// whether a sequence (running or parked) has it.
    pool: Vec<(KvCache, bool)>,
    sequences: Vec<Sequence>,
    /// Finished sequences kept for reuse (`SchedulerOptions::reuse`),
    /// oldest first.
    parked: Vec<Parked>,
    /// Cache entries evicted so far, per policy name.
    evicted: BTreeMap<&'static str, u64>,
    /// Sequences that failed on their own (`take_failed`).
    failed: Vec<(SequenceId, Error)>,
    /// Sequences finished and not yet returned by `step` (kept when a step
    /// fails after they ended).
    done: Vec<(SequenceId, Generation)>,
    next_id: u64,
}

/// A finished sequence's cache, kept for a prompt that continues it.
struct Parked {
    block: usize,
    engine: Engine,
    cache: BoundedCache,
    /// Every token it was fed (position = index).
    tokens: Vec<u32>,
}

/// Steps in a row a prompt may get no token before it goes first (shortest
/// first otherwise); among such overdue prompts the one that waited
/// longest goes first, so none waits for ever, however many short ones
/// arrive (the wait grows with the number of prompts overdue at once).
const PROMPT_WAIT_STEPS: usize = 4;

/// Where a sequence is.
enum Phase {
    /// Reading its prompt: `fed` tokens of it so far.
    Prompt { fed: usize },
    /// Decoding: `next` was sampled and is emitted (and fed) next.
    Decode { next: u32 },
}

struct Sequence {
    id: SequenceId,
    /// Prompt tokens found in a reused cache (not fed again).
    cached: usize,
    /// Its cache in the pool.
    block: usize,
    engine: Engine,
    cache: BoundedCache,
    prompt: Vec<u32>,
    /// Every token fed so far (position = index).
    tokens: Vec<u32>,
    opts: GenerateOptions,
    phase: Phase,
    /// Steps in a row this sequence was reading its prompt and got no
    /// token of the step (see `PROMPT_WAIT_STEPS`).
    waited: usize,
    /// Sampling steps so far (each sampling step's counter).
    steps: u32,
    ids: Vec<u32>,
    text: Option<StopText>,
    on_text: Box<dyn FnMut(&str) -> bool + Send>,
    /// Its constraint, fed each emitted token.
    constraint: Option<ConstraintState>,
    /// Log-probabilities (`GenerateOptions::logprobs`): of the emitted
    /// tokens, and of the one sampled and not yet emitted.
    logprobs: Vec<TokenLogprobs>,
    next_logprobs: Option<TokenLogprobs>,
    cancel: CancelToken,
    started: Instant,
    prefill_seconds: f64,
    decode_started: Option<Instant>,
}

impl Sequence {
    /// Feeds an emitted token to the sequence's constraint; whether that
    /// completed it (the choice after it is then free: the sequence ends
    /// after that step).
    fn accept(&mut self, emitted: u32) -> anyhow::Result<Option<StopReason>> {
        let Some(c) = self.constraint.as_mut() else {
            return Ok(None);
        };
        c.accept(emitted)?;
        Ok(c.is_complete().then_some(StopReason::ConstraintComplete))
    }
}

/// One sequence's part of the next step.
struct Part {
    index: usize,
    ids: Vec<u32>,
    positions: Vec<u32>,
    /// Whether the step samples its next token (decode, or the prompt's last chunk).
    samples: bool,
    /// A stop found when emitting the token this step feeds: it ends after.
    stop_after: Option<StopReason>,
}

impl Scheduler {
    /// A scheduler for `llm`'s model. Errors are [`ErrorKind::InvalidOptions`]
    /// or [`ErrorKind::GpuOutOfMemory`].
    pub fn new(llm: &Llm, opts: SchedulerOptions) -> Result<Scheduler> {
        let build = || -> anyhow::Result<Scheduler> {
            if opts.max_sequences == 0 || opts.step_tokens < opts.max_sequences {
                anyhow::bail!(
                    "a scheduler needs at least one sequence and a step of at least one token per sequence (max_sequences {}, step_tokens {})",
                    opts.max_sequences,
                    opts.step_tokens
                );
            }
            let pool = kv_pool(&llm.model, &opts)?;
            let batch = Batch::new(
                llm.model.clone(),
                opts.step_tokens,
                opts.step_tokens,
                opts.max_context,
            )?;
            Ok(Scheduler {
                model: llm.model.clone(),
                tokenizer: llm.tokenizer.clone(),
                opts,
                batch,
                pool,
                sequences: vec![],
                parked: vec![],
                evicted: BTreeMap::new(),
                failed: vec![],
                done: vec![],
                next_id: 0,
            })
        };
        build().map_err(|e| Error::classify(e, ErrorKind::InvalidOptions))
    }

    /// Sequences not finished.
    pub fn active(&self) -> usize {
        self.sequences.len()
    }

    /// Cache entries the running and parked sequences hold.
    pub fn kv_entries(&self) -> usize {
        let running = self.sequences.iter().map(|s| s.cache.slots.len());
        running
            .chain(self.parked.iter().map(|p| p.cache.slots.len()))
            .sum()
    }

    /// Cache entries evicted so far, per policy name.
    pub fn evicted(&self) -> &BTreeMap<&'static str, u64> {
        &self.evicted
    }

    /// Finished sequences whose caches are kept for reuse.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// The sequences not finished, oldest first.
    pub fn sequences(&self) -> Vec<SequenceId> {
        self.sequences.iter().map(|s| s.id).collect()
    }

    /// Adds a generation of `prompt` with `opts`, its own cache (None: the
    /// scheduler's), and `on_text` called with each new piece of its text
    /// (false stops it). Its prompt is read from the next step on. Errors:
    /// [`ErrorKind::InvalidOptions`] (an empty prompt, a token outside the
    /// vocabulary, sampling settings, a cache larger than the scheduler's
    /// sequences, every sequence busy: the error names the numbers) or
    /// [`ErrorKind::PromptTooLong`].
    pub fn add(
        &mut self,
        prompt: &[u32],
        opts: GenerateOptions,
        cache: Option<CacheOptions>,
        on_text: impl FnMut(&str) -> bool + Send + 'static,
    ) -> Result<SequenceId> {
        self.add_inner(prompt, opts, cache, Box::new(on_text))
            .map_err(|e| Error::classify(e, ErrorKind::InvalidOptions))
    }

    fn add_inner(
        &mut self,
        prompt: &[u32],
        opts: GenerateOptions,
        cache: Option<CacheOptions>,
        on_text: Box<dyn FnMut(&str) -> bool + Send>,
    ) -> anyhow::Result<SequenceId> {
        if self.sequences.len() >= self.opts.max_sequences {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "all {} sequences of the scheduler are busy (max_sequences); wait for one to finish",
                self.opts.max_sequences
            );
        }
        if prompt.is_empty() {
            bail_kind!(ErrorKind::InvalidOptions, "the prompt is empty");
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "prompt token id {bad} is outside the model's vocabulary of {vocab} tokens"
            );
        }
        opts.sampling.validate()?;
        crate::session::check_logprobs(&opts)?;
        let constraint = (opts.constraint.as_ref())
            .map(|c| ConstraintState::new(c, &self.tokenizer, vocab))
            .transpose()?;
        let cache_opts = cache
            .or(self.opts.cache)
            .unwrap_or(CacheOptions::new(Policy::Full, 0, 0));
        let layers = self.model.config.num_layers;
        let cache = BoundedCache::new(cache_opts, layers)?;
        if let Some(slots) = cache.capacity().filter(|&c| c > self.opts.max_context) {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "the cache takes {slots} slots (budget + chunk); a sequence of this scheduler holds {} (max_context)",
                self.opts.max_context
            );
        }
        if cache.capacity().is_none() && prompt.len() > self.opts.max_context {
            bail_kind!(
                ErrorKind::PromptTooLong,
                "the prompt has {} tokens; a sequence of this scheduler holds {} (max_context), or give it a bounded cache",
                prompt.len(),
                self.opts.max_context
            );
        }
        let reused = match self.opts.reuse {
            true => self.take_parked(prompt, &cache_opts),
            false => None,
        };
        let (block, mut engine, cache, cached) = match reused {
            Some((p, n)) => (p.block, p.engine, p.cache, n),
            None => {
                let block = self.free_block();
                let engine_opts = EngineOptions {
                    kv_cache: Some(self.pool[block].0.clone()),
                    ..cache.engine_options(self.opts.max_context, self.opts.step_tokens, 1)
                };
                // A fresh engine: no entry of the cache's previous sequence is read.
                let engine = self.batch.sequence(engine_opts)?;
                (block, engine, cache, 0)
            }
        };
        self.pool[block].1 = true;
        engine.reset_seen(prompt);
        // A reused engine may hold its last sequence's mask.
        engine.set_allowed(None)?;
        engine.set_logprobs(opts.logprobs);
        let id = SequenceId(self.next_id);
        self.next_id += 1;
        self.sequences.push(Sequence {
            id,
            cached,
            block,
            engine,
            cache,
            prompt: prompt.to_vec(),
            tokens: prompt[..cached].to_vec(),
            text: Some(StopText::new(&opts.stop_strings)),
            opts,
            phase: Phase::Prompt { fed: cached },
            waited: 0,
            steps: 0,
            ids: vec![],
            on_text,
            constraint,
            logprobs: vec![],
            next_logprobs: None,
            cancel: CancelToken::default(),
            started: Instant::now(),
            prefill_seconds: 0.0,
            decode_started: None,
        });
        Ok(id)
    }

    /// The token that cancels a sequence from any thread (it ends within a
    /// step, with [`StopReason::Cancelled`], and its cache is freed).
    pub fn cancel_token(&self, id: SequenceId) -> Option<CancelToken> {
        self.sequences
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.cancel.clone())
    }

    /// Steps until every sequence has finished; returns them in the order
    /// they finished. A sequence that fails on its own is the error (the
    /// others stay, to be stepped on).
    pub fn run(&mut self) -> Result<Vec<(SequenceId, Generation)>> {
        let mut done = vec![];
        while !self.sequences.is_empty() {
            done.extend(self.step()?);
            if let Some((_, e)) = self.take_failed().into_iter().next() {
                return Err(e);
            }
        }
        Ok(done)
    }

    /// The sequences that failed on their own in the steps since the last
    /// call ([`ErrorKind::NonFiniteLogits`], say), each with its error: they
    /// are removed, their caches freed, and the others went on.
    pub fn take_failed(&mut self) -> Vec<(SequenceId, Error)> {
        std::mem::take(&mut self.failed)
    }

    /// One step of every sequence together; returns the sequences that
    /// finished (their caches are freed). An error of the step itself
    /// fails the step's sequences ([`ErrorKind::Gpu`]); they are removed.
    /// One sequence's own failure removes it alone (`take_failed`).
    pub fn step(&mut self) -> Result<Vec<(SequenceId, Generation)>> {
        self.step_inner()
            .map_err(|e| Error::classify(e, ErrorKind::Gpu))?;
        Ok(std::mem::take(&mut self.done))
    }

    /// One step; the sequences that finish go to `done` (and stay there,
    /// to be returned, when the step fails after they ended).
    fn step_inner(&mut self) -> anyhow::Result<()> {
        // Ends decided before a token is fed: cancel, max tokens, end of
        // sequence, a full context.
        let mut i = 0;
        while i < self.sequences.len() {
            match self.end_before_step(i) {
                Some(stop) => {
                    let finished = self.finish(i, stop);
                    self.done.push(finished);
                }
                None => i += 1,
            }
        }
        let (parts, mut failed) = self.plan();
        if parts.is_empty() && failed.is_empty() && !self.sequences.is_empty() {
            // Cannot happen (every running sequence decodes one token or
            // reads part of its prompt); an error rather than a hang.
            bail_kind!(ErrorKind::Gpu, "no sequence could take a token this step");
        }
        if !parts.is_empty() {
            match self.run_parts(&parts) {
                Ok(f) => failed.extend(f),
                Err(e) => {
                    // The step's sequences are out of step with their caches.
                    let mut gone: Vec<usize> = parts.iter().map(|p| p.index).collect();
                    gone.extend(failed.iter().map(|(i, _)| *i));
                    gone.sort_unstable();
                    for &i in gone.iter().rev() {
                        self.remove(i);
                    }
                    return Err(e);
                }
            }
        }
        // Those that end after this step, and those that failed (not both).
        let mut leaving: Vec<(usize, std::result::Result<StopReason, anyhow::Error>)> = parts
            .iter()
            .filter(|p| !failed.iter().any(|(i, _)| *i == p.index))
            .filter_map(|p| p.stop_after.map(|s| (p.index, Ok(s))))
            .collect();
        leaving.extend(failed.into_iter().map(|(i, e)| (i, Err(e))));
        leaving.sort_unstable_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, end) in leaving {
            match end {
                Ok(stop) => {
                    let finished = self.finish(i, stop);
                    self.done.push(finished);
                }
                Err(e) => {
                    let s = self.remove(i);
                    self.failed.push((s.id, Error::classify(e, ErrorKind::Gpu)));
                }
            }
        }
        Ok(())
    }

    /// Why sequence `i` ends before this step feeds it anything, emitting
    /// its sampled token where it goes on (as `Session::generate` does).
    fn end_before_step(&mut self, i: usize) -> Option<StopReason> {
        let s = &mut self.sequences[i];
        if s.cancel.is_cancelled() {
            return Some(StopReason::Cancelled);
        }
        let Phase::Decode { next } = s.phase else {
            return None;
        };
        let full = s.cache.capacity().is_none() && s.tokens.len() >= self.opts.max_context;
        if s.ids.len() >= s.opts.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if s.opts.stop_at_eos && self.tokenizer.eos_ids.contains(&next) {
            Some(StopReason::Eos)
        } else if full {
            Some(StopReason::ContextFull)
        } else {
            None
        }
    }

    /// The parts of the next step: a token of every decoding sequence
    /// (emitted to its callback now), then prompt chunks with the tokens
    /// left, the prompt with the fewest tokens left first (a short request
    /// gets its first token within a step even while long prompts are
    /// read; the long ones take the rest of every step), then the oldest;
    /// but a prompt that got nothing for `PROMPT_WAIT_STEPS` steps in a
    /// row goes before them all, the longest waiting first (short prompts
    /// arriving without end do not starve a long one).
    /// Refreshes each full bounded cache first. Also returns the sequences
    /// that failed on their own here (by index), with no part.
    fn plan(&mut self) -> (Vec<Part>, Vec<(usize, anyhow::Error)>) {
        let mut parts = vec![];
        let mut failed = vec![];
        let mut budget = self.opts.step_tokens;
        for i in 0..self.sequences.len() {
            let s = &mut self.sequences[i];
            let Phase::Decode { next } = s.phase else {
                continue;
            };
            let pos = s.tokens.len() as u32;
            // A refresh or the text failing fails this sequence alone.
            let emitted = make_room(s, pos, &mut self.evicted).and_then(|()| {
                let text = s.text.as_mut().expect("a running sequence has its text");
                let stop = text.push(&self.tokenizer, next, &mut s.on_text)?;
                Ok(stop.or(s.accept(next)?))
            });
            let stop_after = match emitted {
                Ok(stop) => stop,
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            };
            s.ids.push(next);
            if s.opts.logprobs.is_some() {
                let lp = s.next_logprobs.take().unwrap_or_default();
                s.logprobs.push(lp);
            }
            parts.push(Part {
                index: i,
                ids: vec![next],
                positions: vec![pos],
                samples: true,
                stop_after,
            });
            budget -= 1;
        }
        // (not overdue, then tokens left or, when overdue, the longest
        // wait first; index).
        let mut prompting: Vec<(bool, usize, usize)> = (self.sequences.iter().enumerate())
            .filter_map(|(i, s)| match s.phase {
                Phase::Prompt { fed } => Some(match s.waited < PROMPT_WAIT_STEPS {
                    true => (true, s.prompt.len() - fed, i),
                    false => (false, usize::MAX - s.waited, i),
                }),
                Phase::Decode { .. } => None,
            })
            .collect();
        prompting.sort_unstable();
        for (_, _, i) in prompting {
            let s = &mut self.sequences[i];
            // Counts back to 0 below when it gets a chunk.
            s.waited += 1;
            if budget == 0 {
                continue;
            }
            let Phase::Prompt { fed } = s.phase else {
                continue;
            };
            let pos = s.tokens.len() as u32;
            if let Err(e) = make_room(s, pos, &mut self.evicted) {
                failed.push((i, e));
                continue;
            }
            let room = s.cache.room(&s.engine);
            let n = (s.prompt.len() - fed)
                .min(budget)
                .min(room)
                .min(s.engine.max_step_tokens());
            if n == 0 {
                continue;
            }
            let ids = s.prompt[fed..fed + n].to_vec();
            s.waited = 0;
            parts.push(Part {
                index: i,
                positions: (pos..pos + n as u32).collect(),
                ids,
                samples: fed + n == s.prompt.len(),
                stop_after: None,
            });
            budget -= n;
        }
        (parts, failed)
    }

    /// Runs the planned step and records it: each sequence's cache entries,
    /// its sampled token, its phase. Returns the sequences that failed on
    /// their own (by index), not recorded; an error is the step's.
    fn run_parts(&mut self, parts: &[Part]) -> anyhow::Result<Vec<(usize, anyhow::Error)>> {
        // The engines in the parts' order (one part per sequence).
        let mut sequences: Vec<Option<&mut Sequence>> =
            self.sequences.iter_mut().map(Some).collect();
        let mut work: Vec<(&mut Engine, SeqStep)> = Vec::with_capacity(parts.len());
        let mut constraints: Vec<Option<&mut ConstraintState>> = Vec::with_capacity(parts.len());
        for p in parts {
            let s = sequences[p.index].take().expect("one part per sequence");
            if p.samples {
                s.steps += 1;
            }
            let step = SeqStep {
                ids: &p.ids,
                positions: &p.positions,
                sample: p.samples.then_some((s.opts.sampling, s.steps)),
                logits: false,
            };
            work.push((&mut s.engine, step));
            constraints.push(s.constraint.as_mut());
        }
        let masked = (constraints.iter().zip(parts)).any(|(c, p)| c.is_some() && p.samples);
        let sampled = if masked {
            // Each mask depends on the token its sequence feeds in this
            // step: computed while the GPU runs the step's forward pass.
            // A complete constraint leaves its last choice free.
            self.batch
                .step_each_masked(&mut work, |i| match constraints[i].as_mut() {
                    Some(c) => c.next_mask(),
                    None => Ok(None),
                })?
        } else {
            self.batch.step_each(&mut work)?
        };
        drop(work);
        let mut failed = vec![];
        for (p, token) in parts.iter().zip(sampled) {
            let s = &mut self.sequences[p.index];
            let recorded = token.and_then(|token| {
                s.cache.record_step(&s.engine, &p.ids, &p.positions)?;
                Ok(token)
            });
            let token = match recorded {
                Ok(token) => token,
                Err(e) => {
                    failed.push((p.index, e));
                    continue;
                }
            };
            s.tokens.extend_from_slice(&p.ids);
            if let Phase::Prompt { fed } = s.phase {
                s.phase = Phase::Prompt {
                    fed: fed + p.ids.len(),
                };
            }
            if let Some(next) = token {
                s.next_logprobs = s.engine.take_logprobs();
                if matches!(s.phase, Phase::Prompt { .. }) {
                    s.prefill_seconds = s.started.elapsed().as_secs_f64();
                    s.decode_started = Some(Instant::now());
                }
                s.phase = Phase::Decode { next };
            }
        }
        Ok(failed)
    }

    /// Removes sequence `i` and returns its generation; its cache is freed,
    /// or kept for reuse.
    fn finish(&mut self, i: usize, stop: StopReason) -> (SequenceId, Generation) {
        let mut s = self.sequences.remove(i);
        let text = s
            .text
            .take()
            .expect("a running sequence has its text")
            .finish(stop, &mut s.on_text);
        let prompt_fed = match s.phase {
            Phase::Prompt { fed } => fed,
            Phase::Decode { .. } => s.prompt.len(),
        };
        let decode_seconds = s.decode_started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let generation = Generation {
            text,
            stats: GenerationStats {
                prompt_tokens: prompt_fed - s.cached,
                cached_tokens: s.cached,
                generated_tokens: s.ids.len(),
                prefill_seconds: s.prefill_seconds,
                decode_seconds,
                mask_seconds: s.constraint.as_ref().map_or(0.0, |c| c.mask_seconds),
                stop,
            },
            ids: s.ids,
            logprobs: s.logprobs,
        };
        // A cancelled sequence's cache may hold part of a step's tokens.
        if self.opts.reuse && stop != StopReason::Cancelled {
            self.parked.push(Parked {
                block: s.block,
                engine: s.engine,
                cache: s.cache,
                tokens: s.tokens,
            });
        } else {
            self.pool[s.block].1 = false;
        }
        (s.id, generation)
    }

    /// A free cache of the pool, the oldest parked sequence's if none is.
    fn free_block(&mut self) -> usize {
        if let Some(free) = self.pool.iter().position(|(_, busy)| !busy) {
            return free;
        }
        let oldest = self.parked.remove(0);
        self.pool[oldest.block].1 = false;
        oldest.block
    }

    /// The parked sequence whose cache serves `prompt` best, and the
    /// length of the prompt's prefix it holds: one whose every token the
    /// prompt continues (the next turn of its conversation), or, when no
    /// cache of the pool is free, a full cache cut to the prefix it shares
    /// (rather than evicting it for nothing). None when none serves.
    fn take_parked(&mut self, prompt: &[u32], opts: &CacheOptions) -> Option<(Parked, usize)> {
        let none_free = self.pool.iter().all(|(_, busy)| *busy);
        let usable = |p: &Parked| -> usize {
            let full = opts.policy == Policy::Full;
            if (p.cache.opts.policy == Policy::Full) != full || (!full && p.cache.opts != *opts) {
                return 0;
            }
            // At least one prompt token is fed, to sample from.
            let shared = prompt
                .iter()
                .zip(&p.tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(prompt.len() - 1);
            let continues = shared == p.tokens.len();
            match continues || (full && none_free) {
                true => shared,
                false => 0,
            }
        };
        let best = (0..self.parked.len())
            .map(|i| (usable(&self.parked[i]), i))
            .filter(|&(n, _)| n > 0)
            .max();
        let (n, i) = best?;
        let mut p = self.parked.remove(i);
        if p.tokens.len() > n {
            if p.cache.truncate(&mut p.engine, n).is_err() {
                // Out of step with its engine (cannot happen): not reused.
                self.pool[p.block].1 = false;
                return None;
            }
            p.tokens.truncate(n);
        }
        Some((p, n))
    }

    /// Removes sequence `i`, its cache back in the pool.
    fn remove(&mut self, i: usize) -> Sequence {
        let s = self.sequences.remove(i);
        self.pool[s.block].1 = false;
        s
    }
}

/// Refreshes sequence `s`'s cache when full, before the token at `pos`,
/// counting what it evicts.
fn make_room(
    s: &mut Sequence,
    pos: u32,
    evicted: &mut BTreeMap<&'static str, u64>,
) -> anyhow::Result<()> {
    let before = s.cache.slots.len();
    s.cache.make_room(&mut s.engine, pos)?;
    let gone = before.saturating_sub(s.cache.slots.len()) as u64;
    if gone > 0 {
        *evicted.entry(s.cache.opts.policy.name()).or_default() += gone;
    }
    Ok(())
}

/// A generation for [`run_jobs`]: its prompt and its cache (None: the full
/// one).
pub type Job = (Vec<u32>, Option<CacheOptions>);

/// Most generations [`jobs_that_fit`] steps together: past a few dozen, a
/// step is bound by the mat-muls' arithmetic and by every sequence's own
/// attention dispatches, and more sequences add memory but little speed.
pub const AUTO_BATCH_CAP: usize = 32;

/// Cache slots a sequence of `jobs` needs with up to `max_new` new tokens:
/// the longest prompt and answer (within the model's context) or the
/// largest bounded cache (budget + chunk).
fn job_slots(model: &Model, jobs: &[Job], max_new: usize) -> usize {
    let full = |p: &[u32]| (p.len() + max_new + 1).min(model.config.max_position_embeddings);
    let slots = jobs
        .iter()
        .map(|(p, c)| c.map_or_else(|| full(p), |c| c.capacity()));
    slots.max().unwrap_or(1).max(1)
}

/// Sequences to step `jobs` with up to `max_new` new tokens each in:
/// as many as the jobs, the device's memory and [`AUTO_BATCH_CAP`] allow.
pub fn jobs_that_fit(model: &Model, jobs: &[Job], max_new: usize) -> usize {
    let slots = job_slots(model, jobs, max_new);
    SchedulerOptions::sequences_that_fit(model, slots, AUTO_BATCH_CAP).min(jobs.len())
}

/// Generations of `jobs`, all with `opts`, `max_sequences` at a time
/// stepped together on one scheduler (the weights read once per step for
/// all of them), each as if alone: no cache is reused, and a full cache
/// holds the longest prompt and answer within the model's context (a
/// longer one ends with `ContextFull`, as alone). `done(job index, generation,
/// seconds from its start to its end)` is called as each finishes, in that
/// order. The first error, of a sequence or of `done`, ends the run.
pub fn run_jobs<E: From<Error>>(
    llm: &Llm,
    jobs: &[Job],
    opts: &GenerateOptions,
    max_sequences: usize,
    mut done: impl FnMut(usize, Generation, f64) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let max_sequences = max_sequences.clamp(1, jobs.len().max(1));
    let sched = SchedulerOptions {
        max_sequences,
        step_tokens: SchedulerOptions::default().step_tokens.max(max_sequences),
        max_context: job_slots(&llm.model, jobs, opts.max_new_tokens),
        cache: None,
        reuse: false,
    };
    let mut scheduler = Scheduler::new(llm, sched)?;
    let mut running = HashMap::new();
    let mut next = 0;
    loop {
        while next < jobs.len() && scheduler.active() < max_sequences {
            let (prompt, cache) = &jobs[next];
            let id = scheduler.add(prompt, opts.clone(), *cache, |_| true)?;
            running.insert(id, (next, Instant::now()));
            next += 1;
        }
        if scheduler.active() == 0 {
            return Ok(());
        }
        let finished = scheduler.step()?;
        if let Some((_, e)) = scheduler.take_failed().into_iter().next() {
            return Err(e.into());
        }
        for (id, g) in finished {
            // Every finished sequence was added above.
            if let Some((i, t)) = running.remove(&id) {
                done(i, g, t.elapsed().as_secs_f64())?;
            }
        }
    }
}

/// The KV pool of a scheduler: `max_sequences` caches of `max_context`
/// slots, refused before anything is allocated where it cannot fit the
/// device, and allocated once.
fn kv_pool(model: &Model, opts: &SchedulerOptions) -> anyhow::Result<Vec<(KvCache, bool)>> {
    let bytes = slot_bytes(model) * (opts.max_sequences as u128) * (opts.max_context as u128);
    let describe = || {
        format!(
            "the KV pool of {} sequences (max_sequences) of {} slots (max_context) needs {:.1} MiB",
            opts.max_sequences,
            opts.max_context,
            bytes as f64 / 1048576.0
        )
    };
    let ceiling = model.gpu.memory_ceiling() as u128;
    if bytes + model.weight_bytes as u128 > ceiling {
        bail_kind!(
            ErrorKind::GpuOutOfMemory,
            "{}; with {:.1} MiB of weights that is more than this device can hold ({:.1} MiB at most)",
            describe(),
            model.weight_bytes as f64 / 1048576.0,
            ceiling as f64 / 1048576.0
        );
    }
    (0..opts.max_sequences)
        .map(|_| Ok((KvCache::new(model, opts.max_context, None)?, false)))
        .collect::<anyhow::Result<Vec<_>>>()
        .with_context(describe)
}

/// Bytes of one cache slot: every layer's key and value.
fn slot_bytes(model: &Model) -> u128 {
    model.heads().kv_row_bytes() as u128 * 2 * model.config.num_layers as u128
}
