//! `oracle` and `oracle-rest` (docs/POLICIES.md): an upper reference for the
//! others, not a policy a generator can run. At a refresh before position
//! P they keep the entries that the future queries will attend to most in
//! the full-cache run: the next h queries (positions P..P+h) for `oracle`,
//! every remaining query of the document for `oracle-rest`; attention is
//! averaged over layers and query heads, as H2O's. They need the document's
//! future, so only teacher-forced fidelity (`sieve eval fidelity`, which
//! runs the full cache once first to record it) builds them.

use anyhow::{bail, Result};
use std::sync::Arc;

use super::{RefreshContext, Scorer};
use crate::engine::Engine;

/// The attention each position receives in the full-cache run, summed over
/// queries, at every `step` positions: `cumulative[k][p]` is the total
/// attention position p received from the queries at positions `0..k*step`
/// (the last row: from every query of the document, at `len`).
#[derive(Clone, Debug, Default)]
pub struct FutureAttention {
    pub step: usize,
    pub len: usize,
    pub cumulative: Vec<Vec<f32>>,
}

impl FutureAttention {
    /// The row of the queries before `position` (a multiple of `step`, or the
    /// document's length).
    fn before(&self, position: usize) -> Result<&[f32]> {
        let k = if position >= self.len {
            self.cumulative.len() - 1
        } else if position.is_multiple_of(self.step) {
            position / self.step
        } else {
            bail!(
                "the oracle's record has a row every {} positions, not at {position}",
                self.step
            )
        };
        Ok(&self.cumulative[k])
    }

    /// Attention received by `positions` from the queries at `from..to`.
    pub fn received(&self, positions: &[u32], from: usize, to: usize) -> Result<Vec<f64>> {
        let (a, b) = (self.before(from)?, self.before(to.min(self.len))?);
        Ok(positions
            .iter()
            .map(|&p| {
                let p = p as usize;
                b.get(p).copied().unwrap_or(0.0) as f64 - a.get(p).copied().unwrap_or(0.0) as f64
            })
            .collect())
    }
}

/// How far ahead the oracle looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Horizon {
    /// The next `n` queries.
    Next(usize),
    /// Every remaining query of the document.
    Rest,
}

pub struct Oracle {
    pub future: Arc<FutureAttention>,
    pub horizon: Horizon,
}

impl Scorer for Oracle {
    fn score(&mut self, _: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        let from = ctx.before_position as usize;
        let to = match self.horizon {
            Horizon::Next(n) => from + n,
            Horizon::Rest => self.future.len,
        };
        let positions: Vec<u32> = ctx
            .unprotected
            .iter()
            .map(|&i| ctx.present[i].position)
            .collect();
        self.future.received(&positions, from, to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn received_attention_is_a_difference_of_rows() {
        // 5 positions, a row every 2 queries: before 0, 2, 4 and at the end (5).
        let f = FutureAttention {
            step: 2,
            len: 5,
            cumulative: vec![
                vec![0.0; 5],
                vec![1.5, 0.5, 0.0, 0.0, 0.0],
                vec![2.0, 1.0, 0.6, 0.4, 0.0],
                vec![2.5, 1.1, 0.7, 0.5, 0.2],
            ],
        };
        let close = |a: Vec<f64>, b: &[f64]| {
            assert!(
                a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6),
                "{a:?} vs {b:?}"
            )
        };
        close(f.received(&[0, 1, 3], 2, 4).unwrap(), &[0.5, 0.5, 0.4]);
        // Past the end counts to the end; a position outside the record gets 0.
        close(f.received(&[1, 4, 9], 4, 6).unwrap(), &[0.1, 0.2, 0.0]);
        close(f.received(&[0], 0, 5).unwrap(), &[2.5]);
        assert!(f.received(&[0], 3, 4).is_err());
    }
}
