//! `shaders/query_scores.wgsl`: kvpress's SnapKVPress and
//! ExpectedAttentionPress at a refresh, from a ring of every layer's recent
//! queries that the forward pass fills: SnapKV from the window's attention
//! to each older cache entry (queries after RoPE), averaged over the
//! window and smoothed over neighbouring entries; Expected Attention from
//! the attention that queries with the window's mean and covariance (before
//! RoPE), rotated as over the next positions, are expected to pay each
//! entry, times its value's norm. Per (layer, KV head), then the mean per
//! slot over every (layer, KV head).

use anyhow::{bail, Result};
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::attention::AttnLayer;
use super::compact::Granularity;
use super::paging::SlotPages;
use super::rope_kv::Heads;
use super::{ceil_div, dispatch};
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n_heads: u32,
    n_kv: u32,
    hd4: u32,
    slots: u32,
    layer: u32,
    n_layers: u32,
    ring: u32,
    scale: f32,
    window: u32,
    kernel: u32,
    src_stride4: u32,
    half_rot: u32,
    kpos_lists: u32,
    kpos_first: u32,
    kpos_per_kv: u32,
    _p: u32,
}

/// How `Params` mirrors `QueryParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "QueryParams" in [shaders::QUERY_SCORES] {
        n_heads, n_kv, hd4, slots, layer, n_layers, ring, scale, window, kernel,
        src_stride4, half_rot, kpos_lists, kpos_first, kpos_per_kv, _p
    })
}

/// The refresh's window, as the shader's `Window` uniform.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable, PartialEq, Eq)]
pub struct QueryWindow {
    /// Present slots.
    pub n: u32,
    /// Slots `first .. end` are scored (slots are in position order):
    /// SnapKV's the entries older than the window's first query, Expected
    /// Attention's those after the sinks.
    pub first: u32,
    pub end: u32,
    /// Window queries, the newest at position `last_pos`.
    pub queries: u32,
    pub last_pos: u32,
    pub _p: [u32; 3],
}

/// SnapKV's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapKv {
    /// Queries in the observation window (kvpress's `window_size`).
    pub window: usize,
    /// Width of the smoothing average over neighbouring entries
    /// (kvpress's `kernel_size`, odd).
    pub kernel: usize,
}

/// Expected Attention's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpectedAttention {
    /// Queries whose mean and covariance are taken.
    pub window: usize,
    /// Future positions the rotation is averaged over (kvpress's
    /// `n_future_positions`).
    pub future: usize,
}

/// Which score the queries give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryPolicy {
    SnapKv(SnapKv),
    ExpectedAttention(ExpectedAttention),
}

impl QueryPolicy {
    /// Queries the ring keeps for the window.
    pub fn window(self) -> usize {
        match self {
            QueryPolicy::SnapKv(s) => s.window,
            QueryPolicy::ExpectedAttention(e) => e.window,
        }
    }

    /// Whether the ring keeps the queries before RoPE.
    fn before_rope(self) -> bool {
        matches!(self, QueryPolicy::ExpectedAttention(_))
    }
}

/// The query ring and SnapKV's or Expected Attention's kernels, bound to
/// every layer.
pub struct QueryScores {
    keep: Arc<wgpu::ComputePipeline>,
    lse: Arc<wgpu::ComputePipeline>,
    snap_mean: Arc<wgpu::ComputePipeline>,
    pool: Arc<wgpu::ComputePipeline>,
    top_up: Arc<wgpu::ComputePipeline>,
    mean: Arc<wgpu::ComputePipeline>,
    ea_mean: Arc<wgpu::ComputePipeline>,
    ea_center: Arc<wgpu::ComputePipeline>,
    ea_logits: Arc<wgpu::ComputePipeline>,
    ea_softmax: Arc<wgpu::ComputePipeline>,
    ea_combine: Arc<wgpu::ComputePipeline>,
    count: wgpu::Buffer,
    /// m, Expected Attention's mean rotation and the log-sum-exps
    /// (shaders/query_scores.wgsl).
    work: wgpu::Buffer,
    /// Per layer, one bind group per key-cache page with the slots it holds.
    layers: Vec<Vec<(std::ops::Range<u32>, wgpu::BindGroup)>>,
    /// `[n_layers, n_kv, slots]` f32: each (layer, KV head)'s score of each slot.
    /// Then `[slots]` f32: the mean over layers and KV heads, from
    /// [`QueryScores::mean_offset`].
    pub scores: wgpu::Buffer,
    heads: Heads,
    slots: usize,
    /// Half the rotary dimensions of each layer.
    half_rot: Vec<usize>,
    pub policy: QueryPolicy,
}

