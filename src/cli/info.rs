//! `sieve info`: the adapter, backend, driver, features and limits.

use anyhow::Result;
use clap::Args;

use sieve::gpu::{Gpu, GpuOptions};

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Graphics backend: vulkan, metal, dx12 or gl.
    #[arg(long)]
    pub backend: Option<String>,
    /// Use the adapter whose name contains this text.
    #[arg(long)]
    pub adapter: Option<String>,
    /// Kernel set: auto, cpu or gpu (also $SIEVE_KERNELS).
    #[arg(long, value_parser = ["auto", "cpu", "gpu"])]
    pub kernels: Option<String>,
}

/// `println!` that stops quietly at a closed pipe.
macro_rules! out {
    ($($arg:tt)*) => { super::print_line(&format!($($arg)*))? };
}

pub fn main(a: InfoArgs) -> Result<()> {
    let gpu = Gpu::new(&GpuOptions {
        backend: a.backend,
        adapter: a.adapter,
        max_binding_override: None,
        kernels: super::kernel_set(&a.kernels)?,
    })?;
    let i = &gpu.info;
    out!("adapter:      {}", i.name);
    out!("backend:      {:?}", i.backend);
    out!("device type:  {:?}", i.device_type);
    out!("driver:       {} {}", i.driver, i.driver_info);
    out!("vendor/device: {:#06x}/{:#06x}", i.vendor, i.device);
    out!(
        "subgroup size: {}..{}",
        i.subgroup_min_size,
        i.subgroup_max_size
    );
    out!("features used: {:?}", gpu.features);
    out!("kernels:      {}", gpu.kernels.describe());
    let l = &gpu.limits;
    out!(
        "max storage binding:     {} bytes",
        l.max_storage_buffer_binding_size
    );
    out!("max buffer size:         {} bytes", l.max_buffer_size);
    out!(
        "max workgroup memory:    {} bytes",
        l.max_compute_workgroup_storage_size
    );
    out!(
        "max invocations/group:   {}",
        l.max_compute_invocations_per_workgroup
    );
    out!(
        "max workgroups/dim:      {}",
        l.max_compute_workgroups_per_dimension
    );
    out!(
        "max storage buffers/stage: {}",
        l.max_storage_buffers_per_shader_stage
    );
    Ok(())
}
