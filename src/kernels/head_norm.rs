//! `shaders/head_norm.wgsl`: RMSNorm of each query and key head in place
//! (q/k norm, before RoPE).

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::dispatch;
use crate::gpu::Gpu;
use crate::kernels::rope_kv::Heads;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    eps: f32,
    weight_offset: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

/// How `Params` mirrors `HeadNormParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "HeadNormParams" in [shaders::HEAD_NORM] {
        n_heads, n_kv, head_dim, eps, weight_offset, _p0, _p1, _p2
    })
}

pub struct HeadNorm {
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    heads: u32,
}

impl HeadNorm {
    /// `qkv` `[rows, (n_heads + 2 n_kv) * head_dim]`, normed in place;
    /// `q_w` and `k_w` `[head_dim]`, used as `w + weight_offset`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        heads: Heads,
        eps: f64,
        weight_offset: f32,
        qkv: &wgpu::Buffer,
        (q_w, k_w): (&wgpu::Buffer, &wgpu::Buffer),
    ) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::HEAD_NORM, None, "main", &[])?;
        let params = gpu.uniform(
            "head-norm-params",
            &Params {
                n_heads: heads.n_heads as u32,
                n_kv: heads.n_kv as u32,
                head_dim: heads.head_dim as u32,
                eps: eps as f32,
                weight_offset,
                _p0: 0,
                _p1: 0,
                _p2: 0,
            },
        );
        let group = gpu.bind_group(&pipeline, &[step, &params, qkv, q_w, k_w]);
        Ok(HeadNorm {
            pipeline,
            group,
            heads: (heads.n_heads + heads.n_kv) as u32,
        })
    }

    /// The step's `n_tokens` rows.
    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_tokens: u32) {
        dispatch(pass, &self.pipeline, &self.group, (self.heads, n_tokens, 1));
    }
}

/// CPU reference: `qkv` rows with each query and key head normed.
pub fn reference(
    qkv: &[f32],
    h: Heads,
    eps: f64,
    weight_offset: f32,
    (q_w, k_w): (&[f32], &[f32]),
) -> Vec<f32> {
    let row = (h.n_heads + 2 * h.n_kv) * h.head_dim;
    let mut out = qkv.to_vec();
    for r in out.chunks_mut(row) {
        for (head, x) in r.chunks_mut(h.head_dim).enumerate() {
            if head >= h.n_heads + h.n_kv {
                break;
            }
            let w = if head < h.n_heads { q_w } else { k_w };
            let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, &g) in x.iter_mut().zip(w) {
                *v = (*v as f64 * inv) as f32 * (g + weight_offset);
            }
        }
    }
    out
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::formats::KvFormat;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    /// Head sizes around the workgroup's 64 lanes (32: lanes idle; 100 and
    /// 256: lanes take several values), GQA and MHA, one and several rows,
    /// both weight offsets (Qwen3's w, Gemma's 1 + w); value heads untouched.
    #[cfg_attr(test, test)]
    fn matches_reference() {
        let gpu = gpu();
        for &(n_heads, n_kv, head_dim, rows, offset) in &[
            (4, 2, 64, 1, 0.0f32),
            (3, 1, 32, 5, 0.0),
            (2, 2, 100, 3, 1.0),
            (8, 1, 256, 2, 1.0),
        ] {
            let h = Heads::new(n_heads, n_kv, head_dim, KvFormat::F32);
            let row = (n_heads + 2 * n_kv) * head_dim;
            // Large values, as activations before a norm can be.
            let qkv: Vec<f32> = rand_vec(row * rows, 3, 1.0)
                .iter()
                .map(|v| v * 40.0)
                .collect();
            let q_w = rand_vec(head_dim, 5, 1.5);
            let k_w = rand_vec(head_dim, 7, 1.5);
            let qkv_b = gpu.storage_from("qkv", &qkv);
            let (qb, kb) = (gpu.storage_from("q_w", &q_w), gpu.storage_from("k_w", &k_w));
            let step = step_buffer(
                &gpu,
                Step {
                    n_tokens: rows as u32,
                    ..Default::default()
                },
            );
            let k = HeadNorm::new(&gpu, &step, h, 1e-6, offset, &qkv_b, (&qb, &kb)).unwrap();
            run_pass(&gpu, |pass| k.encode(pass, rows as u32));
            let got: Vec<f32> = gpu.read(&qkv_b, 0, row * rows).unwrap();
            let want = reference(&qkv, h, 1e-6, offset, (&q_w, &k_w));
            let d = max_abs_diff(&got, &want);
            assert!(
                d < 1e-5,
                "heads {n_heads}/{n_kv} x {head_dim}, {rows} rows: max |d| {d}"
            );
            // The value heads are what they were.
            for r in 0..rows {
                let v = (n_heads + n_kv) * head_dim;
                assert_eq!(
                    got[r * row + v..][..n_kv * head_dim],
                    qkv[r * row + v..][..n_kv * head_dim]
                );
            }
        }
    }

    crate::kernels::checks::register![matches_reference,];
}
