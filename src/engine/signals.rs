//! What eviction policies read from the engine beyond the forward pass,
//! computed on the GPU only for a policy that asks ([`Signals`], from
//! `Scorer::needs`): EpiKV's per-layer change of the residual stream, the
//! attention weight each cache slot receives (H2O, TOVA), and the
//! counter-causal pass of the CCS policies; and the GPU state of theirs
//! that a step submitted ahead saves so that `Engine::undo` can put it back.

use anyhow::{bail, Context, Result};

use super::layer::{LayerAttention, OutputWithoutResidual};
use super::{Activations, Engine, EngineOptions, Readbacks};
use crate::kernels::attn_weights::{AttnWeights, WeightMode};
use crate::kernels::compact::Gather;
use crate::kernels::epikv_delta::LayerDelta;
use crate::kernels::key_scores::{KeyScore, KeyScores};
use crate::kernels::matmul::Matmul;
use crate::kernels::paging::SlotPages;
use crate::kernels::query_scores::{
    KeepQueries, QueryPolicy, QueryScores, QuerySources, QueryWindow,
};
use crate::kernels::rmsnorm::RmsNorm;
use crate::kernels::rope_kv::RopeKv;
use crate::kernels::runtime::Runtime;
use crate::kernels::token_logit::TokenLogit;
use crate::kernels::Step;
use crate::model::Model;

/// What an eviction policy needs the engine to compute for it (a policy
/// says so in `Scorer::needs`; `BoundedCache::engine_options` passes it on).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Signals {
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
    /// Compute kvpress's cache-only scores at a refresh (K-norm, KeyDiff, LagKV).
    pub key_scores: Option<KeyScore>,
    /// Keep every layer's recent queries and score with them at a refresh
    /// (SnapKV, Expected Attention).
    pub queries: Option<QueryPolicy>,
}

impl Signals {
    /// What `self` and `other` need together: the tracked layers of both;
    /// of the attention weights and the counter-causal pass, `self`'s where
    /// both ask (a hybrid combines at most one part of each kind).
    pub fn and(mut self, other: Signals) -> Signals {
        self.track_layers.extend(other.track_layers);
        self.track_layers.sort_unstable();
        self.track_layers.dedup();
        self.attention_weights = self.attention_weights.or(other.attention_weights);
        self.counter_causal = self.counter_causal.or(other.counter_causal);
        self.materialize |= other.materialize;
        self.key_scores = self.key_scores.or(other.key_scores);
        self.queries = self.queries.or(other.queries);
        self
    }
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
    o_without_residual: Option<OutputWithoutResidual>,
    token_logit: TokenLogit,
    out: wgpu::Buffer,
}

/// The kernels and buffers of the signals an engine computes.
pub(super) struct SignalKernels {
    /// 1-based layers, as `Signals::track_layers`.
    track_layers: Vec<usize>,
    /// (0-based layer index, kernel) for every tracked layer.
    deltas: Vec<(usize, LayerDelta)>,
    /// `[max_tokens, tracked layers]` g values of the step that ran last.
    delta_out: wgpu::Buffer,
    /// Where `delta_out` is read back; none without tracked layers.
    delta_staging: Option<Readbacks>,
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
    ccs: Option<CounterCausal>,
    /// The key-only scores, when a policy reads them.
    keys: Option<KeyScores>,
    /// The query ring and SnapKV's scores, when a policy reads them.
    queries: Option<QueryScores>,
}

