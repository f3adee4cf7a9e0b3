//! `shaders/key_scores.wgsl`: kvpress's key-only scores (KnormPress,
//! KeyDiffPress) per (layer, KV head, cache slot), from the key cache at a
//! refresh, and their mean per slot over every (layer, KV head).

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::paging::SlotPages;
use super::rope_kv::Heads;
use super::{ceil_div, dispatch};
use crate::gpu::Gpu;
use crate::shaders;

/// Which key score.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyScore {
    /// KnormPress: -||k||.
    Norm = 0,
    /// KeyDiffPress: -cos(k, the sum of the present keys, each normalized).
    Diff = 1,
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
    _p: [u32; 2],
}

/// How `Params` mirrors `KeyParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "KeyParams" in [shaders::KEY_SCORES] {
        n_kv, hd4, slots, layer, n_layers, mode, _p
    })
}

/// The kernels bound to every layer's key cache, for one score.
pub struct KeyScores {
    norms: Arc<wgpu::ComputePipeline>,
    anchor_sum: Arc<wgpu::ComputePipeline>,
    cosine: Arc<wgpu::ComputePipeline>,
    mean: Arc<wgpu::ComputePipeline>,
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
    /// Bytes it allocates for a cache of `slots` slots.
    pub fn bytes(heads: Heads, n_layers: usize, slots: usize) -> u64 {
        let cells = (n_layers * heads.n_kv) as u64;
        (2 * cells * slots as u64 + cells * heads.head_dim as u64 + slots as u64) * 4
    }

    /// `k_cache`: each layer's key cache of `slots` slots.
    pub fn new(
        gpu: &Gpu,
        heads: Heads,
        k_cache: &[SlotPages],
        slots: usize,
        kind: KeyScore,
    ) -> Result<Self> {
        let kv = Some(heads.kv_format.into());
        let n_layers = k_cache.len();
        let cells = (n_layers * heads.n_kv) as u64 * slots as u64 * 4;
        gpu.check_binding("key scores (layers x KV heads x slots x 4 bytes)", cells)?;
        let norm = gpu.storage("key-norms", cells);
        let per_head = gpu.storage("key-scores-per-head", cells);
        let anchor = gpu.storage(
            "key-anchors",
            (n_layers * heads.n_kv * heads.head_dim) as u64 * 4,
        );
        let score = gpu.storage("key-scores", slots as u64 * 4);
        let count = gpu.uniform("key-scores-count", &Count { n: 0, _p: [0; 3] });
        let norms = gpu.pipeline(&shaders::KEY_SCORES, kv, "norms", &[])?;
        let layers = (k_cache.iter().enumerate())
            .map(|(l, pages)| {
                let params = gpu.uniform(
                    "key-scores-params",
                    &Params {
                        n_kv: heads.n_kv as u32,
                        hd4: (heads.head_dim / 4) as u32,
                        slots: slots as u32,
                        layer: l as u32,
                        n_layers: n_layers as u32,
                        mode: kind as u32,
                        _p: [0; 2],
                    },
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
        for pages in &self.layers {
            let present = || pages.iter().filter(|(r, _)| r.start < n);
            for (r, group) in present() {
                let x = ceil_div(r.end.min(n) - r.start, 64);
                dispatch(pass, &self.norms, group, (x, n_kv, 1));
            }
            if self.kind == KeyScore::Diff {
                for (_, group) in present() {
                    dispatch(pass, &self.anchor_sum, group, (hd4, n_kv, 1));
                }
                for (r, group) in present() {
                    let x = ceil_div(r.end.min(n) - r.start, 64);
                    dispatch(pass, &self.cosine, group, (x, n_kv, 1));
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

/// CPU reference for one layer's keys `k` (`[slots, n_kv * head_dim]`):
/// each KV head's score of slots `0..n`, `[n_kv][n]`.
pub fn reference(
    k: &[f32],
    n_kv: usize,
    head_dim: usize,
    n: usize,
    kind: KeyScore,
) -> Vec<Vec<f64>> {
    let key = |i: usize, h: usize| {
        let at = (i * n_kv + h) * head_dim;
        k[at..at + head_dim]
            .iter()
            .map(|&x| x as f64)
            .collect::<Vec<f64>>()
    };
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
        })
        .collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::formats::KvFormat;
    use crate::kernels::testutil::*;

    /// Each (layer, KV head)'s score and the per-slot mean against the CPU
    /// reference: both scores, both cache formats, one page or several
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
            let mut caches = vec![];
            let mut stored = vec![];
            for l in 0..n_layers {
                let mut k = rand_vec(slots * n_kv * hd, 11 + l as u64, 1.5);
                for (j, x) in k.iter_mut().enumerate() {
                    *x += ((j % hd) as f32 * 0.37 + l as f32).sin();
                }
                let (pages, values) = kv_pages(&gpu, &k, n_kv * hd, page, format);
                caches.push(pages);
                stored.push(values);
            }
            for kind in [KeyScore::Norm, KeyScore::Diff] {
                let ks = KeyScores::new(&gpu, h, &caches, slots, kind).unwrap();
                ks.set_present(&gpu, n);
                run_pass(&gpu, |pass| ks.encode(pass, n));
                let per_head: Vec<f32> =
                    gpu.read(&ks.per_head, 0, n_layers * n_kv * slots).unwrap();
                let score: Vec<f32> = gpu.read(&ks.score, 0, n).unwrap();
                let mut want_mean = vec![0.0f64; n];
                for (l, k) in stored.iter().enumerate() {
                    let want = reference(k, n_kv, hd, n, kind);
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
