//! `shaders/key_scores.wgsl`: kvpress's cache-only scores (KnormPress,
//! KeyDiffPress, LagKVPress) per (layer, KV head, cache slot), from the key
//! and value cache at a refresh, and their mean per slot over every
//! (layer, KV head).

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::paging::SlotPages;
use super::rope_kv::Heads;
use super::{ceil_div, dispatch};
use crate::gpu::Gpu;
use crate::shaders;

/// Which score.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyScore {
    /// KnormPress: -||k||.
    Norm,
    /// KeyDiffPress: -cos(k, the sum of the present keys, each normalized).
    Diff,
    /// LagKVPress: the slots after `sinks` in partitions of `lag`, each
    /// ranked in its partition by the spread of its key and value scaled to
    /// the next partition's range; the sinks and the last partitions score 1.
    Lag { sinks: u32, lag: u32 },
}

impl KeyScore {
    /// The shader's `mode`.
    fn mode(self) -> u32 {
        match self {
            KeyScore::Norm => 0,
            KeyScore::Diff => 1,
            KeyScore::Lag { .. } => 2,
        }
    }

    /// LagKV's (sinks, lag), 0 for the others.
    fn lag(self) -> (u32, u32) {
        match self {
            KeyScore::Lag { sinks, lag } => (sinks, lag),
            _ => (0, 0),
        }
    }

    /// LagKV: (the number of full partitions, whether the short rule
    /// applies) with `n` slots present; (0, true) for the others.
    fn partitions(self, n: u32) -> (u32, bool) {
        let (sinks, lag) = self.lag();
        if lag == 0 || n < sinks + 2 * lag {
            return (0, true);
        }
        ((n - sinks) / lag, false)
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Count {
    n: u32,
    _p: [u32; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n_kv: u32,
    hd4: u32,
    slots: u32,
    layer: u32,
    n_layers: u32,
    mode: u32,
    sinks: u32,
    lag: u32,
    parts: u32,
    _p: [u32; 3],
}

/// How `Params` mirrors `KeyParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "KeyParams" in [shaders::KEY_SCORES] {
        n_kv, hd4, slots, layer, n_layers, mode, sinks, lag, parts, _p
    })
}

/// The kernels bound to every layer's key cache, for one score.
pub struct KeyScores {
    norms: Arc<wgpu::ComputePipeline>,
    anchor_sum: Arc<wgpu::ComputePipeline>,
    cosine: Arc<wgpu::ComputePipeline>,
    mean: Arc<wgpu::ComputePipeline>,
    lag_range: Arc<wgpu::ComputePipeline>,
    lag_sigma: Arc<wgpu::ComputePipeline>,
    lag_rank: Arc<wgpu::ComputePipeline>,
    count: wgpu::Buffer,
    /// Per layer, one bind group per key-cache page with the slots it holds.
    layers: Vec<Vec<(std::ops::Range<u32>, wgpu::BindGroup)>>,
    /// `[n_layers, n_kv, slots]` f32: each (layer, KV head)'s score of each slot.
    pub per_head: wgpu::Buffer,
    /// `[slots]` f32: the mean of `per_head` over layers and KV heads.
    pub score: wgpu::Buffer,
    kind: KeyScore,
    heads: Heads,
    slots: usize,
}

impl KeyScores {
    /// LagKV's buffers (`lag_ranges`, `sigma`) in bytes; 4 for the others.
    fn lag_bytes(kind: KeyScore, heads: Heads, n_layers: usize, slots: usize) -> (u64, u64) {
        let (_, lag) = kind.lag();
        if lag == 0 {
            return (4, 4);
        }
        let cells = (n_layers * heads.n_kv) as u64;
        let parts = slots.div_ceil(lag as usize) as u64;
        (
            cells * parts * 4 * heads.head_dim as u64 * 4,
            cells * 2 * slots as u64 * 4,
        )
    }

    /// Bytes it allocates for a cache of `slots` slots.
    pub fn bytes(kind: KeyScore, heads: Heads, n_layers: usize, slots: usize) -> u64 {
        let cells = (n_layers * heads.n_kv) as u64;
        let (ranges, sigma) = Self::lag_bytes(kind, heads, n_layers, slots);
        (2 * cells * slots as u64 + cells * heads.head_dim as u64 + slots as u64) * 4
            + ranges
            + sigma
    }

