//! Eviction policies: each one scores the unprotected cache entries at a
//! refresh (higher = keep). Everything else (the schedule, protected entries,
//! ranking, the GPU compaction of K, V and slot data) is done once by
//! [`crate::cache::BoundedCache`], whatever the policy.

mod attention;
mod ccs;
pub mod epikv;
pub mod hybrid;
pub mod oracle;
mod random;
pub mod sinks;
mod window;

use anyhow::{bail, Result};

use crate::engine::{CcsMode, Engine, Signals};
use crate::kernels::attn_weights::WeightMode;

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
}

impl Policy {
    pub const ALL: [(&'static str, Policy); 16] = [
        ("full", Policy::Full),
        ("window", Policy::Window),
        ("random", Policy::Random),
        ("h2o", Policy::H2o),
        ("tova", Policy::Tova),
        ("epikv", Policy::Epikv),
        ("ccs", Policy::Ccs),
        ("ccs-full", Policy::CcsFull),
        ("epikv-robust", Policy::EpikvRobust),
        ("ccs-context", Policy::CcsContext),
        ("epikv-recency", Policy::EpikvRecency),
        ("epikv-tova", Policy::EpikvTova),
        ("window-sinks", Policy::WindowSinks),
        ("ccs-sinks", Policy::CcsSinks),
        ("oracle", Policy::Oracle),
        ("oracle-rest", Policy::OracleRest),
    ];

    pub fn name(self) -> &'static str {
        Policy::ALL
            .iter()
            .find(|(_, p)| *p == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }

    pub fn parse(name: &str) -> Result<Policy> {
        match Policy::ALL.iter().find(|(n, _)| *n == name) {
            Some((_, p)) => Ok(*p),
            None => {
                let names: Vec<&str> = Policy::ALL.iter().map(|(n, _)| *n).collect();
                bail!("unknown policy '{name}'; known: {}", names.join(", "))
            }
        }
    }

    /// Whether the policy is one of SPEC.md's eight (the rest are the
    /// variants and oracles of docs/POLICIES.md).
    pub fn is_spec(self) -> bool {
        Policy::ALL[..8].iter().any(|(_, p)| *p == self)
    }

    /// What a variant of docs/POLICIES.md builds on, the policy it is
    /// compared with to see what it adds: the SPEC policy it changes, or a
    /// hybrid's cheap part (whether EpiKV's signal adds to it); None for
    /// SPEC's policies and the oracles.
    pub fn builds_on(self) -> Option<Policy> {
        match self {
            Policy::EpikvRobust => Some(Policy::Epikv),
            Policy::CcsContext | Policy::CcsSinks => Some(Policy::Ccs),
            Policy::EpikvRecency | Policy::WindowSinks => Some(Policy::Window),
            Policy::EpikvTova => Some(Policy::Tova),
            _ => None,
        }
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
