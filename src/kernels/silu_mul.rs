//! `shaders/silu_mul.wgsl`: SwiGLU gate, silu(gate) * up.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::{ceil_div, dispatch};
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    ffn4: u32,
    _p: [u32; 3],
}

/// How `Params` mirrors `SiluParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "SiluParams" in [shaders::SILU_MUL] {
        ffn4, _p
    })
}

pub struct SiluMul {
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    ffn4: u32,
}

impl SiluMul {
    /// `gate_up` `[n, 2 ffn]` (gate then up in each row), `out` `[n, ffn]`.
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        ffn: usize,
        gate_up: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::SILU_MUL, None, "main", &[])?;
        let ffn4 = (ffn / 4) as u32;
        let params = gpu.uniform("silu-params", &Params { ffn4, _p: [0; 3] });
        let group = gpu.bind_group(&pipeline, &[step, &params, gate_up, out]);
        Ok(SiluMul {
            pipeline,
            group,
            ffn4,
        })
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_tokens: u32) {
        let (pipeline, group, groups) = self.dispatch_for(n_tokens);
        dispatch(pass, &pipeline, &group, groups);
    }

    /// What [`SiluMul::encode`] dispatches for `n_tokens` tokens (the
    /// timings run it before an unfused mat-vec).
    pub fn dispatch_for(&self, n_tokens: u32) -> super::tune::Dispatch {
        let groups = (ceil_div(self.ffn4, 64), n_tokens, 1);
        (self.pipeline.clone(), self.group.clone(), groups)
    }
}

/// CPU reference.
pub fn reference(gate_up: &[f32], ffn: usize) -> Vec<f32> {
    gate_up
        .chunks(2 * ffn)
        .flat_map(|row| (0..ffn).map(move |i| row[i] / (1.0 + (-row[i]).exp()) * row[ffn + i]))
        .collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    #[cfg_attr(test, test)]
    fn matches_reference() {
        let gpu = gpu();
        for &(ffn, n) in &[(4, 1), (352, 3), (260, 7)] {
            let gu = rand_vec(2 * ffn * n, 4, 6.0);
            let step = step_buffer(
                &gpu,
                Step {
                    n_tokens: n as u32,
                    ..Default::default()
                },
            );
            let gb = gpu.storage_from("gu", &gu);
            let ob = gpu.storage("o", (ffn * n * 4) as u64);
            let k = SiluMul::new(&gpu, &step, ffn, &gb, &ob).unwrap();
            run_pass(&gpu, |pass| k.encode(pass, n as u32));
            let got: Vec<f32> = gpu.read(&ob, 0, ffn * n).unwrap();
            assert!(max_abs_diff(&got, &reference(&gu, ffn)) < 1e-5);
        }
    }

    crate::kernels::checks::register![matches_reference,];
}
