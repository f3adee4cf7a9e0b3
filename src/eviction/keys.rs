//! `knorm`, `keydiff` and `lagkv`: kvpress's KnormPress, KeyDiffPress and
//! LagKVPress, scores from the cached keys (and values) alone
//! (docs/POLICIES.md). Each (layer, KV head) scores every present entry on
//! the GPU at the refresh
//! (`shaders/key_scores.wgsl`); the cache's one kept set takes the mean
//! over layers and KV heads.

use anyhow::Result;

use super::{RefreshContext, Scorer};
use crate::engine::{Engine, Signals};
use crate::kernels::key_scores::KeyScore;

pub struct KeyScorer(pub KeyScore);

impl Scorer for KeyScorer {
    fn needs(&self) -> Signals {
        Signals {
            key_scores: Some(self.0),
            ..Default::default()
        }
    }

    fn score(&mut self, engine: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        let scores = engine.key_scores()?;
        if scores.len() != ctx.present.len() {
            anyhow::bail!(
                "the engine holds {} entries, the cache {}",
                scores.len(),
                ctx.present.len()
            );
        }
        Ok(ctx.unprotected.iter().map(|&i| scores[i] as f64).collect())
    }
}
