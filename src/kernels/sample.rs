//! `shaders/sample.wgsl`: next-token choice on the GPU (greedy, temperature,
//! top-k, top-p, repetition, presence and frequency penalties, seeded),
//! among the tokens a constraint allows.

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
    /// OpenAI's presence penalty (0 = off): subtracted from the logit of
    /// every token sampled at least once in this generation.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty (0 = off): subtracted once per time the
    /// token was sampled in this generation.
    pub frequency_penalty: f32,
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
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
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
    /// OpenAI's range for the presence and frequency penalties.
    pub const PRESENCE_FREQUENCY_RANGE: (f32, f32) = (-2.0, 2.0);

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
        let (lo, hi) = Self::PRESENCE_FREQUENCY_RANGE;
        for (name, v) in [
            ("presence", self.presence_penalty),
            ("frequency", self.frequency_penalty),
        ] {
            if !(lo..=hi).contains(&v) {
                bail_kind!(
                    InvalidOptions,
                    "{name} penalty {v:?} is not in [{lo}, {hi}] (0 = off)"
                );
            }
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
    presence: f32,
    frequency: f32,
    top_logprobs: u32,
    _p1: u32,
}

/// How `Params` mirrors `SampleParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "SampleParams" in [shaders::SAMPLE] {
        vocab, row, top_k, seed, temperature, top_p, rep_penalty, counter, presence, frequency,
        top_logprobs, _p1
    })
}

/// What the sampler returns instead of a token when the logit row holds a
/// NaN or an infinity (`NONFINITE` in sample.wgsl).
pub const NONFINITE: u32 = u32::MAX;

/// The most top entries a choice reports with its log-probability
/// (`MAX_TOP` in sample.wgsl; OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Bytes of the sampler's result: the token, and what log-probabilities
/// it reports (sample.wgsl's binding 3).
pub const RESULT_BYTES: u64 = 4 * (4 + 2 * MAX_TOP_LOGPROBS as u64);

/// A sampled token's log-probability under the distribution it was drawn
/// from (after the allowed set, the penalties and the temperature; before
/// top-k and top-p), and the most likely tokens' (most likely first, ties
/// to the lower id).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// Reads the result words past the token (`RESULT_BYTES` layout).
    pub fn from_result(words: &[u32]) -> Option<TokenLogprobs> {
        let n = (*words.get(3)? as usize).min(MAX_TOP_LOGPROBS);
        let pairs = words.get(4..4 + 2 * n)?;
        Some(TokenLogprobs {
            logprob: f32::from_bits(words[2]),
            top: (pairs.chunks(2))
                .filter(|p| p[0] != NONFINITE)
                .map(|p| (p[0], f32::from_bits(p[1])))
                .collect(),
        })
    }
}

pub struct Sampler {
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    params: wgpu::Buffer,
    /// Bitmask of tokens seen so far (for the repetition penalty).
    pub seen: wgpu::Buffer,
    /// The chosen token id, `[1]` u32, or [`NONFINITE`].
    pub result: wgpu::Buffer,
    /// Bitmask of the tokens the next choice may take.
    allowed: wgpu::Buffer,
    /// Whether `allowed` holds every token (no constraint): kept so that an
    /// unconstrained generation writes it once, not every step.
    all_allowed: std::sync::atomic::AtomicBool,
    /// Times each token was chosen since `reset_seen` (the presence and
    /// frequency penalties).
    counts: wgpu::Buffer,
    /// 0: no log-probabilities; else 1 + the top entries reported.
    top_logprobs: std::sync::atomic::AtomicU32,
    vocab: u32,
}

