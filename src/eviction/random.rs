//! `random`: seeded uniform scores, a control. The score of an entry is a hash
//! of (seed, refresh number, position), so a run is reproducible and does not
//! depend on how the work was batched.

use anyhow::Result;

use super::{RefreshContext, Scorer};
use crate::engine::Engine;

pub struct Random {
    pub seed: u64,
}

/// SplitMix64: a well-mixed 64-bit hash.
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

impl Scorer for Random {
    fn score(&mut self, _: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        Ok(ctx
            .unprotected
            .iter()
            .map(|&s| {
                let h = splitmix(
                    self.seed
                        ^ splitmix((ctx.refresh as u64) << 32 | ctx.present[s].position as u64),
                );
                (h >> 11) as f64 / (1u64 << 53) as f64
            })
            .collect())
    }
}
