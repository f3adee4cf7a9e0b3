//! `shaders/sample.wgsl`: next-token choice on the GPU (greedy, temperature,
//! top-k, top-p, repetition penalty, seeded).

use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::dispatch;
use crate::gpu::Gpu;
use crate::shaders;

/// Sampling settings. `temperature == 0` is greedy decoding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1 disables top-p.
    pub top_p: f32,
    /// 1 disables the repetition penalty (Hugging Face's definition: positive
    /// logits of seen tokens are divided by it, negative ones multiplied).
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::GREEDY
    }
}

impl SamplingParams {
    /// The most likely token every step (the default).
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        repetition_penalty: 1.0,
        seed: 0,
    };

    /// Below this temperature (other than 0) logits divided by it leave f32's
    /// range and sampling degenerates (at 1e-38 it repeated one token); at
    /// this temperature it already picks the argmax unless logits are within
    /// about 1e-3 of each other.
    pub const MIN_TEMPERATURE: f32 = 1e-3;
    /// The repetition penalty's range: outside it a logit scaled by it leaves
    /// the range where sampling stays meaningful (1e-45 gave degenerate text).
    pub const PENALTY_RANGE: (f32, f32) = (1e-2, 1e2);

    /// Refuses settings with which sampling degenerates or is undefined,
    /// naming the setting, its value and the rule.
    pub fn validate(&self) -> anyhow::Result<()> {
        use crate::error::{bail_kind, ErrorKind::InvalidOptions};
        let t = self.temperature;
        if !(t.is_finite() && (t == 0.0 || t >= Self::MIN_TEMPERATURE)) {
            bail_kind!(
                InvalidOptions,
                "temperature {t:?} is not 0 (greedy) or a finite value of at least {}",
                Self::MIN_TEMPERATURE
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail_kind!(InvalidOptions, "top-p {:?} is not in (0, 1]", self.top_p);
        }
        let (lo, hi) = Self::PENALTY_RANGE;
        let r = self.repetition_penalty;
        if !(lo..=hi).contains(&r) {
            bail_kind!(
                InvalidOptions,
                "repetition penalty {r:?} is not in [{lo}, {hi}] (1 = off)"
            );
        }
        Ok(())
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    vocab: u32,
    row: u32,
    top_k: u32,
    seed: u32,
    temperature: f32,
    top_p: f32,
    rep_penalty: f32,
    counter: u32,
}

/// How `Params` mirrors `SampleParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "SampleParams" in [shaders::SAMPLE] {
        vocab, row, top_k, seed, temperature, top_p, rep_penalty, counter
    })
}

/// What the sampler returns instead of a token when the logit row holds a
/// NaN or an infinity (`NONFINITE` in sample.wgsl).
pub const NONFINITE: u32 = u32::MAX;

pub struct Sampler {
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    params: wgpu::Buffer,
    /// Bitmask of tokens seen so far (for the repetition penalty).
    pub seen: wgpu::Buffer,
    /// The chosen token id, `[1]` u32, or [`NONFINITE`].
    pub result: wgpu::Buffer,
    vocab: u32,
}

impl Sampler {
    pub fn new(gpu: &Gpu, vocab: usize, logits: &wgpu::Buffer) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::SAMPLE, None, "main", &[])?;
        let params = gpu.uniform("sample-params", &Params::zeroed());
        let seen = gpu.storage("seen", vocab.div_ceil(32) as u64 * 4);
        let result = gpu.storage("sampled", 16);
        let group = gpu.bind_group(&pipeline, &[&params, logits, &seen, &result]);
        Ok(Sampler {
            pipeline,
            group,
            params,
            seen,
            result,
            vocab: vocab as u32,
        })
    }

    /// Replaces the seen-token set (the prompt's tokens at the start of a generation).
    pub fn reset_seen(&self, gpu: &Gpu, tokens: &[u32]) {
        let mut mask = vec![0u32; (self.vocab as usize).div_ceil(32)];
        for &t in tokens {
            if t < self.vocab {
                mask[t as usize / 32] |= 1 << (t % 32);
            }
        }
        gpu.write(&self.seen, 0, bytemuck::cast_slice(&mask));
    }

    /// Writes the parameters for sampling row `row` of the logits at step `counter`.
    pub fn set_params(&self, gpu: &Gpu, s: &SamplingParams, row: u32, counter: u32) {
        let p = Params {
            vocab: self.vocab,
            row,
            top_k: s.top_k,
            seed: (s.seed ^ (s.seed >> 32)) as u32,
            temperature: s.temperature,
            top_p: s.top_p,
            rep_penalty: s.repetition_penalty,
            counter,
        };
        gpu.write(&self.params, 0, bytemuck::bytes_of(&p));
    }

    pub fn encode(&self, pass: &mut wgpu::ComputePass) {
        dispatch(pass, &self.pipeline, &self.group, (1, 1, 1));
    }
}

/// The shader's random stream (PCG hash), for the CPU reference.
pub fn pcg(v: u32) -> u32 {
    let state = v.wrapping_mul(747796405).wrapping_add(2891336453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277803737);
    (word >> 22) ^ word
}

