//! The buffers an engine allocates once: the activations a step's kernels
//! read and write (its own, or a batch's shared by its sequences) and every
//! layer's key and value cache.

use anyhow::Result;

use super::EngineOptions;
use crate::kernels::attention::{Attention, KEY_CHUNK};
use crate::kernels::paging::SlotPages;
use crate::kernels::runtime::Runtime;
use crate::kernels::Step;
use crate::model::Model;

/// The activation buffers of a [`Batch`](super::Batch), which its sequences' engines
/// share (`EngineOptions::shared_activations`).
#[derive(Clone)]
pub struct SharedActivations {
    pub(super) acts: Activations,
    /// Which batch: its engines, and no other, step with it.
    pub(super) batch: u64,
}

impl std::fmt::Debug for SharedActivations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedActivations(batch {})", self.batch)
    }
}

/// The buffers a step's kernels read and write, one set per engine (every
/// layer uses them in turn), or one set per [`Batch`](super::Batch) shared by its
/// sequences' engines, each with its own `step`.
#[derive(Clone)]
pub(crate) struct Activations {
    /// The `Step` uniform: token count, first cache slot, logit rows.
    pub(super) step: wgpu::Buffer,
    /// `[max_tokens]` u32 token ids and positions.
    pub(super) ids: wgpu::Buffer,
    pub(super) positions: wgpu::Buffer,
    /// Residual stream `[max_tokens, hidden]`, and its RMSNorm.
    pub(super) x: wgpu::Buffer,
    pub(super) xn: wgpu::Buffer,
    pub(super) qkv: wgpu::Buffer,
    /// Queries after RoPE, and the attention output, `[max_tokens, heads * head_dim]`.
    pub(super) q: wgpu::Buffer,
    pub(super) attn_out: wgpu::Buffer,
    /// `[max_tokens, heads]` log-sum-exp of each query's scores.
    pub(super) lse: wgpu::Buffer,
    pub(super) gate_up: wgpu::Buffer,
    /// silu(gate) * up.
    pub(super) act: wgpu::Buffer,
    /// The attention partials (scratch every layer rewrites).
    pub(super) part: wgpu::Buffer,
    /// `[max_logit_rows, vocab]`.
    pub(super) logits: wgpu::Buffer,
    /// `[max_tokens]` u32: each query's own slot (the counter-causal pass).
    pub(super) qslot: wgpu::Buffer,
}

impl Activations {
    /// The step's buffers for `opts`, and the bytes of the attention
    /// partials (for max_tokens queries over every slot, but at most one
    /// binding: at long contexts the deepest steps then take fewer tokens,
    /// `Engine::max_step_tokens`; a single query must always fit).
    pub(super) fn new(
        gpu: &Runtime,
        model: &Model,
        opts: &EngineOptions,
        key_slots: usize,
        bytes: &mut u64,
    ) -> Result<(Self, u64)> {
        let c = &model.config;
        let heads = model.heads();
        let (h, t) = (c.hidden_size as u64, opts.max_tokens as u64);
        let mut buf = |label: &str, size: u64| -> Result<wgpu::Buffer> {
            gpu.check_binding(label, size)?;
            *bytes += size;
            Ok(gpu.storage(label, size))
        };
        let q_row = (c.num_heads * c.head_dim) as u64 * 4;
        let partials_one = Attention::partials_bytes(heads, 1, key_slots);
        gpu.check_binding(
            "attention partials of one query over the whole cache",
            partials_one,
        )?;
        let partials_capacity = Attention::partials_bytes(heads, opts.max_tokens, key_slots)
            .min(gpu.max_binding / 16 * 16);
        let acts = Activations {
            step: gpu.uniform("step", &Step::default()),
            ids: buf("ids", t * 4)?,
            positions: buf("positions", t * 4)?,
            x: buf("x", t * h * 4)?,
            xn: buf("x-normed", t * h * 4)?,
            qkv: buf("qkv", t * c.qkv_dim() as u64 * 4)?,
            q: buf("q", t * q_row)?,
            attn_out: buf("attn-out", t * q_row)?,
            lse: buf("lse", t * c.num_heads as u64 * 4)?,
            gate_up: buf("gate-up", t * 2 * c.intermediate_size as u64 * 4)?,
            act: buf("ffn-act", t * c.intermediate_size as u64 * 4)?,
            part: buf(
                "attention partials (queries x heads x key chunks)",
                partials_capacity,
            )?,
            logits: buf(
                "logits (rows x vocabulary)",
                (opts.max_logit_rows.max(1) * c.vocab_size) as u64 * 4,
            )?,
            qslot: buf("query slots", t * 4)?,
        };
        Ok((acts, partials_capacity))
    }
}

