//! Several sequences in one step. A decode step of one sequence is a
//! mat-vec per weight matrix, bound by reading the weights; B sequences
//! stepped together read them once for B rows. A [`Batch`] runs the
//! embedding, every norm and mat-mul, the final norm and the LM head once
//! over all the step's rows (so the mat-mul variants, not the mat-vec ones,
//! apply as soon as two rows are in a step), and each sequence's RoPE,
//! cache append, attention and policy signals over its own rows, against
//! its own cache.
//!
//! Each sequence is an ordinary [`Engine`] made by [`Batch::sequence`]: its
//! own KV cache, compaction, policy signals, sampler and `Step` uniform,
//! with its kernels bound to the batch's activation buffers. The `Step`
//! uniform's `row0` says where its rows start in them, so its kernels are
//! those of a single sequence. It can also step alone (`Engine::step`: its
//! rows then start at 0), as a bounded cache's refresh and the
//! counter-causal pass do, between batched steps.
//!
//! The rows of a step are the sequences' tokens in the order given. Logits
//! are computed for the rows from the first to the last row that samples:
//! put the sequences that sample (decode) together, and a prompt chunk that
//! does not sample before or after them.

use anyhow::{bail, Context, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::layer::{LayerAttention, SeqAttention};
use super::{copy_between_passes, Engine, EngineOptions, SharedActivations, StepIds};
use super::{StepOutput, Submitted};
use crate::kernels::sample::SamplingParams;
use crate::kernels::Step;
use crate::model::Model;

/// One sequence's part of a batched step.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    /// Its tokens, which go to its cache slots `n_cached..`.
    pub ids: &'a [u32],
    pub positions: &'a [u32],
    /// Sample its next token from its last row, with these settings and
    /// step counter.
    pub sample: Option<(SamplingParams, u32)>,
    /// Compute the logits of all its rows (`Batch::read_logits`).
    pub logits: bool,
}

/// The shared part of a batched step: activation buffers for every row of
/// a step, and the kernels that run once over all of them.
pub struct Batch {
    /// An engine whose embedding, layers' norms and mat-muls, final norm and
    /// LM head run over the whole step (its own cache is never used).
    trunk: Engine,
    /// The most cache slots of a sequence (the attention partials' size).
    max_slots: usize,
    /// The rows of the last step whose logits it computed.
    last_logits: std::ops::Range<usize>,
}

/// Tells batches apart (an engine steps only in its own).
static NEXT_BATCH: AtomicU64 = AtomicU64::new(1);

impl Batch {
    /// A batch of steps of up to `rows` tokens in all, with logits for up
    /// to `logit_rows` of them, for sequences of up to `max_slots` cache
    /// slots each.
    pub fn new(
        model: Arc<Model>,
        rows: usize,
        logit_rows: usize,
        max_slots: usize,
    ) -> Result<Batch> {
        let opts = EngineOptions {
            // The trunk's own cache is never written; one slot.
            max_slots: 1,
            max_tokens: rows,
            max_logit_rows: logit_rows,
            ..Default::default()
        };
        let trunk = Engine::new_with(model, opts, max_slots)?;
        let mut trunk = trunk;
        trunk.batch = Some(NEXT_BATCH.fetch_add(1, Ordering::Relaxed));
        Ok(Batch {
            trunk,
            max_slots,
            last_logits: 0..0,
        })
    }

    /// An engine for one sequence of this batch, with `opts` (its cache
    /// slots, policy signals, compaction scratch; its tokens per step and
    /// logit rows at most the batch's).
    pub fn sequence(&self, opts: EngineOptions) -> Result<Engine> {
        let t = &self.trunk.opts;
        if opts.max_tokens > t.max_tokens
            || opts.max_logit_rows > t.max_logit_rows
            || opts.max_slots > self.max_slots
        {
            bail!(
                "a sequence of this batch takes at most {} tokens and {} logit rows a step and {} cache slots (asked for {}, {} and {})",
                t.max_tokens,
                t.max_logit_rows,
                self.max_slots,
                opts.max_tokens,
                opts.max_logit_rows,
                opts.max_slots
            );
        }
        let batch = self.trunk.batch.expect("a batch's trunk has its batch id");
        let shared = SharedActivations {
            acts: self.trunk.acts.clone(),
            batch,
        };
        Engine::new(
            self.trunk.model.clone(),
            EngineOptions {
                shared_activations: Some(shared),
                ..opts
            },
        )
    }

