//! `shaders/epikv_delta.wgsl`: g(t) = ||h_l(t) - h_l(t-1)|| after a tracked layer.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::dispatch;
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    hidden4: u32,
    column: u32,
    n_tracked: u32,
    _p: u32,
}

/// How `Params` mirrors `DeltaParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "DeltaParams" in [shaders::EPIKV_DELTA] {
        hidden4, column, n_tracked, _p
    })
}

/// The delta kernel for one tracked layer.
pub struct LayerDelta {
    delta: Arc<wgpu::ComputePipeline>,
    save: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
}

impl LayerDelta {
    /// `x` `[n, hidden]` residual stream, `positions` `[n]`, `prev` `[hidden]`
    /// (this layer's own), `g` `[n, n_tracked]` with this layer in `column`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        hidden: usize,
        column: usize,
        n_tracked: usize,
        x: &wgpu::Buffer,
        positions: &wgpu::Buffer,
        prev: &wgpu::Buffer,
        g: &wgpu::Buffer,
    ) -> Result<Self> {
        let delta = gpu.pipeline(&shaders::EPIKV_DELTA, None, "delta", &[])?;
        let save = gpu.pipeline(&shaders::EPIKV_DELTA, None, "save_last", &[])?;
        let params = gpu.uniform(
            "epikv-delta-params",
            &Params {
                hidden4: (hidden / 4) as u32,
                column: column as u32,
                n_tracked: n_tracked as u32,
                _p: 0,
            },
        );
        let group = gpu.bind_group(&delta, &[step, &params, x, positions, prev, g]);
        Ok(LayerDelta { delta, save, group })
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_tokens: u32) {
        dispatch(pass, &self.delta, &self.group, (n_tokens, 1, 1));
        dispatch(pass, &self.save, &self.group, (1, 1, 1));
    }
}

/// CPU reference: g for rows of `x` (`[n, hidden]`) after `prev`.
pub fn reference(x: &[f32], prev: &[f32], positions: &[u32]) -> Vec<f32> {
    let h = prev.len();
    (0..positions.len())
        .map(|t| {
            if positions[t] == 0 {
                return 0.0;
            }
            let before = if t == 0 { prev } else { &x[(t - 1) * h..t * h] };
            let row = &x[t * h..(t + 1) * h];
            row.iter()
                .zip(before)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
                .sqrt() as f32
        })
        .collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    #[cfg_attr(test, test)]
    fn deltas_chain_across_steps() {
        let gpu = gpu();
        let h = 20;
        let rows = rand_vec(9 * h, 4, 50.0);
        let xb = gpu.storage("x", (9 * h * 4) as u64);
        let posb = gpu.storage("pos", 9 * 4);
        let prev = gpu.storage("prev", (h * 4) as u64);
        let g = gpu.storage("g", 9 * 2 * 4);
        let step = gpu.uniform("step", &Step::default());
        // Column 1 of a two-layer table; steps of 4, 1 and 4 tokens from position 0.
        let k = LayerDelta::new(&gpu, &step, h, 1, 2, &xb, &posb, &prev, &g).unwrap();
        let mut start = 0;
        let mut want_prev = vec![0.0; h];
        for n in [4usize, 1, 4] {
            let x = &rows[start * h..(start + n) * h];
            let pos: Vec<u32> = (start as u32..(start + n) as u32).collect();
            gpu.write(
                &step,
                0,
                bytemuck::bytes_of(&Step {
                    n_tokens: n as u32,
                    ..Default::default()
                }),
            );
            gpu.write(&xb, 0, bytemuck::cast_slice(x));
            gpu.write(&posb, 0, bytemuck::cast_slice(&pos));
            run_pass(&gpu, |pass| k.encode(pass, n as u32));
            let got: Vec<f32> = gpu.read(&g, 0, n * 2).unwrap();
            let got: Vec<f32> = got.chunks(2).map(|c| c[1]).collect();
            let want = reference(x, &want_prev, &pos);
            assert!(
                max_abs_diff(&got, &want) < 1e-3,
                "step of {n} at {start}: {got:?} vs {want:?}"
            );
            want_prev = x[(n - 1) * h..].to_vec();
            start += n;
        }
        assert_eq!(reference(&rows[..h], &want_prev, &[0])[0], 0.0);
    }

    crate::kernels::checks::register![deltas_chain_across_steps,];
}
