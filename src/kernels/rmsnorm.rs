//! `shaders/rmsnorm.wgsl`: RMSNorm in f32.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::{dispatch, Rows};
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    dim4: u32,
    eps: f32,
    in_row_sel: u32,
    count_sel: u32,
}

/// How `Params` mirrors `NormParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "NormParams" in [shaders::RMSNORM] {
        dim4, eps, in_row_sel, count_sel
    })
}

pub struct RmsNorm {
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
}

impl RmsNorm {
    /// `w` `[dim]` f32; `x` and `y` `[rows, dim]` f32. With `Rows::Logits` the
    /// kernel reads rows starting at the step's `logit_row0` and writes rows from 0.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        dim: usize,
        eps: f64,
        w: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        rows: Rows,
    ) -> Result<Self> {
        Self::build(gpu, step, dim, eps, w, x, y, rows, false)
    }

    /// As [`RmsNorm::new`], adding the norm to `y` (a sandwich norm: a
    /// layer's output normed into the residual stream).
    #[allow(clippy::too_many_arguments)]
    pub fn accumulating(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        dim: usize,
        eps: f64,
        w: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Result<Self> {
        Self::build(gpu, step, dim, eps, w, x, y, Rows::Tokens, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        dim: usize,
        eps: f64,
        w: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        rows: Rows,
        accumulate: bool,
    ) -> Result<Self> {
        let constants: &[(&str, f64)] = if accumulate {
            &[("ACCUMULATE", 1.0)]
        } else {
            &[]
        };
        let pipeline = gpu.pipeline(&shaders::RMSNORM, None, "main", constants)?;
        let params = gpu.uniform(
            "rmsnorm-params",
            &Params {
                dim4: (dim / 4) as u32,
                eps: eps as f32,
                in_row_sel: rows as u32,
                count_sel: rows as u32,
            },
        );
        let group = gpu.bind_group(&pipeline, &[step, &params, w, x, y]);
        Ok(RmsNorm { pipeline, group })
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, rows: u32) {
        let (pipeline, group, groups) = self.dispatch_for(rows);
        dispatch(pass, &pipeline, &group, groups);
    }

    /// What [`RmsNorm::encode`] dispatches for `rows` rows (the timings run
    /// it before an unfused mat-vec).
    pub fn dispatch_for(&self, rows: u32) -> super::tune::Dispatch {
        (self.pipeline.clone(), self.group.clone(), (rows, 1, 1))
    }
}

/// CPU reference.
pub fn reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    x.chunks(dim)
        .flat_map(|row| {
            let ms = row.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            row.iter()
                .zip(w)
                .map(move |(v, g)| (*v as f64 * inv) as f32 * g)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    #[cfg_attr(test, test)]
    fn matches_reference_including_logit_rows() {
        let gpu = gpu();
        for &(dim, n) in &[(4, 1), (12, 3), (576, 5), (1028, 2)] {
            let w = rand_vec(dim, 2, 1.5);
            // Large values as in the "massive activation" of position 0.
            let x: Vec<f32> = rand_vec(dim * n, 9, 1.0).iter().map(|v| v * 3e3).collect();
            let wb = gpu.storage_from("w", &w);
            let xb = gpu.storage_from("x", &x);
            let yb = gpu.storage("y", (dim * n * 4) as u64);
            let step = step_buffer(
                &gpu,
                Step {
                    n_tokens: n as u32,
                    start_slot: 0,
                    logit_row0: n as u32 - 1,
                    n_logits: 1,
                    ..Default::default()
                },
            );
            let all = RmsNorm::new(&gpu, &step, dim, 1e-5, &wb, &xb, &yb, Rows::Tokens).unwrap();
            run_pass(&gpu, |pass| all.encode(pass, n as u32));
            let got: Vec<f32> = gpu.read(&yb, 0, dim * n).unwrap();
            let want = reference(&x, &w, 1e-5);
            assert!(max_abs_diff(&got, &want) < 1e-5 * 4.0, "dim {dim}");
            let last = RmsNorm::new(&gpu, &step, dim, 1e-5, &wb, &xb, &yb, Rows::Logits).unwrap();
            run_pass(&gpu, |pass| last.encode(pass, 1));
            let got: Vec<f32> = gpu.read(&yb, 0, dim).unwrap();
            assert!(
                max_abs_diff(&got, &want[(n - 1) * dim..]) < 4e-5,
                "dim {dim} last row"
            );
            // Accumulating: y (holding `want`) gains the norm once more.
            let y0: Vec<f32> = rand_vec(dim * n, 3, 1.0);
            let yb = gpu.storage_from("y", &y0);
            let add = RmsNorm::accumulating(&gpu, &step, dim, 1e-5, &wb, &xb, &yb).unwrap();
            run_pass(&gpu, |pass| add.encode(pass, n as u32));
            let got: Vec<f32> = gpu.read(&yb, 0, dim * n).unwrap();
            let want_sum: Vec<f32> = y0.iter().zip(&want).map(|(a, b)| a + b).collect();
            assert!(
                max_abs_diff(&got, &want_sum) < 1e-5 * 4.0,
                "dim {dim} accumulating"
            );
        }
    }

    crate::kernels::checks::register![matches_reference_including_logit_rows,];
}
