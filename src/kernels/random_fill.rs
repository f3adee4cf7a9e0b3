//! `shaders/random_fill.wgsl`: seeded uniform random values written on the
//! GPU (synthetic models: weights of any size with no file and no host copy).

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::{ceil_div, dispatch};
use crate::formats::WeightFormat;
use crate::gpu::Gpu;
use crate::shaders;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    word0: u32,
    n_words: u32,
    format: u32,
    seed: u32,
    scale: f32,
    offset: f32,
    block_words: u32,
    scale_words: u32,
}

/// How `Params` mirrors `FillParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "FillParams" in [shaders::RANDOM_FILL] {
        word0, n_words, format, seed, scale, offset, block_words, scale_words
    })
}

pub struct RandomFill {
    pipeline: Arc<wgpu::ComputePipeline>,
}

/// Values `offset + scale * u`, u uniform in [-1, 1). For a quantized format,
/// blocks whose scale is `scale` (and whose offset or minimum scale is
/// `offset`: Q4_1's m, the K-quants' dmin; Q4_0 has none) and whose other
/// words (quants, sub-block scales) are random bits.
#[derive(Clone, Copy, Debug)]
pub struct Distribution {
    pub seed: u32,
    pub scale: f32,
    pub offset: f32,
}

impl RandomFill {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(RandomFill {
            pipeline: gpu.pipeline(&shaders::RANDOM_FILL, None, "main", &[])?,
        })
    }

    /// Fills words `word0 .. word0 + n_words` of `buffer` (submitted at once).
    pub fn fill(
        &self,
        gpu: &Gpu,
        buffer: &wgpu::Buffer,
        word0: u64,
        n_words: u64,
        format: WeightFormat,
        d: Distribution,
    ) -> Result<()> {
        anyhow::ensure!(
            (word0 + n_words) * 4 <= buffer.size(),
            "random fill past the end of a {}-byte buffer",
            buffer.size()
        );
        if n_words == 0 {
            return Ok(());
        }
        // Q4_0's groups of 8 blocks start with 4 words of 8 scales.
        let (code, block_words, scale_words) = match (format, format.block()) {
            (WeightFormat::Q4_0, Some(b)) => (3, b.words as u32, 4),
            (_, Some(b)) => (2, b.words as u32, 1),
            (WeightFormat::F32, None) => (0, 0, 0),
            (_, None) => (1, 0, 0),
        };
        anyhow::ensure!(
            block_words == 0 || word0.is_multiple_of(block_words as u64),
            "random {} blocks must start at a block boundary (word {word0})",
            format.name()
        );
        let params = gpu.uniform(
            "random-fill",
            &Params {
                word0: word0 as u32,
                n_words: n_words as u32,
                format: code,
                seed: d.seed,
                scale: d.scale,
                offset: d.offset,
                block_words,
                scale_words,
            },
        );
        let group = gpu.bind_group(&self.pipeline, &[&params, buffer]);
        let groups = ceil_div(n_words as u32, 256);
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            dispatch(
                &mut pass,
                &self.pipeline,
                &group,
                (groups.min(65535), ceil_div(groups, 65535), 1),
            );
        }
        gpu.queue.submit([enc.finish()]);
        Ok(())
    }
}

fn hash(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846ca68b);
    h ^= h >> 16;
    h
}

/// CPU reference: the value of element `e` (word e for f32, half e for f16).
pub fn reference_value(d: Distribution, e: u32) -> f32 {
    let u = (hash(e ^ hash(d.seed)) >> 8) as f32 * (2.0 / 16777216.0) - 1.0;
    d.offset + d.scale * u
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    #[cfg_attr(test, test)]
    fn matches_the_cpu_reference() {
        let gpu = gpu();
        let fill = RandomFill::new(&gpu).unwrap();
        let d = Distribution {
            seed: 7,
            scale: 0.25,
            offset: 1.0,
        };
        // A range that is not a multiple of the workgroup, inside a larger buffer.
        let (words, word0, n) = (3000u64, 5u64, 2777u64);
        for format in [WeightFormat::F32, WeightFormat::F16] {
            let buf = gpu.storage_from("fill", &vec![0u32; words as usize]);
            fill.fill(&gpu, &buf, word0, n, format, d).unwrap();
            let got: Vec<u32> = gpu.read(&buf, 0, words as usize).unwrap();
            for (w, &g) in got.iter().enumerate() {
                let w32 = w as u32;
                let inside = (word0..word0 + n).contains(&(w as u64));
                if !inside {
                    assert_eq!(g, 0, "word {w} outside the range was written");
                    continue;
                }
                let (values, tol) = match format {
                    WeightFormat::F32 => (vec![f32::from_bits(g)], 1e-6),
                    WeightFormat::F16 => (
                        vec![
                            half::f16::from_bits(g as u16).to_f32(),
                            half::f16::from_bits((g >> 16) as u16).to_f32(),
                        ],
                        1e-3,
                    ),
                    q => unreachable!("{q:?} is refused above"),
                };
                for (k, v) in values.iter().enumerate() {
                    let e = match format {
                        WeightFormat::F32 => w32,
                        _ => 2 * w32 + k as u32,
                    };
                    let want = reference_value(d, e);
                    assert!(
                        (v - want).abs() <= tol,
                        "{format:?} word {w}: {v} vs {want}"
                    );
                    assert!((0.75..=1.25).contains(v), "{v}");
                }
            }
        }
        // Quantized blocks: the scale words of each block or group the scale
        // pairs, the others the hash bits; a fill must start at a block boundary.
        for format in [WeightFormat::Q4_0, WeightFormat::Q6_K] {
            let bw = format.block().unwrap().words as u64;
            let (word0, n) = (3 * bw, 40 * bw + 1);
            let buf = gpu.storage_from("fill", &vec![0u32; words as usize]);
            fill.fill(&gpu, &buf, word0, n, format, d).unwrap();
            let got: Vec<u32> = gpu.read(&buf, 0, words as usize).unwrap();
            let half = |v: f32| half::f16::from_f32(v).to_bits() as u32;
            // Q4_0: four words of two scales; else one (scale, offset).
            let (pair, scale_words) = match format {
                WeightFormat::Q4_0 => (half(d.scale) | half(d.scale) << 16, 4),
                _ => (half(d.scale) | half(d.offset) << 16, 1),
            };
            for (w, &g) in got.iter().enumerate() {
                let w = w as u64;
                let want = if !(word0..word0 + n).contains(&w) {
                    0
                } else if w % bw < scale_words {
                    pair
                } else {
                    hash(w as u32 ^ hash(d.seed))
                };
                assert_eq!(g, want, "{format:?} word {w}");
            }
            let err = fill.fill(&gpu, &buf, bw + 1, n, format, d).unwrap_err();
            assert!(err.to_string().contains("block boundary"), "{err}");
        }
        // Uniform on [-1, 1): mean near 0, spread near 1/sqrt(3).
        let d0 = Distribution {
            seed: 1,
            scale: 1.0,
            offset: 0.0,
        };
        let v: Vec<f32> = (0..100_000).map(|e| reference_value(d0, e)).collect();
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt();
        assert!(
            mean.abs() < 0.01 && (sd - 0.5774).abs() < 0.01,
            "{mean} {sd}"
        );
    }

    crate::kernels::checks::register![matches_the_cpu_reference,];
}
