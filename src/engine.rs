//! The forward pass: activation buffers, the KV cache and every kernel bound
//! once, then one compute pass (one submission) per step.
//!
//! A step processes `n` new tokens (a prefill chunk, or 1 when decoding),
//! appends their keys and values to the cache after the entries already there,
//! and optionally computes logits for a contiguous range of the step's rows and
//! samples the next token from the last of them.

use anyhow::{bail, Context, Result};
use std::sync::Arc;

use crate::kernels::attention::{Attention, KEY_CHUNK};
use crate::kernels::attn_weights::{AttnWeights, WeightMode};
use crate::kernels::compact::{Compactor, Gather};
use crate::kernels::embed::Embed;
use crate::kernels::epikv_delta::LayerDelta;
use crate::kernels::matmul::{FusedInput, Matmul, MatmulOptions};
use crate::kernels::paging::SlotPages;
use crate::kernels::rmsnorm::RmsNorm;
use crate::kernels::rope_kv::RopeKv;
use crate::kernels::sample::{Sampler, SamplingParams};
use crate::kernels::silu_mul::SiluMul;
use crate::kernels::token_logit::TokenLogit;
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
    /// Decoder layers (1-based) after which the EpiKV signal
    /// g_l(t) = ||h_l(t) - h_l(t-1)|| is computed for every token.
    pub track_layers: Vec<usize>,
    /// Accumulate the attention weight each cache slot receives (H2O, TOVA).
    pub attention_weights: Option<WeightMode>,
    /// Prepare the counter-causal pass of the CCS policies.
    pub counter_causal: Option<CcsMode>,
    /// With `attention_weights`: hold each layer's full weight matrix (heads x
    /// queries x slots) as eager attention does, to reproduce its memory.
    pub materialize: bool,
    /// At most this many slots per page of a layer's key or value cache (a
    /// multiple of 256). None: a page is as large as one storage binding of
    /// the device allows, so a cache that fits one binding is one buffer.
    /// Smaller pages change no result; the tests use them to exercise paging.
    pub kv_page_slots: Option<usize>,
}

/// The two counter-causal surprise modes (SPEC.md 4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CcsMode {
    /// From the stored residual stream entering the last layer, through the last layer.
    Fast,
    /// From the token embeddings, through every layer.
    Full,
    /// As `Fast`, but the entry's own residual stream is not added back
    /// after the attention: r_i = W_o(attn) (the `ccs-context` variant,
    /// docs/POLICIES.md), so the logit reads what the later entries say.
    FastContext,
}

impl CcsMode {
    /// Whether the pass starts from the stored residual stream entering the
    /// last layer (and runs that layer only).
    pub fn from_last_layer(self) -> bool {
        self != CcsMode::Full
    }
}

/// Buffers and kernels of the counter-causal pass.
struct CounterCausal {
    /// Per layer (all for Full, the last for Fast): RoPE writing k/v to scratch,
    /// never to the real cache.
    rope: Vec<RopeKv>,
    /// Fast mode: `[max_slots, hidden]` residual stream entering the last layer,
    /// per slot (compacted with K and V), and its gather into `x`.
    hidden: Option<(wgpu::Buffer, Gather)>,
    /// FastContext: the last layer's output projection writing x instead of
    /// adding to it (drops the entry's own residual path).
    o_without_residual: Option<Matmul>,
    token_logit: TokenLogit,
    out: wgpu::Buffer,
}

struct LayerKernels {
    attn_norm: RmsNorm,
    qkv: Matmul,
    rope: RopeKv,
    attn: Attention,
    o: Matmul,
    mlp_norm: RmsNorm,
    gate_up: Matmul,
    silu: SiluMul,
    down: Matmul,
}

/// How a layer's attention reads the cache.
#[derive(Clone, Copy)]
enum LayerAttention<'a> {
    /// The forward step: the step's rows are written to the cache from slot
    /// `start` on and attend causally; `weights` accumulates the attention
    /// each slot receives (H2O, TOVA).
    Causal {
        start: u32,
        weights: Option<&'a AttnWeights>,
    },
    /// The counter-causal pass: k/v go to scratch (`rope`), never to the
    /// cache, and each query attends the entries after it among `n_present`.
    /// `o`: an output projection to use instead of the layer's own.
    AntiCausal {
        rope: &'a RopeKv,
        n_present: u32,
        o: Option<&'a Matmul>,
    },
}

