//! `shaders/attn_weights.wgsl`: attention weight received by each cache slot,
//! summed over heads and layers (H2O: over every query so far; TOVA: from the
//! newest query), recomputed from the attention's log-sum-exp.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::attention::AttnLayer;
use super::paging::SlotPages;
use super::rope_kv::Heads;
use super::{ceil_div, dispatch};
use crate::gpu::Gpu;
use crate::shaders;

/// Which queries count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightMode {
    /// Every query since the entry entered the cache; sums persist (H2O).
    Cumulative = 0,
    /// Only the newest query; overwritten every step (TOVA).
    LastRow = 1,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n_heads: u32,
    n_kv: u32,
    hd4: u32,
    scale: f32,
    mode: u32,
    slots: u32,
    n_layers: u32,
    max_tokens: u32,
    window: u32,
    kpos_lists: u32,
    kpos_first: u32,
    kpos_per_kv: u32,
}

/// How `Params` mirrors `WeightParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "WeightParams" in [shaders::ATTN_WEIGHTS] {
        n_heads, n_kv, hd4, scale, mode, slots, n_layers, max_tokens, window, kpos_lists, kpos_first, kpos_per_kv
    })
}

/// The accumulate kernel bound to one layer's keys (and the shared cell/score buffers).
pub struct AttnWeights {
    accumulate: Arc<wgpu::ComputePipeline>,
    /// `materialize` and `accumulate_materialized`, with `--materialize`.
    materialized: Option<(Arc<wgpu::ComputePipeline>, Arc<wgpu::ComputePipeline>)>,
    reduce: Arc<wgpu::ComputePipeline>,
    /// One bind group per key-cache page, with the slots it holds.
    pages: Vec<(std::ops::Range<u32>, wgpu::BindGroup)>,
    n_heads: u32,
}

impl AttnWeights {
    /// Bytes of the eager weight matrix of `--materialize`: heads x queries x slots.
    pub fn matrix_bytes(heads: Heads, max_tokens: usize, slots: usize) -> u64 {
        (heads.n_heads * max_tokens) as u64 * slots as u64 * 4
    }

    /// `cell` is `[n_heads, slots]` f32 (zeroed), `score` `[slots]` f32;
    /// `matrix` ([`Self::matrix_bytes`]) switches to the materialized path.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        heads: Heads,
        n_layers: usize,
        slots: usize,
        mode: WeightMode,
        q: &wgpu::Buffer,
        k_cache: &SlotPages,
        lse: &wgpu::Buffer,
        cell: &wgpu::Buffer,
        score: &wgpu::Buffer,
        max_tokens: usize,
        matrix: Option<&wgpu::Buffer>,
        layer: AttnLayer,
    ) -> Result<Self> {
        let kv = Some(heads.kv_format.into());
        let accumulate = gpu.pipeline(&shaders::ATTN_WEIGHTS, kv, "accumulate", &[])?;
        let reduce = gpu.pipeline(&shaders::ATTN_WEIGHTS, kv, "reduce", &[])?;
        let positions = layer.window.map(|w| w.positions).unwrap_or_default();
        let params = gpu.uniform(
            "attn-weights-params",
            &Params {
                n_heads: heads.n_heads as u32,
                n_kv: heads.n_kv as u32,
                hd4: (heads.head_dim / 4) as u32,
                scale: layer.scale.unwrap_or(1.0 / (heads.head_dim as f32).sqrt()),
                mode: mode as u32,
                slots: slots as u32,
                n_layers: n_layers as u32,
                max_tokens: max_tokens as u32,
                window: layer.window.as_ref().map_or(0, |w| w.size),
                kpos_lists: positions.lists,
                kpos_first: positions.first,
                kpos_per_kv: positions.per_kv,
            },
        );
        // Without a window the position bindings are never read: any buffer.
        let kpos = match &layer.window {
            Some(w) => w.slot_positions,
            None => q,
        };
        let dummy = gpu.storage("no-matrix", 16);
        let matrix_buf = matrix.unwrap_or(&dummy);
        let pages = (0..k_cache.n_pages())
            .map(|p| {
                let (kc, page) = (&k_cache.buffers[p], &k_cache.uniforms[p]);
                let group = gpu.bind_group(
                    &accumulate,
                    &[
                        step, &params, q, kc, lse, cell, score, matrix_buf, page, kpos,
                    ],
                );
                let r = k_cache.range(p);
                (r.start as u32..r.end as u32, group)
            })
            .collect();
        let materialized = match matrix {
            Some(_) => Some((
                gpu.pipeline(&shaders::ATTN_WEIGHTS, kv, "materialize", &[])?,
                gpu.pipeline(&shaders::ATTN_WEIGHTS, kv, "accumulate_materialized", &[])?,
            )),
            None => None,
        };
        Ok(AttnWeights {
            accumulate,
            materialized,
            reduce,
            pages,
            n_heads: heads.n_heads as u32,
        })
    }

    /// After this layer's attention.
    pub fn encode_accumulate(&self, pass: &mut wgpu::ComputePass, n_tokens: u32, start_slot: u32) {
        let n_keys = start_slot + n_tokens;
        for (range, group) in self.pages.iter().filter(|(r, _)| r.start < n_keys) {
            let x = ceil_div(range.end.min(n_keys) - range.start, 64);
            match &self.materialized {
                None => dispatch(pass, &self.accumulate, group, (x, self.n_heads, 1)),
                Some((write, _)) => dispatch(pass, write, group, (x, n_tokens, self.n_heads)),
            }
        }
        if let Some((_, sum)) = &self.materialized {
            let x = ceil_div(n_keys, 64);
            dispatch(pass, sum, &self.pages[0].1, (x, self.n_heads, 1));
        }
    }

    /// Once per step, after the last layer.
    pub fn encode_reduce(&self, pass: &mut wgpu::ComputePass, n_tokens: u32, start_slot: u32) {
        dispatch(
            pass,
            &self.reduce,
            &self.pages[0].1,
            (ceil_div(start_slot + n_tokens, 64), 1, 1),
        );
    }
}

