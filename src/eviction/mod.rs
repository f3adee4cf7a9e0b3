//! Eviction policies: each one scores the unprotected cache entries at a
//! refresh (higher = keep). Everything else (the schedule, protected entries,
//! ranking, the GPU compaction of K, V and slot data) is done once by
//! [`crate::cache::BoundedCache`], whatever the policy.

mod attention;
mod ccs;
pub mod epikv;
pub mod hybrid;
mod keys;
pub mod oracle;
mod queries;
mod random;
pub mod sinks;
mod window;

use anyhow::{bail, Result};

use crate::engine::{CcsMode, Engine, Signals};
use crate::kernels::attn_weights::WeightMode;
use crate::kernels::key_scores::KeyScore;
use crate::kernels::query_scores::{ExpectedAttention, QueryPolicy, SnapKv};

/// The policies' own parameters (`--seed`, `--epikv-window`,
/// `--epikv-bands`, `--epikv-layers`), and the cache's sinks, which EpiKV's
/// robust statistics and the sink guards leave out of their windows. The
/// cache options carry them (`CacheOptions::policy_params`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyParams {
    /// Seed of the `random` policy.
    pub seed: u64,
    /// EpiKV rolling z-score window W.
    pub epikv_window: usize,
    /// EpiKV: average z over whole layer bands instead of two representative layers.
    pub epikv_bands: bool,
    /// EpiKV: explicit (A, B) layers, 1-based.
    pub epikv_layers: Option<(usize, usize)>,
    /// Entries at positions 0..sinks, which the cache always keeps.
    pub sinks: usize,
    /// LagKV's partition size.
    pub lag_size: usize,
    /// SnapKV's observation window (queries).
    pub snapkv_window: usize,
    /// Expected Attention's query window and future positions.
    pub ea_window: usize,
    pub ea_future: usize,
}

/// One cache entry as the host tracks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Original position in the sequence (never renumbered).
    pub position: u32,
    pub token: u32,
}

/// What a scorer sees at a refresh.
pub struct RefreshContext<'a> {
    /// Refresh number, from 0.
    pub refresh: usize,
    /// The position of the token about to be appended.
    pub before_position: u32,
    /// The entries present, in slot order (= position order).
    pub present: &'a [Slot],
    /// Slot indices (into `present`) of the entries to score, ascending.
    pub unprotected: &'a [usize],
}

/// A policy's scoring rule (`Send`, so that a session can move to a worker thread).
pub trait Scorer: Send {
    /// What the engine must compute for this scorer besides the forward
    /// pass (EpiKV's layers, attention weights, the counter-causal pass).
    fn needs(&self) -> Signals {
        Signals::default()
    }
    /// Sees every step once it has run (`positions` of its tokens).
    fn observe(&mut self, _engine: &Engine, _positions: &[u32]) -> Result<()> {
        Ok(())
    }
    /// One score per entry of `ctx.unprotected`, higher = keep.
    fn score(&mut self, engine: &mut Engine, ctx: &RefreshContext) -> Result<Vec<f64>>;
    /// For a policy that scores each (layer, KV head) on its own (kvpress's
    /// presses), at layer or head granularity: every present slot's score
    /// in each head's keep list, `[layers, KV heads, present]`. None: the
    /// policy scores tokens, and `score` serves every keep list.
    fn score_heads(
        &mut self,
        _engine: &mut Engine,
        _ctx: &RefreshContext,
    ) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
}

/// The policies of SPEC.md section 4, then variants of them (defined in
/// docs/POLICIES.md; the SPEC ones stay exactly as specified).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Full,
    Window,
    Random,
    H2o,
    Tova,
    Epikv,
    Ccs,
    CcsFull,
    /// EpiKV with the sinks out of the rolling window and median/MAD z.
    EpikvRobust,
    /// Fast CCS without the entry's own residual stream in its readout.
    CcsContext,
    /// Rank mean of `epikv-robust` and recency (the window's score).
    EpikvRecency,
    /// Rank mean of `epikv-robust` and TOVA's last-query weight.
    EpikvTova,
    /// The window, keeping the residual stream's massive-activation positions.
    WindowSinks,
    /// Fast CCS, keeping the residual stream's massive-activation positions.
    CcsSinks,
    /// The next h queries' full-cache attention (fidelity only).
    Oracle,
    /// Every remaining query's full-cache attention (fidelity only).
    OracleRest,
    /// kvpress's KnormPress: keep the keys of smallest norm.
    Knorm,
    /// kvpress's KeyDiffPress: keep the keys least like the average key.
    Keydiff,
    /// kvpress's LagKVPress: rank each partition's entries by their spread
    /// against the next partition's range.
    Lagkv,
    /// kvpress's SnapKVPress: keep what the newest queries attend to.
    Snapkv,
    /// kvpress's ExpectedAttentionPress: keep what queries like the newest
    /// are expected to attend to, weighted by the value's norm.
    ExpectedAttention,
}

