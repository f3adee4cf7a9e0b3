//! `shaders/attention.wgsl`: flash attention split over key chunks, with a
//! merge pass; one partial kernel for prefill (many queries) and one for decode
//! (one query, all heads of a KV group per workgroup).
//!
//! Causal by cache slot: query t of a step sits in slot `start_slot + t` and
//! attends slots `0..=start_slot + t`. Nothing of size queries x keys is
//! allocated; the partials are `queries x heads x ceil(slots / 256) x (head_dim + 4)`
//! floats.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::compact::SlotPositions;
use super::paging::SlotPages;
use super::rope_kv::Heads;
use super::runtime::Runtime;
use super::tune::{Candidate, TuneKey};
use super::variants::{AttnDecodeVariant, AttnPrefillVariant};
use super::{ceil_div, dispatch};
use crate::formats::KvFormat;
use crate::shaders;

/// Cache slots per key chunk (CHUNK in attention_io.wgsl) of every kernel
/// but the short-chunk decode ([`AttnDecodeVariant::key_chunk`]); cache
/// pages hold whole chunks of it (and so of the shorter ones).
pub const KEY_CHUNK: u32 = 256;
/// The shortest key chunk of any decode variant: the partials buffer holds
/// a decode step's chunks of this size.
const SHORTEST_KEY_CHUNK: u32 = 64;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n_heads: u32,
    n_kv: u32,
    hd4: u32,
    scale: f32,
    window: u32,
    kpos_lists: u32,
    kpos_first: u32,
    kpos_per_kv: u32,
}

impl Params {
    fn of(heads: Heads, layer: &AttnLayer) -> Self {
        let positions = layer.window.map(|w| w.positions).unwrap_or_default();
        Params {
            n_heads: heads.n_heads as u32,
            n_kv: heads.n_kv as u32,
            hd4: (heads.head_dim / 4) as u32,
            scale: layer.scale(heads),
            window: layer.window.as_ref().map_or(0, |w| w.size),
            kpos_lists: positions.lists,
            kpos_first: positions.first,
            kpos_per_kv: positions.per_kv,
        }
    }
}

/// How `Params` mirrors `AttnParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "AttnParams" in [shaders::ATTENTION, shaders::ATTENTION_WIDE, shaders::ATTENTION_DECODE, shaders::ATTENTION_DECODE_LANES, shaders::ATTENTION_DECODE_WIDE, shaders::ATTENTION_DECODE_LANES_WIDE, shaders::ATTENTION_DECODE_SPLIT, shaders::ATTENTION_DECODE_SPLIT_WIDE, shaders::ATTENTION_PREFILL, shaders::ATTENTION_PREFILL_WIDE, shaders::ATTENTION_PREFILL_COOP] {
        n_heads, n_kv, hd4, scale, window, kpos_lists, kpos_first, kpos_per_kv
    })
}

/// What one layer's attention computes beyond softmax(q k / sqrt(head_dim))
/// over every earlier slot: its own score scale, and a sliding window.
#[derive(Clone, Copy, Default)]
pub struct AttnLayer<'a> {
    /// The scores' scale; None: 1 / sqrt(head_dim).
    pub scale: Option<f32>,
    pub window: Option<Window<'a>>,
}

/// A sliding window: a query sees the keys whose original positions are
/// less than `size` from its own (the counter-causal pass: after it).
#[derive(Clone, Copy)]
pub struct Window<'a> {
    pub size: u32,
    /// `[slots, lists]` u32: the original position of the entry in each
    /// cache slot of each keep list.
    pub slot_positions: &'a wgpu::Buffer,
    /// Where this layer's KV heads find theirs.
    pub positions: SlotPositions,
}

impl AttnLayer<'_> {
    fn scale(&self, heads: Heads) -> f32 {
        self.scale.unwrap_or(1.0 / (heads.head_dim as f32).sqrt())
    }
}

struct PageGroups {
    slots: std::ops::Range<u32>,
    /// For attention.wgsl's pipelines (the merge).
    group: wgpu::BindGroup,
    /// For the prefill and anti-causal variant's pipelines.
    prefill_group: wgpu::BindGroup,
    /// For each decode kernel's pipeline (`Attention::decode`, same order).
    decode_groups: Vec<wgpu::BindGroup>,
    /// For each decode kernel's merge (the same order).
    decode_merge_groups: Vec<wgpu::BindGroup>,
}

/// The decode kernel for steps of up to `up_to_keys` keys (and more than
/// the one before it covers), with the merge of its key chunk.
struct DecodeKernel {
    up_to_keys: u32,
    variant: AttnDecodeVariant,
    pipeline: Arc<wgpu::ComputePipeline>,
    merge: Arc<wgpu::ComputePipeline>,
}

pub struct Attention {
    prefill: Arc<wgpu::ComputePipeline>,
    anticausal: Arc<wgpu::ComputePipeline>,
    /// By depth, shallowest first; the last covers every depth past the
    /// one before it (one kernel unless `tuned` timed several depths).
    decode: Vec<DecodeKernel>,
    merge: Arc<wgpu::ComputePipeline>,
    pub prefill_variant: AttnPrefillVariant,
    /// One bind group per cache page (and one for each decode kernel's
    /// pipeline), with the slots the page holds.
    pages: Vec<PageGroups>,
    heads: Heads,
    max_slots: u32,
}

// The head limits of the attention kernels' builds live with the variants
// (variants.rs), which need them too.
pub use super::variants::{MAX_HEADS_PER_KV, MAX_HEAD_DIM, NARROW_HEAD_DIM, WIDE_HEADS_PER_KV};

/// Whether `heads` need the wide builds.
fn wide(heads: Heads) -> bool {
    heads.head_dim > NARROW_HEAD_DIM
}

/// Of a kernel's (narrow, wide) builds, the one for `heads`.
fn build_for(
    (narrow, wide_build): (&'static shaders::Shader, &'static shaders::Shader),
    heads: Heads,
) -> &'static shaders::Shader {
    if wide(heads) {
        wide_build
    } else {
        narrow
    }
}

/// attention.wgsl built for `heads`.
fn attention_shader(heads: Heads) -> &'static shaders::Shader {
    build_for((&shaders::ATTENTION, &shaders::ATTENTION_WIDE), heads)
}

impl Attention {
    /// Bytes of the partials buffer for up to `max_tokens` queries over
    /// `max_slots` slots: chunks of [`KEY_CHUNK`] for each query, and at
    /// least a decode step's chunks of the shortest decode chunk.
    pub fn partials_bytes(heads: Heads, max_tokens: usize, max_slots: usize) -> u64 {
        let chunks = |chunk: u32| (max_slots as u32).div_ceil(chunk) as u64;
        let decode = if max_tokens > 0 {
            chunks(SHORTEST_KEY_CHUNK)
        } else {
            0
        };
        let rows = (max_tokens as u64 * chunks(KEY_CHUNK)).max(decode);
        rows * heads.n_heads as u64 * (heads.head_dim as u64 / 4 + 1) * 16
    }

