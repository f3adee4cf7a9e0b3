//! The forward pass: activation buffers, the KV cache and every kernel bound
//! once, then one compute pass (one submission) per step.
//!
//! A step processes `n` new tokens (a prefill chunk, or 1 when decoding),
//! appends their keys and values to the cache after the entries already there,
//! and optionally computes logits for a contiguous range of the step's rows and
//! samples the next token from the last of them.

use anyhow::{bail, Context, Result};
use std::sync::Arc;

mod batch;
mod buffers;
mod deferred;
mod layer;
mod signals;

pub use batch::{Batch, SeqStep};
pub use buffers::{KvCache, SharedActivations};
pub use deferred::submit_samples;

use buffers::Activations;

pub use signals::{CcsMode, Signals};

use layer::{LayerAttention, LayerKernels};
use signals::SignalKernels;

use crate::family::Activation;
use crate::kernels::attention::{Attention, AttnLayer, Window};
use crate::kernels::compact::{Compactor, Granularity, RowLists};
use crate::kernels::embed::Embed;
use crate::kernels::head_norm::HeadNorm;
use crate::kernels::matmul::{Matmul, MatmulOptions};
use crate::kernels::paging::SlotPages;
use crate::kernels::prepared_x::FusedInput;
use crate::kernels::rmsnorm::RmsNorm;
use crate::kernels::rope_kv::RopeKv;
use crate::kernels::runtime::Runtime;
use crate::kernels::sample::{Sampler, SamplingParams, TokenLogprobs, RESULT_BYTES};
use crate::kernels::silu_mul::SiluMul;
use crate::kernels::{Rows, Step};
use crate::model::Model;

/// Sizes of the buffers an engine allocates once.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Cache slots (the longest context this engine can hold).
    pub max_slots: usize,
    /// Most tokens processed in one step (the prefill chunk).
    pub max_tokens: usize,
    /// Most rows of logits computed in one step.
    pub max_logit_rows: usize,
    /// Most entries a compaction keeps (the KV budget J); None when the cache
    /// never evicts (no compaction scratch is allocated).
    pub max_keep: Option<usize>,
    /// Which entries a compaction keeps: one set, or one per layer or per
    /// (layer, KV head) (`Engine::compact_lists`).
    pub granularity: Granularity,
    /// What the eviction policy needs computed besides the forward pass.
    pub signals: Signals,
    /// At most this many slots per page of a layer's key or value cache (a
    /// multiple of 256). None: a page is as large as one storage binding of
    /// the device allows, so a cache that fits one binding is one buffer.
    /// Smaller pages change no result; the tests use them to exercise paging.
    pub kv_page_slots: Option<usize>,
    /// The activations of a [`Batch`] this engine's sequence steps in (set
    /// by `Batch::sequence`): its kernels read and write those buffers,
    /// its own `Step` uniform placing its rows; None: its own buffers.
    pub shared_activations: Option<SharedActivations>,
    /// A cache lent to this engine (at least `max_slots` slots; a
    /// scheduler's pool): it uses those buffers and allocates none. None:
    /// its own.
    pub kv_cache: Option<KvCache>,
    /// The most positions this engine's sequence is meant to reach (the
    /// context its caller states), which picks LongRoPE's factors. None:
    /// `max_slots` for a full cache, no end for a bounded one.
    pub max_position: Option<usize>,
}

impl EngineOptions {
    /// Whether this engine can see positions past LongRoPE's original
    /// context, and so takes its long frequencies (llama.cpp's rule: by the
    /// context, not by the positions seen so far, so that every key in the
    /// cache is rotated alike): [`EngineOptions::max_position`] past it.
    pub fn sees_positions_past(&self, rope: &crate::kernels::rope_kv::Rope) -> bool {
        let reach = match (self.max_position, self.max_keep) {
            (Some(p), _) => p,
            (None, Some(_)) => usize::MAX,
            (None, None) => self.max_slots,
        };
        rope.long.as_ref().is_some_and(|l| reach > l.original)
    }
}

/// Which rows of a step get logits, and whether to sample from the last one.
#[derive(Clone, Copy, Debug)]
pub struct StepOutput {
    /// First row (within the step) whose logits are computed.
    pub logit_row0: usize,
    /// Number of rows with logits (0 = none).
    pub n_logits: usize,
    /// Sample a token from the last logit row with these settings and step counter.
    pub sample: Option<(SamplingParams, u32)>,
}

impl StepOutput {
    pub const NONE: StepOutput = StepOutput {
        logit_row0: 0,
        n_logits: 0,
        sample: None,
    };
    /// Logits of the last row only.
    pub fn last(n_tokens: usize) -> Self {
        StepOutput {
            logit_row0: n_tokens - 1,
            n_logits: 1,
            sample: None,
        }
    }
}

/// Where a step's token ids come from.
#[derive(Clone, Copy, Debug)]
pub enum StepIds<'a> {
    /// Given by the caller.
    Host(&'a [u32]),
    /// The one token that the previous step sampled, still on the GPU: the
    /// step copies it into its input there, so it can be submitted before the
    /// token is read back (decode overlaps the host's recording of step t + 1
    /// with the GPU's running of step t). Should that token turn out to be
    /// the NaN marker, the step embeds an arbitrary row (WGSL clamps the
    /// read); `complete` of the previous step reports the error and the
    /// caller undoes this one.
    LastSampled,
}