    /// `k_cache`, `v_cache`: each layer's key and value cache of `slots`
    /// slots, paged alike.
    pub fn new(
        gpu: &Gpu,
        heads: Heads,
        (k_cache, v_cache): (&[SlotPages], &[SlotPages]),
        slots: usize,
        kind: KeyScore,
    ) -> Result<Self> {
        let kv = Some(heads.kv_format.into());
        let n_layers = k_cache.len();
        let (sinks, lag) = kind.lag();
        if let KeyScore::Lag { .. } = kind {
            // One workgroup per partition and KV head.
            let parts = slots.div_ceil(lag.max(1) as usize);
            if lag == 0 || parts > 65_535 {
                anyhow::bail!(
                    "LagKV's lag size {lag} cuts a cache of {slots} slots into {parts} partitions; it must be at least 1 and make at most 65,535"
                );
            }
        }
        let cells = (n_layers * heads.n_kv) as u64 * slots as u64 * 4;
        gpu.check_binding("key scores (layers x KV heads x slots x 4 bytes)", cells)?;
        let (range_bytes, sigma_bytes) = Self::lag_bytes(kind, heads, n_layers, slots);
        gpu.check_binding(
            "LagKV's partition ranges (layers x KV heads x partitions x 4 x head_dim x 4 bytes)",
            range_bytes,
        )?;
        gpu.check_binding(
            "LagKV's spreads (layers x KV heads x 2 x slots x 4 bytes)",
            sigma_bytes,
        )?;
        let norm = gpu.storage("key-norms", cells);
        let per_head = gpu.storage("key-scores-per-head", cells);
        let anchor = gpu.storage(
            "key-anchors",
            (n_layers * heads.n_kv * heads.head_dim) as u64 * 4,
        );
        let lag_ranges = gpu.storage("lag-ranges", range_bytes);
        let sigma = gpu.storage("lag-sigma", sigma_bytes);
        let score = gpu.storage("key-scores", slots as u64 * 4);
        let count = gpu.uniform("key-scores-count", &Count { n: 0, _p: [0; 3] });
        let norms = gpu.pipeline(&shaders::KEY_SCORES, kv, "norms", &[])?;
        let layers = (k_cache.iter().zip(v_cache).enumerate())
            .map(|(l, (pages, values))| {
                let params = gpu.uniform(
                    "key-scores-params",
                    &Params {
                        n_kv: heads.n_kv as u32,
                        hd4: (heads.head_dim / 4) as u32,
                        slots: slots as u32,
                        layer: l as u32,
                        n_layers: n_layers as u32,
                        mode: kind.mode(),
                        sinks,
                        lag,
                        parts: slots.div_ceil(lag.max(1) as usize) as u32,
                        _p: [0; 3],
                    },
                );
                assert_eq!(
                    (pages.page_slots, pages.slots),
                    (values.page_slots, values.slots),
                    "key and value caches are paged alike"
                );
                (0..pages.n_pages())
                    .map(|p| {
                        let group = gpu.bind_group(
                            &norms,
                            &[
                                &count,
                                &params,
                                &pages.buffers[p],
                                &norm,
                                &anchor,
                                &per_head,
                                &score,
                                &pages.uniforms[p],
                                &values.buffers[p],
                                &lag_ranges,
                                &sigma,
                            ],
                        );
                        let r = pages.range(p);
                        (r.start as u32..r.end as u32, group)
                    })
                    .collect()
            })
            .collect();
        Ok(KeyScores {
            anchor_sum: gpu.pipeline(&shaders::KEY_SCORES, kv, "anchor_sum", &[])?,
            cosine: gpu.pipeline(&shaders::KEY_SCORES, kv, "cosine", &[])?,
            mean: gpu.pipeline(&shaders::KEY_SCORES, kv, "mean", &[])?,
            lag_range: gpu.pipeline(&shaders::KEY_SCORES, kv, "lag_range", &[])?,
            lag_sigma: gpu.pipeline(&shaders::KEY_SCORES, kv, "lag_sigma", &[])?,
            lag_rank: gpu.pipeline(&shaders::KEY_SCORES, kv, "lag_rank", &[])?,
            norms,
            count,
            layers,
            per_head,
            score,
            kind,
            heads,
            slots,
        })
    }

    /// Writes the number of present slots the next `encode` scores (before
    /// the submission that runs it).
    pub fn set_present(&self, gpu: &Gpu, n: usize) {
        let count = Count {
            n: n.min(self.slots) as u32,
            _p: [0; 3],
        };
        gpu.write(&self.count, 0, bytemuck::bytes_of(&count));
    }