impl LayerKernels {
    /// One decoder layer over `n` rows of the residual stream. The layer
    /// sequence is written here only, for the forward step and the
    /// counter-causal pass alike, so a kernel variant or a fusion changes both.
    /// `mark` labels the kernel just encoded (per-kernel timestamps).
    fn encode(
        &self,
        p: &mut wgpu::ComputePass,
        n: u32,
        attention: LayerAttention,
        mark: &mut dyn FnMut(&mut wgpu::ComputePass, &'static str),
    ) {
        // The RMSNorms and the SwiGLU are folded into the mat-vecs after them
        // where the kernel set does that (decode with the `gpu` kernels).
        if !(n == 1 && self.qkv.fuses_input) {
            self.attn_norm.encode(p, n);
            mark(p, "rmsnorm");
        }
        self.qkv.encode(p, n);
        mark(p, "qkv matmul");
        let mut o = &self.o;
        match attention {
            LayerAttention::Causal { start, weights } => {
                self.rope.encode(p, n, start);
                mark(p, "rope + kv write");
                self.attn.encode(p, n, start);
                mark(p, "attention");
                if let Some(w) = weights {
                    w.encode_accumulate(p, n, start);
                    mark(p, "attention weights (h2o/tova)");
                }
            }
            LayerAttention::AntiCausal {
                rope,
                n_present,
                o: own_o,
            } => {
                rope.encode(p, n, n_present - n);
                mark(p, "rope + kv write");
                self.attn.encode_anticausal(p, n, n_present);
                mark(p, "attention");
                o = own_o.unwrap_or(o);
            }
        }
        o.encode(p, n);
        mark(p, "o matmul");
        if !(n == 1 && self.gate_up.fuses_input) {
            self.mlp_norm.encode(p, n);
            mark(p, "rmsnorm");
        }
        self.gate_up.encode(p, n);
        mark(p, "gate+up matmul");
        if !(n == 1 && self.down.fuses_input) {
            self.silu.encode(p, n);
            mark(p, "silu*mul");
        }
        self.down.encode(p, n);
        mark(p, "down matmul");
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
    /// The readback buffer holding its sampled token, if it samples.
    staging: Option<usize>,
    /// The readback buffer holding its EpiKV signal, if layers are tracked.
    delta_staging: Option<usize>,
    /// Whether it saved the policy state it changes (`Engine::undo` restores it).
    saved_state: bool,
    first_slot: usize,
    n_tokens: usize,
}

pub struct Engine {
    pub model: Arc<Model>,
    pub opts: EngineOptions,
    step: wgpu::Buffer,
    ids: wgpu::Buffer,
    positions: wgpu::Buffer,
    /// Residual stream `[max_tokens, hidden]`.
    x: wgpu::Buffer,
    logits: wgpu::Buffer,
    embed: Embed,
    layers: Vec<LayerKernels>,
    final_norm: RmsNorm,
    lm_head: Matmul,
    sampler: Sampler,
    /// Two readback buffers for sampled tokens, used in turn, so that a
    /// step's token can be read while the next step (which writes the other)
    /// is already submitted.
    sample_staging: [wgpu::Buffer; 2],
    next_staging: usize,
    /// Whether the last submitted step sampled (`StepIds::LastSampled` reads its token).
    last_step_sampled: bool,
    compactor: Option<Compactor>,
    /// (0-based layer index, kernel) for every tracked layer.
    deltas: Vec<(usize, LayerDelta)>,
    /// `[max_tokens, tracked layers]` g values of the step that ran last.
    delta_out: wgpu::Buffer,
    /// Two readback buffers for `delta_out`, used in turn (as the sampled
    /// tokens' are), so that a step's g values are read while the next step
    /// is already submitted; none without tracked layers.
    delta_staging: Vec<wgpu::Buffer>,
    next_delta_staging: usize,
    /// `[n, tracked layers]` g values of the last completed step.
    last_deltas: Vec<f32>,
    /// GPU state a step changes and later steps or refreshes read (the
    /// attention-weight policies' per-slot sums, EpiKV's previous hidden
    /// states), each as (state, copy): a step submitted ahead copies it
    /// first, so that `undo` can put it back.
    undo_state: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    /// Per layer, when attention weights are accumulated.
    weights: Vec<AttnWeights>,
    /// `[max_slots]` attention weight received per slot (compacted with K and V).
    slot_scores: wgpu::Buffer,
    /// `[max_tokens]` u32: each query's own slot (the counter-causal pass).
    qslot: wgpu::Buffer,
    /// Bytes of the attention partials buffer: at most one storage binding,
    /// which can bound how many queries a step takes at depth.
    partials_capacity: u64,
    ccs: Option<CounterCausal>,
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
        // Buffers the device cannot allocate (out of memory, or larger than
        // its largest buffer) become an error here, not a crash later.
        let device = model.gpu.device.clone();
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let built = Self::build(model, opts);
        let invalid = pollster::block_on(invalid.pop());
        let oom = pollster::block_on(oom.pop());
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

    fn build(model: Arc<Model>, opts: EngineOptions) -> Result<Self> {
        let gpu = model.gpu.clone();
        let c = &model.config;
        if opts.max_tokens == 0 || opts.max_slots == 0 {
            bail!("the cache and the prefill chunk need at least one slot");
        }
        let heads = model.heads();
        check_sizes(&model, &opts)?;
        let (h, t) = (c.hidden_size, opts.max_tokens as u64);
        let mut bytes = 0u64;
        let mut buf = |label: &str, size: u64| -> Result<wgpu::Buffer> {
            gpu.check_binding(label, size)?;
            bytes += size;
            Ok(gpu.storage(label, size))
        };
        let ids = buf("ids", t * 4)?;
        let positions = buf("positions", t * 4)?;
        let x = buf("x", t * h as u64 * 4)?;
        let xn = buf("x-normed", t * h as u64 * 4)?;
        let qkv = buf("qkv", t * c.qkv_dim() as u64 * 4)?;
        let q = buf("q", t * (c.num_heads * c.head_dim) as u64 * 4)?;
        let attn_out = buf("attn-out", t * (c.num_heads * c.head_dim) as u64 * 4)?;
        let lse = buf("lse", t * c.num_heads as u64 * 4)?;
        let gate_up = buf("gate-up", t * 2 * c.intermediate_size as u64 * 4)?;
        let act = buf("ffn-act", t * c.intermediate_size as u64 * 4)?;
        // Partials for max_tokens queries over every slot, but at most one
        // binding: at long contexts the deepest steps then take fewer tokens
        // (`max_step_tokens`); a single query must always fit.
        let partials_one = Attention::partials_bytes(heads, 1, opts.max_slots);
        gpu.check_binding(
            "attention partials of one query over the whole cache",
            partials_one,
        )?;
        let partials_capacity = Attention::partials_bytes(heads, opts.max_tokens, opts.max_slots)
            .min(gpu.max_binding / 16 * 16);
        let part = buf(
            "attention partials (queries x heads x key chunks)",
            partials_capacity,
        )?;
        let logits = buf(
            "logits (rows x vocabulary)",
            (opts.max_logit_rows.max(1) * c.vocab_size) as u64 * 4,
        )?;
        let qslot = buf("query slots", t * 4)?;
        // A cache larger than one storage binding is split into pages.
        let kv_row = heads.kv_row_bytes();
        let mut k_cache = Vec::new();
        let mut v_cache = Vec::new();
        for l in 0..c.num_layers {
            for (cache, what) in [(&mut k_cache, "key"), (&mut v_cache, "value")] {
                let pages = SlotPages::new(
                    &gpu,
                    &format!("layer {l} {what} cache"),
                    opts.max_slots,
                    kv_row,
                    KEY_CHUNK as usize,
                    opts.kv_page_slots,
                )?;
                bytes += pages.bytes();
                cache.push(pages);
            }
        }
        let step = gpu.uniform("step", &Step::default());
        let acc = MatmulOptions {
            accumulate: true,
            rows: Rows::Tokens,
        };
        let set = MatmulOptions {
            accumulate: false,
            rows: Rows::Tokens,
        };
        let eps = c.rms_norm_eps;
        let mut layers = Vec::new();
        for (l, w) in model.layers.iter().enumerate() {
            layers.push(LayerKernels {
                attn_norm: RmsNorm::new(&gpu, &step, h, eps, &w.attn_norm, &x, &xn, Rows::Tokens)?,
                qkv: Matmul::normed(
                    &gpu,
                    &step,
                    &w.qkv,
                    w.qkv_bias.as_ref(),
                    &xn,
                    &qkv,
                    set,
                    Some(FusedInput::RmsNorm {
                        residual: &x,
                        weights: &w.attn_norm,
                        eps,
                    }),
                )?,
                rope: RopeKv::new(
                    &gpu,
                    &step,
                    heads,
                    &qkv,
                    &positions,
                    &model.inv_freq,
                    &q,
                    Some((&k_cache[l], &v_cache[l])),
                )?,
                attn: Attention::new(
                    &gpu,
                    &step,
                    heads,
                    opts.max_slots,
                    &q,
                    &k_cache[l],
                    &v_cache[l],
                    &part,
                    &attn_out,
                    &lse,
                    &qslot,
                )?,
                o: Matmul::new(&gpu, &step, &w.o, None, &attn_out, &x, acc)?,
                mlp_norm: RmsNorm::new(&gpu, &step, h, eps, &w.mlp_norm, &x, &xn, Rows::Tokens)?,
                gate_up: Matmul::normed(
                    &gpu,
                    &step,
                    &w.gate_up,
                    None,
                    &xn,
                    &gate_up,
                    set,
                    Some(FusedInput::RmsNorm {
                        residual: &x,
                        weights: &w.mlp_norm,
                        eps,
                    }),
                )?,
                silu: SiluMul::new(&gpu, &step, c.intermediate_size, &gate_up, &act)?,
                down: Matmul::normed(
                    &gpu,
                    &step,
                    &w.down,
                    None,
                    &act,
                    &x,
                    acc,
                    Some(FusedInput::SwiGlu { gate_up: &gate_up }),
                )?,
            });
        }
        let embed = Embed::new(&gpu, &step, &model.embed, &ids, &x)?;
        let final_norm = RmsNorm::new(
            &gpu,
            &step,
            h,
            eps,
            &model.final_norm,
            &x,
            &xn,
            Rows::Logits,
        )?;
        let lm_head = Matmul::new(
            &gpu,
            &step,
            model.head(),
            None,
            &xn,
            &logits,
            MatmulOptions {
                accumulate: false,
                rows: Rows::Logits,
            },
        )?;
        let sampler = Sampler::new(&gpu, c.vocab_size, &logits)?;
        for &l in &opts.track_layers {
            if l == 0 || l > c.num_layers {
                bail!(
                    "EpiKV layer {l} is outside the model's layers 1..={}",
                    c.num_layers
                );
            }
        }
        let n_tracked = opts.track_layers.len();
        let delta_out = gpu.storage("epikv-g", (opts.max_tokens * n_tracked.max(1)) as u64 * 4);
        let delta_staging = if n_tracked == 0 {
            vec![]
        } else {
            bytes += 2 * delta_out.size();
            [0, 1]
                .map(|_| gpu.readback("epikv-g-readback", delta_out.size()))
                .into()
        };
        let mut deltas = vec![];
        let mut undo_state = vec![];
        for (column, &l) in opts.track_layers.iter().enumerate() {
            let prev = gpu.storage(&format!("layer {l} previous hidden state"), h as u64 * 4);
            bytes += h as u64 * 4 * 2;
            undo_state.push((
                prev.clone(),
                gpu.storage("saved previous hidden state", h as u64 * 4),
            ));
            let k = LayerDelta::new(
                &gpu, &step, h, column, n_tracked, &x, &positions, &prev, &delta_out,
            )?;
            deltas.push((l - 1, k));
        }
        let slot_scores = gpu.storage("slot-attention-weights", opts.max_slots as u64 * 4);
        let mut weights = vec![];
        if opts.materialize && opts.attention_weights.is_none() {
            bail!("materialize applies to the attention-weight policies (h2o, tova)");
        }
        if let Some(mode) = opts.attention_weights {
            let cell = gpu.storage(
                "attention-weight-cells",
                (c.num_heads * opts.max_slots) as u64 * 4,
            );
            bytes += (c.num_heads + 2) as u64 * opts.max_slots as u64 * 4;
            // The per-slot sums persist between steps (the cells are
            // zeroed by every step's reduce).
            let saved = gpu.storage("saved attention weights", slot_scores.size());
            undo_state.push((slot_scores.clone(), saved));
            for kc in &k_cache {
                // Eager attention holds every layer's weight matrix at once
                // (what attention-scored eviction reads): one per layer.
                let matrix = if opts.materialize {
                    let size = AttnWeights::matrix_bytes(heads, opts.max_tokens, opts.max_slots);
                    gpu.check_binding(
                        "the materialized attention matrix (heads x queries x slots)",
                        size,
                    )?;
                    bytes += size;
                    Some(gpu.storage("materialized attention matrix", size))
                } else {
                    None
                };
                weights.push(AttnWeights::new(
                    &gpu,
                    &step,
                    heads,
                    c.num_layers,
                    opts.max_slots,
                    mode,
                    &q,
                    kc,
                    &lse,
                    &cell,
                    &slot_scores,
                    opts.max_tokens,
                    matrix.as_ref(),
                )?);
            }
        }
        let ccs = match opts.counter_causal {
            None => None,
            Some(mode) => {
                let first = if mode.from_last_layer() {
                    c.num_layers - 1
                } else {
                    0
                };
                let rope = (first..c.num_layers)
                    .map(|_| {
                        // The entries' keys and values are in the cache
                        // already: the pass rotates the queries only.
                        RopeKv::new(
                            &gpu,
                            &step,
                            heads,
                            &qkv,
                            &positions,
                            &model.inv_freq,
                            &q,
                            None,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                let hidden = if mode.from_last_layer() {
                    let row = h as u64 * 4;
                    gpu.check_binding(
                        "stored last-layer inputs (slots x hidden)",
                        opts.max_slots as u64 * row,
                    )?;
                    let store =
                        gpu.storage("stored last-layer inputs", opts.max_slots as u64 * row);
                    bytes += opts.max_slots as u64 * row;
                    let gather = Gather::new(&gpu, &store, &x, row, opts.max_tokens)?;
                    Some((store, gather))
                } else {
                    None
                };
                let o_without_residual = if mode == CcsMode::FastContext {
                    let last = model.layers.last().context("a model without layers")?;
                    Some(Matmul::new(&gpu, &step, &last.o, None, &attn_out, &x, set)?)
                } else {
                    None
                };
                let out = gpu.storage("counter-causal logits", t * 4);
                let token_logit = TokenLogit::new(&gpu, &step, model.head(), &ids, &xn, &out)?;
                Some(CounterCausal {
                    rope,
                    hidden,
                    o_without_residual,
                    token_logit,
                    out,
                })
            }
        };
        let compactor = match opts.max_keep {
            Some(keep) => {
                let mut singles = vec![];
                if !weights.is_empty() {
                    singles.push(SlotPages::single(
                        &gpu,
                        slot_scores.clone(),
                        opts.max_slots,
                        4,
                    ));
                }
                if let Some((store, _)) = ccs.as_ref().and_then(|c| c.hidden.as_ref()) {
                    let row = h as u64 * 4;
                    singles.push(SlotPages::single(&gpu, store.clone(), opts.max_slots, row));
                }
                let targets: Vec<&SlotPages> =
                    k_cache.iter().chain(&v_cache).chain(&singles).collect();
                let compactor = Compactor::new(&gpu, &targets, keep)?;
                bytes += compactor.scratch_bytes();
                Some(compactor)
            }
            None => None,
        };
        let sample_staging = [0, 1].map(|_| gpu.readback("sampled-token", 4));
        Ok(Engine {
            model,
            opts,
            step,
            ids,
            positions,
            x,
            logits,
            embed,
            layers,
            final_norm,
            lm_head,
            sampler,
            sample_staging,
            next_staging: 0,
            last_step_sampled: false,
            compactor,
            deltas,
            delta_out,
            delta_staging,
            next_delta_staging: 0,
            last_deltas: vec![],
            undo_state,
            weights,
            slot_scores,
            qslot,
            partials_capacity,
            ccs,
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
        let recording = std::time::Instant::now();
        let n = match ids {
            StepIds::Host(ids) => ids.len(),
            StepIds::LastSampled => {
                if !self.can_chain() {
                    bail!("a step can take the last sampled token only right after a sampling step, with profiling off");
                }
                1
            }
        };
        let c = &self.model.config;
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
        let gpu = self.model.gpu.clone();
        let step = Step {
            n_tokens: n as u32,
            start_slot: self.n_cached as u32,
            logit_row0: out.logit_row0 as u32,
            n_logits: out.n_logits as u32,
        };
        gpu.write(&self.step, 0, bytemuck::bytes_of(&step));
        gpu.write(&self.positions, 0, bytemuck::cast_slice(positions));
        if let Some((params, counter)) = &out.sample {
            self.sampler
                .set_params(&gpu, params, (out.n_logits - 1) as u32, *counter);
        }
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        // (Queue writes land before this submission's commands; the copy is
        // ordered after the previous submission's sampling.)
        match ids {
            StepIds::Host(ids) => gpu.write(&self.ids, 0, bytemuck::cast_slice(ids)),
            StepIds::LastSampled => {
                enc.copy_buffer_to_buffer(&self.sampler.result, 0, &self.ids, 0, 4);
                // A step submitted ahead may be undone (its token not
                // emitted): save what it changes for the policy.
                for (state, saved) in &self.undo_state {
                    enc.copy_buffer_to_buffer(state, 0, saved, 0, state.size());
                }
            }
        }
        let saved_state = matches!(ids, StepIds::LastSampled);
        let (nt, start) = (n as u32, self.n_cached as u32);
        let hidden_bytes = (n * c.hidden_size * 4) as u64;
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
        let ccs_store = self
            .ccs
            .as_ref()
            .and_then(|cc| cc.hidden.as_ref())
            .map(|(b, _)| b);
        for (l, k) in self.layers.iter().enumerate() {
            if let (Some(store), true) = (ccs_store, l + 1 == self.layers.len()) {
                // The residual stream entering the last layer, kept per slot for CCS.
                let row = (c.hidden_size * 4) as u64;
                copy_between_passes(
                    &mut enc,
                    &mut pass,
                    &self.x,
                    store,
                    start as u64 * row,
                    hidden_bytes,
                );
            }
            if let Some(cap) = &self.capture {
                let at = l as u64 * capture_stride;
                copy_between_passes(&mut enc, &mut pass, &self.x, cap, at, hidden_bytes);
            }
            let p = pass.as_mut().unwrap();
            mark!(p, "copies");
            let attention = LayerAttention::Causal {
                start,
                weights: self.weights.get(l),
            };
            k.encode(p, nt, attention, &mut |p, label| mark!(p, label));
            for (_, d) in self.deltas.iter().filter(|(dl, _)| *dl == l) {
                d.encode(p, nt);
                mark!(p, "epikv delta");
            }
        }
        if let Some(w) = self.weights.first() {
            w.encode_reduce(pass.as_mut().unwrap(), nt, start);
            mark!(pass.as_mut().unwrap(), "attention weights (h2o/tova)");
        }
        if let Some(cap) = &self.capture {
            let at = c.num_layers as u64 * capture_stride;
            copy_between_passes(&mut enc, &mut pass, &self.x, cap, at, hidden_bytes);
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
            if out.sample.is_some() {
                self.sampler.encode(p);
                mark!(p, "sampling");
            }
        }
        drop(pass);
        if let Some(pr) = prof.as_ref() {
            pr.resolve(&mut enc);
        }
        let staging = out.sample.map(|_| {
            let k = self.next_staging;
            self.next_staging = 1 - k;
            enc.copy_buffer_to_buffer(&self.sampler.result, 0, &self.sample_staging[k], 0, 4);
            k
        });
        let delta_staging = (!self.delta_staging.is_empty()).then(|| {
            let k = self.next_delta_staging;
            self.next_delta_staging = 1 - k;
            let bytes = (n * self.deltas.len() * 4) as u64;
            enc.copy_buffer_to_buffer(&self.delta_out, 0, &self.delta_staging[k], 0, bytes);
            k
        });
        let index = gpu.queue.submit([enc.finish()]);
        self.last_record_seconds = recording.elapsed().as_secs_f64();
        self.last_step_sampled = out.sample.is_some();
        let first_slot = self.n_cached;
        self.n_cached += n;
        Ok(Submitted {
            index,
            staging,
            delta_staging,
            saved_state,
            first_slot,
            n_tokens: n,
        })
    }

    /// Waits for a submitted step and returns its sampled token, if it
    /// samples. A caller completes every step it submits (`step` does), or
    /// undoes the last one: steps that read nothing back (prompt chunks) would
    /// otherwise queue a whole prompt on the GPU at once, a cancel would still
    /// wait for all of it, and on a device shared with a renderer every frame
    /// would wait behind it (on a CPU driver, seconds).
    pub fn complete(&mut self, s: Submitted) -> Result<Option<u32>> {
        let gpu = self.model.gpu.clone();
        let token = match s.staging {
            Some(k) => {
                let bytes = gpu
                    .map_and_read_after(&self.sample_staging[k], 4, Some(s.index.clone()))
                    .context("reading the sampled token")?;
                Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
            }
            None => {
                gpu.device
                    .poll(wgpu::PollType::Wait {
                        submission_index: Some(s.index.clone()),
                        timeout: None,
                    })
                    .map_err(|e| anyhow::anyhow!("waiting for the GPU: {e}"))?;
                None
            }
        };
        if let Some(k) = s.delta_staging {
            let bytes = (s.n_tokens * self.deltas.len() * 4) as u64;
            let g = gpu
                .map_and_read_after(&self.delta_staging[k], bytes, Some(s.index))
                .context("reading the EpiKV signal")?;
            self.last_deltas = bytemuck::pod_collect_to_vec(&g);
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
        if !self.undo_state.is_empty() && !s.saved_state {
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
        if !self.undo_state.is_empty() {
            let gpu = &self.model.gpu;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            for (state, saved) in &self.undo_state {
                enc.copy_buffer_to_buffer(saved, 0, state, 0, state.size());
            }
            gpu.queue.submit([enc.finish()]);
        }
        self.n_cached = s.first_slot;
        self.last_step_sampled = false;
        Ok(())
    }

    /// Logits of the last step: `[n_logits, vocab]` row-major.
    /// An error when a row holds NaN or infinity, naming the row: a
    /// non-finite answer is never returned as if it were one.
    pub fn read_logits(&self, n_logits: usize) -> Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        let logits: Vec<f32> = self.model.gpu.read(&self.logits, 0, n_logits * vocab)?;
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            crate::error::bail_kind!(
                crate::error::ErrorKind::NonFiniteLogits,
                "logit row {} of {n_logits} (token {} of the vocabulary) is {} (non-finite weights, or values that overflowed)",
                i / vocab,
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

    /// The EpiKV signal of the last completed step (read back with it, so a
    /// step submitted behind it does not change it) at `layers` (1-based,
    /// each one of `EngineOptions::track_layers`): `[n, layers.len()]`, row t
    /// for the step's token t, columns in the order of `layers`.
    pub fn read_layer_deltas(&self, n: usize, layers: &[usize]) -> Result<Vec<f32>> {
        let tracked = &self.opts.track_layers;
        let columns = layers
            .iter()
            .map(|l| {
                tracked.iter().position(|t| t == l).with_context(|| {
                    format!("EpiKV layer {l} is not tracked by this engine (tracked: {tracked:?})")
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        let width = tracked.len();
        if self.last_deltas.len() < n * width {
            bail!(
                "the last completed step has {} EpiKV values, {} asked for",
                self.last_deltas.len(),
                n * width
            );
        }
        Ok(self
            .last_deltas
            .chunks(width)
            .take(n)
            .flat_map(|row| columns.iter().map(|&c| row[c]))
            .collect())
    }

    /// Counter-causal logits (SPEC.md 4.2) of the given cache entries, as
    /// (slot, position, token): each entry's query attends only the entries
    /// after it among those cached; returns `<FinalNorm(r'), E[token]>` per entry.
    pub fn counter_causal_logits(&mut self, entries: &[(u32, u32, u32)]) -> Result<Vec<f32>> {
        let cc = self
            .ccs
            .as_ref()
            .context("this engine was built without the counter-causal pass")?;
        let gpu = self.model.gpu.clone();
        let n_present = self.n_cached as u32;
        let mut logits = Vec::with_capacity(entries.len());
        let batch_max = self.max_queries(|_| n_present as usize);
        for batch in entries.chunks(batch_max) {
            let m = batch.len() as u32;
            if batch.iter().any(|e| e.0 >= n_present) {
                bail!("counter-causal entry outside the {n_present} cached slots");
            }
            let step = Step {
                n_tokens: m,
                start_slot: n_present - m,
                logit_row0: 0,
                n_logits: m,
            };
            gpu.write(&self.step, 0, bytemuck::bytes_of(&step));
            let col =
                |f: fn(&(u32, u32, u32)) -> u32| -> Vec<u32> { batch.iter().map(f).collect() };
            gpu.write(&self.qslot, 0, bytemuck::cast_slice(&col(|e| e.0)));
            gpu.write(&self.positions, 0, bytemuck::cast_slice(&col(|e| e.1)));
            gpu.write(&self.ids, 0, bytemuck::cast_slice(&col(|e| e.2)));
            if let Some((_, gather)) = &cc.hidden {
                gather.set_rows(&gpu, &col(|e| e.0))?;
            }
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            {
                let mut p = enc.begin_compute_pass(&Default::default());
                let first = match &cc.hidden {
                    Some((_, gather)) => {
                        gather.encode(&mut p, m);
                        self.layers.len() - 1
                    }
                    None => {
                        self.embed.encode(&mut p, m);
                        0
                    }
                };
                for (k, rope) in self.layers[first..].iter().zip(&cc.rope) {
                    let attention = LayerAttention::AntiCausal {
                        rope,
                        n_present,
                        o: cc.o_without_residual.as_ref(),
                    };
                    k.encode(&mut p, m, attention, &mut |_, _| {});
                }
                self.final_norm.encode(&mut p, m);
                cc.token_logit.encode(&mut p, m);
            }
            gpu.queue.submit([enc.finish()]);
            logits.extend(gpu.read::<f32>(&cc.out, 0, batch.len())?);
        }
        Ok(logits)
    }

    /// Attention weight received by each of the first `n` cache slots, averaged
    /// over layers and query heads (needs `EngineOptions::attention_weights`).
    pub fn read_slot_attention(&self, n: usize) -> Result<Vec<f32>> {
        if self.weights.is_empty() {
            bail!("this engine does not accumulate attention weights");
        }
        self.model.gpu.read(&self.slot_scores, 0, n)
    }

    /// Keeps the cache slots listed in `keep` (ascending), moved to slots
    /// 0..keep.len() of every layer's K and V, on the GPU.
    pub fn compact(&mut self, keep: &[u32]) -> Result<()> {
        let c = self
            .compactor
            .as_ref()
            .context("this engine was built without a KV budget (EngineOptions::max_keep)")?;
        if keep.last().is_some_and(|&k| k as usize >= self.n_cached) {
            bail!(
                "keep list names slot {} of {} cached",
                keep.last().unwrap(),
                self.n_cached
            );
        }
        c.compact(&self.model.gpu, keep)?;
        self.n_cached = keep.len();
        Ok(())
    }

    /// Waits for all submitted work.
    pub fn sync(&self) -> Result<()> {
        self.model
            .gpu
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow::anyhow!("waiting for the GPU: {e}"))?;
        Ok(())
    }
}

/// Most cache slots (and tokens per step) an engine takes: slot and row
/// indices are u32 in the kernels, and half that range leaves room for
/// index arithmetic.
pub const MAX_SLOTS: usize = (u32::MAX / 2) as usize;

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
    let ccs = if opts.counter_causal.is_some() {
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
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    offset: u64,
    bytes: u64,
) {
    drop(pass.take());
    enc.copy_buffer_to_buffer(src, 0, dst, offset, bytes);
    *pass = Some(
        enc.begin_compute_pass(&Default::default())
            .forget_lifetime(),
    );
}
