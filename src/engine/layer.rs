//! One decoder layer's kernels, bound once, and the layer sequence, written
//! once for the forward step and the counter-causal pass alike.

use crate::kernels::attention::Attention;
use crate::kernels::attn_weights::AttnWeights;
use crate::kernels::head_norm::HeadNorm;
use crate::kernels::matmul::Matmul;
use crate::kernels::query_scores::KeepQueries;
use crate::kernels::rmsnorm::RmsNorm;
use crate::kernels::rope_kv::RopeKv;
use crate::kernels::silu_mul::SiluMul;

pub(super) struct LayerKernels {
    pub attn_norm: RmsNorm,
    pub qkv: Matmul,
    /// The per-head norms of q and k, in the families that have them.
    pub qk_norm: Option<HeadNorm>,
    pub rope: RopeKv,
    pub attn: Attention,
    pub o: Matmul,
    pub mlp_norm: RmsNorm,
    pub gate_up: Matmul,
    pub silu: SiluMul,
    pub down: Matmul,
    /// The sandwich norms of the attention and MLP outputs, which add them
    /// to the residual (the o and down products then write `xn`).
    pub post_norms: Option<(RmsNorm, RmsNorm)>,
}

/// How a layer's attention reads the cache.
#[derive(Clone, Copy)]
pub(super) enum LayerAttention<'a> {
    /// The forward step: the step's rows are written to the cache from slot
    /// `start` on and attend causally; `weights` accumulates the attention
    /// each slot receives (H2O, TOVA); `queries` keeps the queries
    /// (SnapKV's after RoPE, Expected Attention's before).
    Causal {
        start: u32,
        weights: Option<&'a AttnWeights>,
        queries: Option<KeepQueries<'a>>,
    },
    /// The counter-causal pass: k/v go to scratch (`rope`), never to the
    /// cache, and each query attends the entries after it among `n_present`.
    /// `o`: an output projection to use instead of the layer's own.
    AntiCausal {
        rope: &'a RopeKv,
        n_present: u32,
        o: Option<&'a OutputWithoutResidual>,
    },
    /// A step several sequences share (`Batch`): each sequence's RoPE and
    /// attention, bound to its own cache and its own `Step` (whose row0
    /// places its rows), over its rows, causally as `Causal`.
    Batch(&'a [SeqAttention<'a>]),
}

/// An attention output that replaces the residual stream instead of adding
/// to it (the `ccs-context` pass): the output projection writing `x`, or
/// with a sandwich norm writing `xn` and the norm (not accumulating) `x`.
pub(super) struct OutputWithoutResidual {
    pub o: Matmul,
    pub norm: Option<RmsNorm>,
}

/// One sequence's attention kernels of one layer in a batched step.
pub(super) struct SeqAttention<'a> {
    pub rope: &'a RopeKv,
    pub attn: &'a Attention,
    pub weights: Option<&'a AttnWeights>,
    pub queries: Option<KeepQueries<'a>>,
    /// Its tokens in the step, and the cache slot of the first.
    pub n: u32,
    pub start: u32,
}

impl LayerKernels {
    /// One decoder layer over `n` rows of the residual stream. The layer
    /// sequence is written here only, for the forward step and the
    /// counter-causal pass alike, so a kernel variant or a fusion changes both.
    /// `mark` labels the kernel just encoded (per-kernel timestamps).
    pub fn encode(
        &self,
        p: &mut wgpu::ComputePass,
        n: u32,
        attention: LayerAttention,
        mark: &mut dyn FnMut(&mut wgpu::ComputePass, &'static str),
    ) {
        // The RMSNorms and the SwiGLU are folded into the mat-vecs after them
        // where the kernel set does that (decode with the `gpu` kernels).
        if !(n == 1 && self.qkv.fuses_input) {
            self.attn_norm.encode(p, n);
            mark(p, "rmsnorm");
        }
        self.qkv.encode(p, n);
        mark(p, "qkv matmul");
        if let Some(norm) = &self.qk_norm {
            norm.encode(p, n);
            mark(p, "q/k norm");
        }
        let mut own_output = None;
        match attention {
            LayerAttention::Causal {
                start,
                weights,
                queries,
            } => {
                if let Some(keep) = queries.filter(|k| k.before_rope()) {
                    keep.encode(p, n);
                    mark(p, "query ring (expected attention)");
                }
                self.rope.encode(p, n, start);
                mark(p, "rope + kv write");
                if let Some(keep) = queries.filter(|k| !k.before_rope()) {
                    keep.encode(p, n);
                    mark(p, "query ring (snapkv)");
                }
                self.attn.encode(p, n, start);
                mark(p, "attention");
                if let Some(w) = weights {
                    w.encode_accumulate(p, n, start);
                    mark(p, "attention weights (h2o/tova)");
                }
            }
            LayerAttention::Batch(seqs) => {
                for s in seqs {
                    if let Some(keep) = s.queries.filter(|k| k.before_rope()) {
                        keep.encode(p, s.n);
                    }
                    s.rope.encode(p, s.n, s.start);
                    if let Some(keep) = s.queries.filter(|k| !k.before_rope()) {
                        keep.encode(p, s.n);
                    }
                    s.attn.encode(p, s.n, s.start);
                    if let Some(w) = s.weights {
                        w.encode_accumulate(p, s.n, s.start);
                    }
                }
                mark(p, "rope + kv write + attention per sequence");
            }
            LayerAttention::AntiCausal {
                rope,
                n_present,
                o: own_o,
            } => {
                rope.encode(p, n, n_present - n);
                mark(p, "rope + kv write");
                self.attn.encode_anticausal(p, n, n_present);
                mark(p, "attention");
                own_output = own_o;
            }
        }
        match own_output {
            Some(own) => {
                own.o.encode(p, n);
                mark(p, "o matmul");
                if let Some(norm) = &own.norm {
                    norm.encode(p, n);
                    mark(p, "post-attention norm");
                }
            }
            None => {
                self.o.encode(p, n);
                mark(p, "o matmul");
                if let Some((attn, _)) = &self.post_norms {
                    attn.encode(p, n);
                    mark(p, "post-attention norm");
                }
            }
        }
        if !(n == 1 && self.gate_up.fuses_input) {
            self.mlp_norm.encode(p, n);
            mark(p, "rmsnorm");
        }
        self.gate_up.encode(p, n);
        mark(p, "gate+up matmul");
        if !(n == 1 && self.down.fuses_input) {
            self.silu.encode(p, n);
            mark(p, "silu*mul");
        }
        self.down.encode(p, n);
        mark(p, "down matmul");
        if let Some((_, mlp)) = &self.post_norms {
            mlp.encode(p, n);
            mark(p, "post-MLP norm");
        }
    }
}