impl Sampler {
    pub fn new(gpu: &Gpu, vocab: usize, logits: &wgpu::Buffer) -> Result<Self> {
        let pipeline = gpu.pipeline(&shaders::SAMPLE, None, "main", &[])?;
        let params = gpu.uniform("sample-params", &Params::zeroed());
        let seen = gpu.storage("seen", vocab.div_ceil(32) as u64 * 4);
        let result = gpu.storage("sampled", RESULT_BYTES);
        let words = vocab.div_ceil(32);
        let allowed = gpu.storage_from("allowed", &vec![u32::MAX; words]);
        let counts = gpu.storage("counts", vocab as u64 * 4);
        let group = gpu.bind_group(
            &pipeline,
            &[&params, logits, &seen, &result, &allowed, &counts],
        );
        Ok(Sampler {
            pipeline,
            group,
            params,
            seen,
            result,
            allowed,
            all_allowed: std::sync::atomic::AtomicBool::new(true),
            counts,
            top_logprobs: Default::default(),
            vocab: vocab as u32,
        })
    }

    /// Starts a generation: `tokens` (the prompt's) are the seen set of
    /// the repetition penalty, and no token has been chosen yet (the
    /// presence and frequency penalties).
    pub fn reset_seen(&self, gpu: &Gpu, tokens: &[u32]) {
        let mut mask = vec![0u32; (self.vocab as usize).div_ceil(32)];
        for &t in tokens {
            if t < self.vocab {
                mask[t as usize / 32] |= 1 << (t % 32);
            }
        }
        gpu.write(&self.seen, 0, bytemuck::cast_slice(&mask));
        gpu.write(
            &self.counts,
            0,
            bytemuck::cast_slice(&vec![0u32; self.vocab as usize]),
        );
    }

    /// The tokens the next choice may take: a bitmask of `ceil(vocab / 32)`
    /// words (bit `t % 32` of word `t / 32` for token t), or None for every
    /// token. A mask with no token set is refused: the shader would have
    /// nothing to choose.
    pub fn set_allowed(&self, gpu: &Gpu, mask: Option<&[u32]>) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let words = (self.vocab as usize).div_ceil(32);
        match mask {
            None if self.all_allowed.load(Relaxed) => {}
            None => {
                gpu.write(
                    &self.allowed,
                    0,
                    bytemuck::cast_slice(&vec![u32::MAX; words]),
                );
                self.all_allowed.store(true, Relaxed);
            }
            Some(mask) => {
                anyhow::ensure!(
                    mask.len() == words,
                    "a token mask of {} words for a vocabulary of {} tokens ({words} words)",
                    mask.len(),
                    self.vocab
                );
                anyhow::ensure!(
                    mask.iter().any(|&w| w != 0),
                    "the token mask allows no token"
                );
                gpu.write(&self.allowed, 0, bytemuck::cast_slice(mask));
                self.all_allowed.store(false, Relaxed);
            }
        }
        Ok(())
    }

    /// Whether each choice also reports log-probabilities, with how many
    /// top entries (None: no; at most `MAX_TOP_LOGPROBS`).
    pub fn set_logprobs(&self, top: Option<usize>) {
        let v = top.map_or(0, |n| 1 + n.min(MAX_TOP_LOGPROBS) as u32);
        self.top_logprobs
            .store(v, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes of `result` a choice fills: the token, and its
    /// log-probabilities when asked for.
    pub fn result_bytes(&self) -> u64 {
        match self.top_logprobs.load(std::sync::atomic::Ordering::Relaxed) {
            0 => 4,
            n => 16 + 8 * (n as u64 - 1),
        }
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
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            top_logprobs: self.top_logprobs.load(std::sync::atomic::Ordering::Relaxed),
            _p1: 0,
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

/// What the sampler knows besides the logits and the settings: the seen
/// set (repetition penalty), the times each token was chosen (presence and
/// frequency penalties) and the allowed set (None: every token).
#[derive(Clone, Copy, Default)]
pub struct History<'a> {
    pub seen: &'a [u32],
    /// (token, times chosen), tokens not listed chosen 0 times.
    pub counts: &'a [(u32, u32)],
    /// The ids of the tokens that may be chosen.
    pub allowed: Option<&'a [u32]>,
}

/// The logits as the sampler sees them (`adjusted` in sample.wgsl):
/// -infinity outside the allowed set, penalties, temperature.
fn adjusted(logits: &[f32], h: History, s: &SamplingParams) -> Vec<f64> {
    logits
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let i = i as u32;
            if h.allowed.is_some_and(|a| !a.contains(&i)) {
                return f64::NEG_INFINITY;
            }
            let mut x = x as f64;
            if s.repetition_penalty != 1.0 && h.seen.contains(&i) {
                x = if x > 0.0 {
                    x / s.repetition_penalty as f64
                } else {
                    x * s.repetition_penalty as f64
                };
            }
            if let Some(&(_, c)) = h.counts.iter().find(|(t, c)| *t == i && *c > 0) {
                x -= s.frequency_penalty as f64 * c as f64 + s.presence_penalty as f64;
            }
            if s.temperature > 0.0 {
                x /= s.temperature as f64;
            }
            x
        })
        .collect()
}