/// What the kernels read from the engine.
pub struct QuerySources<'a> {
    /// The step uniform.
    pub step: &'a wgpu::Buffer,
    /// `[rows, n_heads * head_dim]` f32: queries after RoPE.
    pub q: &'a wgpu::Buffer,
    /// `[rows, (n_heads + 2 n_kv) * head_dim]` f32: q, k, v before RoPE.
    pub qkv: &'a wgpu::Buffer,
    /// `[rows]` u32: the step's positions.
    pub positions: &'a wgpu::Buffer,
    /// Each layer's key and value cache, paged alike.
    pub k_cache: &'a [SlotPages],
    pub v_cache: &'a [SlotPages],
    /// `[slots, lists]` u32: the original position of each cache slot in
    /// each keep list.
    pub slot_positions: &'a wgpu::Buffer,
    /// Which entries the cache keeps (the keep lists).
    pub granularity: Granularity,
    /// Each layer's attention scale and sliding window, and its rotary
    /// dimensions.
    pub layers: Vec<(AttnLayer<'a>, usize)>,
}

/// The most queries a window may hold: the kernels dispatch one workgroup
/// per `QUERY_TILE` window queries (65,535 per dimension at most) and keep
/// them all.
pub const MAX_WINDOW: usize = 4096;

/// Window queries the kernels read into workgroup memory at a time
/// (TILE in query_scores.wgsl), and the largest head they fit
/// (QTILE_VEC4 vec4s: 8 KB).
const QUERY_TILE: u32 = 8;
const MAX_HEAD_DIM: usize = 256;

/// The most future positions Expected Attention averages its rotation over
/// (the host sums them at every refresh).
pub const MAX_FUTURE: usize = 1 << 20;

/// The sizes, in f32s, of the three buffers: the ring with Expected
/// Attention's scratch rows after it, `work` (m, the mean rotation, the
/// log-sum-exps) and `scores` (per head, then the mean).
struct Sizes {
    ring: u64,
    work: u64,
    scores: u64,
}

impl Sizes {
    fn new(
        policy: QueryPolicy,
        heads: Heads,
        n_layers: usize,
        slots: usize,
        max_tokens: usize,
    ) -> Result<Self> {
        let (window, hd) = (policy.window() as u64, heads.head_dim as u64);
        let (n_heads, n_kv) = (heads.n_heads as u64, heads.n_kv as u64);
        let (layers, slots) = (n_layers as u64, slots as u64);
        if !(1..=MAX_WINDOW as u64).contains(&window) {
            bail!("the query window holds {window} queries; it must be 1 to {MAX_WINDOW}");
        }
        // Ring rows: the window plus two steps, so that the steps
        // `Engine::undo` can take back never overwrite a window query.
        let ring_rows = window + 2 * max_tokens as u64;
        Ok(Sizes {
            ring: (layers * ring_rows + window + 2) * n_heads * hd,
            work: n_heads * slots + layers * hd + 2 * window * n_heads,
            scores: (layers * n_kv + 1) * slots,
        })
    }
}

impl QueryScores {
    /// Bytes it allocates.
    pub fn bytes(
        policy: QueryPolicy,
        heads: Heads,
        n_layers: usize,
        slots: usize,
        max_tokens: usize,
    ) -> Result<u64> {
        let s = Sizes::new(policy, heads, n_layers, slots, max_tokens)?;
        Ok((s.ring + s.work + s.scores) * 4)
    }