/// A step on the GPU that has not been waited for (`Engine::submit`); hand
/// it to `Engine::complete` or `Engine::undo`.
#[must_use = "a submitted step must be completed or undone"]
#[derive(Debug)]
pub struct Submitted {
    index: wgpu::SubmissionIndex,
    /// The readback buffer holding its sampled token, if it samples, and
    /// the bytes staged (the token, and its log-probabilities when asked).
    staging: Option<(usize, u64)>,
    /// The readback buffer holding its EpiKV signal, if layers are tracked.
    delta_staging: Option<usize>,
    /// Whether it saved the policy state it changes (`Engine::undo` restores it).
    saved_state: bool,
    /// Whether its sampling is still to be submitted (`Engine::submit_forward`).
    sample_pending: bool,
    first_slot: usize,
    n_tokens: usize,
}

/// Two readback buffers used in turn, so that a step's result is read
/// while the next step (which copies into the other) is already submitted.
pub(crate) struct Readbacks {
    buffers: [wgpu::Buffer; 2],
    next: usize,
}

impl Submitted {
    /// Whether its sampling is still to be submitted (`submit_samples`).
    pub fn sample_pending(&self) -> bool {
        self.sample_pending
    }
}

impl Readbacks {
    fn new(gpu: &Runtime, label: &str, bytes: u64) -> Self {
        Readbacks {
            buffers: [0, 1].map(|_| gpu.readback(label, bytes)),
            next: 0,
        }
    }

    /// Copies the first `bytes` of `src` into the next buffer; which one.
    fn stage(&mut self, enc: &mut wgpu::CommandEncoder, src: &wgpu::Buffer, bytes: u64) -> usize {
        let k = self.next;
        self.next = 1 - k;
        enc.copy_buffer_to_buffer(src, 0, &self.buffers[k], 0, bytes);
        k
    }

    fn buffer(&self, k: usize) -> &wgpu::Buffer {
        &self.buffers[k]
    }

    /// Bytes of both buffers.
    fn bytes(&self) -> u64 {
        2 * self.buffers[0].size()
    }
}

pub struct Engine {
    pub model: Arc<Model>,
    pub opts: EngineOptions,
    acts: Activations,
    /// The batch whose activations this engine shares, if any.
    batch: Option<u64>,
    embed: Embed,
    layers: Vec<LayerKernels>,
    final_norm: RmsNorm,
    lm_head: Matmul,
    sampler: Sampler,
    /// Where sampled tokens are read back.
    sample_staging: Readbacks,
    /// The log-probabilities the last completed sampling step reported.
    last_logprobs: Option<TokenLogprobs>,
    /// Whether the last submitted step sampled (`StepIds::LastSampled` reads its token).
    last_step_sampled: bool,
    compactor: Option<Compactor>,
    /// What the policy reads besides the forward pass.
    signals: SignalKernels,
    /// The cache's slot positions (`KvCache::positions`), written each step.
    slot_positions: wgpu::Buffer,
    /// Bytes of the attention partials buffer: at most one storage binding,
    /// which can bound how many queries a step takes at depth.
    partials_capacity: u64,
    /// Entries in the cache (the next token goes to this slot).
    pub n_cached: usize,
    /// Bytes of every buffer the engine allocated (weights not included).
    pub buffer_bytes: u64,
    /// When set, the residual stream after the embedding and after every layer
    /// is copied here: `[layers + 1, max_tokens, hidden]` (tests and inspection).
    capture: Option<wgpu::Buffer>,
    /// Per-kernel timestamps (`set_profiling`).
    profiler: Option<crate::profile::Profiler>,
    /// CPU seconds the last step spent recording and submitting its commands
    /// (checks, buffer writes, encoding, submit; not the wait for the GPU).
    /// The GPU idles meanwhile, so for decode on a fast GPU this is part of
    /// every token's time; `sieve bench` reports it.
    pub last_record_seconds: f64,
}

impl Engine {
    pub fn new(model: Arc<Model>, opts: EngineOptions) -> Result<Self> {
        let key_slots = opts.max_slots;
        Self::new_with(model, opts, key_slots)
    }

    /// As `new`, with the attention partials sized for queries over
    /// `key_slots` keys (a batch's trunk: the most slots of its sequences).
    fn new_with(model: Arc<Model>, opts: EngineOptions, key_slots: usize) -> Result<Self> {
        // Buffers the device cannot allocate (out of memory, or larger than
        // its largest buffer) become an error here, not a crash later.
        let device = model.gpu.device.clone();
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let built = Self::build(model, opts, key_slots);
        let invalid = crate::platform::block_on(invalid.pop());
        let oom = crate::platform::block_on(oom.pop());
        let engine = built?;
        if let Some(err) = oom.or(invalid) {
            crate::error::bail_kind!(
                crate::error::ErrorKind::GpuOutOfMemory,
                "the GPU cannot hold this engine's buffers ({:.1} MiB of cache, activations and scratch besides {:.1} MiB of weights): {err}",
                engine.buffer_bytes as f64 / 1048576.0,
                engine.model.weight_bytes as f64 / 1048576.0
            );
        }
        Ok(engine)
    }