impl SignalKernels {
    /// The kernels of `signals` on the engine's step uniform, activations
    /// and key cache; `bytes` counts what they allocate.
    pub fn new(
        gpu: &Runtime,
        model: &Model,
        opts: &EngineOptions,
        a: &Activations,
        (k_cache, v_cache): (&[SlotPages], &[SlotPages]),
        slot_positions: &wgpu::Buffer,
        bytes: &mut u64,
    ) -> Result<Self> {
        let (signals, max_slots, max_tokens) = (&opts.signals, opts.max_slots, opts.max_tokens);
        let c = &model.config;
        let h = c.hidden_size;
        let heads = model.heads();
        for &l in &signals.track_layers {
            if l == 0 || l > c.num_layers {
                bail!(
                    "EpiKV layer {l} is outside the model's layers 1..={}",
                    c.num_layers
                );
            }
        }
        let n_tracked = signals.track_layers.len();
        let delta_out = gpu.storage("epikv-g", (max_tokens * n_tracked.max(1)) as u64 * 4);
        let delta_staging = (n_tracked > 0).then(|| {
            let staging = Readbacks::new(gpu, "epikv-g-readback", delta_out.size());
            *bytes += staging.bytes();
            staging
        });
        let mut deltas = vec![];
        let mut undo_state = vec![];
        for (column, &l) in signals.track_layers.iter().enumerate() {
            let prev = gpu.storage(&format!("layer {l} previous hidden state"), h as u64 * 4);
            *bytes += h as u64 * 4 * 2;
            undo_state.push((
                prev.clone(),
                gpu.storage("saved previous hidden state", h as u64 * 4),
            ));
            let k = LayerDelta::new(
                gpu,
                &a.step,
                h,
                column,
                n_tracked,
                &a.x,
                &a.positions,
                &prev,
                &delta_out,
            )?;
            deltas.push((l - 1, k));
        }
        let slot_scores = gpu.storage("slot-attention-weights", max_slots as u64 * 4);
        let mut weights = vec![];
        if signals.materialize && signals.attention_weights.is_none() {
            bail!("materialize applies to the attention-weight policies (h2o, tova)");
        }
        if let Some(mode) = signals.attention_weights {
            let cell = gpu.storage(
                "attention-weight-cells",
                (c.num_heads * max_slots) as u64 * 4,
            );
            *bytes += (c.num_heads + 2) as u64 * max_slots as u64 * 4;
            // The per-slot sums persist between steps (the cells are
            // zeroed by every step's reduce).
            let saved = gpu.storage("saved attention weights", slot_scores.size());
            undo_state.push((slot_scores.clone(), saved));
            for (l, kc) in k_cache.iter().enumerate() {
                // Eager attention holds every layer's weight matrix at once
                // (what attention-scored eviction reads): one per layer.
                let matrix = if signals.materialize {
                    let size = AttnWeights::matrix_bytes(heads, max_tokens, max_slots);
                    gpu.check_binding(
                        "the materialized attention matrix (heads x queries x slots)",
                        size,
                    )?;
                    *bytes += size;
                    Some(gpu.storage("materialized attention matrix", size))
                } else {
                    None
                };
                weights.push(AttnWeights::new(
                    gpu,
                    &a.step,
                    heads,
                    c.num_layers,
                    max_slots,
                    mode,
                    &a.q,
                    kc,
                    &a.lse,
                    &cell,
                    &slot_scores,
                    max_tokens,
                    matrix.as_ref(),
                    super::attn_layer(model, opts, l, slot_positions),
                )?);
            }
        }
        let ccs = match signals.counter_causal {
            None => None,
            Some(mode) => Some(CounterCausal::new(gpu, model, mode, opts, a, bytes)?),
        };
        let keys = match signals.key_scores {
            Some(kind) => {
                *bytes += KeyScores::bytes(kind, heads, c.num_layers, max_slots);
                let caches = (k_cache, v_cache);
                Some(KeyScores::new(gpu, heads, caches, max_slots, kind)?)
            }
            None => None,
        };
        let queries = match signals.queries {
            Some(policy) => {
                *bytes += QueryScores::bytes(policy, heads, c.num_layers, max_slots, max_tokens)?;
                let src = QuerySources {
                    step: &a.step,
                    q: &a.q,
                    qkv: &a.qkv,
                    positions: &a.positions,
                    k_cache,
                    v_cache,
                    slot_positions,
                    granularity: opts.granularity,
                    layers: (c.layers.iter().enumerate())
                        .map(|(l, spec)| {
                            let layer = super::attn_layer(model, opts, l, slot_positions);
                            (layer, spec.rope.rotary_dim)
                        })
                        .collect(),
                };
                Some(QueryScores::new(
                    gpu, heads, src, max_slots, max_tokens, policy,
                )?)
            }
            None => None,
        };
        Ok(SignalKernels {
            track_layers: signals.track_layers.clone(),
            deltas,
            delta_out,
            delta_staging,
            last_deltas: vec![],
            undo_state,
            weights,
            slot_scores,
            ccs,
            keys,
            queries,
        })
    }

