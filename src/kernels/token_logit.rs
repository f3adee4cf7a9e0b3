//! `shaders/token_logit.wgsl`: the LM-head logit of each row's own token.

use anyhow::Result;
use std::sync::Arc;

use super::{dispatch, table_part_groups};
use crate::gpu::Gpu;
use crate::shaders;
use crate::weights::GpuMatrix;

pub struct TokenLogit {
    pipeline: Arc<wgpu::ComputePipeline>,
    groups: Vec<wgpu::BindGroup>,
}

impl TokenLogit {
    /// `head` `[vocab, hidden]`, `ids` `[n]`, `x` `[n, hidden]`, `out` `[n]`.
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        head: &GpuMatrix,
        ids: &wgpu::Buffer,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<Self> {
        let format = head.single_format("the LM head")?;
        let pipeline = gpu.pipeline(&shaders::TOKEN_LOGIT, Some(format.into()), "main", &[])?;
        let groups = table_part_groups(gpu, &pipeline, step, head, &[ids, x, out]);
        Ok(TokenLogit { pipeline, groups })
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, n: u32) {
        for g in &self.groups {
            dispatch(pass, &self.pipeline, g, (n, 1, 1));
        }
    }
}

/// CPU reference.
pub fn reference(head: &[f32], hidden: usize, ids: &[u32], x: &[f32]) -> Vec<f32> {
    ids.iter()
        .enumerate()
        .map(|(t, &id)| {
            let row = &head[id as usize * hidden..][..hidden];
            row.iter()
                .zip(&x[t * hidden..][..hidden])
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::formats::WeightFormat;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;
    use crate::shaders::WeightStore;

    #[cfg_attr(test, test)]
    fn own_token_logits_across_head_parts() {
        // f32 rows of 36 values; quantized rows of one K-quant super-block
        // or eight 32-value blocks; weights in buffers and in textures.
        let formats = [(WeightFormat::F32, 36)]
            .into_iter()
            .chain(quantized().into_iter().map(|f| (f, 256)));
        for (store, (format, hidden)) in WeightStore::ALL
            .into_iter()
            .flat_map(|s| formats.clone().map(move |f| (s, f)))
        {
            let gpu = gpu_storing(store, Some(4096));
            let vocab = 50;
            let m = GpuMatrix::new(&gpu, "head", vocab, hidden, format).unwrap();
            assert!(m.parts.len() > 1, "{format:?}");
            let head = fill_test_weights(&gpu, &m, 3);
            let w_max = head.iter().fold(1f32, |a, v| a.max(v.abs()));
            let ids = vec![49u32, 0, 7, 8, 33];
            let x = rand_vec(ids.len() * hidden, 4, 2.0);
            let step = step_buffer(
                &gpu,
                Step {
                    n_tokens: ids.len() as u32,
                    ..Default::default()
                },
            );
            let (ib, xb) = (gpu.storage_from("ids", &ids), gpu.storage_from("x", &x));
            let out = gpu.storage("out", ids.len() as u64 * 4);
            let k = TokenLogit::new(&gpu, &step, &m, &ib, &xb, &out).unwrap();
            run_pass(&gpu, |pass| k.encode(pass, ids.len() as u32));
            let got: Vec<f32> = gpu.read(&out, 0, ids.len()).unwrap();
            let err = max_abs_diff(&got, &reference(&head, hidden, &ids, &x));
            assert!(
                err < 1e-4 * w_max * (hidden as f32).sqrt(),
                "{format:?} {store:?}: {err}"
            );
        }
    }

    crate::kernels::checks::register![own_token_logits_across_head_parts,];
}