/// Every layer's key and value cache, each split into pages where it is
/// larger than one storage binding. An engine allocates its own, or is lent
/// one (`EngineOptions::kv_cache`): a scheduler allocates one per sequence
/// it can hold when it is made, and lends each to one sequence after
/// another. Clones share the buffers.
#[derive(Clone)]
pub struct KvCache {
    pub(super) k: Vec<SlotPages>,
    pub(super) v: Vec<SlotPages>,
    /// `[slots, lists]` u32: the original position of the entry in each
    /// slot of each keep list (one list for all layers and heads at token
    /// granularity; `Granularity`): sliding windows and causal masks of
    /// the query scores read it; compaction moves it with the keys and
    /// values.
    pub(super) positions: wgpu::Buffer,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvCache({} slots, {} bytes)", self.slots(), self.bytes())
    }
}

impl KvCache {
    /// A cache of `slots` slots for every layer of `model`, in pages of at
    /// most `page_slots` slots (`EngineOptions::kv_page_slots`). Buffers the
    /// device cannot allocate are an error naming their size.
    pub fn new(model: &Model, slots: usize, page_slots: Option<usize>) -> Result<KvCache> {
        let gpu = &model.gpu;
        let (cache, err) = gpu.catch_errors(|| Self::allocate(gpu, model, slots, page_slots, 1));
        let cache = cache?;
        if let Some(err) = err {
            crate::error::bail_kind!(
                crate::error::ErrorKind::GpuOutOfMemory,
                "the GPU cannot hold a KV cache of {slots} slots ({:.1} MiB): {err}",
                cache.bytes() as f64 / 1048576.0
            );
        }
        Ok(cache)
    }

    fn allocate(
        gpu: &Runtime,
        model: &Model,
        slots: usize,
        page_slots: Option<usize>,
        lists: usize,
    ) -> Result<KvCache> {
        let kv_row = model.heads().kv_row_bytes();
        let mut cache = KvCache {
            k: vec![],
            v: vec![],
            positions: Self::positions(gpu, slots, lists)?,
        };
        for l in 0..model.config.num_layers {
            for (pages, what) in [(&mut cache.k, "key"), (&mut cache.v, "value")] {
                pages.push(SlotPages::new(
                    gpu,
                    &format!("layer {l} {what} cache"),
                    slots,
                    kv_row,
                    KEY_CHUNK as usize,
                    page_slots,
                )?);
            }
        }
        Ok(cache)
    }

    /// Slots of each layer.
    pub fn slots(&self) -> usize {
        self.k.first().map_or(0, |p| p.slots)
    }

    /// Bytes of every layer's keys and values, and of the slot positions.
    pub fn bytes(&self) -> u64 {
        self.k
            .iter()
            .chain(&self.v)
            .map(SlotPages::bytes)
            .sum::<u64>()
            + self.positions.size()
    }

    /// The slot positions of `slots` slots in `lists` keep lists.
    fn positions(gpu: &Runtime, slots: usize, lists: usize) -> Result<wgpu::Buffer> {
        let bytes = (slots as u64 * 4).saturating_mul(lists as u64);
        gpu.check_binding("slot positions (slots x keep lists x 4 bytes)", bytes)?;
        Ok(gpu.storage("slot positions", bytes))
    }

    /// The cache of an engine with `opts`: the lent one's first
    /// `max_slots` slots, or its own (whose bytes count in `bytes`). A lent
    /// cache holds one keep list's positions; an engine keeping several
    /// (`EngineOptions::granularity`) allocates its own positions.
    pub(super) fn for_engine(
        model: &Model,
        opts: &EngineOptions,
        bytes: &mut u64,
    ) -> Result<KvCache> {
        let c = &model.config;
        let lists = opts.granularity.lists(c.num_layers, model.heads().n_kv);
        let Some(lent) = &opts.kv_cache else {
            let own = Self::allocate(&model.gpu, model, opts.max_slots, opts.kv_page_slots, lists)?;
            *bytes += own.bytes();
            return Ok(own);
        };
        if lent.slots() < opts.max_slots || lent.k.len() != model.config.num_layers {
            anyhow::bail!(
                "a lent KV cache of {} layers and {} slots cannot hold an engine of {} layers and {} slots",
                lent.k.len(),
                lent.slots(),
                model.config.num_layers,
                opts.max_slots
            );
        }
        let first = |pages: &[SlotPages]| -> Result<Vec<SlotPages>> {
            pages
                .iter()
                .map(|p| p.first(&model.gpu, opts.max_slots))
                .collect()
        };
        let positions = match lists {
            1 => lent.positions.clone(),
            _ => {
                let own = Self::positions(&model.gpu, opts.max_slots, lists)?;
                *bytes += own.size();
                own
            }
        };
        Ok(KvCache {
            k: first(&lent.k)?,
            v: first(&lent.v)?,
            positions,
        })
    }
}