    /// The attention-weight kernel of layer `l` (0-based), if accumulated.
    pub fn weights_of(&self, l: usize) -> Option<&AttnWeights> {
        self.weights.get(l)
    }

    /// Layer `l`'s query keep (0-based), if the queries are kept.
    pub fn queries_of(&self, l: usize) -> Option<KeepQueries<'_>> {
        self.queries.as_ref().map(|q| q.keep_of(l))
    }

    /// The EpiKV kernels after layer `l` (0-based).
    pub fn deltas_after(&self, l: usize) -> impl Iterator<Item = &LayerDelta> {
        self.deltas
            .iter()
            .filter(move |(dl, _)| *dl == l)
            .map(|(_, d)| d)
    }

    /// Where the residual stream entering the last layer is kept per slot
    /// (the fast counter-causal pass).
    pub fn last_layer_inputs(&self) -> Option<&wgpu::Buffer> {
        self.ccs
            .as_ref()
            .and_then(|cc| cc.hidden.as_ref())
            .map(|(b, _)| b)
    }

    /// Whether a step changes GPU state a policy keeps (then only a step
    /// that saved it first can be undone).
    pub fn keeps_state(&self) -> bool {
        !self.undo_state.is_empty()
    }

    /// Copies the policy state a step changes, before the step, so that
    /// `restore` can put it back.
    pub fn save(&self, enc: &mut wgpu::CommandEncoder) {
        for (state, saved) in &self.undo_state {
            enc.copy_buffer_to_buffer(state, 0, saved, 0, state.size());
        }
    }

    /// Puts back what `save` copied.
    pub fn restore(&self, gpu: &Runtime) {
        if self.undo_state.is_empty() {
            return;
        }
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        for (state, saved) in &self.undo_state {
            enc.copy_buffer_to_buffer(saved, 0, state, 0, state.size());
        }
        gpu.queue.submit([enc.finish()]);
    }

    /// Copies a step's EpiKV values of `n` tokens into the next readback
    /// buffer; which one, if layers are tracked.
    pub fn stage_deltas(&mut self, enc: &mut wgpu::CommandEncoder, n: usize) -> Option<usize> {
        let bytes = (n * self.deltas.len() * 4) as u64;
        let staging = self.delta_staging.as_mut()?;
        Some(staging.stage(enc, &self.delta_out, bytes))
    }

    /// Reads the EpiKV values of a completed step's `n` tokens from
    /// readback buffer `k`.
    pub fn read_staged_deltas(
        &mut self,
        gpu: &Runtime,
        k: usize,
        n: usize,
        after: wgpu::SubmissionIndex,
    ) -> Result<()> {
        let bytes = (n * self.deltas.len() * 4) as u64;
        let g = gpu
            .map_and_read_after(
                self.delta_staging
                    .as_ref()
                    .context("no EpiKV readback")?
                    .buffer(k),
                bytes,
                Some(after),
            )
            .context("reading the EpiKV signal")?;
        self.last_deltas = bytemuck::pod_collect_to_vec(&g);
        Ok(())
    }

    /// Per-slot buffers that compaction moves with the cache: the
    /// attention-weight sums and the stored last-layer inputs, where kept.
    pub fn compacted_with_cache(
        &self,
        gpu: &Runtime,
        max_slots: usize,
        h: usize,
    ) -> Vec<SlotPages> {
        let mut singles = vec![];
        if !self.weights.is_empty() {
            singles.push(SlotPages::single(
                gpu,
                self.slot_scores.clone(),
                max_slots,
                4,
            ));
        }
        if let Some(store) = self.last_layer_inputs() {
            let row = h as u64 * 4;
            singles.push(SlotPages::single(gpu, store.clone(), max_slots, row));
        }
        singles
    }

    /// Encodes the reduction of the step's attention weights into the
    /// per-slot sums, where accumulated.
    pub fn encode_reduce(
        &self,
        p: &mut wgpu::ComputePass,
        n: u32,
        start: u32,
        mark: &mut dyn FnMut(&mut wgpu::ComputePass, &'static str),
    ) {
        if let Some(w) = self.weights.first() {
            w.encode_reduce(p, n, start);
            mark(p, "attention weights (h2o/tova)");
        }
    }
}