/// One policy's facts, one row each in [`POLICIES`].
struct PolicyRow {
    policy: Policy,
    /// As `--policy` takes it.
    name: &'static str,
    /// One of SPEC.md's eight (the others are the variants, the
    /// literature's policies and the oracles of docs/POLICIES.md).
    spec: bool,
    /// What a variant builds on: the SPEC policy it changes, or a hybrid's
    /// cheap part (whether EpiKV's signal adds to it).
    builds_on: Option<Policy>,
}

const fn row(
    policy: Policy,
    name: &'static str,
    spec: bool,
    builds_on: Option<Policy>,
) -> PolicyRow {
    PolicyRow {
        policy,
        name,
        spec,
        builds_on,
    }
}

/// Every policy: SPEC.md's eight, then the variants, the oracles and the
/// literature's policies.
const POLICIES: [PolicyRow; 21] = [
    row(Policy::Full, "full", true, None),
    row(Policy::Window, "window", true, None),
    row(Policy::Random, "random", true, None),
    row(Policy::H2o, "h2o", true, None),
    row(Policy::Tova, "tova", true, None),
    row(Policy::Epikv, "epikv", true, None),
    row(Policy::Ccs, "ccs", true, None),
    row(Policy::CcsFull, "ccs-full", true, None),
    row(
        Policy::EpikvRobust,
        "epikv-robust",
        false,
        Some(Policy::Epikv),
    ),
    row(Policy::CcsContext, "ccs-context", false, Some(Policy::Ccs)),
    row(
        Policy::EpikvRecency,
        "epikv-recency",
        false,
        Some(Policy::Window),
    ),
    row(Policy::EpikvTova, "epikv-tova", false, Some(Policy::Tova)),
    row(
        Policy::WindowSinks,
        "window-sinks",
        false,
        Some(Policy::Window),
    ),
    row(Policy::CcsSinks, "ccs-sinks", false, Some(Policy::Ccs)),
    row(Policy::Oracle, "oracle", false, None),
    row(Policy::OracleRest, "oracle-rest", false, None),
    row(Policy::Knorm, "knorm", false, None),
    row(Policy::Keydiff, "keydiff", false, None),
    row(Policy::Lagkv, "lagkv", false, None),
    row(Policy::Snapkv, "snapkv", false, None),
    row(Policy::ExpectedAttention, "expected-attention", false, None),
];

impl Policy {
    /// Every policy with its name, in the order of `POLICIES`.
    pub const ALL: [(&'static str, Policy); POLICIES.len()] = {
        let mut all = [("", Policy::Full); POLICIES.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = (POLICIES[i].name, POLICIES[i].policy);
            i += 1;
        }
        all
    };

    fn row(self) -> &'static PolicyRow {
        POLICIES
            .iter()
            .find(|r| r.policy == self)
            .expect("every policy has a row")
    }

