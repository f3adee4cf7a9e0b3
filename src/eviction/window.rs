//! `window` (StreamingLLM): score = position, so the sinks and the newest
//! entries survive.

use anyhow::Result;

use super::{RefreshContext, Scorer};
use crate::engine::Engine;

pub struct Window;

impl Scorer for Window {
    fn score(&mut self, _: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        Ok(ctx
            .unprotected
            .iter()
            .map(|&s| ctx.present[s].position as f64)
            .collect())
    }
}