/// CPU reference with exact (sorted) top-k / top-p sets.
pub fn reference(logits: &[f32], seen: &[u32], s: &SamplingParams, counter: u32) -> u32 {
    let adj: Vec<f64> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let mut x = x as f64;
            if s.repetition_penalty != 1.0 && seen.contains(&(i as u32)) {
                x = if x > 0.0 {
                    x / s.repetition_penalty as f64
                } else {
                    x * s.repetition_penalty as f64
                };
            }
            if s.temperature > 0.0 {
                x /= s.temperature as f64;
            }
            x
        })
        .collect();
    let argmax = (0..adj.len()).fold(0, |b, i| if adj[i] > adj[b] { i } else { b });
    if s.temperature == 0.0 {
        return argmax as u32;
    }
    let m = adj[argmax];
    let mut order: Vec<usize> = (0..adj.len()).collect();
    order.sort_by(|&a, &b| adj[b].partial_cmp(&adj[a]).unwrap());
    let mut keep = if s.top_k > 0 {
        (s.top_k as usize).min(adj.len())
    } else {
        adj.len()
    };
    if s.top_p < 1.0 {
        let total: f64 = order[..keep].iter().map(|&i| (adj[i] - m).exp()).sum();
        let mut acc = 0.0;
        for (n, &i) in order[..keep].iter().enumerate() {
            acc += (adj[i] - m).exp();
            if acc >= s.top_p as f64 * total {
                keep = n + 1;
                break;
            }
        }
    }
    let thr = adj[order[keep - 1]];
    let z: f64 = adj
        .iter()
        .filter(|&&x| x >= thr)
        .map(|x| (x - m).exp())
        .sum();
    let r = (pcg((s.seed ^ (s.seed >> 32)) as u32 ^ pcg(counter)) >> 8) as f64 / 16777216.0;
    let mut u = r * z;
    for (i, &x) in adj.iter().enumerate() {
        if x >= thr {
            let w = (x - m).exp();
            if u < w {
                return i as u32;
            }
            u -= w;
        }
    }
    argmax as u32
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    fn run(gpu: &Gpu, logits: &[f32], seen: &[u32], s: &SamplingParams, counter: u32) -> u32 {
        let lb = gpu.storage_from("logits", logits);
        let sm = Sampler::new(gpu, logits.len(), &lb).unwrap();
        sm.reset_seen(gpu, seen);
        sm.set_params(gpu, s, 0, counter);
        run_pass(gpu, |pass| sm.encode(pass));
        gpu.read::<u32>(&sm.result, 0, 1).unwrap()[0]
    }

    #[cfg_attr(test, test)]
    fn greedy_takes_the_first_maximum() {
        let gpu = gpu();
        let mut l = rand_vec(1000, 1, 3.0);
        l[700] = 10.0;
        l[300] = 10.0;
        assert_eq!(run(&gpu, &l, &[], &SamplingParams::default(), 0), 300);
        // Length 1 and a penalty that moves the maximum.
        assert_eq!(run(&gpu, &[0.5], &[], &SamplingParams::default(), 0), 0);
        let pen = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        assert_eq!(run(&gpu, &[4.0, 3.0, -1.0], &[0], &pen, 0), 1);
    }

    /// A NaN or an infinity anywhere in the row gives NONFINITE in every
    /// mode, and marks no token as seen.
    #[cfg_attr(test, test)]
    fn non_finite_logits_give_no_token() {
        let gpu = gpu();
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.3,
            seed: 7,
        };
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0usize, 517, 999] {
                let mut l = rand_vec(1000, 2, 3.0);
                l[at] = bad;
                for s in [SamplingParams::default(), sampled] {
                    assert_eq!(run(&gpu, &l, &[1], &s, 0), NONFINITE, "{bad} at {at}");
                }
            }
        }
        let l = rand_vec(1000, 2, 3.0);
        assert_ne!(run(&gpu, &l, &[], &sampled, 0), NONFINITE);
    }

    #[cfg_attr(test, test)]
    fn validate_refuses_degenerate_settings() {
        let ok = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            repetition_penalty: 1.1,
            ..Default::default()
        };
        ok.validate().unwrap();
        SamplingParams::default().validate().unwrap();
        for bad in [
            SamplingParams {
                temperature: 1e-38,
                ..ok
            },
            SamplingParams {
                temperature: -1.0,
                ..ok
            },
            SamplingParams {
                temperature: f32::NAN,
                ..ok
            },
            SamplingParams { top_p: 0.0, ..ok },
            SamplingParams { top_p: 1.5, ..ok },
            SamplingParams {
                repetition_penalty: 1e-45,
                ..ok
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..ok
            },
            SamplingParams {
                repetition_penalty: f32::INFINITY,
                ..ok
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[cfg_attr(test, test)]
    fn sampling_matches_reference() {
        let gpu = gpu();
        let l = rand_vec(49152, 8, 6.0);
        let seen: Vec<u32> = (0..200).map(|i| i * 7).collect();
        let cases = [
            SamplingParams {
                temperature: 0.8,
                seed: 42,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 40,
                seed: 1,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                seed: 3,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.2,
                top_k: 50,
                top_p: 0.5,
                repetition_penalty: 1.3,
                seed: 9,
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 1,
                seed: 5,
                ..Default::default()
            },
        ];
        for (i, s) in cases.iter().enumerate() {
            for counter in 0..3 {
                let got = run(&gpu, &l, &seen, s, counter);
                let want = reference(&l, &seen, s, counter);
                assert_eq!(got, want, "case {i} counter {counter}");
            }
        }
    }

    crate::kernels::checks::register![
        greedy_takes_the_first_maximum,
        non_finite_logits_give_no_token,
        validate_refuses_degenerate_settings,
        sampling_matches_reference,
    ];
}