impl CounterCausal {
    fn new(
        gpu: &Runtime,
        model: &Model,
        mode: CcsMode,
        opts: &EngineOptions,
        a: &Activations,
        bytes: &mut u64,
    ) -> Result<Self> {
        let (max_slots, max_tokens) = (opts.max_slots, opts.max_tokens);
        let c = &model.config;
        let h = c.hidden_size;
        let first = if mode.from_last_layer() {
            c.num_layers - 1
        } else {
            0
        };
        let rope = (first..c.num_layers)
            .map(|l| {
                // The entries' keys and values are in the cache
                // already: the pass rotates the queries only, each
                // layer's as the forward step does.
                RopeKv::new(
                    gpu,
                    &a.step,
                    model.heads(),
                    &c.layers[l].rope,
                    &a.qkv,
                    &a.positions,
                    model.layers[l].rope_frequencies(opts.sees_positions_past(&c.layers[l].rope)),
                    &a.q,
                    None,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let hidden = if mode.from_last_layer() {
            let row = h as u64 * 4;
            gpu.check_binding(
                "stored last-layer inputs (slots x hidden)",
                max_slots as u64 * row,
            )?;
            let store = gpu.storage("stored last-layer inputs", max_slots as u64 * row);
            *bytes += max_slots as u64 * row;
            let gather = Gather::new(gpu, &store, &a.x, row, max_tokens)?;
            Some((store, gather))
        } else {
            None
        };
        let o_without_residual = if mode == CcsMode::FastContext {
            let last = model.layers.last().context("a model without layers")?;
            let set = crate::kernels::matmul::MatmulOptions {
                accumulate: false,
                rows: crate::kernels::Rows::Tokens,
            };
            // With a sandwich norm the context is that norm of W_o(attn):
            // the product writes xn and the norm (not accumulating) x.
            let (o_out, norm) = match &last.post_norms {
                Some((attn_norm, _)) => {
                    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
                    let rows = crate::kernels::Rows::Tokens;
                    let norm = RmsNorm::new(gpu, &a.step, h, eps, attn_norm, &a.xn, &a.x, rows)?;
                    (&a.xn, Some(norm))
                }
                None => (&a.x, None),
            };
            Some(OutputWithoutResidual {
                o: Matmul::new(
                    gpu,
                    &a.step,
                    &last.o,
                    last.o_bias.as_ref(),
                    &a.attn_out,
                    o_out,
                    set,
                )?,
                norm,
            })
        } else {
            None
        };
        let out = gpu.storage("counter-causal logits", max_tokens as u64 * 4);
        let token_logit = TokenLogit::new(gpu, &a.step, model.head(), &a.ids, &a.xn, &out)?;
        Ok(CounterCausal {
            rope,
            hidden,
            o_without_residual,
            token_logit,
            out,
        })
    }
}

impl Engine {
    /// The EpiKV signal of the last completed step (read back with it, so a
    /// step submitted behind it does not change it) at `layers` (1-based,
    /// each one of `Signals::track_layers`): `[n, layers.len()]`, row t
    /// for the step's token t, columns in the order of `layers`.
    pub fn read_layer_deltas(&self, n: usize, layers: &[usize]) -> Result<Vec<f32>> {
        let s = &self.signals;
        let tracked = &s.track_layers;
        let columns = layers
            .iter()
            .map(|l| {
                tracked.iter().position(|t| t == l).with_context(|| {
                    format!("EpiKV layer {l} is not tracked by this engine (tracked: {tracked:?})")
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        let width = tracked.len();
        if s.last_deltas.len() < n * width {
            bail!(
                "the last completed step has {} EpiKV values, {} asked for",
                s.last_deltas.len(),
                n * width
            );
        }
        Ok(s.last_deltas
            .chunks(width)
            .take(n)
            .flat_map(|row| columns.iter().map(|&c| row[c]))
            .collect())
    }

    /// Attention weight received by each of the first `n` cache slots, averaged
    /// over layers and query heads (needs `Signals::attention_weights`).
    pub fn read_slot_attention(&self, n: usize) -> Result<Vec<f32>> {
        if self.signals.weights.is_empty() {
            bail!("this engine does not accumulate attention weights");
        }
        self.model.gpu.read(&self.signals.slot_scores, 0, n)
    }

    /// kvpress's key-only score (`Signals::key_scores`) of each present
    /// cache slot, computed from the key cache now: the mean over layers
    /// and KV heads. Each (layer, KV head)'s own scores are then in
    /// [`Engine::read_key_scores_per_head`].
    pub fn key_scores(&self) -> Result<Vec<f32>> {
        let keys =
            (self.signals.keys.as_ref()).context("this engine does not compute key scores")?;
        let gpu = &self.model.gpu;
        let n = self.n_cached;
        keys.set_present(gpu, n);
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            keys.encode(&mut pass, n);
        }
        gpu.queue.submit([enc.finish()]);
        gpu.read(&keys.score, 0, n)
    }

    /// SnapKV's or Expected Attention's score (`Signals::queries`) of each
    /// present cache slot, from the window's queries, computed now: the
    /// mean over layers and KV heads. The slots outside `w.first ..
    /// w.end` score above the rest. Each (layer, KV head)'s scores are then
    /// in [`Engine::read_query_scores_per_head`].
    pub fn query_scores(&self, w: QueryWindow) -> Result<Vec<f32>> {
        let queries =
            (self.signals.queries.as_ref()).context("this engine does not keep queries")?;
        let gpu = &self.model.gpu;
        if w.n as usize != self.n_cached {
            bail!(
                "asked to score {} slots from the queries; the engine holds {}",
                w.n,
                self.n_cached
            );
        }
        let c = &self.model.config;
        let rope: Vec<(&[f32], f32)> = (c.layers.iter())
            .map(|spec| {
                let r = &spec.rope;
                let freqs = match &r.long {
                    Some(long) if self.opts.sees_positions_past(r) => &long.inv_freq,
                    _ => &r.inv_freq,
                };
                (freqs.as_slice(), r.attention_factor)
            })
            .collect();
        queries.set_window(gpu, w, &rope)?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            queries.encode(&mut pass, w);
        }
        gpu.queue.submit([enc.finish()]);
        gpu.read(&queries.scores, queries.mean_offset(), w.n as usize)
    }

    /// The scores of the last `query_scores`, `[layers, KV heads, n]` for
    /// its `n` present slots.
    pub fn read_query_scores_per_head(&self, n: usize) -> Result<Vec<f32>> {
        let queries =
            (self.signals.queries.as_ref()).context("this engine does not keep queries")?;
        self.read_per_head(&queries.scores, n)
    }

    /// `[layers, KV heads, n]` of a `[layers, KV heads, slots]` buffer.
    fn read_per_head(&self, buffer: &wgpu::Buffer, n: usize) -> Result<Vec<f32>> {
        let slots = self.opts.max_slots;
        if n > slots {
            bail!("scores of {n} slots asked; the cache holds {slots}");
        }
        let cells = self.model.config.num_layers * self.model.heads().n_kv;
        let all: Vec<f32> = self.model.gpu.read(buffer, 0, cells * slots)?;
        Ok(all
            .chunks(slots)
            .flat_map(|row| row[..n].to_vec())
            .collect())
    }

    /// The scores of the last `key_scores`, `[layers, KV heads, n]` for
    /// its `n` present slots.
    pub fn read_key_scores_per_head(&self, n: usize) -> Result<Vec<f32>> {
        let keys =
            (self.signals.keys.as_ref()).context("this engine does not compute key scores")?;
        self.read_per_head(&keys.per_head, n)
    }

    /// Counter-causal logits (SPEC.md 4.2) of the given cache entries, as
    /// (slot, position, token): each entry's query attends only the entries
    /// after it among those cached; returns `<FinalNorm(r'), E[token]>` per entry.
    pub fn counter_causal_logits(&mut self, entries: &[(u32, u32, u32)]) -> Result<Vec<f32>> {
        let cc = self
            .signals
            .ccs
            .as_ref()
            .context("this engine was built without the counter-causal pass")?;
        let gpu = self.model.gpu.clone();
        let a = &self.acts;
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
                ..Default::default()
            };
            gpu.write(&a.step, 0, bytemuck::bytes_of(&step));
            let col =
                |f: fn(&(u32, u32, u32)) -> u32| -> Vec<u32> { batch.iter().map(f).collect() };
            gpu.write(&a.qslot, 0, bytemuck::cast_slice(&col(|e| e.0)));
            gpu.write(&a.positions, 0, bytemuck::cast_slice(&col(|e| e.1)));
            gpu.write(&a.ids, 0, bytemuck::cast_slice(&col(|e| e.2)));
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
}
