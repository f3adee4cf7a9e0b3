//! `epikv`, the epiphany score (SPEC.md 4.1): how much the residual stream
//! changed from the previous position, in two layer bands, z-scored over a
//! causal rolling window; score s(t) = z_A(t) - z_B(t), higher = keep.
//!
//! The GPU computes g_l(t) = ||h_l(t) - h_l(t-1)|| inside the forward pass for
//! the tracked layers only (`shaders/epikv_delta.wgsl`); the host reads those few
//! floats after each step, keeps the last W values per layer and stores s(t)
//! for the cached entries. Nothing else is kept, and no extra pass runs.
//!
//! `epikv-robust` (not in SPEC.md; docs/POLICIES.md defines it) is the same
//! score with other window statistics: the sink positions stay out of the
//! window (position 1's delta carries position 0's massive activation), and
//! z is robust, `(g - median) / (1.4826 MAD + 1e-6)`, so that other outliers
//! do not flatten everyone else's z either.

use anyhow::Result;
use std::collections::{HashMap, VecDeque};

use super::{RefreshContext, Scorer};
use crate::engine::{Engine, Signals};

/// `layer(f) = floor(f * L + 0.5)`, as a 1-based decoder layer in 1..=L.
pub fn layer_at(fraction: f64, num_layers: usize) -> usize {
    ((fraction * num_layers as f64 + 0.5).floor() as usize).clamp(1, num_layers)
}

/// Tracked layers: (band A layers, band B layers), 1-based.
pub fn bands(
    num_layers: usize,
    whole_bands: bool,
    layers: Option<(usize, usize)>,
) -> (Vec<usize>, Vec<usize>) {
    if let Some((a, b)) = layers {
        return (vec![a], vec![b]);
    }
    if whole_bands {
        // The paper's 32-layer bands, 7..13 and 18..25, scaled to the model's depth.
        let band = |lo: f64, hi: f64| {
            (layer_at(lo / 32.0, num_layers)..=layer_at(hi / 32.0, num_layers)).collect()
        };
        (band(7.0, 13.0), band(18.0, 25.0))
    } else {
        (
            vec![layer_at(10.0 / 32.0, num_layers)],
            vec![layer_at(21.0 / 32.0, num_layers)],
        )
    }
}

/// How z is computed over a layer's rolling window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Statistics {
    /// SPEC.md 4.1: mean and population standard deviation over positions
    /// max(0, t - W + 1) .. t.
    MeanStd,
    /// `epikv-robust`: median and scaled median absolute deviation over the
    /// last W positions at or after `first`; positions before `first` (the
    /// sinks, never evicted) score 0 and stay out of the window.
    Robust { first: u32 },
}

pub struct Epikv {
    window: usize,
    statistics: Statistics,
    band_a: Vec<usize>,
    band_b: Vec<usize>,
    /// The last `window` values of g for every tracked layer (A's, then B's).
    history: Vec<VecDeque<f64>>,
    /// s(t) of the entries that may still be cached, by position.
    scores: HashMap<u32, f64>,
}

impl Epikv {
    pub fn new(
        window: usize,
        statistics: Statistics,
        band_a: Vec<usize>,
        band_b: Vec<usize>,
    ) -> Self {
        let n = band_a.len() + band_b.len();
        Epikv {
            window,
            statistics,
            band_a,
            band_b,
            history: vec![VecDeque::new(); n],
            scores: HashMap::new(),
        }
    }

    /// The tracked layers, 1-based: band A, then band B.
    fn layers(&self) -> Vec<usize> {
        self.band_a.iter().chain(&self.band_b).copied().collect()
    }

    /// z of the newest value of one layer's window (population std).
    fn z(window: &VecDeque<f64>) -> f64 {
        let n = window.len() as f64;
        let mean = window.iter().sum::<f64>() / n;
        let var = window.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / n;
        (window.back().unwrap() - mean) / (var.sqrt() + 1e-6)
    }

    /// Takes position `pos`'s g of every tracked layer (A's, then B's) and
    /// stores its score.
    fn push(&mut self, pos: u32, g: &[f64]) {
        if let Statistics::Robust { first } = self.statistics {
            if pos < first {
                self.scores.insert(pos, 0.0);
                return;
            }
        }
        let mut z = Vec::with_capacity(g.len());
        for (hist, &value) in self.history.iter_mut().zip(g) {
            hist.push_back(value);
            if hist.len() > self.window {
                hist.pop_front();
            }
            z.push(match self.statistics {
                Statistics::MeanStd => Self::z(hist),
                Statistics::Robust { .. } => Self::robust_z(hist),
            });
        }
        let na = self.band_a.len();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        self.scores.insert(pos, mean(&z[..na]) - mean(&z[na..]));
    }

    /// Robust z of the newest value: (g - median) / (1.4826 MAD + 1e-6);
    /// 1.4826 MAD estimates the standard deviation of normal data.
    fn robust_z(window: &VecDeque<f64>) -> f64 {
        let mut values: Vec<f64> = window.iter().copied().collect();
        let m = median(&mut values);
        let mut deviations: Vec<f64> = window.iter().map(|g| (g - m).abs()).collect();
        let mad = median(&mut deviations);
        (window.back().unwrap() - m) / (1.4826 * mad + 1e-6)
    }
}

