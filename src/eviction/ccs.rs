//! `ccs` and `ccs-full`, counter-causal surprise (SPEC.md 4.2): a cached token
//! is worth keeping when the tokens after it cannot predict it. At a refresh,
//! each unprotected entry's query attends only the entries after it (an
//! anti-causal mask over the cache, flash-style, no score matrix); the result
//! runs through the rest of the layer (fast: only the last layer, from the
//! stored residual stream entering it; full: every layer, from the token
//! embedding), then the final norm, and is dotted with the LM-head row of the
//! entry's own token. Score = -logit: predictable entries go first.

use anyhow::Result;

use super::{RefreshContext, Scorer};
use crate::engine::{CcsMode, Engine, Signals};

pub struct CounterCausalSurprise(pub CcsMode);

impl Scorer for CounterCausalSurprise {
    fn needs(&self) -> Signals {
        Signals {
            counter_causal: Some(self.0),
            ..Default::default()
        }
    }

    fn score(&mut self, engine: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        let entries: Vec<(u32, u32, u32)> = ctx
            .unprotected
            .iter()
            .map(|&i| (i as u32, ctx.present[i].position, ctx.present[i].token))
            .collect();
        let logits = engine.counter_causal_logits(&entries)?;
        Ok(logits.iter().map(|&l| -(l as f64)).collect())
    }
}