    /// `q`/`out` `[n, n_heads * head_dim]`, caches `[max_slots, n_kv * head_dim]`
    /// in pages of a multiple of [`KEY_CHUNK`] slots,
    /// `lse` `[n, n_heads]`, all f32; `part` holds [`Self::partials_bytes`] bytes
    /// (scratch, may be shared by all layers); `qslot` `[n]` u32 is read only by
    /// the anti-causal pass (any buffer otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Runtime,
        step: &wgpu::Buffer,
        heads: Heads,
        max_slots: usize,
        q: &wgpu::Buffer,
        k_cache: &SlotPages,
        v_cache: &SlotPages,
        part: &wgpu::Buffer,
        out: &wgpu::Buffer,
        lse: &wgpu::Buffer,
        qslot: &wgpu::Buffer,
        layer: AttnLayer,
    ) -> Result<Self> {
        // The head counts and head size become override constants below.
        anyhow::ensure!(
            heads.n_kv > 0
                && heads.n_heads.is_multiple_of(heads.n_kv)
                && (1..=MAX_HEADS_PER_KV).contains(&(heads.n_heads / heads.n_kv)),
            "attention: {} query heads over {} KV heads; expected 1 to {MAX_HEADS_PER_KV} query heads per KV head",
            heads.n_heads,
            heads.n_kv
        );
        anyhow::ensure!(
            heads.head_dim.is_multiple_of(4) && (4..=MAX_HEAD_DIM).contains(&heads.head_dim),
            "attention: head_dim {} must be a multiple of 4 from 4 to {MAX_HEAD_DIM}",
            heads.head_dim
        );
        anyhow::ensure!(
            !wide(heads) || heads.n_heads / heads.n_kv <= WIDE_HEADS_PER_KV,
            "attention: heads of {} values take at most {WIDE_HEADS_PER_KV} query heads per KV head, not {}",
            heads.head_dim,
            heads.n_heads / heads.n_kv
        );
        anyhow::ensure!(
            layer.window.is_none_or(|w| w.size > 0),
            "attention: a sliding window of 0 tokens"
        );
        let params = gpu.uniform("attn-params", &Params::of(heads, &layer));
        anyhow::ensure!(
            k_cache.n_pages() == 1 || k_cache.page_slots.is_multiple_of(KEY_CHUNK as usize),
            "key cache pages of {} slots are not whole key chunks of {KEY_CHUNK}",
            k_cache.page_slots
        );
        // Without a window the position bindings are never read: any buffer.
        let kpos = match &layer.window {
            Some(w) => w.slot_positions,
            None => q,
        };
        let b = Bindings {
            params: &params,
            q,
            k_cache,
            v_cache,
            part,
            out,
            lse,
            qslot,
            kpos,
        };
        let shape = KernelShape {
            heads,
            window: layer.window.is_some(),
        };
        let decode = tuned_decode(gpu, shape, &b)
            .into_iter()
            .map(|(up_to_keys, variant)| -> Result<DecodeKernel> {
                Ok(DecodeKernel {
                    up_to_keys,
                    variant,
                    pipeline: decode_pipeline(gpu, variant, heads)?,
                    merge: merge_pipeline(gpu, heads, Merge::of(variant))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let prefill_variant = tuned_prefill(gpu, shape, &b);
        let prefill = prefill_pipeline(gpu, prefill_variant, heads, "prefill_partial")?;
        let anticausal = prefill_pipeline(gpu, prefill_variant, heads, "anticausal_partial")?;
        let merge = merge_pipeline(gpu, heads, Merge::Chunks(KEY_CHUNK))?;
        let pages = (0..k_cache.n_pages())
            .map(|p| {
                let bufs = b.page(step, p);
                PageGroups {
                    slots: k_cache.range(p).start as u32..k_cache.range(p).end as u32,
                    group: gpu.bind_group(&merge, &bufs),
                    prefill_group: gpu.bind_group(&prefill, &bufs),
                    decode_groups: decode
                        .iter()
                        .map(|d| gpu.bind_group(&d.pipeline, &bufs))
                        .collect(),
                    decode_merge_groups: decode
                        .iter()
                        .map(|d| gpu.bind_group(&d.merge, &bufs))
                        .collect(),
                }
            })
            .collect();
        Ok(Attention {
            prefill,
            anticausal,
            prefill_variant,
            decode,
            merge,
            pages,
            heads,
            max_slots: max_slots as u32,
        })
    }

    /// Encodes attention for `n_tokens` queries whose first sits in `start_slot`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_tokens: u32, start_slot: u32) {
        debug_assert!(start_slot + n_tokens <= self.max_slots);
        let h = self.heads;
        let n_keys = start_slot + n_tokens;
        if n_tokens == 1 {
            let d = self.decode_index(n_keys);
            let kernel = &self.decode[d];
            for (page, n_chunks) in self.pages_with_keys(n_keys, kernel.variant.key_chunk()) {
                let groups = (n_chunks, h.n_kv as u32, 1);
                dispatch(pass, &kernel.pipeline, &page.decode_groups[d], groups);
            }
            let merge_group = &self.pages[0].decode_merge_groups[d];
            self.encode_merge(pass, &kernel.merge, merge_group, n_tokens);
            return;
        }
        self.encode_queries(pass, &self.prefill, n_tokens, n_keys);
    }

    /// `partials` (the prefill or the counter-causal kernel) for `n_tokens`
    /// queries over each page holding some of the first `n_keys` slots, in
    /// chunks of [`KEY_CHUNK`], then the merge.
    fn encode_queries(
        &self,
        pass: &mut wgpu::ComputePass,
        partials: &wgpu::ComputePipeline,
        n_tokens: u32,
        n_keys: u32,
    ) {
        let heads = self.heads.n_heads as u32;
        for (page, n_chunks) in self.pages_with_keys(n_keys, KEY_CHUNK) {
            let groups = (ceil_div(n_tokens, 64), heads, n_chunks);
            dispatch(pass, partials, &page.prefill_group, groups);
        }
        self.encode_merge(pass, &self.merge, &self.pages[0].group, n_tokens);
    }

    /// The decode kernel for a step over `n_keys` keys.
    fn decode_index(&self, n_keys: u32) -> usize {
        let last = self.decode.len() - 1;
        self.decode[..last]
            .iter()
            .position(|d| n_keys <= d.up_to_keys)
            .unwrap_or(last)
    }

    /// The decode variant a step over `n_keys` keys runs.
    pub fn decode_variant_at(&self, n_keys: u32) -> AttnDecodeVariant {
        self.decode[self.decode_index(n_keys)].variant
    }

    /// The decode variants by depth: (up to how many keys, variant), the
    /// last for every depth past the one before.
    pub fn decode_variants(&self) -> Vec<(u32, AttnDecodeVariant)> {
        self.decode
            .iter()
            .map(|d| (d.up_to_keys, d.variant))
            .collect()
    }

    /// The pages holding any of the first `n_keys` slots, with the number of
    /// key chunks of `chunk` slots of each that hold some.
    fn pages_with_keys(&self, n_keys: u32, chunk: u32) -> impl Iterator<Item = (&PageGroups, u32)> {
        self.pages
            .iter()
            .filter(move |pg| pg.slots.start < n_keys)
            .map(move |pg| {
                let r = &pg.slots;
                (pg, (r.end.min(n_keys) - r.start).div_ceil(chunk))
            })
    }

    fn encode_merge(
        &self,
        pass: &mut wgpu::ComputePass,
        merge: &wgpu::ComputePipeline,
        group: &wgpu::BindGroup,
        n_tokens: u32,
    ) {
        let groups = (n_tokens, self.heads.n_heads as u32, 1);
        dispatch(pass, merge, group, groups);
    }
}

impl Attention {
    /// Encodes the counter-causal pass: `n_tokens` queries, query t being the
    /// entry of slot `qslot[t]`, each attending the entries after it among the
    /// `n_present` in the cache. The step uniform must hold
    /// `start_slot = n_present - n_tokens`.
    pub fn encode_anticausal(&self, pass: &mut wgpu::ComputePass, n_tokens: u32, n_present: u32) {
        self.encode_queries(pass, &self.anticausal, n_tokens, n_present);
    }
}

/// The buffers every attention kernel binds, but the step uniform (see
/// attention_io.wgsl for the order).
struct Bindings<'a> {
    params: &'a wgpu::Buffer,
    q: &'a wgpu::Buffer,
    k_cache: &'a SlotPages,
    v_cache: &'a SlotPages,
    part: &'a wgpu::Buffer,
    out: &'a wgpu::Buffer,
    lse: &'a wgpu::Buffer,
    qslot: &'a wgpu::Buffer,
    kpos: &'a wgpu::Buffer,
}

impl<'a> Bindings<'a> {
    /// The bindings of cache page `p` with the given step uniform.
    fn page(&self, step: &'a wgpu::Buffer, p: usize) -> [&'a wgpu::Buffer; 11] {
        [
            step,
            self.params,
            self.q,
            &self.k_cache.buffers[p],
            &self.v_cache.buffers[p],
            self.part,
            self.out,
            self.lse,
            self.qslot,
            &self.k_cache.uniforms[p],
            self.kpos,
        ]
    }
}

/// Query heads per KV head, an override constant of the decode kernels:
/// their per-head loops get a constant trip count.
fn group_constant(heads: Heads) -> [(&'static str, f64); 1] {
    [("GROUP", (heads.n_heads / heads.n_kv) as f64)]
}

/// head_dim / 4 as an override constant: the row-per-lane partials' and
/// every decode kernel's loops over the head get a constant trip count
/// (and their per-lane arrays and query reads constant indices).
fn head_dim_constant(heads: Heads) -> [(&'static str, f64); 1] {
    [("HD4", (heads.head_dim / 4) as f64)]
}

/// The decode partial pipeline of `variant` for `heads`.
fn decode_pipeline(
    gpu: &Runtime,
    variant: AttnDecodeVariant,
    heads: Heads,
) -> Result<Arc<wgpu::ComputePipeline>> {
    let kernel = variant.kernel();
    let shader = build_for(kernel.shaders, heads);
    let [group] = group_constant(heads);
    let [hd4] = head_dim_constant(heads);
    let mut constants = vec![group, hd4];
    constants.extend(kernel.constants);
    constants.extend(chunk_constant(kernel.key_chunk));
    let kv = Some(heads.kv_format.into());
    gpu.pipeline(shader, kv, "decode_partial", &constants)
}

/// CHUNK (attention_io.wgsl) where it is not the default [`KEY_CHUNK`]:
/// a pipeline of the default keeps the cache key it always had.
fn chunk_constant(chunk: u32) -> Option<(&'static str, f64)> {
    (chunk != KEY_CHUNK).then_some(("CHUNK", chunk as f64))
}

/// Which merge combines a partial kernel's output.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Merge {
    /// attention.wgsl's, one lane per column over every key chunk of this
    /// many slots.
    Chunks(u32),
    /// attention_decode_split.wgsl's, lanes over the splits of this many
    /// keys in parallel.
    Splits(u32),
}

impl Merge {
    /// The merge of a decode variant's partials.
    fn of(variant: AttnDecodeVariant) -> Self {
        let kernel = variant.kernel();
        match kernel.own_merge {
            true => Merge::Splits(kernel.key_chunk),
            false => Merge::Chunks(kernel.key_chunk),
        }
    }
}

/// The merge pipeline of `merge`.
fn merge_pipeline(gpu: &Runtime, heads: Heads, merge: Merge) -> Result<Arc<wgpu::ComputePipeline>> {
    let kv = Some(heads.kv_format.into());
    match merge {
        Merge::Chunks(chunk) => {
            let constants: Vec<_> = chunk_constant(chunk).into_iter().collect();
            gpu.pipeline(attention_shader(heads), kv, "merge", &constants)
        }
        Merge::Splits(chunk) => {
            let [hd4] = head_dim_constant(heads);
            let constants = [hd4, ("CHUNK", chunk as f64)];
            let split = AttnDecodeVariant::SplitKey { chunk }.kernel();
            gpu.pipeline(build_for(split.shaders, heads), kv, "merge", &constants)
        }
    }
}

/// The prefill (or counter-causal, `entry`) partial pipeline of `variant`
/// for `heads`.
fn prefill_pipeline(
    gpu: &Runtime,
    variant: AttnPrefillVariant,
    heads: Heads,
    entry: &str,
) -> Result<Arc<wgpu::ComputePipeline>> {
    let shader = match variant {
        AttnPrefillVariant::RowPerLane => attention_shader(heads),
        AttnPrefillVariant::Tiled if wide(heads) => &shaders::ATTENTION_PREFILL_WIDE,
        AttnPrefillVariant::Tiled => &shaders::ATTENTION_PREFILL,
        AttnPrefillVariant::Coop => {
            anyhow::ensure!(
                heads.head_dim.is_multiple_of(16) && heads.kv_format == KvFormat::F16,
                "attention_prefill_coop takes heads of a multiple of 16 values and an f16 cache, not {} values in {}",
                heads.head_dim,
                heads.kv_format.name()
            );
            &shaders::ATTENTION_PREFILL_COOP
        }
    };
    let constants = prefill_constants(gpu, variant, heads);
    gpu.pipeline(shader, Some(heads.kv_format.into()), entry, &constants)
}

/// A prefill variant's override constants: head_dim / 4, and the
/// matrix-unit kernel's workgroup of four subgroups of the device's one
/// subgroup size.
fn prefill_constants(
    gpu: &Runtime,
    variant: AttnPrefillVariant,
    heads: Heads,
) -> Vec<(&'static str, f64)> {
    let mut constants = head_dim_constant(heads).to_vec();
    if variant == AttnPrefillVariant::Coop {
        constants.push(("SUBGROUP_SIZE", gpu.profile.subgroup_max as f64));
    }
    constants
}

/// Bytes of one query row (all heads, f32).
fn query_row_bytes(heads: Heads) -> u64 {
    (heads.n_heads * heads.head_dim * 4) as u64
}

/// Cache depths the decode candidates are timed at (those the first cache
/// page holds, and its whole length where that is less): each depth's
/// choice runs the steps up to it (the last, every deeper step too). What
/// is fastest differs with depth: at a few thousand keys a 256-key chunk
/// per workgroup leaves fewer workgroups than a large GPU has cores, and
/// the loads in flight per workgroup matter more than at 16,384, where the
/// keys set the time and attention costs a step most (issue #10's deepest
/// decode target).
const TUNE_DEPTHS: [usize; 3] = [1024, 4096, 16384];
/// Queries the prefill candidates are timed at (fewer where the engine's
/// steps hold fewer), from slot 0: a causal prompt chunk.
const TUNE_QUERIES: usize = 512;

/// What decides which attention variants can run a layer: its heads, and
/// whether it has a sliding window.
#[derive(Clone, Copy)]
struct KernelShape {
    heads: Heads,
    window: bool,
}

/// The decode variants by depth, as (up to how many keys, variant): the
/// rule's for every depth, or with `tuned` the fastest of the candidates at
/// each of [`TUNE_DEPTHS`] the first cache page holds (and at its length
/// where that is less: the depths that engine reaches first), neighbours
/// with the same choice merged.
fn tuned_decode(gpu: &Runtime, shape: KernelShape, b: &Bindings) -> Vec<(u32, AttnDecodeVariant)> {
    let heads = shape.heads;
    let page_slots = (b.k_cache.n_pages() > 1).then_some(b.k_cache.page_slots);
    let mut cands: Vec<_> = gpu
        .kernels
        .attn_decode_candidates()
        .into_iter()
        .filter(|v| v.fits_pages(page_slots))
        .collect();
    if cands.is_empty() {
        // A variant set by hand (tests) whose chunks straddle the pages.
        cands.push(AttnDecodeVariant::Parallel);
    }
    if cands.len() == 1 {
        return vec![(u32::MAX, cands[0])];
    }
    let page = b.k_cache.range(0).len();
    let mut depths: Vec<usize> = TUNE_DEPTHS.iter().map(|&d| d.min(page)).collect();
    depths.dedup();
    let mut out: Vec<(u32, AttnDecodeVariant)> = vec![];
    for (i, &keys) in depths.iter().enumerate() {
        let v = tuned_decode_at(gpu, heads, b, &cands, keys);
        // The last covers every deeper step.
        let up_to = if i + 1 == depths.len() {
            u32::MAX
        } else {
            keys as u32
        };
        match out.last_mut() {
            Some(last) if last.1 == v => last.0 = up_to,
            _ => out.push((up_to, v)),
        }
    }
    out
}

/// The fastest decode candidate at a depth of `keys` slots of the first
/// cache page. Where the engine's buffers cannot hold such a step (a query
/// buffer of no row), the rule's choice is kept, and the timings say why.
fn tuned_decode_at(
    gpu: &Runtime,
    heads: Heads,
    b: &Bindings,
    cands: &[AttnDecodeVariant],
    keys: usize,
) -> AttnDecodeVariant {
    let key = TuneKey::Attention {
        op: "attention decode",
        heads,
        queries: 1,
        keys,
    };
    if keys == 0
        || b.q.size() < query_row_bytes(heads)
        || b.part.size() < Attention::partials_bytes(heads, 1, keys)
    {
        let why =
            "not timed: the step buffers hold no decode step; the fixed rule's choice is kept";
        gpu.tuner.keep_rule(key, labels(cands), why.into());
        return cands[0];
    }
    // Each candidate with its merge: a shorter chunk leaves the merge more
    // partials to combine.
    let merge_groups = (1, heads.n_heads as u32, 1);
    time_on_first_page(gpu, b, key, cands, (1, keys - 1), |v| {
        let chunks = (keys as u32).div_ceil(v.key_chunk());
        Ok(vec![
            (
                decode_pipeline(gpu, v, heads)?,
                (chunks, heads.n_kv as u32, 1),
            ),
            (merge_pipeline(gpu, heads, Merge::of(v))?, merge_groups),
        ])
    })
}

/// The prefill (and counter-causal) variant: the rule's, or with `tuned`
/// the fastest of the candidates on a causal chunk of up to
/// [`TUNE_QUERIES`] queries from slot 0, as many as the engine's buffers
/// and first cache page hold (where that is under 2, the rule's choice is
/// kept, and the timings say why).
fn tuned_prefill(gpu: &Runtime, shape: KernelShape, b: &Bindings) -> AttnPrefillVariant {
    let heads = shape.heads;
    let mut cands: Vec<_> = gpu
        .kernels
        .attn_prefill_candidates(heads.head_dim, heads.kv_format)
        .into_iter()
        .filter(|v| v.takes(heads.head_dim, shape.window))
        .collect();
    if cands.is_empty() {
        cands.push(AttnPrefillVariant::RowPerLane);
    }
    if cands.len() == 1 {
        return cands[0];
    }
    let fits = |n: usize| Attention::partials_bytes(heads, n, n) <= b.part.size();
    let q_rows = (b.q.size() / query_row_bytes(heads)) as usize;
    let mut queries = b.k_cache.range(0).len().min(TUNE_QUERIES).min(q_rows);
    while queries > 1 && !fits(queries) {
        queries /= 2;
    }
    let key = TuneKey::Attention {
        op: "attention prefill",
        heads,
        queries,
        keys: queries,
    };
    if queries < 2 {
        let why = "not timed: the step buffers or the cache's first page hold fewer than 2 queries; the fixed rule's choice is kept";
        gpu.tuner.keep_rule(key, labels(&cands), why.into());
        return cands[0];
    }
    let n = queries as u32;
    let groups = (ceil_div(n, 64), heads.n_heads as u32, n.div_ceil(KEY_CHUNK));
    time_on_first_page(gpu, b, key, &cands, (queries, 0), |v| {
        Ok(vec![(
            prefill_pipeline(gpu, v, heads, "prefill_partial")?,
            groups,
        )])
    })
}

/// The fastest of `cands` for `key` (timed once per device), each run on
/// the engine's first cache page with a step uniform of the timings' own:
/// `n_tokens` queries from `start_slot`; a candidate is the pipelines
/// `dispatches` gives, each on its workgroups, in turn.
fn time_on_first_page<V: Copy + std::fmt::Debug>(
    gpu: &Runtime,
    b: &Bindings,
    key: TuneKey,
    cands: &[V],
    (n_tokens, start_slot): (usize, usize),
    dispatches: impl Fn(V) -> Result<Vec<(Arc<wgpu::ComputePipeline>, (u32, u32, u32))>>,
) -> V {
    let i = gpu.tuner.choose(gpu, key, labels(cands), || {
        let step = tune_step(gpu, n_tokens, start_slot);
        let bufs = b.page(&step, 0);
        cands
            .iter()
            .map(|&v| Candidate {
                dispatches: dispatches(v).map(|run| {
                    run.into_iter()
                        .map(|(p, groups)| {
                            let group = gpu.bind_group(&p, &bufs);
                            (p, group, groups)
                        })
                        .collect()
                }),
            })
            .collect()
    });
    cands[i]
}

/// Runs decode `variant` once, with the merge, against [`reference`]: 8
/// query heads over 2 KV heads of 80 (columns not a multiple of the eight
/// lanes of a key), an f32 cache of 600 slots (a partial last chunk). An
/// error when the kernel fails to build or run, or its result is off.
/// A device whose `tuned` set would time the eight-lanes-per-key kernel
/// runs this first (`Gpu::new`): that kernel counts on the subgroup layout
/// Vulkan does not promise.
pub fn check_decode_variant(gpu: &Runtime, variant: AttnDecodeVariant) -> Result<()> {
    let heads = Heads::new(8, 2, 80, KvFormat::F32);
    let run = WaveRun {
        heads,
        slots: 600,
        n_tokens: 1,
        qslots: None,
    };
    let groups = (600u32.div_ceil(variant.key_chunk()), heads.n_kv as u32, 1);
    run.check(
        gpu,
        &format!("{variant:?}"),
        1e-4,
        groups,
        Merge::of(variant),
        || decode_pipeline(gpu, variant, heads),
    )
}

/// Runs prefill `variant` once, with the merge, against [`reference`]: 70
/// queries (a partial 64-query block) from slot 230 (across a key chunk's
/// end), 8 query heads over 2 KV heads of 128, an f16 cache; and the
/// counter-causal entry once over the same 300 slots. An error when the
/// kernel fails to build or run, or its result is off by more than the f16
/// rounding of the matrix-unit kernel's inputs explains. A device whose
/// `tuned` set would time the matrix-unit prefill runs this first
/// (`Gpu::new`): it rests on an experimental wgpu feature.
pub fn check_prefill_variant(gpu: &Runtime, variant: AttnPrefillVariant) -> Result<()> {
    let heads = Heads::new(8, 2, 128, KvFormat::F16);
    let slots = 300;
    let chunks = (slots as u32).div_ceil(KEY_CHUNK);
    let qslots: &[u32] = &[0, 7, 255, 256, 298];
    for (entry, n, qslots) in [
        ("prefill_partial", 70, None),
        ("anticausal_partial", qslots.len(), Some(qslots)),
    ] {
        let run = WaveRun {
            heads,
            slots,
            n_tokens: n,
            qslots,
        };
        let groups = (ceil_div(n as u32, 64), heads.n_heads as u32, chunks);
        run.check(
            gpu,
            &format!("{variant:?} {entry}"),
            5e-3,
            groups,
            Merge::Chunks(KEY_CHUNK),
            || prefill_pipeline(gpu, variant, heads, entry),
        )?;
    }
    Ok(())
}

/// A made-up attention step for the start-up checks (and tests): smooth
/// waves for queries, keys and values, in one cache page of `slots` slots
/// in the heads' format; `n_tokens` queries, the last in the last slot
/// (causal), or with `qslots` the counter-causal queries of those slots
/// over all `slots` entries.
pub(crate) struct WaveRun<'a> {
    pub heads: Heads,
    pub slots: usize,
    pub n_tokens: usize,
    pub qslots: Option<&'a [u32]>,
}

impl WaveRun<'_> {
    /// Builds the partials pipeline `what` and checks its run against the
    /// CPU reference: an error when it fails to build or run (wgpu's
    /// validation errors included), or is off by `tol` or more.
    fn check(
        &self,
        gpu: &Runtime,
        what: &str,
        tol: f32,
        groups: (u32, u32, u32),
        merge: Merge,
        pipeline: impl FnOnce() -> Result<Arc<wgpu::ComputePipeline>>,
    ) -> Result<()> {
        let (ran, e) = gpu.catch_errors(|| {
            pipeline().map(|p| self.partials_and_merge(gpu, &p, &[], groups, merge))
        });
        if let Some(e) = e {
            anyhow::bail!("{what}: {e}");
        }
        let (got, want) = ran?;
        let err = super::max_error(&got?, &want);
        anyhow::ensure!(err < tol, "{what}: off the CPU reference by {err}");
        Ok(())
    }

    /// Runs `partials` (bound to the eleven bindings of attention_io.wgsl,
    /// then `extra`) on `groups` workgroups and the merge, and returns its
    /// output (an error if it cannot be read back) and the CPU reference's.
    pub(crate) fn partials_and_merge(
        &self,
        gpu: &Runtime,
        partials: &wgpu::ComputePipeline,
        extra: &[&wgpu::Buffer],
        groups: (u32, u32, u32),
        merge: Merge,
    ) -> (Result<Vec<f32>>, Vec<f32>) {
        let (heads, slots, n) = (self.heads, self.slots, self.n_tokens);
        let wave = |len: usize, f: f32, scale: f32| -> Vec<f32> {
            (0..len).map(|i| (i as f32 * f).sin() * scale).collect()
        };
        let row = heads.n_kv * heads.head_dim;
        let q = wave(n * heads.n_heads * heads.head_dim, 0.37, 1.0);
        let mut k = wave(slots * row, 0.91, 2.0);
        let mut v = wave(slots * row, 1.3, 1.0);
        let (k_cache, v_cache) = match heads.kv_format {
            KvFormat::F16 => {
                let bits = |x: &mut Vec<f32>| -> Vec<u16> {
                    x.iter_mut()
                        .map(|x| {
                            let h = half::f16::from_f32(*x);
                            *x = h.to_f32();
                            h.to_bits()
                        })
                        .collect()
                };
                (
                    SlotPages::from_rows(gpu, &bits(&mut k), row, slots),
                    SlotPages::from_rows(gpu, &bits(&mut v), row, slots),
                )
            }
            _ => (
                SlotPages::from_rows(gpu, &k, row, slots),
                SlotPages::from_rows(gpu, &v, row, slots),
            ),
        };
        let step = tune_step(gpu, n, slots - n);
        let params = gpu.uniform(
            "check-attn-params",
            &Params::of(heads, &AttnLayer::default()),
        );
        let (qb, out) = (
            gpu.storage_from("check-q", &q),
            gpu.storage("check-out", n as u64 * query_row_bytes(heads)),
        );
        let qslot = match self.qslots {
            Some(s) => gpu.storage_from("check-qslot", s),
            None => gpu.storage("check-qslot", 16),
        };
        let b = Bindings {
            params: &params,
            q: &qb,
            k_cache: &k_cache,
            v_cache: &v_cache,
            part: &gpu.storage("check-part", Attention::partials_bytes(heads, n, slots)),
            out: &out,
            lse: &gpu.storage("check-lse", (n * heads.n_heads * 4) as u64),
            qslot: &qslot,
            kpos: &qb,
        };
        let merge = merge_pipeline(gpu, heads, merge);
        let bufs = b.page(&step, 0);
        let with_extra: Vec<&wgpu::Buffer> =
            bufs.iter().copied().chain(extra.iter().copied()).collect();
        let got = merge.and_then(|merge| {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                let group = gpu.bind_group(partials, &with_extra);
                dispatch(&mut pass, partials, &group, groups);
                let group = gpu.bind_group(&merge, &bufs);
                dispatch(
                    &mut pass,
                    &merge,
                    &group,
                    (n as u32, heads.n_heads as u32, 1),
                );
            }
            gpu.queue.submit([enc.finish()]);
            gpu.read(&out, 0, q.len())
        });
        let want = match self.qslots {
            Some(s) => anticausal_reference(&q, &k, &v, heads, s, slots),
            None => reference(&q, &k, &v, heads, slots - n).0,
        };
        (got, want)
    }
}