    fn build(model: Arc<Model>, opts: EngineOptions, key_slots: usize) -> Result<Self> {
        let gpu = model.gpu.clone();
        if opts.max_tokens == 0 || opts.max_slots == 0 {
            bail!("the cache and the prefill chunk need at least one slot");
        }
        check_sizes(&model, &opts)?;
        let mut bytes = 0u64;
        let (acts, partials_capacity, batch) = match &opts.shared_activations {
            Some(shared) => {
                let acts = Activations {
                    step: gpu.uniform("step", &Step::default()),
                    ..shared.acts.clone()
                };
                let capacity = acts.part.size();
                (acts, capacity, Some(shared.batch))
            }
            None => {
                let (acts, capacity) =
                    Activations::new(&gpu, &model, &opts, key_slots, &mut bytes)?;
                (acts, capacity, None)
            }
        };
        let KvCache {
            k: k_cache,
            v: v_cache,
            positions: slot_positions,
        } = KvCache::for_engine(&model, &opts, &mut bytes)?;
        let layers = (0..model.layers.len())
            .map(|l| {
                let cache = (&k_cache[l], &v_cache[l], &slot_positions);
                LayerKernels::new(&gpu, &model, &opts, l, &acts, cache)
            })
            .collect::<Result<Vec<_>>>()?;
        let a = &acts;
        let (h, eps) = (model.config.hidden_size, model.config.rms_norm_eps);
        let embed_scale = if model.config.family.scales_embeddings {
            (h as f32).sqrt()
        } else {
            1.0
        };
        let embed = Embed::new(&gpu, &a.step, &model.embed, &a.ids, &a.x, embed_scale)?;
        let final_norm = RmsNorm::new(
            &gpu,
            &a.step,
            h,
            eps,
            &model.final_norm,
            &a.x,
            &a.xn,
            Rows::Logits,
        )?;
        let logit_rows = MatmulOptions {
            accumulate: false,
            rows: Rows::Logits,
        };
        let lm_head = Matmul::new(
            &gpu,
            &a.step,
            model.head(),
            None,
            &a.xn,
            &a.logits,
            logit_rows,
        )?;
        let sampler = Sampler::new(&gpu, model.config.vocab_size, &a.logits)?;
        let signals = SignalKernels::new(
            &gpu,
            &model,
            &opts,
            a,
            (&k_cache, &v_cache),
            &slot_positions,
            &mut bytes,
        )?;
        let compactor = match opts.max_keep {
            Some(keep) => {
                // Per-slot data of the policy moves with the cache.
                // (at any granularity the policies that keep such data
                // keep one set: every list is the same).
                let singles = signals.compacted_with_cache(&gpu, opts.max_slots, h);
                let (layers, n_kv) = (model.config.num_layers, model.heads().n_kv);
                let lists = opts.granularity.lists(layers, n_kv);
                let positions = SlotPages::single(
                    &gpu,
                    slot_positions.clone(),
                    opts.max_slots,
                    4 * lists as u64,
                );
                let kv = |l: usize| opts.granularity.kv_rows(l, n_kv);
                let targets: Vec<(&SlotPages, RowLists)> = (k_cache.iter().enumerate())
                    .chain(v_cache.iter().enumerate())
                    .map(|(l, pages)| (pages, kv(l)))
                    .chain(singles.iter().map(|s| (s, RowLists::whole(0))))
                    .chain([(
                        &positions,
                        RowLists {
                            first: 0,
                            per_row: lists,
                        },
                    )])
                    .collect();
                let compactor = Compactor::new(&gpu, &targets, keep, lists)?;
                bytes += compactor.scratch_bytes();
                Some(compactor)
            }
            None => None,
        };
        let sample_staging = Readbacks::new(&gpu, "sampled-token", RESULT_BYTES);
        Ok(Engine {
            model,
            opts,
            acts,
            batch,
            embed,
            layers,
            final_norm,
            lm_head,
            sampler,
            sample_staging,
            last_logprobs: None,
            last_step_sampled: false,
            compactor,
            signals,
            slot_positions,
            partials_capacity,
            n_cached: 0,
            buffer_bytes: bytes,
            capture: None,
            profiler: None,
            last_record_seconds: 0.0,
        })
    }

    /// Starts (or stops) timing every kernel of each step with GPU timestamps;
    /// returns false when the adapter cannot.
    pub fn set_profiling(&mut self, on: bool) -> bool {
        self.profiler = if on {
            crate::profile::Profiler::new(&self.model.gpu)
        } else {
            None
        };
        self.profiler.is_some()
    }

    /// The kernel times gathered since profiling was turned on.
    pub fn profiler(&mut self) -> Option<&mut crate::profile::Profiler> {
        self.profiler.as_mut()
    }

    /// Starts (or stops) copying the residual stream after every layer.
    pub fn set_capture(&mut self, on: bool) {
        let c = &self.model.config;
        self.capture = on.then(|| {
            let size = ((c.num_layers + 1) * self.opts.max_tokens * c.hidden_size) as u64 * 4;
            self.model.gpu.storage("hidden-capture", size)
        });
    }