    pub fn new(
        gpu: &Gpu,
        heads: Heads,
        src: QuerySources,
        slots: usize,
        max_tokens: usize,
        policy: QueryPolicy,
    ) -> Result<Self> {
        match policy {
            QueryPolicy::SnapKv(s) if s.kernel % 2 == 0 => bail!(
                "SnapKV's kernel size must be odd (kvpress's avg_pool1d keeps the length only then), got {}",
                s.kernel
            ),
            QueryPolicy::ExpectedAttention(e) if !(1..=MAX_FUTURE).contains(&e.future) => {
                bail!(
                    "Expected Attention's future positions are {}; they must be 1 to {MAX_FUTURE}",
                    e.future
                )
            }
            _ => {}
        }
        if heads.head_dim > MAX_HEAD_DIM {
            bail!(
                "SnapKV and Expected Attention hold query heads in workgroup memory: head_dim at most {MAX_HEAD_DIM}, this model has {}",
                heads.head_dim
            );
        }
        let half_rot: Vec<usize> = src.layers.iter().map(|(_, r)| r / 2).collect();
        if policy.before_rope() {
            if let Some(r) = half_rot.iter().find(|&&h| h % 4 != 0) {
                bail!(
                    "Expected Attention rotates vec4s of the head: it needs rotary dimensions that are a multiple of 8, this model has {}",
                    2 * r
                );
            }
        }
        let kv = Some(heads.kv_format.into());
        let n_layers = src.k_cache.len();
        let sizes = Sizes::new(policy, heads, n_layers, slots, max_tokens)?;
        let ring_rows = policy.window() + 2 * max_tokens;
        let buffer = |label: &str, what: &str, floats: u64| -> Result<wgpu::Buffer> {
            gpu.check_binding(what, floats * 4)?;
            Ok(gpu.storage(label, floats * 4))
        };
        let ring = buffer(
            "query-ring",
            "the query ring (layers x (window + 2 steps' tokens) x query heads x head_dim x 4 bytes)",
            sizes.ring,
        )?;
        let work = buffer(
            "query-scores-work",
            "the query scores' work (query heads x slots x 4 bytes, and more)",
            sizes.work,
        )?;
        let scores = buffer(
            "query-scores",
            "the query scores (layers x KV heads x slots x 4 bytes)",
            sizes.scores,
        )?;
        let (source, src_stride) = match policy.before_rope() {
            true => (src.qkv, heads.n_heads + 2 * heads.n_kv),
            false => (src.q, heads.n_heads),
        };
        let count = gpu.uniform("query-window", &QueryWindow::default());
        let keep = gpu.pipeline(&shaders::QUERY_SCORES, kv, "keep", &[])?;
        let layers = (src
            .k_cache
            .iter()
            .zip(src.v_cache)
            .zip(&src.layers)
            .enumerate())
        .map(|(l, ((pages, values), (layer, rotary)))| {
            let positions = src.granularity.positions_of(l, n_layers, heads.n_kv);
            let params = gpu.uniform(
                "query-scores-params",
                &Params {
                    n_heads: heads.n_heads as u32,
                    n_kv: heads.n_kv as u32,
                    hd4: (heads.head_dim / 4) as u32,
                    slots: slots as u32,
                    layer: l as u32,
                    n_layers: n_layers as u32,
                    ring: ring_rows as u32,
                    scale: layer.scale.unwrap_or(1.0 / (heads.head_dim as f32).sqrt()),
                    window: layer.window.as_ref().map_or(0, |w| w.size),
                    kernel: match policy {
                        QueryPolicy::SnapKv(s) => s.kernel as u32,
                        QueryPolicy::ExpectedAttention(_) => 0,
                    },
                    src_stride4: (src_stride * heads.head_dim / 4) as u32,
                    half_rot: (rotary / 2) as u32,
                    kpos_lists: positions.lists,
                    kpos_first: positions.first,
                    kpos_per_kv: positions.per_kv,
                    _p: 0,
                },
            );
            (0..pages.n_pages())
                .map(|p| {
                    let group = gpu.bind_group(
                        &keep,
                        &[
                            src.step,
                            &params,
                            source,
                            src.positions,
                            &ring,
                            &count,
                            &pages.buffers[p],
                            &pages.uniforms[p],
                            src.slot_positions,
                            &work,
                            &scores,
                            &values.buffers[p],
                        ],
                    );
                    let r = pages.range(p);
                    (r.start as u32..r.end as u32, group)
                })
                .collect()
        })
        .collect();
        let pipeline = |entry| gpu.pipeline(&shaders::QUERY_SCORES, kv, entry, &[]);
        Ok(QueryScores {
            lse: pipeline("snap_lse")?,
            snap_mean: pipeline("snap_mean")?,
            pool: pipeline("snap_pool")?,
            top_up: pipeline("top_up")?,
            mean: pipeline("mean")?,
            ea_mean: pipeline("ea_mean")?,
            ea_center: pipeline("ea_center")?,
            ea_logits: pipeline("ea_logits")?,
            ea_softmax: pipeline("ea_softmax")?,
            ea_combine: pipeline("ea_combine")?,
            keep,
            count,
            work,
            layers,
            scores,
            heads,
            slots,
            half_rot,
            policy,
        })
    }

