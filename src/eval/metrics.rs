//! The fidelity metrics of SPEC.md section 5, per position and across documents.
//!
//! Per position t (teacher forcing, the same tokens fed to the full cache and to
//! a policy): KL(full || policy) of the next-token distributions, whether the
//! two argmaxes agree, and the increase of the negative log-likelihood of the
//! true next token x_{t+1}. Conventions (those of ../shared/golden/eviction):
//! KL and top-1 over every position t >= C (C = J + h, the first refresh), the
//! NLL increase over t = C .. T-2 (the last position has no next token).

use serde::{Deserialize, Serialize};

/// log softmax of one row of logits, in f64 (vocabularies are large and the
/// KL of close distributions is a small difference of large sums).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&x| x as f64 - log_z).collect()
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// KL(p || q) in nats from log-probabilities.
pub fn kl_divergence(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                lp.exp() * (lp - lq)
            }
        })
        .sum()
}

/// Sums of the per-position metrics of one document under one policy.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FidelitySums {
    /// Positions compared for KL and top-1.
    pub positions: usize,
    pub kl_sum: f64,
    pub top1_agree: usize,
    /// Positions with a true next token (NLL).
    pub nll_positions: usize,
    pub nll_full_sum: f64,
    pub nll_policy_sum: f64,
}

impl FidelitySums {
    /// Adds one position: the two rows of logits and the true next token, if any.
    pub fn add(&mut self, full: &[f32], policy: &[f32], next_token: Option<u32>) {
        self.add_reference(&log_softmax(full), argmax(full), policy, next_token);
    }

    /// Adds one position given the reference's log-probabilities and argmax
    /// (computed once when several policies are compared with one reference).
    pub fn add_reference(
        &mut self,
        lp: &[f64],
        full_argmax: usize,
        policy: &[f32],
        next_token: Option<u32>,
    ) {
        let lq = log_softmax(policy);
        self.positions += 1;
        self.kl_sum += kl_divergence(lp, &lq);
        if full_argmax == argmax(policy) {
            self.top1_agree += 1;
        }
        if let Some(x) = next_token {
            self.nll_positions += 1;
            self.nll_full_sum -= lp[x as usize];
            self.nll_policy_sum -= lq[x as usize];
        }
    }

    pub fn mean_kl(&self) -> f64 {
        self.kl_sum / self.positions.max(1) as f64
    }
    pub fn top1_agreement(&self) -> f64 {
        self.top1_agree as f64 / self.positions.max(1) as f64
    }
    pub fn mean_nll_full(&self) -> f64 {
        self.nll_full_sum / self.nll_positions.max(1) as f64
    }
    pub fn mean_nll_increase(&self) -> f64 {
        (self.nll_policy_sum - self.nll_full_sum) / self.nll_positions.max(1) as f64
    }
}

/// Mean and 95% confidence interval of per-document values (Student's t with
/// n - 1 degrees of freedom; no interval for a single document).
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct MeanCi {
    pub mean: f64,
    /// Half-width of the 95% interval; None for fewer than two values.
    pub ci95: Option<f64>,
    pub n: usize,
}

pub fn mean_ci(values: &[f64]) -> MeanCi {
    let n = values.len();
    let mean = values.iter().sum::<f64>() / n.max(1) as f64;
    let ci95 = (n >= 2).then(|| {
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        t_quantile_975(n - 1) * (var / n as f64).sqrt()
    });
    MeanCi { mean, ci95, n }
}

/// The two-sided sign test of `lower` documents below and `higher` above
/// (ties left out): the probability, with each side equally likely, of a
/// split at least this uneven. Unlike the t interval it does not let one
/// document's large difference outweigh the rest.
pub fn sign_test_p(lower: usize, higher: usize) -> f64 {
    let n = lower + higher;
    let k = lower.max(higher);
    if n == 0 {
        return 1.0;
    }
    // ln C(n, i) - n ln 2, summed over the tail i >= k.
    let ln_choose =
        |i: usize| -> f64 { (1..=i).map(|j| ((n - i + j) as f64 / j as f64).ln()).sum() };
    let tail: f64 = (k..=n)
        .map(|i| (ln_choose(i) - n as f64 * 2f64.ln()).exp())
        .sum();
    (2.0 * tail).min(1.0)
}

/// The 97.5% quantile of Student's t distribution with `df` degrees of freedom.
fn t_quantile_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::NAN,
        1..=30 => TABLE[df - 1],
        31..=60 => 2.000 + (2.042 - 2.000) * (60 - df) as f64 / 30.0,
        61..=120 => 1.980 + (2.000 - 1.980) * (120 - df) as f64 / 60.0,
        _ => 1.960,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_position() {
        // full: logits ln(1), ln(2), ln(1) -> p = (1/4, 1/2, 1/4)
        // policy: uniform q = (1/3, 1/3, 1/3)
        let full = [0.0f32, 2f32.ln(), 0.0];
        let policy = [5.0f32, 5.0, 5.0];
        let mut s = FidelitySums::default();
        s.add(&full, &policy, Some(1));
        // KL = 1/4 ln(3/4) + 1/2 ln(3/2) + 1/4 ln(3/4)
        let kl = 0.5 * (0.75f64).ln() + 0.5 * (1.5f64).ln();
        assert!((s.mean_kl() - kl).abs() < 1e-7, "{} vs {kl}", s.mean_kl());
        // argmax: full 1, policy 0 (first of equal logits)
        assert_eq!(s.top1_agree, 0);
        // NLL of token 1: full -ln(1/2), policy -ln(1/3)
        let inc = 3f64.ln() - 2f64.ln();
        assert!((s.mean_nll_increase() - inc).abs() < 1e-7);
        // The same distribution: KL 0, agreement, no NLL change; no next token.
        s.add(&full, &[1.0, 1.0 + 2f32.ln(), 1.0], None);
        assert!((s.mean_kl() - kl / 2.0).abs() < 1e-7);
        assert_eq!((s.positions, s.top1_agree, s.nll_positions), (2, 1, 1));
        assert!((s.top1_agreement() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn kl_of_disjoint_support_is_finite_for_zero_mass() {
        let lp = [0.0, f64::NEG_INFINITY];
        let lq = [(0.5f64).ln(), (0.5f64).ln()];
        assert!((kl_divergence(&lp, &lq) - 2f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn sign_test_by_hand() {
        // 16 of 20 below: 2 (C(20,16) + C(20,17) + ... + C(20,20)) / 2^20
        // = 2 * 6196 / 1048576.
        assert!((sign_test_p(16, 4) - 2.0 * 6196.0 / 1048576.0).abs() < 1e-12);
        assert_eq!(sign_test_p(4, 16), sign_test_p(16, 4));
        // 3 of 3: 2 / 8; an even split and no documents: 1.
        assert!((sign_test_p(3, 0) - 0.25).abs() < 1e-12);
        assert_eq!(sign_test_p(10, 10), 1.0);
        assert_eq!(sign_test_p(0, 0), 1.0);
    }

    #[test]
    fn confidence_interval_by_hand() {
        // values 1, 2, 3: mean 2, sample sd 1, t(2) = 4.303 -> 4.303 / sqrt(3)
        let m = mean_ci(&[1.0, 2.0, 3.0]);
        assert_eq!(m.mean, 2.0);
        assert!((m.ci95.unwrap() - 4.303 / 3f64.sqrt()).abs() < 1e-9);
        assert_eq!(mean_ci(&[5.0]).ci95, None);
        assert!((t_quantile_975(1000) - 1.96).abs() < 1e-12);
    }
}