/// The median of `v` (sorted in place; the mean of the middle two for an
/// even count). `v` must not be empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl Scorer for Epikv {
    fn needs(&self) -> Signals {
        Signals {
            track_layers: self.layers(),
            ..Default::default()
        }
    }

    fn observe(&mut self, engine: &Engine, positions: &[u32]) -> Result<()> {
        let n_tracked = self.history.len();
        // By layer, not by column: a hybrid's engine tracks the union of its
        // parts' layers, sorted and without repeats.
        let g = engine.read_layer_deltas(positions.len(), &self.layers())?;
        for (t, &pos) in positions.iter().enumerate() {
            let row: Vec<f64> = g[t * n_tracked..][..n_tracked]
                .iter()
                .map(|&v| v as f64)
                .collect();
            self.push(pos, &row);
        }
        Ok(())
    }

    fn score(&mut self, _: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        // Entries evicted at earlier refreshes are gone for good: forget their scores.
        let present: std::collections::HashSet<u32> =
            ctx.present.iter().map(|s| s.position).collect();
        self.scores.retain(|p, _| present.contains(p));
        ctx.unprotected
            .iter()
            .map(|&i| {
                let p = ctx.present[i].position;
                self.scores
                    .get(&p)
                    .copied()
                    .ok_or_else(|| anyhow::anyhow!("epikv: no score for position {p}"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_follow_the_spec_fractions() {
        assert_eq!(bands(30, false, None), (vec![9], vec![20]));
        assert_eq!(bands(3, false, None), (vec![1], vec![2]));
        assert_eq!(bands(4, false, None), (vec![1], vec![3]));
        assert_eq!(
            bands(32, true, None),
            ((7..=13).collect(), (18..=25).collect())
        );
        assert_eq!(bands(32, false, Some((5, 6))), (vec![5], vec![6]));
    }

    #[test]
    fn z_score_uses_the_population_std() {
        let w: VecDeque<f64> = [0.0, 2.0, 4.0].into_iter().collect();
        // mean 2, population std sqrt(8/3)
        assert!((Epikv::z(&w) - 2.0 / ((8.0f64 / 3.0).sqrt() + 1e-6)).abs() < 1e-12);
        let one: VecDeque<f64> = [5.0].into_iter().collect();
        assert_eq!(Epikv::z(&one), 0.0);
    }

    /// Robust z by hand: median and MAD of an even and an odd window, and an
    /// outlier that the mean/std z lets flatten everything else.
    #[test]
    fn robust_z_uses_median_and_mad() {
        // [1, 2, 4, 10]: median 3, deviations [2, 1, 1, 7] -> MAD 1.5.
        let w: VecDeque<f64> = [1.0, 2.0, 4.0, 10.0].into_iter().collect();
        let want = (10.0 - 3.0) / (1.4826 * 1.5 + 1e-6);
        assert!((Epikv::robust_z(&w) - want).abs() < 1e-12);
        // [3, 9, 5]: median 5, deviations [2, 4, 0] -> MAD 2.
        let w: VecDeque<f64> = [3.0, 9.0, 5.0].into_iter().collect();
        assert!((Epikv::robust_z(&w) - 0.0).abs() < 1e-12);
        // One huge value early in the window: the newest ordinary spike keeps
        // a large robust z, while the mean/std z of it shrinks.
        let mut w: VecDeque<f64> = (0..20).map(|i| 1.0 + 0.1 * (i % 3) as f64).collect();
        w[0] = 1e4;
        w.push_back(2.0);
        assert!(Epikv::robust_z(&w) > 5.0, "{}", Epikv::robust_z(&w));
        assert!(Epikv::z(&w).abs() < 0.5, "{}", Epikv::z(&w));
    }

    /// The robust variant keeps sink positions out of the window and gives
    /// them 0; the SPEC statistics see every position.
    #[test]
    fn robust_windows_skip_the_sinks() {
        let mut e = Epikv::new(4, Statistics::Robust { first: 2 }, vec![1], vec![2]);
        let mut spec = Epikv::new(4, Statistics::MeanStd, vec![1], vec![2]);
        // g per position for (layer A, layer B): position 1 is massive.
        let g = [
            (0.0, 0.0),
            (500.0, 400.0),
            (1.0, 2.0),
            (3.0, 1.0),
            (2.0, 2.0),
        ];
        for (pos, &(a, b)) in g.iter().enumerate() {
            e.push(pos as u32, &[a, b]);
            spec.push(pos as u32, &[a, b]);
        }
        assert_eq!(e.scores[&0], 0.0);
        assert_eq!(e.scores[&1], 0.0);
        assert_eq!(e.history[0], [1.0, 3.0, 2.0]);
        assert_eq!(spec.history[0], [500.0, 1.0, 3.0, 2.0]);
        // Position 3: window A [1, 3] -> median 2, MAD 1; B [2, 1] -> 1.5, 0.5.
        let za = (3.0 - 2.0) / (1.4826 + 1e-6);
        let zb = (1.0 - 1.5) / (1.4826 * 0.5 + 1e-6);
        assert!((e.scores[&3] - (za - zb)).abs() < 1e-9);
    }
}