    /// Layer `l`'s `keep`, for the layer sequence.
    pub fn keep_of(&self, l: usize) -> KeepQueries<'_> {
        KeepQueries {
            scores: self,
            layer: l,
        }
    }

    /// After layer `l`'s RoPE: its `n` query rows go to the ring.
    pub fn encode_keep(&self, pass: &mut wgpu::ComputePass, l: usize, n: u32) {
        let width = (self.heads.n_heads * self.heads.head_dim / 4) as u32;
        let group = &self.layers[l][0].1;
        dispatch(pass, &self.keep, group, (ceil_div(width, 64), n, 1));
    }

    /// Writes the window the next `encode` scores (before the submission
    /// that runs it); `queries` at most the policy's window. Expected
    /// Attention's rotation is averaged over the positions after
    /// `w.last_pos` with each layer's `rope` (frequencies, attention factor).
    pub fn set_window(&self, gpu: &Gpu, w: QueryWindow, rope: &[(&[f32], f32)]) -> Result<()> {
        let window = self.policy.window();
        let fits = w.n as usize <= self.slots
            && w.first <= w.end
            && w.end <= w.n
            && (1..=window).contains(&(w.queries as usize))
            && w.queries <= w.last_pos + 1;
        if !fits {
            bail!(
                "query window {w:?} does not fit a cache of {} slots and a window of {window} queries",
                self.slots,
            );
        }
        gpu.write(&self.count, 0, bytemuck::bytes_of(&w));
        if let QueryPolicy::ExpectedAttention(e) = self.policy {
            let mut rot = vec![0.0f32; self.half_rot.len() * self.heads.head_dim];
            for (l, &half) in self.half_rot.iter().enumerate() {
                let (inv_freq, factor) = rope[l];
                let (c, s) =
                    average_rotation(&inv_freq[..half], factor, w.last_pos as u64 + 1, e.future);
                // C_j at j, S_j at half + j of the layer's head_dim floats.
                let at = l * self.heads.head_dim;
                rot[at..at + half].copy_from_slice(&c);
                rot[at + half..at + 2 * half].copy_from_slice(&s);
            }
            // After m (query heads x slots) in `work`.
            let offset = (self.heads.n_heads * self.slots) as u64 * 4;
            gpu.write(&self.work, offset, bytemuck::cast_slice(&rot));
        }
        Ok(())
    }

    /// Where the mean per slot starts in `scores` (f32s).
    pub fn mean_offset(&self) -> u64 {
        (self.half_rot.len() * self.heads.n_kv * self.slots) as u64
    }

    /// Scores the `w.end` oldest of `w.n` present slots of every layer
    /// into `per_head` (the window's own slots get the layer's highest
    /// score plus 1), and their means into `score`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass, w: QueryWindow) {
        if w.n == 0 {
            return;
        }
        let n_heads = self.heads.n_heads as u32;
        let n_kv = self.heads.n_kv as u32;
        let hd4 = ceil_div(self.heads.head_dim as u32 / 4, 64);
        for pages in &self.layers {
            let below = |limit: u32| pages.iter().filter(move |(r, _)| r.start < limit);
            let scored = || below(w.end).filter(|(r, _)| r.end > w.first);
            let slots_of = |r: &std::ops::Range<u32>| ceil_div(r.end.min(w.end) - r.start, 64);
            let group = &pages[0].1;
            match self.policy {
                QueryPolicy::SnapKv(_) => {
                    for (_, group) in below(w.n) {
                        let tiles = ceil_div(w.queries, QUERY_TILE);
                        dispatch(pass, &self.lse, group, (tiles, n_heads, 1));
                    }
                    for (r, group) in scored() {
                        dispatch(pass, &self.snap_mean, group, (slots_of(r), n_heads, 1));
                    }
                    dispatch(pass, &self.pool, group, (ceil_div(w.end, 64), n_kv, 1));
                }
                QueryPolicy::ExpectedAttention(_) => {
                    dispatch(pass, &self.ea_mean, group, (hd4, n_heads, 1));
                    let rows = w.queries + 1;
                    dispatch(pass, &self.ea_center, group, (hd4, rows, n_heads));
                    for (r, group) in scored() {
                        dispatch(pass, &self.ea_logits, group, (slots_of(r), n_heads, 1));
                    }
                    dispatch(pass, &self.ea_softmax, group, (n_heads, 1, 1));
                    for (r, group) in scored() {
                        dispatch(pass, &self.ea_combine, group, (slots_of(r), n_kv, 1));
                    }
                }
            }
            dispatch(pass, &self.top_up, group, (1, 1, 1));
        }
        let group = &self.layers[0][0].1;
        dispatch(pass, &self.mean, group, (ceil_div(w.n, 64), 1, 1));
    }
}

/// The mean cos and sin of each rotary frequency over the `future`
/// positions from `from` (kvpress's `apply_avg_rope`), times the attention
/// factor.
pub fn average_rotation(
    inv_freq: &[f32],
    factor: f32,
    from: u64,
    future: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (mut c, mut s) = (vec![], vec![]);
    for &f in inv_freq {
        let (mut cs, mut ss) = (0.0f64, 0.0f64);
        for p in from..from + future as u64 {
            // As the GPU's RoPE: the angle in float32.
            let angle = (p as f32 * f) as f64;
            cs += angle.cos();
            ss += angle.sin();
        }
        c.push((cs / future as f64) as f32 * factor);
        s.push((ss / future as f64) as f32 * factor);
    }
    (c, s)
}

/// One layer's query `keep`, encoded before or after its RoPE.
#[derive(Clone, Copy)]
pub struct KeepQueries<'a> {
    scores: &'a QueryScores,
    layer: usize,
}

impl KeepQueries<'_> {
    /// Whether it reads the queries before RoPE (Expected Attention).
    pub fn before_rope(&self) -> bool {
        self.scores.policy.before_rope()
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, n: u32) {
        self.scores.encode_keep(pass, self.layer, n);
    }
}

