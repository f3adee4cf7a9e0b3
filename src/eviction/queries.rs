//! `snapkv` and `expected-attention`: kvpress's SnapKVPress and
//! ExpectedAttentionPress, scores from the recent queries
//! (docs/POLICIES.md). The engine keeps every layer's last queries in a
//! ring; at a refresh the window of the newest ones scores the entries
//! (`shaders/query_scores.wgsl`): SnapKV by the attention the window pays
//! each older entry, Expected Attention by the attention queries with the
//! window's statistics are expected to pay each entry after the sinks. At
//! token granularity the cache's one kept set takes the mean over layers
//! and KV heads, at layer granularity each layer's mean, at head
//! granularity each head's own. The slot ranges come from keep list 0's
//! positions; they hold for every list (the sinks and the window's entries
//! sit in the same slots of each: `CacheOptions::validate`).

use anyhow::Result;

use super::{RefreshContext, Scorer};
use crate::engine::{Engine, Signals};
use crate::kernels::query_scores::{QueryPolicy, QueryWindow};

pub struct QueryScorer {
    pub policy: QueryPolicy,
    /// Expected Attention: entries at positions below this are the sinks,
    /// neither scored nor among the window's queries.
    pub sinks: u32,
}

impl Scorer for QueryScorer {
    fn needs(&self) -> Signals {
        Signals {
            queries: Some(self.policy),
            ..Default::default()
        }
    }

    fn score(&mut self, engine: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>> {
        let Some(w) = self.window(ctx) else {
            return Ok(vec![0.0; ctx.unprotected.len()]);
        };
        let scores = engine.query_scores(w)?;
        Ok(ctx.unprotected.iter().map(|&i| scores[i] as f64).collect())
    }

    fn score_heads(
        &mut self,
        engine: &mut Engine,
        ctx: &RefreshContext,
    ) -> Result<Option<Vec<f32>>> {
        let n = ctx.present.len();
        let Some(w) = self.window(ctx) else {
            let cells = engine.model.config.num_layers * engine.model.heads().n_kv;
            return Ok(Some(vec![0.0; cells * n]));
        };
        engine.query_scores(w)?;
        Ok(Some(engine.read_query_scores_per_head(n)?))
    }
}

impl QueryScorer {
    /// The refresh's window of queries and scored slots; None before any
    /// query the window may take.
    fn window(&self, ctx: &RefreshContext) -> Option<QueryWindow> {
        // The window: the newest queries, all of them fed through this
        // engine (positions 0 .. before_position); Expected Attention's
        // leave out the sinks' positions.
        let before = ctx.before_position;
        let oldest = match self.policy {
            QueryPolicy::SnapKv(_) => 0,
            QueryPolicy::ExpectedAttention(_) => self.sinks.min(before),
        };
        let queries = (self.policy.window() as u32).min(before - oldest);
        if queries == 0 {
            return None;
        }
        let below = |p: u32| ctx.present.iter().take_while(|s| s.position < p).count() as u32;
        let n = ctx.present.len() as u32;
        let (first, end) = match self.policy {
            // The entries older than the window.
            QueryPolicy::SnapKv(_) => (0, below(before - queries)),
            // The entries after the sinks.
            QueryPolicy::ExpectedAttention(_) => (below(self.sinks), n),
        };
        Some(QueryWindow {
            n,
            first,
            end,
            queries,
            last_pos: before - 1,
            _p: [0; 3],
        })
    }
}