    /// Scores slots `0..n` (`set_present(n)`) of every layer into
    /// `per_head`, and their means into `score`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass, n: usize) {
        let n = n.min(self.slots) as u32;
        if n == 0 {
            return;
        }
        let n_kv = self.heads.n_kv as u32;
        let hd4 = (self.heads.head_dim / 4) as u32;
        let (parts, short) = self.kind.partitions(n);
        for pages in &self.layers {
            let present = || pages.iter().filter(|(r, _)| r.start < n);
            let slots_of = |r: &std::ops::Range<u32>| ceil_div(r.end.min(n) - r.start, 64);
            if let KeyScore::Norm | KeyScore::Diff = self.kind {
                for (r, group) in present() {
                    dispatch(pass, &self.norms, group, (slots_of(r), n_kv, 1));
                }
            }
            match self.kind {
                KeyScore::Norm => {}
                KeyScore::Diff => {
                    for (_, group) in present() {
                        dispatch(pass, &self.anchor_sum, group, (hd4, n_kv, 1));
                    }
                    for (r, group) in present() {
                        dispatch(pass, &self.cosine, group, (slots_of(r), n_kv, 1));
                    }
                }
                KeyScore::Lag { .. } => {
                    if !short {
                        for (_, group) in present() {
                            dispatch(pass, &self.lag_range, group, (parts, n_kv, 1));
                        }
                    }
                    for (r, group) in present() {
                        dispatch(pass, &self.lag_sigma, group, (slots_of(r), n_kv, 1));
                    }
                    if !short {
                        let group = &pages[0].1;
                        dispatch(pass, &self.lag_rank, group, (parts - 1, n_kv, 1));
                    }
                }
            }
        }
        dispatch(
            pass,
            &self.mean,
            &self.layers[0][0].1,
            (ceil_div(n, 64), 1, 1),
        );
    }
}

/// CPU reference for one layer's keys `k` and values `v` (each `[slots,
/// n_kv * head_dim]`): each KV head's score of slots `0..n`, `[n_kv][n]`.
pub fn reference(
    (k, v): (&[f32], &[f32]),
    n_kv: usize,
    head_dim: usize,
    n: usize,
    kind: KeyScore,
) -> Vec<Vec<f64>> {
    let row = |x: &[f32], i: usize, h: usize| {
        let at = (i * n_kv + h) * head_dim;
        x[at..at + head_dim]
            .iter()
            .map(|&x| x as f64)
            .collect::<Vec<f64>>()
    };
    let key = |i: usize, h: usize| row(k, i, h);
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    (0..n_kv)
        .map(|h| match kind {
            KeyScore::Norm => (0..n).map(|i| -norm(&key(i, h))).collect(),
            KeyScore::Diff => {
                let mut anchor = vec![0.0; head_dim];
                for i in 0..n {
                    let v = key(i, h);
                    let scale = norm(&v).max(1e-12);
                    for (a, x) in anchor.iter_mut().zip(&v) {
                        *a += x / scale;
                    }
                }
                let anchor_norm = norm(&anchor);
                (0..n)
                    .map(|i| {
                        let v = key(i, h);
                        let dot: f64 = v.iter().zip(&anchor).map(|(x, a)| x * a).sum();
                        -dot / (norm(&v) * anchor_norm).max(1e-8)
                    })
                    .collect()
            }
            KeyScore::Lag { sinks, lag } => {
                lag_reference(|i| row(k, i, h), |i| row(v, i, h), n, sinks, lag)
            }
        })
        .collect()
}