    /// Forgets the cache contents (the buffers stay allocated).
    pub fn reset(&mut self) {
        self.n_cached = 0;
        self.last_step_sampled = false;
    }

    /// Marks `tokens` as seen for the repetition penalty (the prompt).
    pub fn reset_seen(&self, tokens: &[u32]) {
        self.sampler.reset_seen(&self.model.gpu, tokens);
    }

    /// Whether sampling steps also report log-probabilities, with how many
    /// top entries (None: no); read back with [`Engine::take_logprobs`].
    pub fn set_logprobs(&mut self, top: Option<usize>) {
        self.sampler.set_logprobs(top);
        self.last_logprobs = None;
    }

    /// The log-probabilities of the last completed step's sampled token,
    /// when asked for (`set_logprobs`).
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.last_logprobs.take()
    }

    /// Copies the sampler's result (what a choice filled) for reading back.
    pub(crate) fn stage_sample(&mut self, enc: &mut wgpu::CommandEncoder) -> (usize, u64) {
        let n = self.sampler.result_bytes();
        (self.sample_staging.stage(enc, &self.sampler.result, n), n)
    }

    /// The tokens the next sampling step may choose (a constraint's mask,
    /// one bit per token of the vocabulary; see `Sampler::set_allowed`),
    /// or None for every token. Kept until changed.
    pub fn set_allowed(&self, mask: Option<&[u32]>) -> Result<()> {
        self.sampler.set_allowed(&self.model.gpu, mask)
    }

    /// The most queries whose attention partials over `n_keys(n)` keys fit
    /// the partials buffer (at most `max_tokens`; at least 1).
    fn max_queries(&self, n_keys: impl Fn(usize) -> usize) -> usize {
        let heads = self.model.heads();
        let fits =
            |n: usize| Attention::partials_bytes(heads, n, n_keys(n)) <= self.partials_capacity;
        // The bytes grow with n: binary search for the last n that fits.
        let (mut lo, mut hi) = (1, self.opts.max_tokens);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// The most tokens the next step can take: `max_tokens`, or fewer deep in
    /// a long context when their attention partials would exceed one storage
    /// binding of the device.
    pub fn max_step_tokens(&self) -> usize {
        let start = self.n_cached;
        self.max_queries(|n| start + n)
    }

    /// Runs one step: `ids` at `positions` go to cache slots `n_cached..`.
    /// Returns the sampled token when `out.sample` is set.
    pub fn step(&mut self, ids: &[u32], positions: &[u32], out: StepOutput) -> Result<Option<u32>> {
        let submitted = self.submit(StepIds::Host(ids), positions, out)?;
        self.complete(submitted)
    }

    /// Whether `StepIds::LastSampled` steps can be submitted now (the last
    /// step sampled, and no per-kernel profiling, whose queries one step at a
    /// time reuses).
    pub fn can_chain(&self) -> bool {
        self.last_step_sampled && self.profiler.is_none()
    }

    /// Records and submits one step without waiting for it (`step` is this
    /// and `complete`). Its tokens take cache slots `n_cached..` at once, so
    /// the next step can be submitted behind it. Steps complete in order.
    pub fn submit(
        &mut self,
        ids: StepIds,
        positions: &[u32],
        out: StepOutput,
    ) -> Result<Submitted> {
        self.submit_inner(ids, positions, out, false)
    }

    /// As `submit` for a sampling step, but its sampling is left for
    /// [`submit_samples`]: the host computes what the choice needs (a
    /// constraint's token mask, which depends on the token this step feeds)
    /// while the GPU runs the forward pass.
    pub fn submit_forward(
        &mut self,
        ids: StepIds,
        positions: &[u32],
        out: StepOutput,
    ) -> Result<Submitted> {
        if out.sample.is_none() {
            bail!("only a sampling step can leave its sampling for later");
        }
        self.submit_inner(ids, positions, out, true)
    }

    fn submit_inner(
        &mut self,
        ids: StepIds,
        positions: &[u32],
        out: StepOutput,
        defer_sample: bool,
    ) -> Result<Submitted> {
        let recording = web_time::Instant::now();
        let n = self.check_step(&ids, positions, &out)?;
        let gpu = self.model.gpu.clone();
        let step = Step {
            n_tokens: n as u32,
            start_slot: self.n_cached as u32,
            logit_row0: out.logit_row0 as u32,
            n_logits: out.n_logits as u32,
            ..Default::default()
        };
        let a = &self.acts;
        gpu.write(&a.step, 0, bytemuck::bytes_of(&step));
        gpu.write(&a.positions, 0, bytemuck::cast_slice(positions));
        self.write_slot_positions(positions);
        if let Some((params, counter)) = &out.sample {
            self.sampler
                .set_params(&gpu, params, (out.n_logits - 1) as u32, *counter);
        }
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        // (Queue writes land before this submission's commands; the copy is
        // ordered after the previous submission's sampling.)
        match ids {
            StepIds::Host(ids) => gpu.write(&a.ids, 0, bytemuck::cast_slice(ids)),
            StepIds::LastSampled => {
                enc.copy_buffer_to_buffer(&self.sampler.result, 0, &a.ids, 0, 4);
                // A step submitted ahead may be undone (its token not
                // emitted): save what it changes for the policy.
                self.signals.save(&mut enc);
            }
        }
        let saved_state = matches!(ids, StepIds::LastSampled);
        let (nt, start) = (n as u32, self.n_cached as u32);
        let samples_now = out.sample.is_some() && !defer_sample;
        self.encode_step(&mut enc, nt, start, &out, samples_now);
        if let Some(pr) = self.profiler.as_ref() {
            pr.resolve(&mut enc);
        }
        let staging = samples_now.then(|| self.stage_sample(&mut enc));
        let delta_staging = self.signals.stage_deltas(&mut enc, n);
        let index = gpu.queue.submit([enc.finish()]);
        self.last_record_seconds = recording.elapsed().as_secs_f64();
        self.last_step_sampled = samples_now;
        let first_slot = self.n_cached;
        self.n_cached += n;
        Ok(Submitted {
            index,
            staging,
            delta_staging,
            saved_state,
            sample_pending: defer_sample,
            first_slot,
            n_tokens: n,
        })
    }

    /// Records the original positions of a step's tokens for the slots
    /// they go to (from `n_cached` on), in every keep list, which sliding
    /// windows mask by.
    fn write_slot_positions(&self, positions: &[u32]) {
        let lists = self.keep_lists();
        let offset = (self.n_cached * lists) as u64 * 4;
        let rows: Vec<u32> = (positions.iter())
            .flat_map(|&p| std::iter::repeat_n(p, lists))
            .collect();
        let gpu = &self.model.gpu;
        gpu.write(&self.slot_positions, offset, bytemuck::cast_slice(&rows));
    }

    /// Keep lists of a compaction: 1, the layers, or the layers times the
    /// KV heads (`EngineOptions::granularity`).
    pub fn keep_lists(&self) -> usize {
        let c = &self.model.config;
        (self.opts.granularity).lists(c.num_layers, self.model.heads().n_kv)
    }

    /// The step's token count, after checking the step against the
    /// engine's sizes, the vocabulary and the logit rows.
    fn check_step(&self, ids: &StepIds, positions: &[u32], out: &StepOutput) -> Result<usize> {
        let c = &self.model.config;
        let n = match ids {
            StepIds::Host(ids) => ids.len(),
            StepIds::LastSampled => {
                if !self.can_chain() {
                    bail!("a step can take the last sampled token only right after a sampling step, with profiling off");
                }
                1
            }
        };
        if n == 0 || n > self.opts.max_tokens {
            bail!("a step takes 1 to {} tokens, got {n}", self.opts.max_tokens);
        }
        if n > self.max_step_tokens() {
            bail!(
                "a step at cache depth {} takes at most {} tokens (their attention partials must fit one storage binding of {} bytes), got {n}",
                self.n_cached,
                self.max_step_tokens(),
                self.model.gpu.max_binding
            );
        }
        if positions.len() != n {
            bail!("{} positions for {n} tokens", positions.len());
        }
        if self.n_cached + n > self.opts.max_slots {
            crate::error::bail_kind!(
                crate::error::ErrorKind::PromptTooLong,
                "the context needs {} cache slots but this engine holds {} (a longer max_context, or a bounded cache with a KV budget)",
                self.n_cached + n,
                self.opts.max_slots
            );
        }
        if let StepIds::Host(ids) = ids {
            if let Some(&bad) = ids.iter().find(|&&i| i as usize >= c.vocab_size) {
                crate::error::bail_kind!(
                    crate::error::ErrorKind::InvalidOptions,
                    "token id {bad} is outside the vocabulary of {} tokens",
                    c.vocab_size
                );
            }
        }
        if out.n_logits > self.opts.max_logit_rows || out.logit_row0 + out.n_logits > n {
            bail!(
                "logit rows {}..{} are not within the step's {n} rows (at most {} rows)",
                out.logit_row0,
                out.logit_row0 + out.n_logits,
                self.opts.max_logit_rows
            );
        }
        if out.sample.is_some() && out.n_logits == 0 {
            bail!("sampling needs logits");
        }
        Ok(n)
    }

    /// Encodes one step's compute pass: embedding, the layers (with the
    /// copies for CCS and capture, the policy signals), the final norm, the
    /// LM head and sampling.
    fn encode_step(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        nt: u32,
        start: u32,
        out: &StepOutput,
        samples: bool,
    ) {
        let c = &self.model.config;
        let a = &self.acts;
        let hidden_bytes = (nt as usize * c.hidden_size * 4) as u64;
        let capture_stride = (self.opts.max_tokens * c.hidden_size * 4) as u64;
        let mut pass = Some(
            enc.begin_compute_pass(&Default::default())
                .forget_lifetime(),
        );
        let mut prof = self.profiler.as_mut();
        macro_rules! mark {
            ($p:expr, $label:expr) => {
                if let Some(pr) = prof.as_mut() {
                    pr.mark($p, $label);
                }
            };
        }
        mark!(pass.as_mut().unwrap(), "start");
        self.embed.encode(pass.as_mut().unwrap(), nt);
        mark!(pass.as_mut().unwrap(), "embedding");
        let ccs_store = self.signals.last_layer_inputs();
        for (l, k) in self.layers.iter().enumerate() {
            if let (Some(store), true) = (ccs_store, l + 1 == self.layers.len()) {
                // The residual stream entering the last layer, kept per slot for CCS.
                let row = (c.hidden_size * 4) as u64;
                copy_between_passes(
                    enc,
                    &mut pass,
                    (&a.x, 0),
                    store,
                    start as u64 * row,
                    hidden_bytes,
                );
            }
            if let Some(cap) = &self.capture {
                let at = l as u64 * capture_stride;
                copy_between_passes(enc, &mut pass, (&a.x, 0), cap, at, hidden_bytes);
            }
            let p = pass.as_mut().unwrap();
            mark!(p, "copies");
            let attention = LayerAttention::Causal {
                start,
                weights: self.signals.weights_of(l),
                queries: self.signals.queries_of(l),
            };
            k.encode(p, nt, attention, &mut |p, label| mark!(p, label));
            for d in self.signals.deltas_after(l) {
                d.encode(p, nt);
                mark!(p, "epikv delta");
            }
        }
        self.signals
            .encode_reduce(pass.as_mut().unwrap(), nt, start, &mut |p, label| {
                mark!(p, label)
            });
        if let Some(cap) = &self.capture {
            let at = c.num_layers as u64 * capture_stride;
            copy_between_passes(enc, &mut pass, (&a.x, 0), cap, at, hidden_bytes);
        }
        {
            let p = pass.as_mut().unwrap();
            mark!(p, "copies");
            if out.n_logits > 0 {
                self.final_norm.encode(p, out.n_logits as u32);
                mark!(p, "rmsnorm");
                self.lm_head.encode(p, out.n_logits as u32);
                mark!(p, "lm head matmul");
            }
            if samples {
                self.sampler.encode(p);
                mark!(p, "sampling");
            }
        }
    }

    /// Waits for a submitted step and returns its sampled token, if it
    /// samples. A caller completes every step it submits (`step` does), or
    /// undoes the last one: steps that read nothing back (prompt chunks) would
    /// otherwise queue a whole prompt on the GPU at once, a cancel would still
    /// wait for all of it, and on a device shared with a renderer every frame
    /// would wait behind it (on a CPU driver, seconds).
    pub fn complete(&mut self, s: Submitted) -> Result<Option<u32>> {
        if s.sample_pending {
            bail!("the step's sampling was never submitted (submit_samples)");
        }
        let gpu = self.model.gpu.clone();
        let token = match s.staging {
            Some((k, n)) => {
                let bytes = gpu
                    .map_and_read_after(self.sample_staging.buffer(k), n, Some(s.index.clone()))
                    .context("reading the sampled token")?;
                let words: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
                self.last_logprobs = TokenLogprobs::from_result(&words);
                Some(words[0])
            }
            None => {
                crate::platform::wait_for_gpu(&gpu.device, &gpu.queue, Some(s.index.clone()))?;
                None
            }
        };
        if let Some(k) = s.delta_staging {
            self.signals
                .read_staged_deltas(&gpu, k, s.n_tokens, s.index)?;
        }
        if let Some(pr) = self.profiler.as_mut() {
            pr.collect(&gpu)?;
        }
        if token == Some(crate::kernels::sample::NONFINITE) {
            crate::error::bail_kind!(
                crate::error::ErrorKind::NonFiniteLogits,
                "the logits of the token in cache slot {} hold NaN or infinity (non-finite weights, or values that overflowed); no token sampled",
                s.first_slot + s.n_tokens - 1
            );
        }
        Ok(token)
    }

    /// Takes the last submitted step's tokens out of the cache again (a
    /// decode step submitted ahead of a token that ended the generation),
    /// without waiting for it: the GPU may still be running it, and whatever
    /// is submitted later (which rewrites its slots) runs after it. Its
    /// sampled token is dropped; the repetition penalty's seen set may keep
    /// it until the next `reset_seen`. What it changed for an evicting policy
    /// (attention-weight sums, EpiKV's previous hidden states) is put back
    /// from the copy it took first; only a `StepIds::LastSampled` step takes
    /// one, so only such a step can be undone where a policy keeps state.
    pub fn undo(&mut self, s: Submitted) -> Result<()> {
        if self.signals.keeps_state() && !s.saved_state {
            bail!("a step fed from the host cannot be undone while an evicting policy keeps state on the GPU (only steps submitted ahead save it)");
        }
        if s.first_slot + s.n_tokens != self.n_cached {
            bail!(
                "only the last submitted step can be undone (it took slots {}..{}, the cache holds {})",
                s.first_slot,
                s.first_slot + s.n_tokens,
                self.n_cached
            );
        }
        self.signals.restore(&self.model.gpu);
        self.n_cached = s.first_slot;
        self.last_step_sampled = false;
        Ok(())
    }

    /// Logits of the last step: `[n_logits, vocab]` row-major.
    /// An error when a row holds NaN or infinity, naming the row: a
    /// non-finite answer is never returned as if it were one.
    pub fn read_logits(&self, n_logits: usize) -> Result<Vec<f32>> {
        self.read_logit_rows(0, n_logits)
    }

    /// Rows `first..first + n` of the logits buffer (row 0 is the step's
    /// first logit row), checked finite.
    fn read_logit_rows(&self, first: usize, n: usize) -> Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        let logits: Vec<f32> =
            self.model
                .gpu
                .read(&self.acts.logits, (first * vocab) as u64, n * vocab)?;
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            crate::error::bail_kind!(
                crate::error::ErrorKind::NonFiniteLogits,
                "logit row {} of {n} (token {} of the vocabulary) is {} (non-finite weights, or values that overflowed)",
                first + i / vocab,
                i % vocab,
                logits[i]
            );
        }
        Ok(logits)
    }

    /// Captured residual stream of the last step for layer index `l` (0 = embedding
    /// output, l = output of decoder layer l): `[n, hidden]`.
    pub fn read_hidden(&self, l: usize, n: usize) -> Result<Vec<f32>> {
        let cap = self
            .capture
            .as_ref()
            .context("hidden-state capture is off")?;
        let c = &self.model.config;
        let offset = (l * self.opts.max_tokens * c.hidden_size) as u64;
        self.model.gpu.read(cap, offset, n * c.hidden_size)
    }

    /// Keeps the cache slots listed in `keep` (ascending), moved to slots
    /// 0..keep.len() of every layer's K and V, on the GPU: every keep list
    /// the same.
    pub fn compact(&mut self, keep: &[u32]) -> Result<()> {
        let lists = vec![keep; self.keep_lists()];
        self.compact_lists(&lists)
    }

    /// Keeps the cache slots of each keep list (`keep_lists()` of them:
    /// layer l's KV head h takes list `Granularity::list_of(l, h)`), each
    /// ascending and all of one length, moved to slots 0..len.
    pub fn compact_lists(&mut self, lists: &[&[u32]]) -> Result<()> {
        let c = self
            .compactor
            .as_ref()
            .context("this engine was built without a KV budget (EngineOptions::max_keep)")?;
        let n = self.n_cached;
        if let Some(k) = lists
            .iter()
            .filter_map(|l| l.last())
            .find(|&&k| k as usize >= n)
        {
            bail!("keep list names slot {k} of {n} cached");
        }
        c.compact(&self.model.gpu, lists)?;
        self.n_cached = lists.first().map_or(0, |l| l.len());
        Ok(())
    }

    /// Waits for all submitted work.
    pub fn sync(&self) -> Result<()> {
        let gpu = &self.model.gpu;
        crate::platform::wait_for_gpu(&gpu.device, &gpu.queue, None)
    }
}

