//! The sink guard (docs/POLICIES.md, `window-sinks` and `ccs-sinks`): a
//! policy's ranking, except that the positions where the residual stream
//! carries a massive activation are kept. Such positions (in SmolLM2 a space
//! or " the") act as secondary attention sinks: the development split's
//! diagnosis (EVAL.md) found one that would have received half of the later
//! attention the window evicts. They are found without attention weights,
//! from EpiKV's signal at its layer A, g(t) = ||h_A(t) - h_A(t-1)||: a
//! position whose residual state jumps far out and back again has both g(t)
//! and g(t+1) far above the usual jump.
//!
//! Rule: t (at or after the sinks) is a detected sink when
//! min(g(t), g(t+1)) > RATIO x the median of g over the last W positions up
//! to t + 1 (positions before the sinks left out). Detected sinks score
//! `f64::MAX`; every other entry keeps the inner policy's score. The ratio
//! was chosen on the development split (EVAL.md).

use anyhow::{bail, Result};
use std::collections::{HashSet, VecDeque};

use super::epikv::median;
use super::{RefreshContext, Scorer};
use crate::engine::{Engine, Signals};

/// How far above the median jump both jumps of a detected sink lie.
pub const RATIO: f64 = 2.0;

pub struct SinkGuard {
    inner: Box<dyn Scorer>,
    /// The tracked layer (1-based): EpiKV's layer A.
    layer: usize,
    ratio: f64,
    /// Positions before this one (the sinks) take no part.
    first: u32,
    window: usize,
    /// The last `window` values of g at or after `first`.
    history: VecDeque<f64>,
    /// The newest position and its g, waiting for the next one's.
    pending: Option<(u32, f64)>,
    /// Detected sinks that may still be cached.
    sinks: HashSet<u32>,
}

impl SinkGuard {
    /// Guards `inner`, which must track no layer of its own (the engine's
    /// tracked-layer output is the guard's alone).
    pub fn new(
        inner: Box<dyn Scorer>,
        layer: usize,
        ratio: f64,
        first: u32,
        window: usize,
    ) -> Result<Self> {
        if !inner.needs().track_layers.is_empty() {
            bail!("the sink guard needs a policy that tracks no layer itself");
        }
        if window == 0 {
            bail!("the sink guard's window must be at least 1");
        }
        Ok(SinkGuard {
            inner,
            layer,
            ratio,
            first,
            window,
            history: VecDeque::new(),
            pending: None,
            sinks: HashSet::new(),
        })
    }

    /// Takes position `pos`'s g; decides whether the position before it is a sink.
    fn push(&mut self, pos: u32, g: f64) {
        if pos >= self.first {
            self.history.push_back(g);
            if self.history.len() > self.window {
                self.history.pop_front();
            }
        }
        if let Some((t, gt)) = self.pending {
            if t + 1 == pos && t >= self.first {
                let mut values: Vec<f64> = self.history.iter().copied().collect();
                if gt.min(g) > self.ratio * median(&mut values) {
                    self.sinks.insert(t);
                }
            }
        }
        self.pending = Some((pos, g));
    }
}

impl Scorer for SinkGuard {
    fn needs(&self) -> Signals {
        let own = Signals {
            track_layers: vec![self.layer],
            ..Default::default()
        };
        self.inner.needs().and(own)
    }
    fn observe(&mut self, engine: &Engine, positions: &[u32]) -> Result<()> {
        let g = engine.read_layer_deltas(positions.len(), &[self.layer])?;
        for (&pos, &value) in positions.iter().zip(&g) {
            self.push(pos, value as f64);
        }
        self.inner.observe(engine, positions)
    }
    fn score(&mut self, engine: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        let present: HashSet<u32> = ctx.present.iter().map(|s| s.position).collect();
        self.sinks.retain(|p| present.contains(p));
        let mut scores = self.inner.score(engine, ctx)?;
        for (score, &i) in scores.iter_mut().zip(ctx.unprotected) {
            if self.sinks.contains(&ctx.present[i].position) {
                *score = f64::MAX;
            }
        }
        Ok(scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;
    impl Scorer for Nothing {
        fn score(&mut self, _: &mut Engine, _: &RefreshContext) -> Result<Vec<f64>> {
            Ok(vec![])
        }
    }

    fn guard(first: u32, window: usize) -> SinkGuard {
        SinkGuard::new(Box::new(Nothing), 1, 2.0, first, window).unwrap()
    }

    /// A jump out and back (two large g in a row) is a sink; a single large
    /// g (position 1 after a massive position 0, or a step change) is not;
    /// the sinks' own g stays out of the median.
    #[test]
    fn a_sink_is_a_jump_out_and_back() {
        let mut s = guard(2, 100);
        let g = [
            0.0, 500.0, 10.0, 11.0, 9.0, 50.0, 48.0, 10.0, 30.0, 10.0, 12.0,
        ];
        for (t, &v) in g.iter().enumerate() {
            s.push(t as u32, v);
        }
        // Position 5: g(5) = 50, g(6) = 48, median of g(2..=6) = 11: a sink.
        // Position 8: g(8) = 30 but g(9) = 10: a single jump, not a sink.
        // Position 1: before `first`, never a sink.
        assert_eq!(s.sinks, HashSet::from([5]));
    }

    /// The median is over the last W values only: a pair that stands out
    /// from the last 100 does not from the last 2 (itself).
    #[test]
    fn the_median_is_over_the_window() {
        let mut g = vec![10.0; 10];
        g.extend([40.0, 40.0, 10.0]);
        let mut wide = guard(0, 100);
        let mut narrow = guard(0, 2);
        for (t, &v) in g.iter().enumerate() {
            wide.push(t as u32, v);
            narrow.push(t as u32, v);
        }
        assert_eq!(wide.sinks, HashSet::from([10]));
        assert!(narrow.sinks.is_empty());
    }
}
