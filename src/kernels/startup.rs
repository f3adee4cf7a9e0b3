//! Making a [`Runtime`]: the variants the device's profile and kernel set
//! select, then the start-up checks each op module owns
//! (`matmul::start_up_checks`, `attention::start_up_checks`), which run
//! the kernels they check; here rather than in runtime.rs, which those
//! launchers import.

use anyhow::Result;
use std::sync::Arc;

use super::runtime::Runtime;
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
/// reference, and is dropped from `rt.kernels` where it fails. Each op
/// module owns its checks.
fn run_start_up_checks(rt: &mut Runtime) {
    super::matmul::start_up_checks(rt);
    super::attention::start_up_checks(rt);
}
