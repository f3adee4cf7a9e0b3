//! `shaders/silu_mul.wgsl`: the gated MLP's activation, act(gate) * up
//! (SiLU, or the tanh-approximated GELU).

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::{ceil_div, dispatch};
use crate::family::Activation;
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
        activation: Activation,
        gate_up: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<Self> {
        let constants: &[(&str, f64)] = match activation {
            Activation::Silu => &[],
            Activation::GeluTanh => &[("GELU_TANH", 1.0)],
        };
        let pipeline = gpu.pipeline(&shaders::SILU_MUL, None, "main", constants)?;
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

/// CPU reference (in f64; GELU as PyTorch's `gelu(approximate="tanh")`).
pub fn reference(gate_up: &[f32], ffn: usize, activation: Activation) -> Vec<f32> {
    let act = move |g: f64| match activation {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => {
            0.5 * g
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3))).tanh())
        }
    };
    gate_up
        .chunks(2 * ffn)
        .flat_map(|row| (0..ffn).map(move |i| (act(row[i] as f64) * row[ffn + i] as f64) as f32))
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
        let cases = [(4, 1), (352, 3), (260, 7)];
        for (&(ffn, n), activation) in cases
            .iter()
            .flat_map(|c| [(c, Activation::Silu), (c, Activation::GeluTanh)])
        {
            // Gates out to +-60 reach both saturated ends of each activation.
            let mut gu = rand_vec(2 * ffn * n, 4, 6.0);
            gu[0] = 60.0;
            gu[1] = -60.0;
            let step = step_buffer(
                &gpu,
                Step {
                    n_tokens: n as u32,
                    ..Default::default()
                },
            );
            let gb = gpu.storage_from("gu", &gu);
            let ob = gpu.storage("o", (ffn * n * 4) as u64);
            let k = SiluMul::new(&gpu, &step, ffn, activation, &gb, &ob).unwrap();
            run_pass(&gpu, |pass| k.encode(pass, n as u32));
            let got: Vec<f32> = gpu.read(&ob, 0, ffn * n).unwrap();
            let want = reference(&gu, ffn, activation);
            let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            let err = max_abs_diff(&got, &want);
            assert!(err < 1e-6 * scale, "{activation:?} ffn {ffn}: {err}");
        }
    }

    crate::kernels::checks::register![matches_reference,];
}