/// LagKVPress's score of one KV head (tests/data/kvpress/README.md), ties
/// in a partition's ranking broken by slot.
fn lag_reference(
    key: impl Fn(usize) -> Vec<f64>,
    value: impl Fn(usize) -> Vec<f64>,
    n: usize,
    sinks: u32,
    lag: u32,
) -> Vec<f64> {
    let (sinks, lag) = (sinks as usize, lag as usize);
    if n < sinks + 2 * lag {
        return (0..n)
            .map(|i| match i < sinks {
                true => 1.0,
                false => (i - sinks) as f64 / (n - sinks) as f64,
            })
            .collect();
    }
    let end = sinks + (n - sinks) / lag * lag;
    let mut score = vec![1.0; n];
    // Softmax over a partition of each slot's spread against the next
    // partition's per-channel range.
    let weights = |state: &dyn Fn(usize) -> Vec<f64>, start: usize| -> Vec<f64> {
        let next: Vec<Vec<f64>> = (start + lag..start + 2 * lag).map(state).collect();
        let d = next[0].len();
        let lo: Vec<f64> = (0..d)
            .map(|c| next.iter().map(|x| x[c]).fold(f64::MAX, f64::min))
            .collect();
        let hi: Vec<f64> = (0..d)
            .map(|c| next.iter().map(|x| x[c]).fold(f64::MIN, f64::max))
            .collect();
        let sigma: Vec<f64> = (start..start + lag)
            .map(|i| {
                let x = state(i);
                let z: Vec<f64> = (0..d)
                    .map(|c| match hi[c] == lo[c] {
                        true => 0.0,
                        false => (x[c] - lo[c]) / (hi[c] - lo[c]),
                    })
                    .collect();
                let mean = z.iter().sum::<f64>() / d as f64;
                (z.iter().map(|z| (z - mean).powi(2)).sum::<f64>() / (d - 1) as f64).sqrt()
            })
            .collect();
        let top = sigma.iter().cloned().fold(f64::MIN, f64::max);
        let total: f64 = sigma.iter().map(|s| (s - top).exp()).sum();
        sigma.iter().map(|s| (s - top).exp() / total).collect()
    };
    for start in (sinks..end - lag).step_by(lag) {
        let (wk, wv) = (weights(&key, start), weights(&value, start));
        let pre: Vec<f64> = wk.iter().zip(&wv).map(|(a, b)| (a + b) / 2.0).collect();
        for j in 0..lag {
            let rank = (0..lag)
                .filter(|&t| pre[t] < pre[j] || (pre[t] == pre[j] && t < j))
                .count();
            score[start + j] = rank as f64 / lag as f64;
        }
    }
    score
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::formats::KvFormat;
    use crate::kernels::testutil::*;

    /// Each (layer, KV head)'s score and the per-slot mean against the CPU
    /// reference: every score (LagKV with two partition sizes), both cache
    /// formats, one page or several
    /// with a partial last one, present slots fewer than the cache holds,
    /// head sizes 32 to 256; keys with an offset shared by a head (the
    /// anchor then points somewhere), different per layer.
    #[cfg_attr(test, test)]
    fn key_scores_match_reference() {
        let gpu = gpu();
        for (n_kv, hd, slots, n, page, format) in [
            (1, 32, 7, 7, 0, KvFormat::F32),
            (3, 64, 300, 211, 64, KvFormat::F16),
            (2, 128, 129, 129, 100, KvFormat::F32),
            (5, 256, 90, 33, 0, KvFormat::F16),
            (2, 64, 520, 517, 256, KvFormat::F32),
            // Present slots ending on a page boundary, pages after it.
            (2, 32, 300, 256, 64, KvFormat::F16),
        ] {
            let h = Heads::new(n_kv, n_kv, hd, format);
            let n_layers = 2;
            let page = if page == 0 { slots } else { page };
            let (mut k_caches, mut v_caches, mut stored) = (vec![], vec![], vec![]);
            for l in 0..n_layers {
                let mut k = rand_vec(slots * n_kv * hd, 11 + l as u64, 1.5);
                for (j, x) in k.iter_mut().enumerate() {
                    *x += ((j % hd) as f32 * 0.37 + l as f32).sin();
                }
                let v = rand_vec(slots * n_kv * hd, 23 + l as u64, 0.8);
                let (k_pages, k_stored) = kv_pages(&gpu, &k, n_kv * hd, page, format);
                let (v_pages, v_stored) = kv_pages(&gpu, &v, n_kv * hd, page, format);
                k_caches.push(k_pages);
                v_caches.push(v_pages);
                stored.push((k_stored, v_stored));
            }
            // LagKV: partitions of 16 (several per page, some across a
            // page boundary) and of 40; with n = 7 and 33 the short rule.
            let lag = [
                KeyScore::Lag { sinks: 3, lag: 16 },
                KeyScore::Lag { sinks: 4, lag: 40 },
            ];
            for kind in [[KeyScore::Norm, KeyScore::Diff].as_slice(), &lag].concat() {
                let caches = (k_caches.as_slice(), v_caches.as_slice());
                let ks = KeyScores::new(&gpu, h, caches, slots, kind).unwrap();
                ks.set_present(&gpu, n);
                run_pass(&gpu, |pass| ks.encode(pass, n));
                let per_head: Vec<f32> =
                    gpu.read(&ks.per_head, 0, n_layers * n_kv * slots).unwrap();
                let score: Vec<f32> = gpu.read(&ks.score, 0, n).unwrap();
                let mut want_mean = vec![0.0f64; n];
                for (l, (k, v)) in stored.iter().enumerate() {
                    let want = reference((k, v), n_kv, hd, n, kind);
                    for (hh, row) in want.iter().enumerate() {
                        let at = (l * n_kv + hh) * slots;
                        let got = &per_head[at..at + n];
                        let row32: Vec<f32> = row.iter().map(|&x| x as f32).collect();
                        let tolerance = 1e-5 * row32.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                        assert!(
                            max_abs_diff(got, &row32) < tolerance,
                            "{kind:?} layer {l} head {hh} of {n_kv} hd {hd} n {n}/{slots} page {page} {format:?}"
                        );
                        for (m, x) in want_mean.iter_mut().zip(row) {
                            *m += x / (n_layers * n_kv) as f64;
                        }
                    }
                }
                let want_mean: Vec<f32> = want_mean.iter().map(|&x| x as f32).collect();
                let tolerance = 1e-5 * want_mean.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                assert!(
                    max_abs_diff(&score, &want_mean) < tolerance,
                    "{kind:?} mean, n_kv {n_kv} hd {hd} n {n}/{slots} page {page} {format:?}"
                );
            }
        }
    }

    crate::kernels::checks::register![key_scores_match_reference,];
}
