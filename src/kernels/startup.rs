//! Making a [`Runtime`]: the variants the device's profile and kernel set
//! select, then the start-up checks, which run the kernels they check
//! (`matmul::check_variant`, `attention::check_*_variant`); here rather
//! than in runtime.rs, which those launchers import.

use anyhow::Result;
use std::sync::Arc;

use super::runtime::Runtime;
use super::variants::MatmulVariant;
use crate::gpu::{Gpu, GpuOptions};

impl Runtime {
    /// Opens the adapter `opts` (and the `SIEVE_*` settings) choose and
    /// chooses its kernels; errors are of kind
    /// [`ErrorKind::Gpu`](crate::error::ErrorKind::Gpu).
    pub fn open(opts: &GpuOptions) -> Result<Arc<Self>> {
        Ok(Self::new(Gpu::new(opts)?))
    }

    /// sieve's kernels on `gpu`: the variants its profile and kernel set
    /// select, each candidate that rests on an experimental feature or on
    /// what the API does not promise checked against its CPU reference
    /// first (a failure drops it, with a warning).
    pub fn new(gpu: Arc<Gpu>) -> Arc<Self> {
        let mut rt = Runtime::unchecked(gpu);
        run_start_up_checks(&mut rt);
        Arc::new(rt)
    }
}

/// The start-up checks: each kernel the device would run or time that rests
/// on an experimental wgpu feature (the cooperative matrices) or on what
/// the API does not promise (subgroup layouts) runs once against its CPU
/// reference, and is dropped from `rt.kernels` where it fails.
fn run_start_up_checks(rt: &mut Runtime) {
    if rt.kernels.matmul == MatmulVariant::Coop {
        check_cooperative_matmuls(rt);
    }
    check_attention_variants(rt);
}

/// The attention variants that rest on what the API does not promise.
fn check_attention_variants(rt: &mut Runtime) {
    // The matrix-unit prefill attention rests on the same experimental
    // feature: where `tuned` would time it, it runs once against the CPU
    // reference first, and is dropped on a failure.
    if rt.kernels.attn_prefill_coop {
        use super::variants::AttnPrefillVariant::Coop;
        if let Err(e) = crate::kernels::attention::check_prefill_variant(rt, Coop) {
            eprintln!(
                "warning: the cooperative-matrix prefill attention failed its check on {} ({e:#}); it is not timed",
                rt.info.name
            );
            rt.kernels.attn_prefill_coop = false;
        }
    }
    // The eight-lanes-per-key decode attention numbers its lanes by
    // subgroup, counting on subgroups of one size in a workgroup, which
    // Vulkan does not promise: where `tuned` would time it, it runs once
    // against the CPU reference first, and is dropped on a failure.
    if rt.kernels.tuned() && rt.kernels.attn_decode_lanes {
        use super::variants::AttnDecodeVariant::LanesPerKey;
        if let Err(e) = crate::kernels::attention::check_decode_variant(rt, LanesPerKey) {
            eprintln!(
                "warning: the eight-lanes-per-key decode attention failed its check on {} ({e:#}); it is not timed",
                rt.info.name
            );
            rt.kernels.attn_decode_lanes = false;
        }
    }
}

/// The cooperative GEMMs rest on an experimental wgpu feature: before
/// the engine relies on them, one small product each (f16 weights, and
/// Q4_0 for the staged kernel that block formats use) is checked
/// against the CPU reference; a wrong or failing result falls back to
/// the tiled kernel (the fallback always works) with a warning, for
/// the weights that kernel serves.
fn check_cooperative_matmuls(rt: &mut Runtime) {
    use crate::formats::WeightFormat;
    use crate::kernels::matmul::check_variant;
    let device = rt.info.name.clone();
    let warn = |variant: MatmulVariant, format: WeightFormat, e: anyhow::Error, then: &str| {
        eprintln!(
            "warning: the cooperative-matrix mat-mul ({variant:?}) failed its check with {} weights on {} ({e:#}); {then}",
            format.name(),
            device
        );
    };
    if let Err(e) = check_variant(rt, MatmulVariant::CoopStaged, WeightFormat::Q4_0) {
        let then = "weights in block formats use the tiled kernel";
        warn(MatmulVariant::CoopStaged, WeightFormat::Q4_0, e, then);
        rt.kernels.coop_staged = false;
    }
    // With timings the staged kernel is also a candidate for f16
    // weights, checked with them on its own.
    if rt.kernels.coop_staged_f16 {
        if let Err(e) = check_variant(rt, MatmulVariant::CoopStaged, WeightFormat::F16) {
            let then = "it is not timed for f16 weights";
            warn(MatmulVariant::CoopStaged, WeightFormat::F16, e, then);
            rt.kernels.coop_staged_f16 = false;
        }
    }
    // Its 128-token tiles too (the same kernel with WIDE = 2, a
    // candidate wherever the staged one is), with the weights the
    // staged kernel kept.
    let formats = [
        (rt.kernels.coop_staged, WeightFormat::Q4_0),
        (rt.kernels.coop_staged_f16, WeightFormat::F16),
    ];
    for (kept, format) in formats {
        if !kept || !rt.kernels.coop_staged_wide {
            continue;
        }
        let wide = MatmulVariant::CoopStagedWide;
        if let Err(e) = check_variant(rt, wide, format) {
            warn(wide, format, e, "it is not timed");
            rt.kernels.coop_staged_wide = false;
        }
    }
    // The refined kernels (candidates beside the two above), with the
    // weights their plain kernels kept.
    let refined = [
        (
            rt.kernels.coop_staged,
            MatmulVariant::CoopStagedPadded,
            WeightFormat::Q4_0,
        ),
        (
            rt.kernels.coop_staged_f16,
            MatmulVariant::CoopStagedPadded,
            WeightFormat::F16,
        ),
        (
            rt.kernels.coop_staged,
            MatmulVariant::CoopStagedPrefetch,
            WeightFormat::Q4_0,
        ),
        (
            rt.kernels.coop_staged_f16,
            MatmulVariant::CoopStagedPrefetch,
            WeightFormat::F16,
        ),
        (
            rt.kernels.coop_staged,
            MatmulVariant::CoopStagedTokensFast,
            WeightFormat::Q4_0,
        ),
        (true, MatmulVariant::CoopPadded, WeightFormat::F16),
        (true, MatmulVariant::CoopTokensFast, WeightFormat::F16),
        (true, MatmulVariant::CoopX16, WeightFormat::F16),
    ];
    for (kept, variant, format) in refined {
        if !kept || !rt.kernels.coop_refined {
            continue;
        }
        if let Err(e) = check_variant(rt, variant, format) {
            warn(
                variant,
                format,
                e,
                "the refined cooperative kernels are not timed",
            );
            rt.kernels.coop_refined = false;
        }
    }
    if let Err(e) = check_variant(rt, MatmulVariant::Coop, WeightFormat::F16) {
        let then = "every weight format uses the tiled kernel";
        warn(MatmulVariant::Coop, WeightFormat::F16, e, then);
        rt.kernels.matmul = MatmulVariant::Tiled;
        rt.kernels.coop_staged = false;
        rt.kernels.coop_staged_f16 = false;
        rt.kernels.coop_staged_wide = false;
        rt.kernels.coop_refined = false;
    }
}
