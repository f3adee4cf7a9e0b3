//! `epikv`, the epiphany score (SPEC.md 4.1): how much the residual stream
//! changed from the previous position, in two layer bands, z-scored over a
//! causal rolling window; score s(t) = z_A(t) - z_B(t), higher = keep.
//!
//! The GPU computes g_l(t) = ||h_l(t) - h_l(t-1)|| inside the forward pass for
//! the tracked layers only (`shaders/epikv_delta.wgsl`); the host reads those few
//! floats after each step, keeps the last W values per layer and stores s(t)
//! for the cached entries. Nothing else is kept, and no extra pass runs.

use anyhow::Result;
use std::collections::{HashMap, VecDeque};

use super::{RefreshContext, Scorer};
use crate::engine::Engine;

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

pub struct Epikv {
    window: usize,
    band_a: Vec<usize>,
    band_b: Vec<usize>,
    /// The last `window` values of g for every tracked layer (A's, then B's).
    history: Vec<VecDeque<f64>>,
    /// s(t) of the entries that may still be cached, by position.
    scores: HashMap<u32, f64>,
}

impl Epikv {
    pub fn new(window: usize, band_a: Vec<usize>, band_b: Vec<usize>) -> Self {
        let n = band_a.len() + band_b.len();
        Epikv {
            window,
            band_a,
            band_b,
            history: vec![VecDeque::new(); n],
            scores: HashMap::new(),
        }
    }

    /// z of the newest value of one layer's window (population std).
    fn z(window: &VecDeque<f64>) -> f64 {
        let n = window.len() as f64;
        let mean = window.iter().sum::<f64>() / n;
        let var = window.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / n;
        (window.back().unwrap() - mean) / (var.sqrt() + 1e-6)
    }
}

impl Scorer for Epikv {
    fn tracked_layers(&self) -> Vec<usize> {
        self.band_a.iter().chain(&self.band_b).copied().collect()
    }

    fn observe(&mut self, engine: &Engine, positions: &[u32]) -> Result<()> {
        let n_tracked = self.history.len();
        let g = engine.read_layer_deltas(positions.len())?;
        let na = self.band_a.len();
        for (t, &pos) in positions.iter().enumerate() {
            let mut z = Vec::with_capacity(n_tracked);
            for (j, hist) in self.history.iter_mut().enumerate() {
                hist.push_back(g[t * n_tracked + j] as f64);
                if hist.len() > self.window {
                    hist.pop_front();
                }
                z.push(Self::z(hist));
            }
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            self.scores.insert(pos, mean(&z[..na]) - mean(&z[na..]));
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
}