    pub fn name(self) -> &'static str {
        self.row().name
    }

    pub fn parse(name: &str) -> Result<Policy> {
        match POLICIES.iter().find(|r| r.name == name) {
            Some(r) => Ok(r.policy),
            None => {
                let names: Vec<&str> = POLICIES.iter().map(|r| r.name).collect();
                bail!("unknown policy '{name}'; known: {}", names.join(", "))
            }
        }
    }

    /// Whether the policy is one of SPEC.md's eight (the rest are the
    /// variants and oracles of docs/POLICIES.md).
    pub fn is_spec(self) -> bool {
        self.row().spec
    }

    /// What a variant of docs/POLICIES.md builds on, the policy it is
    /// compared with to see what it adds: the SPEC policy it changes, or a
    /// hybrid's cheap part (whether EpiKV's signal adds to it); None for
    /// SPEC's policies and the oracles.
    pub fn builds_on(self) -> Option<Policy> {
        self.row().builds_on
    }

    /// Whether the policy reads the document's future (the oracles): only
    /// teacher-forced fidelity can run it.
    pub fn needs_future(self) -> bool {
        matches!(self, Policy::Oracle | Policy::OracleRest)
    }

    /// The scorer of this policy for a model of `num_layers` layers.
    pub fn scorer(self, opts: &PolicyParams, num_layers: usize) -> Result<Box<dyn Scorer>> {
        Ok(match self {
            Policy::CcsContext => Box::new(ccs::CounterCausalSurprise(CcsMode::FastContext)),
            Policy::EpikvRecency => Box::new(hybrid::RankMean(vec![
                Policy::EpikvRobust.scorer(opts, num_layers)?,
                Box::new(window::Window),
            ])),
            Policy::EpikvTova => Box::new(hybrid::RankMean(vec![
                Policy::EpikvRobust.scorer(opts, num_layers)?,
                Policy::Tova.scorer(opts, num_layers)?,
            ])),
            Policy::Oracle | Policy::OracleRest => bail!(
                "policy '{}' reads the document's future: only `sieve eval fidelity` runs it",
                self.name()
            ),
            Policy::Window => Box::new(window::Window),
            Policy::Random => Box::new(random::Random { seed: opts.seed }),
            Policy::H2o => Box::new(attention::AttentionWeights(WeightMode::Cumulative)),
            Policy::Tova => Box::new(attention::AttentionWeights(WeightMode::LastRow)),
            Policy::Ccs => Box::new(ccs::CounterCausalSurprise(CcsMode::Fast)),
            Policy::Knorm => Box::new(keys::KeyScorer(KeyScore::Norm)),
            Policy::Keydiff => Box::new(keys::KeyScorer(KeyScore::Diff)),
            Policy::Lagkv => {
                if opts.lag_size == 0 {
                    bail!("LagKV's lag size must be at least 1");
                }
                Box::new(keys::KeyScorer(KeyScore::Lag {
                    sinks: opts.sinks as u32,
                    lag: opts.lag_size.min(u32::MAX as usize / 4) as u32,
                }))
            }
            Policy::Snapkv => Box::new(queries::QueryScorer {
                policy: QueryPolicy::SnapKv(SnapKv {
                    window: opts.snapkv_window,
                    kernel: 5,
                }),
                sinks: 0,
            }),
            Policy::ExpectedAttention => Box::new(queries::QueryScorer {
                policy: QueryPolicy::ExpectedAttention(ExpectedAttention {
                    window: opts.ea_window,
                    future: opts.ea_future,
                }),
                sinks: opts.sinks.min(u32::MAX as usize) as u32,
            }),
            Policy::CcsFull => Box::new(ccs::CounterCausalSurprise(CcsMode::Full)),
            Policy::WindowSinks | Policy::CcsSinks => {
                let inner = match self {
                    Policy::WindowSinks => Policy::Window,
                    _ => Policy::Ccs,
                };
                // EpiKV's layer A (also with --epikv-bands: one layer is enough).
                epikv_layers(opts, num_layers)?;
                let (a, _) = epikv::bands(num_layers, false, opts.epikv_layers);
                Box::new(sinks::SinkGuard::new(
                    inner.scorer(opts, num_layers)?,
                    a[0],
                    sinks::RATIO,
                    opts.sinks as u32,
                    opts.epikv_window,
                )?)
            }
            Policy::Epikv | Policy::EpikvRobust => {
                let (a, b) = epikv_layers(opts, num_layers)?;
                let statistics = match self {
                    Policy::EpikvRobust => epikv::Statistics::Robust {
                        first: opts.sinks as u32,
                    },
                    _ => epikv::Statistics::MeanStd,
                };
                Box::new(epikv::Epikv::new(opts.epikv_window, statistics, a, b))
            }
            _ => bail!("policy '{}' never evicts and has no scorer", self.name()),
        })
    }
}

/// EpiKV's tracked layers (bands A and B) from the options, checked.
fn epikv_layers(opts: &PolicyParams, num_layers: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    if let Some((a, b)) = opts.epikv_layers {
        for l in [a, b] {
            if l == 0 || l > num_layers {
                bail!("EpiKV layer {l} is outside the model's layers 1..={num_layers}");
            }
        }
    }
    if opts.epikv_window == 0 {
        bail!("EpiKV window must be at least 1");
    }
    Ok(epikv::bands(
        num_layers,
        opts.epikv_bands,
        opts.epikv_layers,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every policy has one row (the match fails to compile when a policy
    /// is added without being listed here), its name parses back to it,
    /// SPEC's eight come first, and a variant builds on a SPEC policy.
    #[test]
    fn every_policy_has_one_row() {
        for (name, p) in Policy::ALL {
            let listed = match p {
                Policy::Full
                | Policy::Window
                | Policy::Random
                | Policy::H2o
                | Policy::Tova
                | Policy::Epikv
                | Policy::Ccs
                | Policy::CcsFull
                | Policy::EpikvRobust
                | Policy::CcsContext
                | Policy::EpikvRecency
                | Policy::EpikvTova
                | Policy::WindowSinks
                | Policy::CcsSinks
                | Policy::Oracle
                | Policy::OracleRest
                | Policy::Knorm
                | Policy::Keydiff
                | Policy::Lagkv
                | Policy::Snapkv
                | Policy::ExpectedAttention => p,
            };
            assert_eq!(POLICIES.iter().filter(|r| r.policy == listed).count(), 1);
            assert_eq!(Policy::parse(name).unwrap(), p);
            assert_eq!(p.name(), name);
            if let Some(base) = p.builds_on() {
                assert!(!p.is_spec() && base.is_spec(), "{name}");
            }
        }
        let spec: Vec<bool> = Policy::ALL.iter().map(|(_, p)| p.is_spec()).collect();
        assert_eq!(spec, [vec![true; 8], vec![false; 13]].concat());
        let e = Policy::parse("lru").unwrap_err().to_string();
        assert!(
            e.contains("unknown policy 'lru'") && e.contains("window"),
            "{e}"
        );
    }
}