    /// Runs one step of every sequence in `seqs` together and returns each
    /// one's sampled token (None where it does not sample). Every check of
    /// `Engine::step` applies to each sequence; the rows of all of them
    /// must fit the batch. A sequence's own failure (non-finite logits) is
    /// the step's error, after every sequence's step completed.
    pub fn step(&mut self, seqs: &mut [(&mut Engine, SeqStep)]) -> Result<Vec<Option<u32>>> {
        self.step_each(seqs)?.into_iter().collect()
    }

    /// As `step`, with each sequence's own result: one whose logits are
    /// not finite fails alone, and the others' steps stand. The outer
    /// error is the step's (a check, the submission): nothing ran.
    pub fn step_each(
        &mut self,
        seqs: &mut [(&mut Engine, SeqStep)],
    ) -> Result<Vec<Result<Option<u32>>>> {
        self.run(seqs, None)
    }

    /// As `step_each`, each sampling sequence choosing among the tokens
    /// `allowed(i)` returns for it (a bitmask over the vocabulary; None:
    /// every token), computed on the host while the GPU runs the step's
    /// forward pass; the samplers follow in a second submission. An error
    /// from `allowed`, or a mask the sampler refuses, fails that sequence
    /// alone (its choice is then free, and dropped). An outer error after
    /// the forward pass (the samplers' submission) leaves every sequence
    /// of the step out of step with its cache.
    pub fn step_each_masked(
        &mut self,
        seqs: &mut [(&mut Engine, SeqStep)],
        mut allowed: impl FnMut(usize) -> Result<Option<Vec<u32>>>,
    ) -> Result<Vec<Result<Option<u32>>>> {
        self.run(seqs, Some(&mut allowed))
    }

    #[allow(clippy::type_complexity)]
    fn run(
        &mut self,
        seqs: &mut [(&mut Engine, SeqStep)],
        allowed: Option<&mut dyn FnMut(usize) -> Result<Option<Vec<u32>>>>,
    ) -> Result<Vec<Result<Option<u32>>>> {
        let mut submitted = self.submit(seqs, allowed.is_some())?;
        let mut mask_errors: Vec<Option<anyhow::Error>> = seqs.iter().map(|_| None).collect();
        if let Some(allowed) = allowed {
            for (i, ((engine, _), s)) in seqs.iter_mut().zip(&submitted).enumerate() {
                if !s.sample_pending {
                    continue;
                }
                let set = allowed(i).and_then(|mask| engine.set_allowed(mask.as_deref()));
                if let Err(e) = set {
                    mask_errors[i] = Some(e);
                    engine.set_allowed(None)?;
                }
            }
            let mut pending: Vec<_> = (seqs.iter_mut().zip(&mut submitted))
                .filter(|(_, s)| s.sample_pending)
                .map(|((engine, _), s)| (&mut **engine, s))
                .collect();
            super::submit_samples(&mut pending)?;
        }
        // Every sequence's step is completed (its readbacks freed) even
        // after one fails.
        Ok((seqs.iter_mut().zip(submitted).zip(mask_errors))
            .map(|(((engine, _), s), mask_error)| {
                let token = engine.complete(s);
                match mask_error {
                    Some(e) => Err(e),
                    None => token,
                }
            })
            .collect())
    }