/// Most cache slots (and tokens per step) an engine takes: slot and row
/// indices are u32 in the kernels, and half that range leaves room for
/// index arithmetic.
pub const MAX_SLOTS: usize = (u32::MAX / 2) as usize;

impl LayerKernels {
    /// Layer `w`'s kernels bound to the step's activations and its own
    /// key and value cache.
    fn new(
        gpu: &Runtime,
        model: &Model,
        opts: &EngineOptions,
        layer: usize,
        a: &Activations,
        (k_cache, v_cache, slot_positions): (&SlotPages, &SlotPages, &wgpu::Buffer),
    ) -> Result<Self> {
        let c = &model.config;
        let (h, eps, step) = (c.hidden_size, c.rms_norm_eps, &a.step);
        let spec = &c.layers[layer];
        let w = &model.layers[layer];
        let add = MatmulOptions {
            accumulate: true,
            rows: Rows::Tokens,
        };
        let set = MatmulOptions {
            accumulate: false,
            rows: Rows::Tokens,
        };
        let normed = |weights| {
            Some(FusedInput::RmsNorm {
                residual: &a.x,
                weights,
                eps,
            })
        };
        // With sandwich norms the attention and MLP outputs go to `xn` (free
        // by then), and their norms add them to the residual `x`.
        let (out, out_mode) = match &w.post_norms {
            Some(_) => (&a.xn, set),
            None => (&a.x, add),
        };
        let post_norms = match &w.post_norms {
            Some((attn, mlp)) => Some((
                RmsNorm::accumulating(gpu, step, h, eps, attn, &a.xn, &a.x)?,
                RmsNorm::accumulating(gpu, step, h, eps, mlp, &a.xn, &a.x)?,
            )),
            None => None,
        };

        Ok(LayerKernels {
            attn_norm: RmsNorm::new(gpu, step, h, eps, &w.attn_norm, &a.x, &a.xn, Rows::Tokens)?,
            qkv: Matmul::normed(
                gpu,
                step,
                &w.qkv,
                w.qkv_bias.as_ref(),
                &a.xn,
                &a.qkv,
                set,
                normed(&w.attn_norm),
            )?,
            qk_norm: match &w.qk_norm {
                Some((q_w, k_w)) => Some(HeadNorm::new(
                    gpu,
                    step,
                    model.heads(),
                    eps,
                    0.0,
                    &a.qkv,
                    (q_w, k_w),
                )?),
                None => None,
            },
            rope: RopeKv::new(
                gpu,
                step,
                model.heads(),
                &spec.rope,
                &a.qkv,
                &a.positions,
                w.rope_frequencies(opts.sees_positions_past(&spec.rope)),
                &a.q,
                Some((k_cache, v_cache)),
            )?,
            attn: Attention::new(
                gpu,
                step,
                model.heads(),
                opts.max_slots,
                &a.q,
                k_cache,
                v_cache,
                &a.part,
                &a.attn_out,
                &a.lse,
                &a.qslot,
                attn_layer(model, opts, layer, slot_positions),
            )?,
            o: Matmul::new(
                gpu,
                step,
                &w.o,
                w.o_bias.as_ref(),
                &a.attn_out,
                out,
                out_mode,
            )?,
            mlp_norm: RmsNorm::new(gpu, step, h, eps, &w.mlp_norm, &a.x, &a.xn, Rows::Tokens)?,
            gate_up: Matmul::normed(
                gpu,
                step,
                &w.gate_up,
                None,
                &a.xn,
                &a.gate_up,
                set,
                normed(&w.mlp_norm),
            )?,
            silu: SiluMul::new(
                gpu,
                step,
                c.intermediate_size,
                spec.activation,
                &a.gate_up,
                &a.act,
            )?,
            // The mat-vecs fold in SiLU only: another activation runs first.
            down: Matmul::normed(
                gpu,
                step,
                &w.down,
                None,
                &a.act,
                out,
                out_mode,
                (spec.activation == Activation::Silu).then_some(FusedInput::SwiGlu {
                    gate_up: &a.gate_up,
                }),
            )?,
            post_norms,
        })
    }
}

