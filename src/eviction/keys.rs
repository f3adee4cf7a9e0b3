//! `knorm`, `keydiff` and `lagkv`: kvpress's KnormPress, KeyDiffPress and
//! LagKVPress, scores from the cached keys (and values) alone
//! (docs/POLICIES.md). Each (layer, KV head) scores every present entry on
//! the GPU at the refresh
//! (`shaders/key_scores.wgsl`); at token granularity the cache's one kept
//! set takes the mean over layers and KV heads, at layer granularity each
//! layer's mean, at head granularity each head's own.

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

    fn score_heads(
        &mut self,
        engine: &mut Engine,
        ctx: &RefreshContext,
    ) -> Result<Option<Vec<f32>>> {
        self.score(engine, ctx)?;
        Ok(Some(engine.read_key_scores_per_head(ctx.present.len())?))
    }
}