    /// The logits of rows `rows` of the last step (a sequence's rows follow
    /// those of the sequences before it in the step), which must be rows
    /// of sequences that asked for them (`SeqStep::logits`) or sampled.
    pub fn read_logits(&self, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let computed = &self.last_logits;
        if rows.start < computed.start || rows.end > computed.end {
            bail!("logits of rows {rows:?} asked; the last step computed rows {computed:?}");
        }
        self.trunk
            .read_logit_rows(rows.start - computed.start, rows.len())
    }

    /// Records and submits one batched step; each sequence's `Submitted`
    /// is completed by its own engine, in the order of `seqs`. With
    /// `defer_sample` the samplers are left for `submit_samples`.
    fn submit(
        &mut self,
        seqs: &mut [(&mut Engine, SeqStep)],
        defer_sample: bool,
    ) -> Result<Vec<Submitted>> {
        self.last_logits = 0..0;
        let trunk = &mut self.trunk;
        let batch = trunk.batch;
        if seqs.is_empty() {
            bail!("a batched step needs at least one sequence");
        }
        // Each sequence's checks (token count, cache room, vocabulary), and
        // its rows in the step.
        let mut rows = Vec::with_capacity(seqs.len());
        let mut row0 = 0usize;
        for (i, (engine, s)) in seqs.iter().enumerate() {
            if engine.batch != batch {
                bail!("sequence {i} of the step was not made by this batch (Batch::sequence)");
            }
            let out = StepOutput {
                logit_row0: s.ids.len().saturating_sub(1),
                n_logits: usize::from(s.sample.is_some()),
                sample: s.sample,
            };
            let n = engine
                .check_step(&StepIds::Host(s.ids), s.positions, &out)
                .with_context(|| format!("sequence {i} of the batched step"))?;
            rows.push((row0, n));
            row0 += n;
        }
        let total = row0;
        if total > trunk.opts.max_tokens {
            bail!(
                "the batched step has {total} tokens; the batch takes {} (Batch::new)",
                trunk.opts.max_tokens
            );
        }
        // Logits for the rows from the first to the last that samples or
        // asks for them.
        let logit_rows: Vec<std::ops::Range<usize>> = seqs
            .iter()
            .zip(&rows)
            .filter_map(|((_, s), &(r0, n))| match (s.logits, s.sample) {
                (true, _) => Some(r0..r0 + n),
                (false, Some(_)) => Some(r0 + n - 1..r0 + n),
                (false, None) => None,
            })
            .collect();
        let (logit_row0, n_logits) = match (logit_rows.first(), logit_rows.last()) {
            (Some(a), Some(b)) => (a.start, b.end - a.start),
            _ => (0, 0),
        };
        let logit_range = logit_row0..logit_row0 + n_logits;
        if n_logits > trunk.opts.max_logit_rows {
            bail!(
                "the batched step needs logits for rows {logit_row0}..={}, {n_logits} rows; the batch computes at most {} (put the sequences that sample or read logits together)",
                logit_row0 + n_logits - 1,
                trunk.opts.max_logit_rows
            );
        }

        let gpu = trunk.model.gpu.clone();
        let a = &trunk.acts;
        let step = Step {
            n_tokens: total as u32,
            logit_row0: logit_row0 as u32,
            n_logits: n_logits as u32,
            ..Default::default()
        };
        gpu.write(&a.step, 0, bytemuck::bytes_of(&step));
        let ids: Vec<u32> = seqs.iter().flat_map(|(_, s)| s.ids).copied().collect();
        let positions: Vec<u32> = seqs
            .iter()
            .flat_map(|(_, s)| s.positions)
            .copied()
            .collect();
        gpu.write(&a.ids, 0, bytemuck::cast_slice(&ids));
        gpu.write(&a.positions, 0, bytemuck::cast_slice(&positions));
        for ((engine, s), &(r0, n)) in seqs.iter().zip(&rows) {
            let own = Step {
                n_tokens: n as u32,
                start_slot: engine.n_cached as u32,
                row0: r0 as u32,
                ..Default::default()
            };
            gpu.write(&engine.acts.step, 0, bytemuck::bytes_of(&own));
            engine.write_slot_positions(s.positions);
            if let Some((params, counter)) = &s.sample {
                let row = (r0 + n - 1 - logit_row0) as u32;
                engine.sampler.set_params(&gpu, params, row, *counter);
            }
        }

        let mut enc = gpu.device.create_command_encoder(&Default::default());
        let c = &trunk.model.config;
        let row_bytes = (c.hidden_size * 4) as u64;
        let mut pass = Some(
            enc.begin_compute_pass(&Default::default())
                .forget_lifetime(),
        );
        let mut no_mark = |_: &mut wgpu::ComputePass, _: &'static str| {};
        trunk.embed.encode(pass.as_mut().unwrap(), total as u32);
        let n_layers = trunk.layers.len();
        for l in 0..n_layers {
            if l + 1 == n_layers {
                // The residual stream entering the last layer, kept per slot
                // for the counter-causal pass of the sequences that run it.
                for ((engine, _), &(r0, n)) in seqs.iter().zip(&rows) {
                    if let Some(store) = engine.signals.last_layer_inputs() {
                        copy_between_passes(
                            &mut enc,
                            &mut pass,
                            (&a.x, r0 as u64 * row_bytes),
                            store,
                            engine.n_cached as u64 * row_bytes,
                            n as u64 * row_bytes,
                        );
                    }
                }
            }
            let attention: Vec<SeqAttention> = seqs
                .iter()
                .zip(&rows)
                .map(|((engine, _), &(_, n))| SeqAttention {
                    rope: &engine.layers[l].rope,
                    attn: &engine.layers[l].attn,
                    weights: engine.signals.weights_of(l),
                    queries: engine.signals.queries_of(l),
                    n: n as u32,
                    start: engine.n_cached as u32,
                })
                .collect();
            let p = pass.as_mut().unwrap();
            let batched = LayerAttention::Batch(&attention);
            trunk.layers[l].encode(p, total as u32, batched, &mut no_mark);
            for ((engine, _), &(_, n)) in seqs.iter().zip(&rows) {
                for d in engine.signals.deltas_after(l) {
                    d.encode(p, n as u32);
                }
            }
        }
        {
            let p = pass.as_mut().unwrap();
            for ((engine, _), &(_, n)) in seqs.iter().zip(&rows) {
                engine
                    .signals
                    .encode_reduce(p, n as u32, engine.n_cached as u32, &mut no_mark);
            }
            if n_logits > 0 {
                trunk.final_norm.encode(p, n_logits as u32);
                trunk.lm_head.encode(p, n_logits as u32);
            }
            for (engine, s) in seqs.iter() {
                if s.sample.is_some() && !defer_sample {
                    engine.sampler.encode(p);
                }
            }
        }
        drop(pass);
        let mut staged = Vec::with_capacity(seqs.len());
        for ((engine, s), &(_, n)) in seqs.iter_mut().zip(&rows) {
            let samples_now = s.sample.is_some() && !defer_sample;
            let staging = samples_now.then(|| engine.stage_sample(&mut enc));
            staged.push((staging, engine.signals.stage_deltas(&mut enc, n)));
        }
        let index = gpu.queue.submit([enc.finish()]);
        let mut submitted = Vec::with_capacity(seqs.len());
        for (((engine, s), &(_, n)), (staging, delta_staging)) in
            seqs.iter_mut().zip(&rows).zip(staged)
        {
            engine.last_step_sampled = staging.is_some();
            let first_slot = engine.n_cached;
            engine.n_cached += n;
            submitted.push(Submitted {
                index: index.clone(),
                staging,
                delta_staging,
                saved_state: false,
                sample_pending: s.sample.is_some() && defer_sample,
                first_slot,
                n_tokens: n,
            });
        }
        self.last_logits = logit_range;
        Ok(submitted)
    }
}
