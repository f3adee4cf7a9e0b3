//! `h2o` and `tova`: scores are attention weights, averaged over all query
//! heads and layers (SPEC.md 4). H2O sums the weight an entry received from
//! every query since it entered the cache (its own included); TOVA takes the
//! weight from the newest processed query. The engine recomputes the weights
//! from each query's log-sum-exp right after each layer's attention
//! (`shaders/attn_weights.wgsl`) and keeps one float per slot, compacted with
//! K and V; no score matrix exists.

use anyhow::Result;

use super::{RefreshContext, Scorer};
use crate::engine::{Engine, Signals};
use crate::kernels::attn_weights::WeightMode;

pub struct AttentionWeights(pub WeightMode);

impl Scorer for AttentionWeights {
    fn needs(&self) -> Signals {
        Signals {
            attention_weights: Some(self.0),
            ..Default::default()
        }
    }

    fn score(&mut self, engine: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        let w = engine.read_slot_attention(ctx.present.len())?;
        Ok(ctx.unprotected.iter().map(|&i| w[i] as f64).collect())
    }
}
