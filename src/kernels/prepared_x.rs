//! A mat-vec's input x prepared once per token by the kernels that share
//! `shaders/x_input.wgsl`, with the RMSNorm or SwiGLU that writes x folded
//! in: `quantize_q8.wgsl` writes q8 blocks (llama.cpp's q8_1: 32 signed
//! 8-bit values, a scale and their sums) for the integer-dot mat-vec
//! (`matvec_q8.wgsl`, [`MatvecVariant::IntegerDot`]), `x_half.wgsl` f16
//! values for the f16-x mat-vec ([`MatvecVariant::HalfX`]).
//!
//! [`MatvecVariant::IntegerDot`]: super::variants::MatvecVariant::IntegerDot
//! [`MatvecVariant::HalfX`]: super::variants::MatvecVariant::HalfX

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::{ceil_div, dispatch, Rows};
use crate::gpu::Gpu;
use crate::shaders::{self, Shader};

/// The kernel that writes a mat-vec's input, folded into the mat-vec (decode)
/// of the `gpu` set: the mat-vec reads that kernel's input and computes x
/// itself, which saves decode one dispatch (and one pass over x) each.
/// Prefill (and the `cpu` set) still reads the x the separate kernel writes.
#[derive(Clone, Copy)]
pub enum FusedInput<'a> {
    /// x = RMSNorm(residual) * weights.
    RmsNorm {
        /// `[n, cols]` f32: the norm's input.
        residual: &'a wgpu::Buffer,
        /// `[cols]` f32.
        weights: &'a wgpu::Buffer,
        eps: f64,
    },
    /// x = silu(gate) * up, the SwiGLU gate, from `[n, 2 * cols]` f32 rows
    /// (gate in the first half, up in the second, as the gate|up mat-mul
    /// writes them).
    SwiGlu { gate_up: &'a wgpu::Buffer },
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    k4: u32,
    count_sel: u32,
    flags: u32,
    eps: f32,
}

/// How `Params` mirrors `XInputParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "XInputParams" in [shaders::QUANTIZE_Q8, shaders::X_HALF] {
        k4, count_sel, flags, eps
    })
}

/// FLAG_* of x_input.wgsl.
const FLAG_NORM: u32 = 1;
const FLAG_SWIGLU: u32 = 2;

/// Values per q8 block, and bytes per block on the device (32 quants, d,
/// s0, s1 and a zero word).
pub const BLOCK_VALUES: usize = 32;
pub const BLOCK_BYTES: u64 = 48;

/// The form a mat-vec reads its prepared x in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XForm {
    /// q8 blocks (`quantize_q8.wgsl`): rows of whole 32-value blocks.
    Q8,
    /// f16 values (`x_half.wgsl`).
    F16,
}

impl XForm {
    fn shader(self) -> &'static Shader {
        match self {
            XForm::Q8 => &shaders::QUANTIZE_Q8,
            XForm::F16 => &shaders::X_HALF,
        }
    }

    /// Bytes of one token's `cols` values.
    pub fn bytes(self, cols: usize) -> u64 {
        match self {
            XForm::Q8 => cols.div_ceil(BLOCK_VALUES) as u64 * BLOCK_BYTES,
            XForm::F16 => cols as u64 * 2,
        }
    }

    /// Whether rows of `cols` values take this form.
    pub fn takes(self, cols: usize) -> bool {
        match self {
            XForm::Q8 => cols.is_multiple_of(BLOCK_VALUES),
            XForm::F16 => cols.is_multiple_of(4),
        }
    }

    /// Workgroups along a row: a block (Q8) or four values (F16) per lane
    /// of 64.
    fn row_groups(self, cols: usize) -> u32 {
        let per_lane = match self {
            XForm::Q8 => BLOCK_VALUES,
            XForm::F16 => 4,
        };
        ceil_div((cols / per_lane) as u32, 64)
    }
}

/// One product's x prepared in one form.
pub struct PreparedX {
    pub form: XForm,
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    row_groups: u32,
}

