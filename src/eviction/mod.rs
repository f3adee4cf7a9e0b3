//! Eviction policies: each one scores the unprotected cache entries at a
//! refresh (higher = keep). Everything else (the schedule, protected entries,
//! ranking, the GPU compaction of K, V and slot data) is done once by
//! [`crate::cache::BoundedCache`], whatever the policy.

mod attention;
mod ccs;
pub mod epikv;
mod random;
mod window;

use anyhow::{bail, Result};

use crate::cache::CacheOptions;
use crate::engine::{CcsMode, Engine};
use crate::kernels::attn_weights::WeightMode;

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
    /// Decoder layers (1-based) whose EpiKV signal the engine must compute.
    fn tracked_layers(&self) -> Vec<usize> {
        vec![]
    }
    /// Whether the engine must prepare the counter-causal pass, and which.
    fn counter_causal(&self) -> Option<CcsMode> {
        None
    }
    /// Whether the engine must accumulate attention weights per slot, and how.
    fn attention_weights(&self) -> Option<WeightMode> {
        None
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
}

impl Policy {
    pub const ALL: [(&'static str, Policy); 9] = [
        ("full", Policy::Full),
        ("window", Policy::Window),
        ("random", Policy::Random),
        ("h2o", Policy::H2o),
        ("tova", Policy::Tova),
        ("epikv", Policy::Epikv),
        ("ccs", Policy::Ccs),
        ("ccs-full", Policy::CcsFull),
        ("epikv-robust", Policy::EpikvRobust),
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

    /// The scorer of this policy for a model of `num_layers` layers.
    pub fn scorer(self, opts: &CacheOptions, num_layers: usize) -> Result<Box<dyn Scorer>> {
        Ok(match self {
            Policy::Window => Box::new(window::Window),
            Policy::Random => Box::new(random::Random { seed: opts.seed }),
            Policy::H2o => Box::new(attention::AttentionWeights(WeightMode::Cumulative)),
            Policy::Tova => Box::new(attention::AttentionWeights(WeightMode::LastRow)),
            Policy::Ccs => Box::new(ccs::CounterCausalSurprise(CcsMode::Fast)),
            Policy::CcsFull => Box::new(ccs::CounterCausalSurprise(CcsMode::Full)),
            Policy::Epikv | Policy::EpikvRobust => {
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
                let (a, b) = epikv::bands(num_layers, opts.epikv_bands, opts.epikv_layers);
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