/// CPU reference for one layer: per slot, the sum over heads and counted query
/// rows of the softmax weight (caller divides by layers x heads).
/// With `mask`, its scale and window (a slot outside a row's window gets
/// nothing from it).
pub fn reference(
    q: &[f32],
    k: &[f32],
    h: Heads,
    start_slot: usize,
    mode: WeightMode,
    mask: Option<&super::attention::ReferenceMask>,
) -> Vec<f64> {
    let n = q.len() / (h.n_heads * h.head_dim);
    let mut out = vec![0.0; start_slot + n];
    let rows: Vec<usize> = match mode {
        WeightMode::Cumulative => (0..n).collect(),
        WeightMode::LastRow => vec![n - 1],
    };
    for t in rows {
        let scale = mask.map_or(1.0 / (h.head_dim as f64).sqrt(), |m| m.scale);
        for a in 0..h.n_heads {
            let kvh = a / (h.n_heads / h.n_kv);
            let keys: Vec<usize> = (0..=start_slot + t)
                .filter(|&s| mask.is_none_or(|m| m.sees(m.query_pos[t], s, kvh)))
                .collect();
            let (w, _) = super::attention::reference_softmax(q, k, h, t, a, &keys, scale);
            for (&s, p) in keys.iter().zip(w) {
                out[s] += p;
            }
        }
    }
    out
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::formats::KvFormat;
    use crate::kernels::attention::{Attention, ReferenceMask, Window};
    use crate::kernels::compact::SlotPositions;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    #[cfg_attr(test, test)]
    fn weights_from_lse_match_softmax() {
        let gpu = gpu();
        // The page field: pages of that many slots (0: one page).
        for (nh, nkv, hd, n, start, mode, page, window) in [
            (2, 1, 32, 1, 0, WeightMode::Cumulative, 0),
            (6, 2, 32, 7, 21, WeightMode::Cumulative, 0),
            (9, 3, 64, 5, 300, WeightMode::LastRow, 0),
            (4, 4, 128, 1, 600, WeightMode::LastRow, 0),
            (6, 2, 32, 9, 501, WeightMode::Cumulative, 256),
            (4, 2, 64, 1, 600, WeightMode::LastRow, 256),
            // Windowed (the last field, over positions with gaps) with a
            // scale of the layer's own; heads of 256.
            (2, 1, 256, 7, 300, WeightMode::Cumulative, 0),
            (4, 2, 64, 1, 601, WeightMode::LastRow, 256),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, (nh, nkv, hd, n, start, mode, page))| {
            let window = [0, 0, 0, 0, 0, 0, 20, 50][i];
            (nh, nkv, hd, n, start, mode, page, window)
        }) {
            // Odd start slots store the cache in f16.
            let format = if start % 2 == 1 {
                KvFormat::F16
            } else {
                KvFormat::F32
            };
            let h = Heads::new(nh, nkv, hd, format);
            let slots = start + n;
            // Each KV head reads its own keep list's positions (list 0
            // belongs to none); the cached slots' differ between heads.
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
            let kpos = gpu.storage_from("kpos", &slot_pos);
            let layer = || match window {
                0 => AttnLayer::default(),
                w => AttnLayer {
                    scale: Some(1.0 / 12.0),
                    window: Some(Window {
                        size: w as u32,
                        slot_positions: &kpos,
                        positions,
                    }),
                },
            };
            let mask = ReferenceMask {
                scale: 1.0 / 12.0,
                window,
                query_pos: &query_pos,
                slot_pos: &slot_pos,
                positions,
            };
            let q = rand_vec(n * nh * hd, 5, 1.0);
            let k = rand_vec(slots * nkv * hd, 6, 2.0);
            let v = rand_vec(slots * nkv * hd, 7, 1.0);
            let step = step_buffer(
                &gpu,
                Step {
                    n_tokens: n as u32,
                    start_slot: start as u32,
                    ..Default::default()
                },
            );
            let page = if page == 0 { slots } else { page };
            let qb = gpu.storage_from("q", &q);
            let (kb, k) = kv_pages(&gpu, &k, nkv * hd, page, format);
            let (vb, _) = kv_pages(&gpu, &v, nkv * hd, page, format);
            let part = gpu.storage("part", Attention::partials_bytes(h, n, slots));
            let out = gpu.storage("out", (n * nh * hd * 4) as u64);
            let lse = gpu.storage("lse", (n * nh * 4) as u64);
            let cell = gpu.storage("cell", (nh * slots * 4) as u64);
            // Earlier sums: H2O keeps them for old slots and restarts new ones at 0.
            let old: Vec<f32> = (0..slots).map(|i| i as f32).collect();
            let score = gpu.storage_from("score", &old);
            let att = Attention::new(
                &gpu,
                &step,
                h,
                slots,
                &qb,
                &kb,
                &vb,
                &part,
                &out,
                &lse,
                &gpu.storage("qslot", 16),
                layer(),
            )
            .unwrap();
            // The materialized path (eager matrix) must give the same numbers.
            let matrix = gpu.storage("matrix", AttnWeights::matrix_bytes(h, n, slots));
            let materialize = start % 2 == 0;
            let w = AttnWeights::new(
                &gpu,
                &step,
                h,
                2,
                slots,
                mode,
                &qb,
                &kb,
                &lse,
                &cell,
                &score,
                n,
                materialize.then_some(&matrix),
                layer(),
            )
            .unwrap();
            // Two "layers" with the same keys: every weight counts twice, divided by 2 x heads.
            run_pass(&gpu, |pass| {
                att.encode(pass, n as u32, start as u32);
                w.encode_accumulate(pass, n as u32, start as u32);
                w.encode_accumulate(pass, n as u32, start as u32);
                w.encode_reduce(pass, n as u32, start as u32);
            });
            let got: Vec<f32> = gpu.read(&score, 0, slots).unwrap();
            let r = reference(&q, &k, h, start, mode, (window > 0).then_some(&mask));
            let want: Vec<f32> = (0..slots)
                .map(|i| {
                    let base = if mode == WeightMode::Cumulative && i < start {
                        old[i]
                    } else {
                        0.0
                    };
                    base + (2.0 * r[i] / (2.0 * nh as f64)) as f32
                })
                .collect();
            assert!(
                max_abs_diff(&got, &want) < 1e-5,
                "{nh}/{nkv}/{hd} n {n} start {start} {mode:?} materialized {materialize} page {page} {format:?} window {window}"
            );
            let cells: Vec<f32> = gpu.read(&cell, 0, nh * slots).unwrap();
            assert!(
                cells.iter().all(|&c| c == 0.0),
                "cells are cleared for the next step"
            );
        }
    }

    crate::kernels::checks::register![weights_from_lse_match_softmax,];
}