/// Expected Attention's CPU reference of one layer: the window's queries
/// before RoPE `q` (`[queries, n_heads * head_dim]`), keys after RoPE `k`
/// and values `v` (`[slots, n_kv * head_dim]`), each layer's mean rotation
/// (`c`, `s` per rotary pair); each KV head's score of slots `0..n`,
/// `[n_kv][n]`, the slots outside `first .. end` scored as the highest
/// plus 1.
pub fn expected_reference(
    (q, k, v): (&[f32], &[f32], &[f32]),
    heads: Heads,
    (c, s): (&[f32], &[f32]),
    scale: f32,
    w: QueryWindow,
) -> Vec<Vec<f64>> {
    let (n_heads, n_kv, hd) = (heads.n_heads, heads.n_kv, heads.head_dim);
    let (n, first, end) = (w.n as usize, w.first as usize, w.end as usize);
    let queries = w.queries as usize;
    let group = n_heads / n_kv;
    let half = c.len();
    // Rbar x: each pair (j, j + half) rotated by the mean cos and sin.
    let rotate = |x: &[f64]| -> Vec<f64> {
        let mut out = x.to_vec();
        for j in 0..half {
            let (cj, sj) = (c[j] as f64, s[j] as f64);
            out[j] = cj * x[j] - sj * x[j + half];
            out[j + half] = sj * x[j] + cj * x[j + half];
        }
        out
    };
    let mut out: Vec<Vec<f64>> = vec![vec![0.0; n]; n_kv];
    for a in 0..n_heads {
        let rows: Vec<Vec<f64>> = (0..queries)
            .map(|t| {
                q[(t * n_heads + a) * hd..][..hd]
                    .iter()
                    .map(|&x| x as f64)
                    .collect()
            })
            .collect();
        let mu: Vec<f64> = (0..hd)
            .map(|d| rows.iter().map(|r| r[d]).sum::<f64>() / queries as f64)
            .collect();
        let centered: Vec<Vec<f64>> = (rows.iter())
            .map(|r| rotate(&r.iter().zip(&mu).map(|(x, m)| x - m).collect::<Vec<_>>()))
            .collect();
        let mu = rotate(&mu);
        let key = |i: usize| -> Vec<f64> {
            k[(i * n_kv + a / group) * hd..][..hd]
                .iter()
                .map(|&x| x as f64)
                .collect()
        };
        let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f64>();
        let sc = scale as f64;
        let z: Vec<f64> = (first..end)
            .map(|i| {
                let ki = key(i);
                let quadratic: f64 = centered.iter().map(|r| dot(r, &ki).powi(2)).sum();
                sc * dot(&mu, &ki) + sc * sc * quadratic / (2.0 * queries as f64)
            })
            .collect();
        let top = z.iter().cloned().fold(f64::MIN, f64::max);
        let total: f64 = z.iter().map(|x| (x - top).exp()).sum();
        for (i, zi) in (first..end).zip(&z) {
            let vi = &v[(i * n_kv + a / group) * hd..][..hd];
            let norm = vi.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
            out[a / group][i] += (zi - top).exp() / total * norm / group as f64;
        }
    }
    let top = (out.iter())
        .flat_map(|row| row[first..end].iter().cloned())
        .fold(f64::MIN, f64::max);
    let raised = if end == first { 1.0 } else { top + 1.0 };
    for row in &mut out {
        for (i, x) in row.iter_mut().enumerate() {
            if i < first || i >= end {
                *x = raised;
            }
        }
    }
    out
}