/// CPU reference with exact (sorted) top-k / top-p sets.
pub fn reference(logits: &[f32], h: History, s: &SamplingParams, counter: u32) -> u32 {
    let adj = adjusted(logits, h, s);
    let argmax = (0..adj.len()).fold(0, |b, i| if adj[i] > adj[b] { i } else { b });
    if s.temperature == 0.0 {
        return argmax as u32;
    }
    let m = adj[argmax];
    let mut order: Vec<usize> = (0..adj.len()).collect();
    order.sort_by(|&a, &b| adj[b].partial_cmp(&adj[a]).unwrap());
    let allowed = adj.iter().filter(|x| x.is_finite()).count();
    let mut keep = if s.top_k > 0 {
        (s.top_k as usize).min(allowed)
    } else {
        allowed
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
        .filter(|&&x| x >= thr && x.is_finite())
        .map(|x| (x - m).exp())
        .sum();
    let r = (pcg((s.seed ^ (s.seed >> 32)) as u32 ^ pcg(counter)) >> 8) as f64 / 16777216.0;
    let mut u = r * z;
    for (i, &x) in adj.iter().enumerate() {
        if x >= thr && x.is_finite() {
            let w = (x - m).exp();
            if u < w {
                return i as u32;
            }
            u -= w;
        }
    }
    argmax as u32
}

/// CPU reference of the log-probabilities a choice of `token` reports:
/// log-softmax of the adjusted logits (allowed set, penalties,
/// temperature), the top `n` by value then id.
pub fn reference_logprobs(
    logits: &[f32],
    h: History,
    s: &SamplingParams,
    token: u32,
    n: usize,
) -> TokenLogprobs {
    let adj = adjusted(logits, h, s);
    let m = adj.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + adj.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    let mut order: Vec<usize> = (0..adj.len()).filter(|&i| adj[i].is_finite()).collect();
    order.sort_by(|&a, &b| adj[b].partial_cmp(&adj[a]).unwrap().then(a.cmp(&b)));
    TokenLogprobs {
        logprob: (adj[token as usize] - lse) as f32,
        top: (order.iter().take(n))
            .map(|&i| (i as u32, (adj[i] - lse) as f32))
            .collect(),
    }
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    /// The bitmask of a set of token ids.
    pub(crate) fn bitmask(ids: &[u32], vocab: usize) -> Vec<u32> {
        let mut mask = vec![0u32; vocab.div_ceil(32)];
        for &t in ids {
            mask[t as usize / 32] |= 1 << (t % 32);
        }
        mask
    }

    fn run(gpu: &Gpu, logits: &[f32], h: History, s: &SamplingParams, counter: u32) -> u32 {
        let lb = gpu.storage_from("logits", logits);
        let sm = Sampler::new(gpu, logits.len(), &lb).unwrap();
        sm.reset_seen(gpu, h.seen);
        let mut counts = vec![0u32; logits.len()];
        for &(t, c) in h.counts {
            counts[t as usize] = c;
        }
        gpu.write(&sm.counts, 0, bytemuck::cast_slice(&counts));
        let mask = h.allowed.map(|a| bitmask(a, logits.len()));
        sm.set_allowed(gpu, mask.as_deref()).unwrap();
        sm.set_params(gpu, s, 0, counter);
        run_pass(gpu, |pass| sm.encode(pass));
        gpu.read::<u32>(&sm.result, 0, 1).unwrap()[0]
    }

    fn seen(ids: &[u32]) -> History<'_> {
        History {
            seen: ids,
            ..Default::default()
        }
    }

    #[cfg_attr(test, test)]
    fn greedy_takes_the_first_maximum() {
        let gpu = gpu();
        let mut l = rand_vec(1000, 1, 3.0);
        l[700] = 10.0;
        l[300] = 10.0;
        assert_eq!(run(&gpu, &l, seen(&[]), &SamplingParams::default(), 0), 300);
        // Length 1 and a penalty that moves the maximum.
        assert_eq!(
            run(&gpu, &[0.5], seen(&[]), &SamplingParams::default(), 0),
            0
        );
        let pen = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        assert_eq!(run(&gpu, &[4.0, 3.0, -1.0], seen(&[0]), &pen, 0), 1);
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
            ..Default::default()
        };
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0usize, 517, 999] {
                let mut l = rand_vec(1000, 2, 3.0);
                l[at] = bad;
                for s in [SamplingParams::default(), sampled] {
                    assert_eq!(run(&gpu, &l, seen(&[1]), &s, 0), NONFINITE, "{bad} at {at}");
                }
            }
        }
        let l = rand_vec(1000, 2, 3.0);
        assert_ne!(run(&gpu, &l, seen(&[]), &sampled, 0), NONFINITE);
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
            SamplingParams {
                presence_penalty: 2.5,
                ..ok
            },
            SamplingParams {
                frequency_penalty: -2.01,
                ..ok
            },
            SamplingParams {
                frequency_penalty: f32::NAN,
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
                ..Default::default()
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
                let h = History {
                    seen: &seen,
                    ..Default::default()
                };
                let got = run(&gpu, &l, h, s, counter);
                let want = reference(&l, h, s, counter);
                assert_eq!(got, want, "case {i} counter {counter}");
            }
        }
    }

    /// Random logits and allowed sets (one token, a few, most, scattered
    /// over an awkward vocabulary), with and without the penalties, in
    /// every mode: the GPU's choice is the reference's, and always allowed.
    #[cfg_attr(test, test)]
    fn masked_sampling_matches_reference() {
        let gpu = gpu();
        let vocab = 10_007;
        let l = rand_vec(vocab, 11, 6.0);
        let mut rng = 0x9e37_79b9u32;
        let mut pick = |n: usize| -> Vec<u32> {
            let mut ids: Vec<u32> = (0..n)
                .map(|_| {
                    rng = pcg(rng);
                    rng % vocab as u32
                })
                .collect();
            ids.sort_unstable();
            ids.dedup();
            ids
        };
        let sets = [
            vec![4321],
            pick(3),
            pick(60),
            pick(9000),
            vec![0, vocab as u32 - 1],
        ];
        let seen_ids = pick(500);
        let counts: Vec<(u32, u32)> = pick(300).into_iter().map(|t| (t, 1 + t % 4)).collect();
        let modes = [
            SamplingParams::GREEDY,
            SamplingParams {
                temperature: 0.9,
                seed: 4,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.1,
                top_k: 20,
                top_p: 0.8,
                repetition_penalty: 1.2,
                presence_penalty: 0.7,
                frequency_penalty: 0.4,
                seed: 8,
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 100,
                seed: 2,
                ..Default::default()
            },
        ];
        for (i, set) in sets.iter().enumerate() {
            for (j, s) in modes.iter().enumerate() {
                for counter in 0..2 {
                    let h = History {
                        seen: &seen_ids,
                        counts: &counts,
                        allowed: Some(set),
                    };
                    let got = run(&gpu, &l, h, s, counter);
                    let want = reference(&l, h, s, counter);
                    assert_eq!(got, want, "set {i} mode {j} counter {counter}");
                    assert!(set.contains(&got), "set {i} mode {j}: {got} is not allowed");
                }
            }
        }
        // One allowed token is chosen whatever its logit.
        let mut low = l.clone();
        low[4321] = -50.0;
        let only = History {
            allowed: Some(&[4321]),
            ..Default::default()
        };
        for s in &modes {
            assert_eq!(run(&gpu, &low, only, s, 0), 4321);
        }
        // An empty mask is refused before the shader sees it.
        let lb = gpu.storage_from("logits", &l);
        let sm = Sampler::new(&gpu, vocab, &lb).unwrap();
        assert!(sm
            .set_allowed(&gpu, Some(&vec![0; vocab.div_ceil(32)]))
            .is_err());
    }

    /// The presence and frequency penalties move the choice as OpenAI
    /// defines them, and count the tokens the sampler itself chose.
    #[cfg_attr(test, test)]
    fn presence_and_frequency_penalties_match_reference() {
        let gpu = gpu();
        let l = rand_vec(3001, 12, 4.0);
        let counts: Vec<(u32, u32)> = (0..3001u32).step_by(3).map(|t| (t, t % 5)).collect();
        for (presence, frequency) in [(1.5, 0.0), (0.0, 0.9), (-1.0, 2.0), (2.0, -0.5)] {
            for temperature in [0.0, 0.8] {
                let s = SamplingParams {
                    temperature,
                    presence_penalty: presence,
                    frequency_penalty: frequency,
                    seed: 6,
                    ..Default::default()
                };
                let h = History {
                    counts: &counts,
                    ..Default::default()
                };
                let (got, want) = (run(&gpu, &l, h, &s, 1), reference(&l, h, &s, 1));
                assert_eq!(
                    got, want,
                    "presence {presence} frequency {frequency} t {temperature}"
                );
            }
        }
        // The sampler counts its own choices: greedy with a large frequency
        // penalty on two near-equal maxima alternates between them.
        let mut l = vec![0.0f32; 64];
        l[10] = 5.0;
        l[20] = 4.9;
        let lb = gpu.storage_from("logits", &l);
        let sm = Sampler::new(&gpu, l.len(), &lb).unwrap();
        sm.reset_seen(&gpu, &[]);
        let s = SamplingParams {
            frequency_penalty: 0.2,
            ..Default::default()
        };
        let mut chosen = vec![];
        for counter in 0..4 {
            sm.set_params(&gpu, &s, 0, counter);
            run_pass(&gpu, |pass| sm.encode(pass));
            chosen.push(gpu.read::<u32>(&sm.result, 0, 1).unwrap()[0]);
        }
        assert_eq!(chosen, [10, 20, 10, 20]);
    }

    /// The reported log-probabilities against the reference: the chosen
    /// token's, and the top entries (ids and values), with a mask, the
    /// penalties and a temperature; 0, 5 and 20 top entries; fewer allowed
    /// tokens than entries asked for.
    #[cfg_attr(test, test)]
    fn logprobs_match_reference() {
        let gpu = gpu();
        let vocab = 5003;
        let l = rand_vec(vocab, 13, 5.0);
        let allowed: Vec<u32> = (0..vocab as u32).filter(|t| t % 7 != 3).collect();
        let few = [11u32, 400, 4999];
        let counts = [(5u32, 2u32), (17, 1)];
        let cases = [
            (SamplingParams::GREEDY, None, 5),
            (SamplingParams::GREEDY, Some(&few[..]), 20),
            (
                SamplingParams {
                    temperature: 0.7,
                    top_k: 30,
                    repetition_penalty: 1.3,
                    presence_penalty: 0.5,
                    frequency_penalty: 0.25,
                    seed: 3,
                    ..Default::default()
                },
                Some(&allowed[..]),
                20,
            ),
            (sampled_default(), None, 0),
        ];
        for (i, (s, allowed, n)) in cases.into_iter().enumerate() {
            let h = History {
                seen: &[5, 9, 17],
                counts: &counts,
                allowed,
            };
            let lb = gpu.storage_from("logits", &l);
            let sm = Sampler::new(&gpu, vocab, &lb).unwrap();
            sm.reset_seen(&gpu, h.seen);
            let mut c = vec![0u32; vocab];
            for &(t, k) in h.counts {
                c[t as usize] = k;
            }
            gpu.write(&sm.counts, 0, bytemuck::cast_slice(&c));
            let mask = h.allowed.map(|a| bitmask(a, vocab));
            sm.set_allowed(&gpu, mask.as_deref()).unwrap();
            sm.set_logprobs(Some(n));
            sm.set_params(&gpu, &s, 0, 1);
            run_pass(&gpu, |pass| sm.encode(pass));
            let words = gpu
                .read::<u32>(&sm.result, 0, RESULT_BYTES as usize / 4)
                .unwrap();
            let token = words[0];
            assert_eq!(token, reference(&l, h, &s, 1), "case {i}");
            let got = TokenLogprobs::from_result(&words).unwrap();
            let want = reference_logprobs(&l, h, &s, token, n);
            assert!(
                (got.logprob - want.logprob).abs() < 1e-4,
                "case {i}: {got:?} vs {want:?}"
            );
            assert_eq!(got.top.len(), want.top.len(), "case {i}");
            for ((gi, gv), (wi, wv)) in got.top.iter().zip(&want.top) {
                assert_eq!(gi, wi, "case {i}");
                assert!((gv - wv).abs() < 1e-4, "case {i}: {gv} vs {wv}");
            }
        }
    }

    /// At Qwen 2.5's vocabulary of 151,936, with top-k, top-p and 20 top
    /// entries, every pass of the shader stays inside lavapipe's 65,535
    /// iterations per invocation (past it an invocation is ended silently):
    /// the entries and the draw are still the reference's.
    #[cfg_attr(test, test)]
    fn logprobs_hold_at_a_large_vocabulary() {
        let gpu = gpu();
        let vocab = 151_936;
        let l = rand_vec(vocab, 14, 5.0);
        let s = SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.9,
            seed: 2,
            ..Default::default()
        };
        let lb = gpu.storage_from("logits", &l);
        let sm = Sampler::new(&gpu, vocab, &lb).unwrap();
        sm.reset_seen(&gpu, &[]);
        sm.set_logprobs(Some(MAX_TOP_LOGPROBS));
        sm.set_params(&gpu, &s, 0, 3);
        run_pass(&gpu, |pass| sm.encode(pass));
        let words = gpu
            .read::<u32>(&sm.result, 0, RESULT_BYTES as usize / 4)
            .unwrap();
        let h = History::default();
        assert_eq!(words[0], reference(&l, h, &s, 3));
        let got = TokenLogprobs::from_result(&words).unwrap();
        let want = reference_logprobs(&l, h, &s, words[0], MAX_TOP_LOGPROBS);
        assert_eq!(
            got.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            want.top.iter().map(|t| t.0).collect::<Vec<_>>()
        );
        assert!(
            (got.logprob - want.logprob).abs() < 1e-4,
            "{got:?} vs {want:?}"
        );
    }

    fn sampled_default() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            seed: 1,
            ..Default::default()
        }
    }

    crate::kernels::checks::register![
        logprobs_match_reference,
        logprobs_hold_at_a_large_vocabulary,
        masked_sampling_matches_reference,
        presence_and_frequency_penalties_match_reference,
        greedy_takes_the_first_maximum,
        non_finite_logits_give_no_token,
        validate_refuses_degenerate_settings,
        sampling_matches_reference,
    ];
}
