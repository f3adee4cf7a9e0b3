//! `sieve info`: the adapter, backend, driver, features and limits; with
//! `--model`, also the model's shape and its weight formats as loaded.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

use sieve::formats::WeightFormat;
use sieve::gpu::GpuOptions;
use sieve::kernels::runtime::Runtime;
use sieve::model::{LoadOptions, Model};

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Graphics backend: vulkan, metal, dx12 or gl.
    #[arg(long)]
    pub backend: Option<String>,
    /// Use the adapter whose name contains this text.
    #[arg(long)]
    pub adapter: Option<String>,
    /// Kernel set: auto (cpu on a CPU Vulkan driver such as lavapipe, tuned
    /// elsewhere), cpu, gpu or tuned (also $SIEVE_KERNELS).
    #[arg(long, value_parser = ["auto", "cpu", "gpu", "tuned"])]
    pub kernels: Option<String>,
    /// Also load this model (directory or GGUF file) and print its shape,
    /// weight formats and bytes read per decoded token.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight format with --model, as for `sieve run`.
    #[arg(long, value_parser = ["auto", "f16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k"], default_value = "auto")]
    pub dtype: String,
}

/// `println!` that stops quietly at a closed pipe.
macro_rules! out {
    ($($arg:tt)*) => { super::print_line(&format!($($arg)*))? };
}

pub fn main(a: InfoArgs) -> Result<()> {
    let gpu_options = GpuOptions {
        backend: a.backend,
        adapter: a.adapter,
        max_binding_override: None,
        kernels: super::kernel_set(&a.kernels)?,
    };
    // The model is loaded before anything is printed, so a bad file is one
    // clear error.
    let model = match &a.model {
        Some(path) => Some(Model::load(
            path,
            &LoadOptions {
                dtype: WeightFormat::parse(&a.dtype),
                gpu: gpu_options.clone(),
                ..Default::default()
            },
        )?),
        None => None,
    };
    let gpu = match &model {
        Some(m) => m.gpu.clone(),
        None => Runtime::open(&gpu_options)?,
    };
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
    out!("kernels:      {}", gpu.describe_kernels());
    if let Some(path) = gpu.tuner.disk_path() {
        out!("tuning cache: {}", path.display());
    }
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
    if let (Some(m), Some(path)) = (&model, &a.model) {
        let c = &m.config;
        out!("model:        {}", path.display());
        out!(
            "shape:        {} ({} family) {} layers, hidden {}, {} query / {} KV heads of {}, MLP {}, vocabulary {}",
            c.architecture,
            c.family.name,
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size
        );
        out!(
            "weights:      {:.1} MB on the GPU: {}",
            m.weight_bytes as f64 / 1e6,
            m.formats_summary()
        );
        out!(
            "read per decoded token: {:.1} MB of weights (layer matrices and LM head; {:.1} MB in the GGUF blocks of the same formats)",
            m.decode_weight_bytes() as f64 / 1e6,
            m.decode_gguf_weight_bytes() as f64 / 1e6
        );
    }
    Ok(())
}