impl PreparedX {
    /// Prepares `[n, cols]` f32 rows of `x` in `form` into `out` (`n` rows
    /// of [`XForm::bytes`]); with `fused`, x is what that kernel would
    /// write, computed from its input (`x` is then not read).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        form: XForm,
        step: &wgpu::Buffer,
        cols: usize,
        x: &wgpu::Buffer,
        fused: Option<&FusedInput>,
        out: &wgpu::Buffer,
        rows: Rows,
    ) -> Result<Self> {
        anyhow::ensure!(
            form.takes(cols),
            "{form:?}: x cannot be prepared in rows of {cols} values"
        );
        let pipeline = gpu.pipeline(form.shader(), None, "main", &[])?;
        let no_norm;
        let (flags, input, norm, eps) = match fused {
            None => {
                no_norm = gpu.storage("no-norm", 16);
                (0, x, &no_norm, 0.0)
            }
            Some(FusedInput::RmsNorm {
                residual,
                weights,
                eps,
            }) => (FLAG_NORM, *residual, *weights, *eps),
            Some(FusedInput::SwiGlu { gate_up }) => {
                no_norm = gpu.storage("no-norm", 16);
                (FLAG_SWIGLU, *gate_up, &no_norm, 0.0)
            }
        };
        let params = Params {
            k4: (cols / 4) as u32,
            count_sel: rows as u32,
            flags,
            eps: eps as f32,
        };
        let params = gpu.uniform("prepared-x-params", &params);
        let group = gpu.bind_group(&pipeline, &[step, &params, input, norm, out]);
        Ok(PreparedX {
            form,
            pipeline,
            group,
            row_groups: form.row_groups(cols),
        })
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass, n_tokens: u32) {
        let (pipeline, group, groups) = self.dispatch_for(n_tokens);
        dispatch(pass, &pipeline, &group, groups);
    }

    /// What [`PreparedX::encode`] dispatches for `n_tokens` tokens (the
    /// timings run it before the mat-vec that reads it).
    pub fn dispatch_for(&self, n_tokens: u32) -> super::tune::Dispatch {
        let groups = (self.row_groups, n_tokens, 1);
        (self.pipeline.clone(), self.group.clone(), groups)
    }
}

/// One q8 block: x ~ d * q; `sums` = d * (sum of q) over values 0..15 and
/// 16..31.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Q8Block {
    pub q: [i8; BLOCK_VALUES],
    pub d: f32,
    pub sums: [f32; 2],
}

impl Q8Block {
    /// A block as quantize_q8.wgsl computes it (round half to even, as
    /// WGSL's `round`).
    pub fn quantize(x: &[f32]) -> Self {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let scale = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0i8; BLOCK_VALUES];
        for (q, v) in q.iter_mut().zip(x) {
            *q = (v * scale).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        let sum = |h: &[i8]| d * h.iter().map(|&v| v as i32).sum::<i32>() as f32;
        Q8Block {
            q,
            d,
            sums: [sum(&q[..16]), sum(&q[16..])],
        }
    }

    /// The block as the device stores it (12 words).
    pub fn from_words(w: &[u32]) -> Self {
        let mut q = [0i8; BLOCK_VALUES];
        for (i, q) in q.iter_mut().enumerate() {
            *q = (w[i / 4] >> (8 * (i % 4))) as u8 as i8;
        }
        Q8Block {
            q,
            d: f32::from_bits(w[8]),
            sums: [f32::from_bits(w[9]), f32::from_bits(w[10])],
        }
    }

    /// The values the block stands for.
    pub fn values(&self) -> impl Iterator<Item = f32> + '_ {
        self.q.iter().map(|&q| self.d * q as f32)
    }
}

/// CPU reference: the blocks of each row of `x` (`cols` values a row).
pub fn reference(x: &[f32], cols: usize) -> Vec<Q8Block> {
    x.chunks(cols)
        .flat_map(|row| row.chunks(BLOCK_VALUES).map(Q8Block::quantize))
        .collect()
}