/// The candidates' names, as the timings list them.
fn labels<T: std::fmt::Debug>(cands: &[T]) -> Vec<String> {
    cands.iter().map(|v| format!("{v:?}")).collect()
}

/// A step uniform of the timings' own: `n_tokens` queries from `start_slot`.
fn tune_step(gpu: &Runtime, n_tokens: usize, start_slot: usize) -> wgpu::Buffer {
    gpu.uniform(
        "tune-attn-step",
        &super::Step {
            n_tokens: n_tokens as u32,
            start_slot: start_slot as u32,
            ..Default::default()
        },
    )
}

/// CPU reference of one query row (row t, query head `head`) over the cache
/// slots `keys`: the softmax weights and the log-sum-exp of the scaled scores.
pub fn reference_softmax(
    q: &[f32],
    k: &[f32],
    h: Heads,
    t: usize,
    head: usize,
    keys: &[usize],
    scale: f64,
) -> (Vec<f64>, f64) {
    let hd = h.head_dim;
    let kvh = head / (h.n_heads / h.n_kv);
    let qv = &q[(t * h.n_heads + head) * hd..][..hd];
    let scores: Vec<f64> = keys
        .iter()
        .map(|&s| {
            let kv = &k[(s * h.n_kv + kvh) * hd..][..hd];
            qv.iter()
                .zip(kv)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
    (
        scores.iter().map(|s| (s - m).exp() / z).collect(),
        m + z.ln(),
    )
}

/// CPU reference of attention where query row t attends `keys_of(t)`.
/// Returns (out `[n, n_heads * hd]`, lse `[n, n_heads]`).
fn reference_over(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: Heads,
    scale: f64,
    keys_of: impl Fn(usize, usize) -> Vec<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let hd = h.head_dim;
    let n = q.len() / (h.n_heads * hd);
    let mut out = vec![0.0f32; q.len()];
    let mut lse = vec![0.0f32; n * h.n_heads];
    for t in 0..n {
        for head in 0..h.n_heads {
            let kvh = head / (h.n_heads / h.n_kv);
            let keys = keys_of(t, kvh);
            let (w, l) = reference_softmax(q, k, h, t, head, &keys, scale);
            for d in 0..hd {
                let acc: f64 = keys
                    .iter()
                    .zip(&w)
                    .map(|(&s, p)| p * v[(s * h.n_kv + kvh) * hd + d] as f64)
                    .sum();
                out[(t * h.n_heads + head) * hd + d] = acc as f32;
            }
            lse[t * h.n_heads + head] = l as f32;
        }
    }
    (out, lse)
}

/// CPU reference of causal attention: query t attends slots `0..=start_slot + t`.
/// Returns (out `[n, n_heads * hd]`, lse `[n, n_heads]`).
pub fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: Heads,
    start_slot: usize,
) -> (Vec<f32>, Vec<f32>) {
    let scale = 1.0 / (h.head_dim as f64).sqrt();
    reference_over(q, k, v, h, scale, |t, _| (0..=start_slot + t).collect())
}

/// A layer's scale and window for the references: query row t sits at
/// position `query_pos[t]`, the entry of slot s of KV head h at
/// `slot_pos[s * lists + first + h * per_kv]` (`positions`).
pub struct ReferenceMask<'a> {
    pub scale: f64,
    pub window: usize,
    pub query_pos: &'a [u32],
    pub slot_pos: &'a [u32],
    pub positions: SlotPositions,
}

