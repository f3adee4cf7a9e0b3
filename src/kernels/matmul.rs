//! `shaders/matmul.wgsl`: y (+)= W x (+ bias) with f16 or f32 weights.

use anyhow::Result;
use bytemuck::{Pod, Zeroable};

use super::{ceil_div, dispatch, Rows};
use crate::gpu::Gpu;
use crate::shaders;
use crate::weights::GpuMatrix;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    rows: u32,
    k4: u32,
    col0: u32,
    out_stride: u32,
    flags: u32,
    count_sel: u32,
    _p: [u32; 2],
}

/// How the product is stored.
#[derive(Clone, Copy, Debug)]
pub struct MatmulOptions {
    /// Add into y instead of overwriting (fuses a residual connection).
    pub accumulate: bool,
    pub rows: Rows,
}

struct Part {
    rows: u32,
    group: wgpu::BindGroup,
}

/// One weight matrix bound to its input and output buffers.
pub struct Matmul {
    matmul: std::sync::Arc<wgpu::ComputePipeline>,
    matvec: std::sync::Arc<wgpu::ComputePipeline>,
    parts: Vec<Part>,
}

impl Matmul {
    /// `x` is `[n, w.cols]` f32, `y` is `[n, w.rows]` f32, `bias` is `[w.rows]` f32.
    pub fn new(
        gpu: &Gpu,
        step: &wgpu::Buffer,
        w: &GpuMatrix,
        bias: Option<&wgpu::Buffer>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        opts: MatmulOptions,
    ) -> Result<Self> {
        let fmt = Some(w.format);
        let matmul = gpu.pipeline(&shaders::MATMUL, fmt, "matmul", &[])?;
        let matvec = gpu.pipeline(&shaders::MATMUL, fmt, "matvec", &[])?;
        let dummy;
        let bias_buf = match bias {
            Some(b) => b,
            None => {
                dummy = gpu.storage("no-bias", 16);
                &dummy
            }
        };
        let flags = opts.accumulate as u32 | ((bias.is_some() as u32) << 1);
        let parts = w
            .parts
            .iter()
            .map(|part| {
                let params = gpu.uniform(
                    "matmul-params",
                    &Params {
                        rows: part.rows as u32,
                        k4: (w.cols / 4) as u32,
                        col0: part.row0 as u32,
                        out_stride: w.rows as u32,
                        flags,
                        count_sel: opts.rows as u32,
                        _p: [0; 2],
                    },
                );
                let bufs = [step, &params, &part.buffer, bias_buf, x, y];
                Part {
                    rows: part.rows as u32,
                    group: gpu.bind_group(&matmul, &bufs),
                }
            })
            .collect();
        Ok(Matmul {
            matmul,
            matvec,
            parts,
        })
    }

    /// Encodes the product for `n` rows of x (n must match the step's row count).
    pub fn encode(&self, pass: &mut wgpu::ComputePass, n: u32) {
        for part in &self.parts {
            if n == 1 {
                dispatch(
                    pass,
                    &self.matvec,
                    &part.group,
                    (ceil_div(part.rows, 64), 1, 1),
                );
            } else {
                dispatch(
                    pass,
                    &self.matmul,
                    &part.group,
                    (ceil_div(ceil_div(part.rows, 4), 64), ceil_div(n, 4), 1),
                );
            }
        }
    }
}

/// CPU reference: `y[t, r] = (accumulate ? y : 0) + sum_k w[r, k] x[t, k] + bias[r]`.
pub fn reference(
    w: &[f32],
    rows: usize,
    cols: usize,
    bias: Option<&[f32]>,
    x: &[f32],
    y: &mut [f32],
    accumulate: bool,
) {
    let n = x.len() / cols;
    for t in 0..n {
        for r in 0..rows {
            let mut s = 0.0f64;
            for k in 0..cols {
                s += w[r * cols + k] as f64 * x[t * cols + k] as f64;
            }
            let mut v = s as f32 + bias.map_or(0.0, |b| b[r]);
            if accumulate {
                v += y[t * rows + r];
            }
            y[t * rows + r] = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuOptions;
    use crate::kernels::testutil::*;
    use crate::kernels::Step;
    use crate::shaders::WeightFormat;

    fn check(
        gpu: &Gpu,
        rows: usize,
        cols: usize,
        n: usize,
        format: WeightFormat,
        bias: bool,
        accumulate: bool,
    ) {
        let w = rand_vec(rows * cols, 1 + rows as u64, 0.5);
        // Round weights through the storage format so the reference sees the same values.
        let w: Vec<f32> = match format {
            WeightFormat::F16 => w.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
            WeightFormat::F32 => w,
        };
        let b = rand_vec(rows, 7, 1.0);
        let x = rand_vec(n * cols, 3 + n as u64, 1.0);
        let y0 = rand_vec(n * rows, 11, 1.0);
        let m = GpuMatrix::new(gpu, "w", rows, cols, format).unwrap();
        m.write_rows(gpu, 0, &w, "w").unwrap();
        let step = step_buffer(
            gpu,
            Step {
                n_tokens: n as u32,
                ..Default::default()
            },
        );
        let bias_buf = gpu.storage_from("b", &b);
        let xb = gpu.storage_from("x", &x);
        let yb = gpu.storage_from("y", &y0);
        let mm = Matmul::new(
            gpu,
            &step,
            &m,
            bias.then_some(&bias_buf),
            &xb,
            &yb,
            MatmulOptions {
                accumulate,
                rows: Rows::Tokens,
            },
        )
        .unwrap();
        run_pass(gpu, |pass| mm.encode(pass, n as u32));
        let got: Vec<f32> = gpu.read(&yb, 0, n * rows).unwrap();
        let mut want = y0.clone();
        reference(
            &w,
            rows,
            cols,
            bias.then_some(&b[..]),
            &x,
            &mut want,
            accumulate,
        );
        let err = max_abs_diff(&got, &want);
        assert!(
            err < 1e-4 * (cols as f32).sqrt(),
            "rows {rows} cols {cols} n {n} {format:?}: max err {err}"
        );
        assert_eq!(m.parts.len(), m.rows.div_ceil(m.parts[0].rows));
    }

    #[test]
    fn matches_reference_on_awkward_shapes() {
        let gpu = gpu();
        for &(rows, cols, n) in &[
            (1, 4, 1),
            (7, 12, 1),
            (13, 36, 5),
            (64, 64, 4),
            (130, 96, 7),
            (33, 200, 17),
        ] {
            for format in [WeightFormat::F32, WeightFormat::F16] {
                check(&gpu, rows, cols, n, format, n % 2 == 1, rows % 2 == 1);
            }
        }
    }

    #[test]
    fn matrices_split_across_bindings() {
        // A 1 KiB binding limit forces 8-row parts for 32 f32 columns.
        let gpu = Gpu::new(&GpuOptions {
            max_binding_override: Some(1024),
            ..Default::default()
        })
        .unwrap();
        for n in [1, 6] {
            check(&gpu, 45, 32, n, WeightFormat::F32, true, false);
        }
    }
}