/// CPU reference of one layer: `k` (`[slots, n_kv * head_dim]`, after
/// RoPE) with `key_positions` (each KV head's slot positions), the window's queries `q` (`[queries,
/// n_heads * head_dim]`, after RoPE, the newest at `last_pos`); each KV
/// head's score of slots `0..n`, `[n_kv][n]`, the slots from `end` on
/// scored as the highest plus 1.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    (q, k): (&[f32], &[f32]),
    key_positions: &[&[u32]],
    heads: Heads,
    layer_window: Option<u32>,
    scale: f32,
    w: QueryWindow,
    kernel: usize,
) -> Vec<Vec<f64>> {
    let (n_heads, n_kv, hd) = (heads.n_heads, heads.n_kv, heads.head_dim);
    let (n, end, queries) = (w.n as usize, w.end as usize, w.queries as usize);
    let group = n_heads / n_kv;
    let dot = |t: usize, a: usize, i: usize| -> f64 {
        let qa = &q[(t * n_heads + a) * hd..][..hd];
        let ki = &k[(i * n_kv + a / group) * hd..][..hd];
        qa.iter()
            .zip(ki)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum::<f64>()
            * scale as f64
    };
    let sees = |t: usize, a: usize, i: usize| {
        let qp = w.last_pos + 1 + t as u32 - w.queries;
        let kp = key_positions[a / group][i];
        kp <= qp && layer_window.is_none_or(|size| qp - kp < size)
    };
    // m[a][i]: the window's mean attention to slot i < end.
    let mut m = vec![vec![0.0f64; end]; n_heads];
    for (a, row) in m.iter_mut().enumerate() {
        for t in 0..queries {
            let logits: Vec<(usize, f64)> = (0..n)
                .filter(|&i| sees(t, a, i))
                .map(|i| (i, dot(t, a, i)))
                .collect();
            let top = logits.iter().map(|x| x.1).fold(f64::MIN, f64::max);
            let total: f64 = logits.iter().map(|x| (x.1 - top).exp()).sum();
            for &(i, l) in logits.iter().filter(|x| x.0 < end) {
                row[i] += (l - top).exp() / total / queries as f64;
            }
        }
    }
    let half = kernel / 2;
    let mut out: Vec<Vec<f64>> = (0..n_kv)
        .map(|h| {
            (0..end)
                .map(|i| {
                    let mut sum = 0.0;
                    for row in &m[h * group..(h + 1) * group] {
                        // t = i + k - half, inside 0 .. end (zero padding).
                        for k in 0..kernel {
                            if let Some(t) = (i + k).checked_sub(half).filter(|&t| t < end) {
                                sum += row[t];
                            }
                        }
                    }
                    sum / (kernel * group) as f64
                })
                .collect()
        })
        .collect();
    let top = (out.iter().flatten().cloned()).fold(f64::MIN, f64::max);
    let raised = if end == 0 { 1.0 } else { top + 1.0 };
    for row in &mut out {
        row.resize(n, raised);
    }
    out
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::formats::KvFormat;
    use crate::kernels::attention::Window;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    /// One case: `n` of `slots` present in pages of `page`, the window's
    /// `queries` newest queries, the scored slots `first .. end`.
    struct Case {
        heads: Heads,
        slots: usize,
        n: usize,
        first: usize,
        end: usize,
        queries: usize,
        page: usize,
        layer_window: Option<u32>,
        rotary: usize,
        /// The keep lists whose positions the kernels read: each list's
        /// older entries sit one position later than the last list's
        /// (every other list), so a kernel reading another list's
        /// positions sees another window.
        granularity: Granularity,
    }

    /// What the kernels computed and what they read.
    struct Run {
        per_head: Vec<f32>,
        score: Vec<f32>,
        w: QueryWindow,
        /// Each keep list's slot positions.
        key_positions: Vec<Vec<u32>>,
        /// Per layer: keys and values as stored, the window's queries.
        stored: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
        scale: f32,
    }

    const LAYERS: usize = 2;

    /// RoPE's frequencies with theta 10,000 over `rotary` dimensions.
    fn inv_freq(rotary: usize) -> Vec<f32> {
        (0..rotary / 2)
            .map(|j| 10000f32.powf(-((2 * j) as f32) / rotary as f32))
            .collect()
    }

    /// Fills the ring over two steps (the second overwriting part of the
    /// first, positions wrapping around the ring), then scores. Key
    /// positions have gaps (as after an eviction); the window's keys are
    /// among its queries.
    fn run_case(gpu: &Gpu, c: &Case, policy: QueryPolicy) -> Run {
        let h = c.heads;
        let (n_heads, n_kv, hd) = (h.n_heads, h.n_kv, h.head_dim);
        let (n, queries) = (c.n, c.queries);
        // SnapKV scores the slots before the window; Expected Attention
        // all after the sinks, some of them in the window.
        let older = match policy {
            QueryPolicy::SnapKv(_) => c.end,
            QueryPolicy::ExpectedAttention(_) => n - queries.min(n - c.first) / 2,
        };
        let mut key_positions: Vec<u32> = (0..older as u32).map(|i| i * 2 + i % 3).collect();
        let last_pos = key_positions.last().map_or(0, |p| p + 1) + (n - older) as u32 + 3;
        let first_query = last_pos + 1 - queries as u32;
        for j in 0..(n - older) as u32 {
            key_positions.push(first_query + j * queries as u32 / (n - older) as u32);
        }
        key_positions.resize(c.slots, u32::MAX);
        let lists = c.granularity.lists(LAYERS, n_kv);
        let key_positions: Vec<Vec<u32>> = (0..lists)
            .map(|list| {
                let mut p = key_positions.clone();
                p[..older].iter_mut().for_each(|x| *x += (list % 2) as u32);
                p
            })
            .collect();
        let slot_rows: Vec<u32> = (0..c.slots)
            .flat_map(|s| key_positions.iter().map(move |p| p[s]))
            .collect();
        let slot_positions = gpu.storage_from("kpos", &slot_rows);
        let (mut k_caches, mut v_caches, mut stored) = (vec![], vec![], vec![]);
        for l in 0..LAYERS {
            let k = rand_vec(c.slots * n_kv * hd, 5 + l as u64, 1.0);
            let v = rand_vec(c.slots * n_kv * hd, 17 + l as u64, 1.0);
            let (k_pages, k_stored) = kv_pages(gpu, &k, n_kv * hd, c.page, h.kv_format);
            let (v_pages, v_stored) = kv_pages(gpu, &v, n_kv * hd, c.page, h.kv_format);
            k_caches.push(k_pages);
            v_caches.push(v_pages);
            stored.push((k_stored, v_stored, vec![]));
        }
        let max_tokens = queries;
        let width = n_heads * hd;
        // Rows as the engine's: `q` alone, or q | k | v (before RoPE).
        let stride = match policy.before_rope() {
            true => (n_heads + 2 * n_kv) * hd,
            false => width,
        };
        let q_all = rand_vec(max_tokens * width * LAYERS, 9, 1.2);
        let source = gpu.storage("q", (max_tokens * stride) as u64 * 4);
        let step = gpu.uniform("step", &Step::default());
        let positions = gpu.storage("positions", max_tokens as u64 * 4);
        let scale = 0.7 / (hd as f32).sqrt();
        let layers = (0..LAYERS)
            .map(|_| {
                let window = c.layer_window.map(|size| Window {
                    size,
                    slot_positions: &slot_positions,
                    positions: Default::default(),
                });
                (
                    AttnLayer {
                        scale: Some(scale),
                        window,
                    },
                    c.rotary,
                )
            })
            .collect();
        let src = QuerySources {
            step: &step,
            q: &source,
            qkv: &source,
            positions: &positions,
            k_cache: &k_caches,
            v_cache: &v_caches,
            slot_positions: &slot_positions,
            granularity: c.granularity,
            layers,
        };
        let qs = QueryScores::new(gpu, h, src, c.slots, max_tokens, policy).unwrap();
        for first in [first_query - queries as u32 / 2, first_query] {
            let pos: Vec<u32> = (first..first + queries as u32).collect();
            gpu.write(&positions, 0, bytemuck::cast_slice(&pos));
            let s = Step {
                n_tokens: queries as u32,
                ..Default::default()
            };
            gpu.write(&step, 0, bytemuck::bytes_of(&s));
            for (l, (_, _, want)) in stored.iter_mut().enumerate() {
                let rows = &q_all[l * max_tokens * width..(l + 1) * max_tokens * width];
                let rows: Vec<f32> = rows.iter().map(|x| x + first as f32 * 0.01).collect();
                let mut padded = vec![-7.0f32; max_tokens * stride];
                for t in 0..max_tokens {
                    padded[t * stride..t * stride + width]
                        .copy_from_slice(&rows[t * width..(t + 1) * width]);
                }
                gpu.write(&source, 0, bytemuck::cast_slice(&padded));
                run_pass(gpu, |pass| qs.encode_keep(pass, l, queries as u32));
                *want = rows;
            }
        }
        let w = QueryWindow {
            n: n as u32,
            first: c.first as u32,
            end: c.end as u32,
            queries: queries as u32,
            last_pos,
            _p: [0; 3],
        };
        let freqs = inv_freq(c.rotary);
        let rope = vec![(freqs.as_slice(), 1.0f32); LAYERS];
        qs.set_window(gpu, w, &rope).unwrap();
        run_pass(gpu, |pass| qs.encode(pass, w));
        Run {
            per_head: gpu.read(&qs.scores, 0, LAYERS * n_kv * c.slots).unwrap(),
            score: gpu.read(&qs.scores, qs.mean_offset(), n).unwrap(),
            w,
            key_positions,
            stored,
            scale,
        }
    }

    /// Each layer's scores against `want` (per layer, `[n_kv][n]`), and the
    /// per-slot mean, within `tolerance` relative to the largest score.
    fn check(c: &Case, run: &Run, want: &[Vec<Vec<f64>>], what: &str) {
        let (n, n_kv) = (c.n, c.heads.n_kv);
        let mut want_mean = vec![0.0f64; n];
        for (l, rows) in want.iter().enumerate() {
            for (hh, row) in rows.iter().enumerate() {
                let at = (l * n_kv + hh) * c.slots;
                let got = &run.per_head[at..at + n];
                let row32: Vec<f32> = row.iter().map(|&x| x as f32).collect();
                let tolerance = 2e-5 * row32.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
                assert!(
                    max_abs_diff(got, &row32) < tolerance,
                    "{what} layer {l} head {hh}: heads {:?} n {n} scored {}..{} queries {} page {}: {:?} vs {:?}",
                    c.heads,
                    c.first,
                    c.end,
                    c.queries,
                    c.page,
                    &got[..4.min(n)],
                    &row32[..4.min(n)]
                );
                for (m, x) in want_mean.iter_mut().zip(row) {
                    *m += x / (LAYERS * n_kv) as f64;
                }
            }
        }
        let want_mean: Vec<f32> = want_mean.iter().map(|&x| x as f32).collect();
        let tolerance = 2e-5 * want_mean.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        assert!(
            max_abs_diff(&run.score, &want_mean) < tolerance,
            "{what} mean"
        );
    }

    /// SnapKV's per-(layer, KV head) scores and the per-slot mean against
    /// the CPU reference: the ring filled by `keep` over two steps (one
    /// wrapping around it), GQA groups of 1 to 4, one page or several with a
    /// partial last one, keys with gaps in their positions (as after an
    /// eviction), a sliding-window layer, window queries that see only some
    /// of each other, kernel widths 1, 5 and 7, both cache formats.
    #[cfg_attr(test, test)]
    fn snapkv_matches_reference() {
        let gpu = gpu();
        // (n_heads, n_kv, hd, slots, n, end, queries, page, kernel, format,
        // layer window, keep lists)
        use Granularity::*;
        for (
            n_heads,
            n_kv,
            hd,
            slots,
            n,
            end,
            queries,
            page,
            kernel,
            format,
            layer_window,
            granularity,
        ) in [
            (2, 1, 32, 40, 37, 30, 7, 0, 5, KvFormat::F32, None, Token),
            (
                6,
                2,
                64,
                300,
                211,
                147,
                64,
                64,
                5,
                KvFormat::F16,
                Some(120),
                Layer,
            ),
            (
                4,
                4,
                32,
                130,
                130,
                100,
                30,
                48,
                7,
                KvFormat::F32,
                Some(50),
                Head,
            ),
            (8, 2, 128, 90, 20, 0, 20, 0, 1, KvFormat::F16, None, Token),
            // The largest head the workgroup's query tile holds.
            (2, 1, 256, 50, 45, 33, 9, 0, 3, KvFormat::F32, None, Token),
        ] {
            let c = Case {
                heads: Heads::new(n_heads, n_kv, hd, format),
                slots,
                n,
                first: 0,
                end,
                queries,
                page: if page == 0 { slots } else { page },
                layer_window,
                rotary: hd,
                granularity,
            };
            let policy = QueryPolicy::SnapKv(SnapKv {
                window: queries,
                kernel,
            });
            let run = run_case(&gpu, &c, policy);
            // Each KV head over its keep list's positions.
            let want: Vec<Vec<Vec<f64>>> = (run.stored.iter().enumerate())
                .map(|(l, (k, _, q))| {
                    let qk = (q.as_slice(), k.as_slice());
                    let kp: Vec<&[u32]> = (0..n_kv)
                        .map(|hh| run.key_positions[granularity.list_of(l, hh, n_kv)].as_slice())
                        .collect();
                    reference(qk, &kp, c.heads, layer_window, run.scale, run.w, kernel)
                })
                .collect();
            check(&c, &run, &want, &format!("snapkv, {granularity:?} lists"));
        }
    }

    /// Expected Attention's scores against the CPU reference: the window's
    /// queries read before RoPE from the q | k | v rows, their mean and
    /// covariance rotated by the mean rotation over 512 future positions
    /// (rotary dimensions all of the head, or half of it), GQA groups of 1
    /// to 4, the sinks' slots raised above the rest, pages, both formats.
    #[cfg_attr(test, test)]
    fn expected_attention_matches_reference() {
        let gpu = gpu();
        // (n_heads, n_kv, hd, rotary, slots, n, sinks, queries, page, format)
        for (n_heads, n_kv, hd, rotary, slots, n, sinks, queries, page, format) in [
            (2, 1, 32, 32, 40, 37, 4, 7, 0, KvFormat::F32),
            (6, 2, 64, 64, 300, 211, 4, 64, 64, KvFormat::F16),
            (4, 4, 64, 32, 130, 130, 0, 30, 48, KvFormat::F32),
            (8, 2, 128, 128, 90, 20, 3, 16, 0, KvFormat::F16),
            (2, 1, 256, 256, 50, 45, 2, 9, 0, KvFormat::F32),
        ] {
            let c = Case {
                heads: Heads::new(n_heads, n_kv, hd, format),
                slots,
                n,
                first: sinks,
                end: n,
                queries,
                page: if page == 0 { slots } else { page },
                layer_window: None,
                rotary,
                granularity: Granularity::Token,
            };
            let policy = QueryPolicy::ExpectedAttention(ExpectedAttention {
                window: queries,
                future: 512,
            });
            let run = run_case(&gpu, &c, policy);
            let from = run.w.last_pos as u64 + 1;
            let (cos, sin) = average_rotation(&inv_freq(rotary), 1.0, from, 512);
            let want: Vec<_> = (run.stored.iter())
                .map(|(k, v, q)| {
                    let qkv = (q.as_slice(), k.as_slice(), v.as_slice());
                    expected_reference(qkv, c.heads, (&cos, &sin), run.scale, run.w)
                })
                .collect();
            check(&c, &run, &want, "expected attention");
        }
    }

    crate::kernels::checks::register![
        snapkv_matches_reference,
        expected_attention_matches_reference,
    ];
}