impl ReferenceMask<'_> {
    /// The position of slot s's entry for KV head kvh.
    pub fn pos(&self, s: usize, kvh: usize) -> u32 {
        let p = self.positions;
        self.slot_pos[s * p.lists as usize + (p.first + kvh as u32 * p.per_kv) as usize]
    }

    /// Whether a query at `query_pos` sees slot s of KV head kvh.
    pub fn sees(&self, query_pos: u32, s: usize, kvh: usize) -> bool {
        query_pos.abs_diff(self.pos(s, kvh)) < self.window as u32
    }
}

/// [`reference`] with a scale of its own and a sliding window.
pub fn reference_masked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: Heads,
    start_slot: usize,
    mask: &ReferenceMask,
) -> (Vec<f32>, Vec<f32>) {
    reference_over(q, k, v, h, mask.scale, |t, kvh| {
        (0..=start_slot + t)
            .filter(|&s| mask.sees(mask.query_pos[t], s, kvh))
            .collect()
    })
}

/// CPU reference of the counter-causal attention: query t attends the slots
/// after `qslot[t]` among the `n_present` keys. Returns out `[n, n_heads * hd]`.
pub fn anticausal_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: Heads,
    qslot: &[u32],
    n_present: usize,
) -> Vec<f32> {
    let scale = 1.0 / (h.head_dim as f64).sqrt();
    reference_over(q, k, v, h, scale, |t, _| {
        (qslot[t] as usize + 1..n_present).collect()
    })
    .0
}