/// The values of a row of blocks, as the integer-dot mat-vec multiplies them.
pub fn dequantize(blocks: &[Q8Block]) -> Vec<f32> {
    blocks.iter().flat_map(|b| b.values()).collect()
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;

    /// The shapes both forms run: K of one 32-value block, of three, and of
    /// 130 (4,160 values: three workgroups of 64 lanes for q8 blocks, the
    /// last partial; 17 of them for f16), one token and several; x plain,
    /// normed and gated.
    const CASES: [(usize, usize); 3] = [(32, 1), (96, 3), (4160, 2)];
    const MODES: [&str; 3] = ["x", "rmsnorm", "swiglu"];

    /// x prepared in `form` on the device for `n` tokens of `cols` values,
    /// its input plain, normed or gated (`mode`): the words it wrote and x
    /// as the CPU references of the folded-in norm and SwiGLU compute it.
    /// The first block is zeros, the last value large.
    fn prepare(gpu: &Gpu, form: XForm, cols: usize, n: usize, mode: &str) -> (Vec<u32>, Vec<f32>) {
        let width = if mode == "swiglu" { 2 * cols } else { cols };
        let mut input = rand_vec(n * width, cols as u64 + n as u64, 2.0);
        input[..32].fill(0.0);
        *input.last_mut().unwrap() = 300.0;
        let norm_w = rand_vec(cols, 9, 1.0);
        let eps = 1e-5;
        let x = match mode {
            "x" => input.clone(),
            "rmsnorm" => crate::kernels::rmsnorm::reference(&input, &norm_w, eps),
            _ => crate::kernels::silu_mul::reference(&input, cols, crate::family::Activation::Silu),
        };
        let step = step_buffer(
            gpu,
            Step {
                n_tokens: n as u32,
                ..Default::default()
            },
        );
        let ib = gpu.storage_from("input", &input);
        let wb = gpu.storage_from("norm", &norm_w);
        let out = gpu.storage("prepared", n as u64 * form.bytes(cols));
        let fused = match mode {
            "x" => None,
            "rmsnorm" => Some(FusedInput::RmsNorm {
                residual: &ib,
                weights: &wb,
                eps: eps as f64,
            }),
            _ => Some(FusedInput::SwiGlu { gate_up: &ib }),
        };
        let rows = Rows::Tokens;
        let k = PreparedX::new(gpu, form, &step, cols, &ib, fused.as_ref(), &out, rows).unwrap();
        run_pass(gpu, |pass| k.encode(pass, n as u32));
        let words = (n as u64 * form.bytes(cols) / 4) as usize;
        (gpu.read(&out, 0, words).unwrap(), x)
    }

    /// Each block from the device stands for its 32 values as a q8 block
    /// must: d = max |x| / 127 (an all-zero block: 0), every value within
    /// d / 2 of d * q, and the sums those of its quants.
    #[cfg_attr(test, test)]
    fn q8_blocks_match_reference() {
        let gpu = gpu();
        for ((cols, n), mode) in CASES.into_iter().flat_map(|c| MODES.map(|m| (c, m))) {
            let (words, x) = prepare(&gpu, XForm::Q8, cols, n, mode);
            for (b, (w, xs)) in words.chunks(12).zip(x.chunks(BLOCK_VALUES)).enumerate() {
                let got = Q8Block::from_words(w);
                let want = Q8Block::quantize(xs);
                let at = format!("{mode} K {cols} n {n} block {b}");
                assert!(
                    (got.d - want.d).abs() <= 1e-5 * want.d,
                    "{at}: d {} against {}",
                    got.d,
                    want.d
                );
                assert_eq!(w[11], 0, "{at}: the padding word");
                for (i, (v, x)) in got.values().zip(xs).enumerate() {
                    let err = (v - x).abs();
                    assert!(
                        err <= 0.5 * got.d * (1.0 + 1e-4) + 1e-6 * x.abs(),
                        "{at} value {i}: {v} stands for {x}"
                    );
                }
                for h in 0..2 {
                    let sum: i32 = got.q[16 * h..16 * h + 16].iter().map(|&q| q as i32).sum();
                    let s = got.d * sum as f32;
                    assert!(
                        (got.sums[h] - s).abs() <= 1e-6 * (1.0 + s.abs()),
                        "{at}: sum {h} {} against {s}",
                        got.sums[h]
                    );
                }
            }
        }
    }

    /// Each f16 value from the device is x rounded to f16 (within one f16
    /// step: the device's f32 norm may sit across a rounding boundary from
    /// the CPU's), in x's order.
    #[cfg_attr(test, test)]
    fn f16_values_match_reference() {
        let gpu = gpu();
        for ((cols, n), mode) in CASES.into_iter().flat_map(|c| MODES.map(|m| (c, m))) {
            let (words, x) = prepare(&gpu, XForm::F16, cols, n, mode);
            let got = words
                .iter()
                .flat_map(|w| [*w as u16, (*w >> 16) as u16])
                .map(|h| half::f16::from_bits(h).to_f32());
            for (i, (v, x)) in got.zip(&x).enumerate() {
                let err = (v - x).abs();
                assert!(
                    err <= x.abs() * 2f32.powi(-10) + 1e-7,
                    "{mode} K {cols} n {n} value {i}: {v} stands for {x}"
                );
            }
        }
    }

    crate::kernels::checks::register![q8_blocks_match_reference, f16_values_match_reference,];
}
