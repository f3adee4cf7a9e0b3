//! Hybrids (docs/POLICIES.md): an attention-free score combined with a cheap
//! second opinion by rank fusion. Each part ranks the unprotected entries;
//! a rank becomes a fraction in [0, 1] (lowest 0, highest 1, ties share
//! their mean rank), and the hybrid's score is the mean of the parts'
//! fractions. Ranks, not raw scores, because the parts live on unrelated
//! scales (z-scores, positions, attention weights) and ranks need no
//! per-model calibration.

use anyhow::Result;

use super::{RefreshContext, Scorer};
use crate::engine::{Engine, Signals};

pub struct RankMean(pub Vec<Box<dyn Scorer>>);

/// Each score's rank among `scores` as a fraction: 0 for the lowest, 1 for
/// the highest, tied scores share the mean of their ranks; one score is 1.
pub fn rank_fractions(scores: &[f64]) -> Vec<f64> {
    let n = scores.len();
    if n <= 1 {
        return vec![1.0; n];
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let mut out = vec![0.0; n];
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j + 1 < n && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        let mean_rank = (i + j) as f64 / 2.0;
        for &k in &order[i..=j] {
            out[k] = mean_rank / (n - 1) as f64;
        }
        i = j + 1;
    }
    out
}

impl Scorer for RankMean {
    // The union of its parts' layers; a hybrid combines at most one part
    // of each other kind (Policy::scorer builds them), so the first part
    // that asks decides.
    fn needs(&self) -> Signals {
        self.0
            .iter()
            .fold(Signals::default(), |all, s| all.and(s.needs()))
    }
    fn observe(&mut self, engine: &Engine, positions: &[u32]) -> Result<()> {
        for s in &mut self.0 {
            s.observe(engine, positions)?;
        }
        Ok(())
    }
    fn score(&mut self, engine: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        let mut sum = vec![0.0; ctx.unprotected.len()];
        for s in &mut self.0 {
            for (acc, r) in sum.iter_mut().zip(rank_fractions(&s.score(engine, ctx)?)) {
                *acc += r;
            }
        }
        let parts = self.0.len().max(1) as f64;
        Ok(sum.into_iter().map(|s| s / parts).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_fractions_with_shared_ties() {
        assert_eq!(rank_fractions(&[]), Vec::<f64>::new());
        assert_eq!(rank_fractions(&[-3.0]), vec![1.0]);
        assert_eq!(rank_fractions(&[5.0, -1.0, 2.0]), vec![1.0, 0.0, 0.5]);
        // 2.0 twice: ranks 1 and 2 -> 1.5 of 4.
        assert_eq!(
            rank_fractions(&[2.0, 9.0, 2.0, -4.0, 10.0]),
            vec![0.375, 0.75, 0.375, 0.0, 1.0]
        );
    }
}