/// [`anticausal_reference`] with a scale of its own and a sliding window
/// (a query's position is its own slot's, in its KV head's keep list).
pub fn anticausal_reference_masked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: Heads,
    qslot: &[u32],
    n_present: usize,
    mask: &ReferenceMask,
) -> Vec<f32> {
    reference_over(q, k, v, h, mask.scale, |t, kvh| {
        let own = mask.pos(qslot[t] as usize, kvh);
        (qslot[t] as usize + 1..n_present)
            .filter(|&s| mask.sees(own, s, kvh))
            .collect()
    })
    .0
}

/// The start-up checks of the attention variants that rest on what the
/// API does not promise (`kernels::startup` runs them).
pub(super) fn start_up_checks(rt: &mut Runtime) {
    // The matrix-unit prefill attention rests on the same experimental
    // feature: where `tuned` would time it, it runs once against the CPU
    // reference first, and is dropped on a failure.
    if rt.kernels.attn_prefill_coop {
        use super::variants::AttnPrefillVariant::Coop;
        if let Err(e) = check_prefill_variant(rt, Coop) {
            eprintln!(
                "warning: the cooperative-matrix prefill attention failed its check on {} ({e:#}); it is not timed",
                rt.info.name
            );
            rt.kernels.attn_prefill_coop = false;
        }
    }
    // The decode attentions that number their lanes by subgroup count on
    // subgroups of one size in a workgroup, which Vulkan does not promise:
    // where `tuned` would time one, it runs once against the CPU reference
    // first, and is dropped alone on a failure.
    let checked: Vec<_> = rt
        .kernels
        .attn_decode_candidates()
        .into_iter()
        .filter(|v| rt.kernels.tuned() && v.kernel().min_subgroup > 0)
        .collect();
    for variant in checked {
        if let Err(e) = check_decode_variant(rt, variant) {
            eprintln!(
                "warning: the decode attention {variant:?} failed its check on {} ({e:#}); it is not timed",
                rt.info.name
            );
            rt.kernels.attn_decode_refused.insert(variant);
        }
    }
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::device::KernelSet;
    use crate::formats::KvFormat;
    use crate::kernels::testutil::*;
    use crate::kernels::variants::SPLIT_KEY_CHUNKS;
    use crate::kernels::Step;

    /// Head shapes past the kernels' limits (their override constants) are
    /// refused with an error naming them, before anything is compiled.
    #[cfg_attr(test, test)]
    fn head_shapes_past_the_kernel_limits_are_refused() {
        let gpu = gpu();
        let step = step_buffer(&gpu, Step::default());
        let buf = gpu.storage("any", 1 << 16);
        for (nh, nkv, hd, what) in [
            (9, 1, 64, "9 query heads over 1 KV heads"),
            (6, 4, 64, "6 query heads over 4 KV heads"),
            (4, 4, 260, "head_dim 260"),
            (4, 4, 66, "head_dim 66"),
            (8, 1, 256, "at most 4 query heads per KV head, not 8"),
        ] {
            let h = Heads::new(nh, nkv, hd, KvFormat::F32);
            let (kb, _) = kv_pages(&gpu, &vec![0.0; nkv * hd], nkv * hd, 1, KvFormat::F32);
            let (vb, _) = kv_pages(&gpu, &vec![0.0; nkv * hd], nkv * hd, 1, KvFormat::F32);
            let none = AttnLayer::default();
            let err = Attention::new(
                &gpu, &step, h, 1, &buf, &kb, &vb, &buf, &buf, &buf, &buf, none,
            )
            .err()
            .unwrap_or_else(|| panic!("{what}: accepted"))
            .to_string();
            assert!(err.contains(what), "{err}");
        }
    }

    /// Attention of `n` queries from slot `start` against a cache in pages of
    /// `page` slots (0: one page), stored in f32 and in f16.
    fn check(gpu: &Runtime, nh: usize, nkv: usize, hd: usize, n: usize, start: usize, page: usize) {
        for format in [KvFormat::F32, KvFormat::F16] {
            check_format(gpu, nh, nkv, hd, n, start, page, format);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn check_format(
        gpu: &Runtime,
        nh: usize,
        nkv: usize,
        hd: usize,
        n: usize,
        start: usize,
        page: usize,
        format: KvFormat,
    ) -> Attention {
        let h = Heads::new(nh, nkv, hd, format);
        let slots = start + n;
        let q = rand_vec(n * nh * hd, 1 + n as u64, 1.0);
        // Larger keys make attention peaked, as in trained models.
        let k = rand_vec(slots * nkv * hd, 2 + slots as u64, 2.0);
        let v = rand_vec(slots * nkv * hd, 3, 1.0);
        let step = step_buffer(
            gpu,
            Step {
                n_tokens: n as u32,
                start_slot: start as u32,
                ..Default::default()
            },
        );
        let qb = gpu.storage_from("q", &q);
        let page = if page == 0 { slots } else { page };
        let (kb, k) = kv_pages(gpu, &k, nkv * hd, page, format);
        let (vb, v) = kv_pages(gpu, &v, nkv * hd, page, format);
        let ob = gpu.storage("o", (n * nh * hd * 4) as u64);
        let lb = gpu.storage("lse", (n * nh * 4) as u64);
        let part = gpu.storage("part", Attention::partials_bytes(h, n, slots));
        let a = Attention::new(
            gpu,
            &step,
            h,
            slots,
            &qb,
            &kb,
            &vb,
            &part,
            &ob,
            &lb,
            &gpu.storage("qslot", 16),
            AttnLayer::default(),
        )
        .unwrap();
        run_pass(gpu, |pass| a.encode(pass, n as u32, start as u32));
        let got: Vec<f32> = gpu.read(&ob, 0, n * nh * hd).unwrap();
        let got_lse: Vec<f32> = gpu.read(&lb, 0, n * nh).unwrap();
        let (want, want_lse) = reference(&q, &k, &v, h, start);
        let what = format!("heads {nh}/{nkv} hd {hd} n {n} start {start} page {page} {format:?}");
        assert!(
            max_abs_diff(&got, &want) < 2e-5,
            "{what}: out err {}",
            max_abs_diff(&got, &want)
        );
        assert!(
            max_abs_diff(&got_lse, &want_lse) < 1e-4,
            "{what}: lse err {}",
            max_abs_diff(&got_lse, &want_lse)
        );
        a
    }

    /// `--kernels tuned` times decode at each depth the first page holds
    /// (here 1,024 and its 1,300 slots) and runs each step with its depth's
    /// choice: forced here to differ (the serial kernel to 1,024 keys, the
    /// parallel one past), the deep step matches the reference, and the
    /// choice by depth is the forced one. Equal choices merge.
    #[cfg_attr(test, test)]
    fn tuned_decode_runs_each_depths_choice() {
        let gpu = gpu_with(KernelSet::Tuned);
        let cands = gpu.kernels.attn_decode_candidates();
        let serial = cands.len() - 1;
        assert_eq!(cands[serial], AttnDecodeVariant::Serial);
        let heads = Heads::new(4, 2, 32, KvFormat::F32);
        let key = |keys| TuneKey::Attention {
            op: "attention decode",
            heads,
            queries: 1,
            keys,
        };
        gpu.tuner.force(key(1024), labels(&cands), serial);
        gpu.tuner.force(key(1300), labels(&cands), 0);
        let a = check_format(&gpu, 4, 2, 32, 1, 1299, 0, KvFormat::F32);
        assert_eq!(
            a.decode_variants(),
            [(1024, AttnDecodeVariant::Serial), (u32::MAX, cands[0])]
        );
        assert_eq!(a.decode_variant_at(1), AttnDecodeVariant::Serial);
        assert_eq!(a.decode_variant_at(1024), AttnDecodeVariant::Serial);
        assert_eq!(a.decode_variant_at(1025), cands[0]);
        assert_eq!(a.decode_variant_at(100_000), cands[0]);
        // The same choice at both depths: one kernel for all.
        let heads = Heads::new(4, 2, 16, KvFormat::F32);
        for keys in [1024, 1300] {
            let key = TuneKey::Attention {
                op: "attention decode",
                heads,
                queries: 1,
                keys,
            };
            gpu.tuner.force(key, labels(&cands), serial);
        }
        let a = check_format(&gpu, 4, 2, 16, 1, 1299, 0, KvFormat::F32);
        assert_eq!(a.decode_variants(), [(u32::MAX, AttnDecodeVariant::Serial)]);
    }

    /// Both prefill variants (`cpu`: attention.wgsl, `gpu`: attention_prefill.wgsl).
    #[cfg_attr(test, test)]
    fn prefill_matches_reference() {
        for set in [KernelSet::Cpu, KernelSet::Gpu] {
            let gpu = gpu_with(set);
            // GQA ratios 1, 3 and 4; head_dim 64 and 128 (and 36: columns
            // not a multiple of the 4 lanes of a query); lengths off the
            // 16- and 8-key tiles and the 64-query block.
            check(&gpu, 2, 2, 64, 2, 0, 0);
            check(&gpu, 9, 3, 64, 37, 0, 0);
            check(&gpu, 8, 2, 128, 65, 5, 0);
            check(&gpu, 4, 1, 32, 130, 17, 0);
            check(&gpu, 3, 1, 36, 70, 250, 0);
        }
    }

    /// A cache split into pages of whole key chunks gives the same result,
    /// with queries on both sides of page boundaries and a short last page.
    #[cfg_attr(test, test)]
    fn paged_caches_match_reference() {
        for gpu in decode_devices() {
            check(&gpu, 4, 2, 32, 100, 200, 256);
            check(&gpu, 6, 3, 64, 1, 256, 256);
            check(&gpu, 8, 2, 128, 1, 1100, 512);
            check(&gpu, 4, 1, 64, 130, 700, 256);
        }
    }

    /// Devices with each decode variant: `cpu` (attention.wgsl), `gpu`
    /// (attention_decode.wgsl, with one and with eight value rows loaded at
    /// a time; over chunks of 64 keys in `short_chunks_match_reference`) and, where the device's subgroups take them
    /// (lavapipe's 8 lanes do; with `LP_NATIVE_VECTOR_WIDTH=128` its 4 do
    /// not), the `gpu` set with the eight-lanes-per-key kernel
    /// (attention_decode_lanes.wgsl) and with the split-key one over splits
    /// of 128 keys (attention_decode_split.wgsl; its longer splits in
    /// `split_keys_match_reference`).
    fn decode_devices() -> Vec<Arc<Runtime>> {
        let mut out = vec![
            gpu_with(KernelSet::Cpu),
            gpu_with(KernelSet::Gpu),
            gpu_with_variants(KernelSet::Gpu, |v| {
                v.attn_decode = AttnDecodeVariant::ParallelBatched;
            }),
        ];
        if eight_lane_decodes_run_here(&out[1]) {
            out.push(gpu_with_variants(KernelSet::Gpu, |v| {
                v.attn_decode = AttnDecodeVariant::LanesPerKey;
            }));
            out.push(gpu_with_variants(KernelSet::Gpu, |v| {
                v.attn_decode = AttnDecodeVariant::SplitKey { chunk: 128 };
            }));
        }
        out
    }

    /// Whether the device's subgroups take the decodes with eight lanes a
    /// key (LanesPerKey, SplitKey); where not, a note says that they are
    /// not run (on subgroups of 4 their shuffles would read lanes outside
    /// the subgroup: undefined, whatever a driver happens to return). A
    /// device with subgroups of 8 lanes or more (lavapipe's by default)
    /// must take them: there the rule dropping them is a failure, not a
    /// reason to skip.
    fn eight_lane_decodes_run_here(gpu: &Runtime) -> bool {
        let p = &gpu.profile;
        let subgroups_take_it = p.subgroups && p.subgroup_min >= 8;
        let k = &gpu.kernels;
        let split = AttnDecodeVariant::SplitKey { chunk: 128 };
        assert_eq!(
            (
                k.takes_decode(AttnDecodeVariant::LanesPerKey),
                k.takes_decode(split)
            ),
            (subgroups_take_it, subgroups_take_it),
            "LanesPerKey and SplitKey decodes on {} (subgroups of {}..{} lanes)",
            gpu.info.name,
            p.subgroup_min,
            p.subgroup_max
        );
        if !subgroups_take_it {
            note(format!(
                "this device has subgroups of {}..{} lanes; the LanesPerKey and SplitKey decodes (8 lanes a key) are not run",
                p.subgroup_min, p.subgroup_max
            ));
        }
        subgroups_take_it
    }

    #[cfg_attr(test, test)]
    fn decode_matches_reference() {
        for gpu in decode_devices() {
            // Head sizes 64, 128 and 32, and 36, 100 and 16 (columns not a
            // multiple of the eight lanes of a key; fewer than eight).
            check(&gpu, 2, 2, 64, 1, 0, 0);
            check(&gpu, 9, 3, 64, 1, 255, 0);
            check(&gpu, 8, 2, 128, 1, 600, 0);
            check(&gpu, 6, 2, 32, 1, 257, 0);
            check(&gpu, 3, 1, 36, 1, 40, 0);
            check(&gpu, 4, 2, 100, 1, 520, 0);
            check(&gpu, 4, 2, 16, 1, 300, 0);
            // Group sizes 8 and 7 (the most the kernels take; Qwen2.5-7B's).
            check(&gpu, 8, 1, 128, 1, 300, 0);
            check(&gpu, 14, 2, 64, 1, 513, 0);
        }
    }

    /// The decode kernel over chunks of 64 keys (`ParallelShort`: the
    /// batched kernel with CHUNK = 64 and its own merge): steps ending
    /// inside and just past a chunk, several chunks, the largest group and
    /// head, columns fewer than the lanes of a slice, a cache in pages of
    /// 256 slots (four chunks each), in both cache formats. The other
    /// shapes are the batched kernel's, which differs in CHUNK only.
    #[cfg_attr(test, test)]
    fn short_chunks_match_reference() {
        let gpu = gpu_with_variants(KernelSet::Gpu, |v| {
            v.attn_decode = AttnDecodeVariant::ParallelShort;
        });
        check(&gpu, 2, 2, 64, 1, 0, 0);
        check(&gpu, 8, 1, 128, 1, 64, 0);
        check(&gpu, 14, 2, 64, 1, 513, 0);
        check(&gpu, 3, 1, 36, 1, 40, 0);
        check(&gpu, 6, 3, 64, 1, 300, 256);
    }

    /// The split-key decode over its longer splits (`SplitKey`, with its own
    /// merge): a step inside the first split, one just past a split,
    /// several splits with a partial last, the largest group, columns not a
    /// multiple of the eight lanes of a key, a cache in pages of whole
    /// splits, in both cache formats (splits of 128, windows and wide heads:
    /// `decode_devices`).
    #[cfg_attr(test, test)]
    fn split_keys_match_reference() {
        if !eight_lane_decodes_run_here(&gpu_with(KernelSet::Gpu)) {
            return;
        }
        for chunk in [512, 2048] {
            let gpu = gpu_with_variants(KernelSet::Gpu, |v| {
                v.attn_decode = AttnDecodeVariant::SplitKey { chunk };
            });
            let c = chunk as usize;
            check(&gpu, 2, 2, 64, 1, 0, 0);
            check(&gpu, 8, 1, 128, 1, c, 0);
            check(&gpu, 14, 2, 64, 1, 2 * c + 300, 0);
            check(&gpu, 3, 1, 36, 1, 40, 0);
            check(&gpu, 6, 3, 64, 1, 3000, 2048);
        }
    }

    /// Sequences sharing a step: each has its own cache and depth and its
    /// own `Step` (n_tokens, start_slot, row0), and reads its queries from
    /// and writes its outputs to rows row0.. of buffers all of them share.
    /// Every row must match its own sequence's reference: a kernel that
    /// ignored row0 would read the first sequence's queries and overwrite
    /// its outputs.
    fn check_shared_step(gpu: &Runtime, nh: usize, nkv: usize, hd: usize, seqs: &[(usize, usize)]) {
        let h = Heads::new(nh, nkv, hd, KvFormat::F32);
        let rows: usize = seqs.iter().map(|&(n, _)| n).sum();
        let q = rand_vec(rows * nh * hd, 7, 1.0);
        let qb = gpu.storage_from("q", &q);
        let ob = gpu.storage("o", (rows * nh * hd * 4) as u64);
        let lb = gpu.storage("lse", (rows * nh * 4) as u64);
        let qslot = gpu.storage("qslot", 16);
        let mut row0 = 0;
        let mut runs = vec![];
        for (i, &(n, start)) in seqs.iter().enumerate() {
            let slots = start + n;
            let k = rand_vec(slots * nkv * hd, 20 + i as u64, 2.0);
            let v = rand_vec(slots * nkv * hd, 30 + i as u64, 1.0);
            let step = Step {
                n_tokens: n as u32,
                start_slot: start as u32,
                row0: row0 as u32,
                ..Default::default()
            };
            let step = step_buffer(gpu, step);
            let (kb, k) = kv_pages(gpu, &k, nkv * hd, slots, KvFormat::F32);
            let (vb, v) = kv_pages(gpu, &v, nkv * hd, slots, KvFormat::F32);
            let part = gpu.storage("part", Attention::partials_bytes(h, n, slots));
            let a = Attention::new(
                gpu,
                &step,
                h,
                slots,
                &qb,
                &kb,
                &vb,
                &part,
                &ob,
                &lb,
                &qslot,
                AttnLayer::default(),
            )
            .unwrap();
            let want = reference(&q[row0 * nh * hd..(row0 + n) * nh * hd], &k, &v, h, start);
            runs.push((a, (step, kb, vb, part), n, start, row0, want));
            row0 += n;
        }
        run_pass(gpu, |pass| {
            for (a, _, n, start, _, _) in &runs {
                a.encode(pass, *n as u32, *start as u32);
            }
        });
        let got: Vec<f32> = gpu.read(&ob, 0, rows * nh * hd).unwrap();
        let got_lse: Vec<f32> = gpu.read(&lb, 0, rows * nh).unwrap();
        for (i, (_, _, n, start, row0, (want, want_lse))) in runs.iter().enumerate() {
            let what = format!(
                "sequence {i} of {seqs:?} (rows {row0}.., start {start}) on {:?}",
                gpu.kernels.attn_decode
            );
            let out = &got[row0 * nh * hd..(row0 + n) * nh * hd];
            assert!(
                max_abs_diff(out, want) < 2e-5,
                "{what}: out err {}",
                max_abs_diff(out, want)
            );
            let lse = &got_lse[row0 * nh..(row0 + n) * nh];
            assert!(max_abs_diff(lse, want_lse) < 1e-4, "{what}: lse err");
        }
    }

    /// Decode (one token each) and prefill (several) sequences sharing a
    /// step, with every decode variant and both prefill variants.
    #[cfg_attr(test, test)]
    fn sequences_sharing_a_step_stay_apart() {
        // ParallelBatched is left out: ParallelShort runs its value loop
        // (eight rows at a time) too, and each device's pipelines cost the
        // browser's run seconds.
        let mut devices: Vec<_> = decode_devices()
            .into_iter()
            .filter(|gpu| gpu.kernels.attn_decode != AttnDecodeVariant::ParallelBatched)
            .collect();
        devices.push(gpu_with_variants(KernelSet::Gpu, |v| {
            v.attn_decode = AttnDecodeVariant::ParallelShort;
        }));
        for gpu in &devices {
            check_shared_step(gpu, 8, 2, 64, &[(1, 300), (1, 40), (1, 0)]);
        }
        for prefill in [AttnPrefillVariant::RowPerLane, AttnPrefillVariant::Tiled] {
            let gpu = gpu_with_variants(KernelSet::Gpu, |v| v.attn_prefill = prefill);
            check_shared_step(&gpu, 4, 2, 32, &[(5, 10), (70, 3), (2, 300)]);
        }
        check_shared_step(&gpu_with(KernelSet::Cpu), 4, 2, 32, &[(5, 10), (70, 3)]);
    }

    /// With `tuned`, each attention shape's decode and prefill candidates
    /// are timed once, on the engine's own buffers, and the chosen kernels
    /// still match the reference.
    #[cfg_attr(test, test)]
    fn tuned_attention_times_each_shape_once() {
        let gpu = gpu_with(KernelSet::Tuned);
        // A decode step deep enough to time decode; its one-row query
        // buffer holds no prefill chunk.
        check_format(&gpu, 8, 2, 128, 1, 600, 0, KvFormat::F16);
        // A prefill step: decode is timed at its 147 slots.
        check_format(&gpu, 4, 1, 64, 130, 17, 0, KvFormat::F32);
        let results = gpu.tuner.results();
        let ops: Vec<_> = results.iter().map(|t| t.key.op()).collect();
        let timed: Vec<_> = results.iter().map(|t| t.untimed.is_none()).collect();
        assert_eq!(
            ops,
            [
                "attention decode",
                "attention prefill",
                "attention decode",
                "attention prefill"
            ]
        );
        assert_eq!(timed, [true, false, true, true], "{results:?}");
        let decode = &results[0];
        assert_eq!(
            decode.key,
            TuneKey::Attention {
                op: "attention decode",
                heads: Heads::new(8, 2, 128, KvFormat::F16),
                queries: 1,
                keys: 601
            }
        );
        let labels: &[&str] = if eight_lane_decodes_run_here(&gpu) {
            &[
                "Parallel",
                "ParallelBatched",
                "ParallelShort",
                "LanesPerKey",
                "SplitKey { chunk: 128 }",
                "SplitKey { chunk: 512 }",
                "SplitKey { chunk: 2048 }",
                "Serial",
            ]
        } else {
            &["Parallel", "ParallelBatched", "ParallelShort", "Serial"]
        };
        assert_eq!(decode.labels, labels);
        // The prefill is timed at as many queries as the step's buffers hold.
        let prefill = &results[3];
        assert!(
            matches!(
                prefill.key,
                TuneKey::Attention {
                    queries: 130,
                    keys: 130,
                    ..
                }
            ),
            "{:?}",
            prefill.key
        );
        assert_eq!(prefill.labels, ["Tiled", "RowPerLane"]);
        assert!(matches!(
            results[2].key,
            TuneKey::Attention { keys: 147, .. }
        ));
        for t in [decode, &results[2], prefill] {
            assert!(
                t.seconds.iter().all(|s| s.is_some_and(|s| s > 0.0)),
                "{t:?}"
            );
            assert!(crate::kernels::tune::describe(t).contains("slots"));
        }
        // What was not timed keeps the rule's choice and says why.
        let t = &results[1];
        assert_eq!(t.choice, 0);
        assert!(t.seconds.iter().all(Option::is_none), "{t:?}");
        assert!(
            crate::kernels::tune::describe(t).contains("not timed: "),
            "{t:?}"
        );
        // The same shapes again: nothing new is timed or recorded.
        check_format(&gpu, 8, 2, 128, 1, 600, 0, KvFormat::F16);
        check_format(&gpu, 4, 1, 64, 130, 17, 0, KvFormat::F32);
        assert_eq!(gpu.tuner.results().len(), 4);
    }

    /// The start-up check passes every decode variant this device takes.
    #[cfg_attr(test, test)]
    fn decode_check_passes_every_variant() {
        let gpu = gpu_with(KernelSet::Gpu);
        let mut variants = vec![
            AttnDecodeVariant::Serial,
            AttnDecodeVariant::Parallel,
            AttnDecodeVariant::ParallelBatched,
            AttnDecodeVariant::ParallelShort,
        ];
        if eight_lane_decodes_run_here(&gpu) {
            variants.push(AttnDecodeVariant::LanesPerKey);
            variants.extend(SPLIT_KEY_CHUNKS.map(|chunk| AttnDecodeVariant::SplitKey { chunk }));
        }
        for v in variants {
            check_decode_variant(&gpu, v).unwrap();
        }
    }

    /// The matrix-unit prefill with its matrix operations emulated
    /// (`testutil::emulate_coop`), so that where the device has no
    /// cooperative matrices (lavapipe) the rest of it runs against the CPU
    /// reference: staging, the two passes over the chunk, masks, GQA, the
    /// output columns and the partials layout. Causal steps from slot 0
    /// (partial query blocks) and across a key chunk's end, heads of 16, 32,
    /// 64 and 128 values (one to eight output blocks), and the
    /// counter-causal entry.
    #[cfg_attr(test, test)]
    fn coop_prefill_emulated_matches_reference() {
        let gpu = gpu();
        if !can_emulate_coop(&gpu, "the emulated matrix-unit prefill") {
            return;
        }
        let shader = &shaders::ATTENTION_PREFILL_COOP;
        let init = "emu_init(wid.x + 4u * (wid.y + 16u * wid.z), sg, sg_lane);";
        let (body, emu_slots) = emulate_coop(shader.body, init, 11);
        let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
        let emulated = shaders::Shader {
            name: leak(format!("{}-emulated", shader.name)),
            body: leak(body),
            ..*shader
        };
        use KvFormat::F16;
        // (query heads, KV heads, head_dim, cache format (f16: the only one
        // the launcher gives it), slots, queries,
        // counter-causal query slots)
        let anticausal: &[u32] = &[0, 5, 255, 256, 298];
        let cases = [
            (4, 2, 64, F16, 70, 70, None),
            (3, 1, 32, F16, 270, 30, None),
            (2, 2, 128, F16, 5, 5, None),
            (8, 2, 16, F16, 130, 130, None),
            (2, 1, 64, F16, 300, 5, Some(anticausal)),
        ];
        for (nh, nkv, hd, format, slots, n, qslots) in cases {
            let heads = Heads::new(nh, nkv, hd, format);
            let constants = prefill_constants(&gpu, AttnPrefillVariant::Coop, heads);
            let entry = match qslots {
                Some(_) => "anticausal_partial",
                None => "prefill_partial",
            };
            let pipeline = gpu
                .pipeline(&emulated, Some(format.into()), entry, &constants)
                .unwrap();
            let groups = (
                ceil_div(n as u32, 64),
                nh as u32,
                (slots as u32).div_ceil(KEY_CHUNK),
            );
            assert!(groups.0 <= 4 && groups.1 <= 16 && groups.2 <= 4);
            // 4 x 16 x 4 workgroups of 4 subgroups, `emu_slots` matrices each.
            let scratch = gpu.storage("emulated-matrices", 256 * 4 * emu_slots as u64 * 256 * 4);
            let run = WaveRun {
                heads,
                slots,
                n_tokens: n,
                qslots,
            };
            let (got, want) = run.partials_and_merge(
                &gpu,
                &pipeline,
                &[&scratch],
                groups,
                Merge::Chunks(KEY_CHUNK),
            );
            let err = max_abs_diff(&got.unwrap(), &want);
            // f16 rounding of the inputs gave at most 4.5e-4 here.
            assert!(
                err < 2e-3,
                "{nh}/{nkv} heads of {hd}, {format:?}, {n} queries over {slots} slots ({entry}): {err}"
            );
        }
    }

    /// The prefill start-up check passes the kernels that run here and
    /// refuses (an error, no panic) the matrix-unit one where the device
    /// has no cooperative matrices.
    #[cfg_attr(test, test)]
    fn prefill_check_passes_what_runs_here() {
        let gpu = gpu();
        for v in [AttnPrefillVariant::RowPerLane, AttnPrefillVariant::Tiled] {
            check_prefill_variant(&gpu, v).unwrap();
        }
        let coop = check_prefill_variant(&gpu, AttnPrefillVariant::Coop);
        if gpu.profile.coop_f16_16x16 {
            coop.unwrap();
        } else {
            assert!(
                coop.is_err(),
                "the matrix-unit prefill ran without the feature"
            );
        }
    }

    /// Both variants of the counter-causal pass (with the prefill kernels).
    #[cfg_attr(test, test)]
    fn anticausal_matches_reference() {
        for set in [KernelSet::Cpu, KernelSet::Gpu] {
            anticausal_cases(&gpu_with(set));
        }
    }

    fn anticausal_cases(gpu: &Runtime) {
        // The last case holds the cache in pages of 256 slots.
        use KvFormat::{F16, F32};
        for &(nh, nkv, hd, n_present, ref qslots, page, format) in &[
            (
                2usize,
                1usize,
                32usize,
                20usize,
                vec![0u32, 5, 18],
                20usize,
                F32,
            ),
            (9, 3, 64, 300, vec![4, 100, 255, 256, 298], 300, F16),
            (8, 2, 128, 600, vec![0, 1, 2, 511, 512, 513], 600, F32),
            (
                8,
                2,
                128,
                600,
                vec![0, 1, 2, 255, 256, 511, 512, 513],
                256,
                F16,
            ),
        ] {
            let h = Heads::new(nh, nkv, hd, format);
            let n = qslots.len();
            let q = rand_vec(n * nh * hd, 11, 1.0);
            let k = rand_vec(n_present * nkv * hd, 12, 2.0);
            let v = rand_vec(n_present * nkv * hd, 13, 1.0);
            let step = step_buffer(
                gpu,
                Step {
                    n_tokens: n as u32,
                    start_slot: (n_present - n) as u32,
                    ..Default::default()
                },
            );
            let qb = gpu.storage_from("q", &q);
            let (kb, k) = kv_pages(gpu, &k, nkv * hd, page, format);
            let (vb, v) = kv_pages(gpu, &v, nkv * hd, page, format);
            let qs = gpu.storage_from("qslot", qslots);
            let part = gpu.storage("part", Attention::partials_bytes(h, n, n_present));
            let ob = gpu.storage("o", (n * nh * hd * 4) as u64);
            let lb = gpu.storage("lse", (n * nh * 4) as u64);
            let a = Attention::new(
                gpu,
                &step,
                h,
                n_present,
                &qb,
                &kb,
                &vb,
                &part,
                &ob,
                &lb,
                &qs,
                AttnLayer::default(),
            )
            .unwrap();
            run_pass(gpu, |pass| {
                a.encode_anticausal(pass, n as u32, n_present as u32)
            });
            let got: Vec<f32> = gpu.read(&ob, 0, n * nh * hd).unwrap();
            let want = anticausal_reference(&q, &k, &v, h, qslots, n_present);
            assert!(
                max_abs_diff(&got, &want) < 2e-5,
                "{nh}/{nkv}/{hd} over {n_present} {format:?}: {}",
                max_abs_diff(&got, &want)
            );
        }
    }

    #[cfg_attr(test, test)]
    fn long_contexts_past_4096() {
        for gpu in decode_devices() {
            check(&gpu, 4, 1, 128, 1, 5000, 0);
            check(&gpu, 6, 2, 64, 3, 4200, 0);
            check(&gpu, 8, 2, 128, 70, 4100, 0);
        }
    }

    /// Sliding windows, a scale of the layer's own and heads of 256 (the
    /// wide build): prefill, decode and the counter-causal entry against the
    /// masked reference, on a device with each decode variant but
    /// ParallelBatched and the `gpu` set's `Tiled` prefill (their wide
    /// builds for heads of 256; the variants beyond the `cpu` and `gpu`
    /// sets' on the decode cases). Slot positions have gaps (as after
    /// evictions), so the window is by position, not by slot; the decode
    /// step's first chunk lies wholly outside its window (a chunk with no
    /// key seen). Each KV head reads its own keep list's positions (the
    /// cache kept per head: `Granularity::Head`), which differ between
    /// heads for the cached slots; list 0 belongs to no head.
    #[cfg_attr(test, test)]
    fn windows_scales_and_wide_heads_match_reference() {
        let mut devices = decode_devices();
        devices.push(gpu_with_variants(KernelSet::Gpu, |v| {
            v.attn_decode = AttnDecodeVariant::ParallelShort;
        }));
        // (query heads, KV heads, head_dim, window, queries, first slot, format)
        let cases = [
            (2, 1, 256, 16, 40, 0, KvFormat::F32),
            (2, 1, 256, 16, 1, 300, KvFormat::F16),
            (4, 1, 256, 40, 9, 270, KvFormat::F32),
            (4, 2, 64, 7, 30, 5, KvFormat::F32),
            (4, 2, 64, 100, 1, 400, KvFormat::F16),
            // Four query heads of 256 (the wide build's GMAX) over three
            // chunks, the window wider than the cache.
            (4, 1, 256, 5000, 1, 600, KvFormat::F32),
        ];
        // Every case on the `cpu` and `gpu` sets (Serial and RowPerLane,
        // Parallel and Tiled); on the devices with the other decode
        // variants, the decode cases (the others repeat what those two
        // checked: each test in the browser pays for its devices' pipelines).
        let runs = devices.iter().enumerate().flat_map(|(i, gpu)| {
            cases
                .into_iter()
                .filter(move |&(.., n, _, _)| i < 2 || n == 1)
                .map(move |case| (gpu, case))
        });
        for (gpu, (nh, nkv, hd, window, n, start, format)) in runs {
            let h = Heads::new(nh, nkv, hd, format);
            let slots = start + n;
            let positions = SlotPositions {
                lists: nkv as u32 + 1,
                first: 1,
                per_kv: 1,
            };
            let slot_pos: Vec<u32> = (0..slots as u32)
                .flat_map(|s| {
                    (0..positions.lists).map(move |list| match s < start as u32 {
                        true => 3 * s + 5 + 3 * (list % 2),
                        false => 3 * s + 8,
                    })
                })
                .collect();
            let query_pos: Vec<u32> = (start as u32..slots as u32).map(|s| 3 * s + 8).collect();
            let q = rand_vec(n * nh * hd, 11 + n as u64, 1.0);
            let k = rand_vec(slots * nkv * hd, 12, 2.0);
            let v = rand_vec(slots * nkv * hd, 13, 1.0);
            let step = step_buffer(
                gpu,
                Step {
                    n_tokens: n as u32,
                    start_slot: start as u32,
                    ..Default::default()
                },
            );
            let (kb, k) = kv_pages(gpu, &k, nkv * hd, slots, format);
            let (vb, v) = kv_pages(gpu, &v, nkv * hd, slots, format);
            let (qb, kpos) = (
                gpu.storage_from("q", &q),
                gpu.storage_from("kpos", &slot_pos),
            );
            let ob = gpu.storage("o", (n * nh * hd * 4) as u64);
            let lb = gpu.storage("lse", (n * nh * 4) as u64);
            let part = gpu.storage("part", Attention::partials_bytes(h, n, slots));
            let qslot: Vec<u32> = (0..n as u32).map(|t| (t * 7) % slots as u32).collect();
            let qs = gpu.storage_from("qslot", &qslot);
            let scale = 1.0 / 12.0;
            let layer = AttnLayer {
                scale: Some(scale),
                window: Some(Window {
                    size: window as u32,
                    slot_positions: &kpos,
                    positions,
                }),
            };
            let a = Attention::new(
                gpu, &step, h, slots, &qb, &kb, &vb, &part, &ob, &lb, &qs, layer,
            )
            .unwrap();
            let mask = ReferenceMask {
                scale: scale as f64,
                window,
                query_pos: &query_pos,
                slot_pos: &slot_pos,
                positions,
            };
            let what = format!(
                "{:?} decode, {:?} prefill: {nh}/{nkv} heads of {hd}, window {window}, {n} from {start}",
                gpu.kernels.attn_decode, gpu.kernels.attn_prefill
            );
            run_pass(gpu, |pass| a.encode(pass, n as u32, start as u32));
            let got: Vec<f32> = gpu.read(&ob, 0, n * nh * hd).unwrap();
            let (want, _) = reference_masked(&q, &k, &v, h, start, &mask);
            let err = max_abs_diff(&got, &want);
            assert!(err < 2e-5, "{what}: {err}");
            // The counter-causal entry: each query is the entry of its slot
            // and sees the later ones within the window (rows past the
            // last slot see none).
            run_pass(gpu, |pass| {
                a.encode_anticausal(pass, n as u32, slots as u32)
            });
            let got: Vec<f32> = gpu.read(&ob, 0, n * nh * hd).unwrap();
            let want = anticausal_reference_masked(&q, &k, &v, h, &qslot, slots, &mask);
            // Rows of heads that see no key are left unchecked.
            let group = nh / nkv;
            for (t, a) in (0..n).flat_map(|t| (0..nh).map(move |a| (t, a))) {
                let own = mask.pos(qslot[t] as usize, a / group);
                if !(qslot[t] as usize + 1..slots).any(|s| mask.sees(own, s, a / group)) {
                    continue;
                }
                let row = (t * nh + a) * hd..(t * nh + a + 1) * hd;
                let err = max_abs_diff(&got[row.clone()], &want[row]);
                assert!(err < 2e-5, "{what}: counter-causal row {t} head {a}: {err}");
            }
        }
    }

    crate::kernels::checks::register![
        windows_scales_and_wide_heads_match_reference,
        head_shapes_past_the_kernel_limits_are_refused,
        tuned_decode_runs_each_depths_choice,
        prefill_matches_reference,
        paged_caches_match_reference,
        decode_matches_reference,
        short_chunks_match_reference,
        split_keys_match_reference,
        sequences_sharing_a_step_stay_apart,
        tuned_attention_times_each_shape_once,
        decode_check_passes_every_variant,
        coop_prefill_emulated_matches_reference,
        prefill_check_passes_what_runs_here,
        anticausal_matches_reference,
        long_contexts_past_4096,
    ];
}