/// What the attention kernels (and the attention weights of H2O and TOVA,
/// and the query scores) of layer `l` compute beyond plain causal
/// attention: its score scale, and its window over the cache's slot
/// positions (each KV head's in its keep list).
fn attn_layer<'a>(
    model: &Model,
    opts: &EngineOptions,
    l: usize,
    slot_positions: &'a wgpu::Buffer,
) -> AttnLayer<'a> {
    let c = &model.config;
    let spec = &c.layers[l];
    let positions = (opts.granularity).positions_of(l, c.num_layers, model.heads().n_kv);
    AttnLayer {
        scale: spec.attn_scale,
        window: spec.window.map(|size| Window {
            // A window past u32 range hides nothing the kernels index.
            size: size.min(u32::MAX as usize) as u32,
            slot_positions,
            positions,
        }),
    }
}

/// Refuses, before anything is allocated, sizes that cannot work: more slots
/// or tokens than the kernels index, or buffers (the KV cache, the per-token
/// activations, the logits) more than the device can hold in total
/// ([`Gpu::memory_ceiling`](crate::gpu::Gpu::memory_ceiling)), computed
/// without overflow.
fn check_sizes(model: &Model, opts: &EngineOptions) -> Result<()> {
    let c = &model.config;
    for (what, n) in [
        ("cache slots (context or KV budget + chunk)", opts.max_slots),
        ("tokens per step (prefill chunk)", opts.max_tokens),
        ("logit rows per step", opts.max_logit_rows),
    ] {
        if n > MAX_SLOTS {
            crate::error::bail_kind!(
                crate::error::ErrorKind::InvalidOptions,
                "{n} {what} is more than the kernels index (at most {MAX_SLOTS})"
            );
        }
    }
    let (slots, tokens) = (opts.max_slots as u128, opts.max_tokens as u128);
    let kv = 2 * c.num_layers as u128 * slots * model.heads().kv_row_bytes() as u128;
    let per_token = (2 * c.hidden_size + c.qkv_dim() + 2 * c.num_heads * c.head_dim) as u128
        + 3 * c.intermediate_size as u128;
    let activations = tokens * per_token * 4;
    let logits = opts.max_logit_rows as u128 * c.vocab_size as u128 * 4;
    let ccs = if opts.signals.counter_causal.is_some() {
        slots * c.hidden_size as u128 * 4
    } else {
        0
    };
    let total = kv + activations + logits + ccs;
    let ceiling = model.gpu.memory_ceiling();
    if total > ceiling as u128 {
        let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
        crate::error::bail_kind!(
            crate::error::ErrorKind::GpuOutOfMemory,
            "{} cache slots and {} tokens per step need {:.1} GiB of buffers ({:.1} GiB of KV cache), more than this device can hold ({:.1} GiB at most); lower the context, the KV budget or the chunk",
            opts.max_slots,
            opts.max_tokens,
            gib(total),
            gib(kv),
            gib(ceiling as u128)
        );
    }
    Ok(())
}

/// Buffer copies cannot happen inside a compute pass: end the pass, copy the
/// first `bytes` of `src` to `dst` at `offset`, and start a new pass.
fn copy_between_passes(
    enc: &mut wgpu::CommandEncoder,
    pass: &mut Option<wgpu::ComputePass<'static>>,
    (src, src_offset): (&wgpu::Buffer, u64),
    dst: &wgpu::Buffer,
    offset: u64,
    bytes: u64,
) {
    drop(pass.take());
    enc.copy_buffer_to_buffer(src, src_offset, dst, offset, bytes);
    *pass = Some(
        enc.begin_compute_pass(&Default::default())
            .forget_lifetime(),
    );
}
