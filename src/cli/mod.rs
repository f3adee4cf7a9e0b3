//! The `sieve` command line: one module per subcommand.

pub mod bench;
pub mod convert;
pub mod eval;
pub mod info;
pub mod logits;
pub mod run;
#[cfg(feature = "server")]
pub mod serve;
pub mod shaders;
pub mod tokenize;

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

use sieve::cache::{CacheOptions, Granularity};
use sieve::device::KernelSet;
use sieve::eviction::Policy;
use sieve::formats::WeightFormat;
use sieve::gpu::GpuOptions;
use sieve::model::LoadOptions;

/// The directory `scripts/setup.sh` creates.
pub const DEFAULT_MODEL: &str = "models/smollm2-135m-instruct";

/// `--dtype`'s values: auto, then every storage format's name.
fn dtype_names() -> clap::builder::PossibleValuesParser {
    let names = sieve::WeightFormat::ALL.map(|f| f.name());
    clap::builder::PossibleValuesParser::new(std::iter::once("auto").chain(names))
}

/// Options every command that loads a model shares.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json, *.safetensors,
    /// tokenizer.json) or GGUF file. Default: $SIEVE_MODEL, else
    /// models/smollm2-135m-instruct.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Storage format of weight matrices on the GPU: auto (a GGUF file's
    /// own types where sieve has a GPU layout for them, else f16), f16, f32,
    /// q8_0/q4_0 (quantized at load time), or another block format (for a
    /// GGUF's tensors of that type, and random blocks with --synthetic).
    #[arg(long, value_parser = dtype_names(), default_value = "auto")]
    pub dtype: String,
    /// Storage format of the KV cache (f16 halves its memory and bandwidth).
    #[arg(long, value_parser = sieve::formats::KvFormat::ALL.map(|f| f.name()), default_value = "f32")]
    pub kv_dtype: String,
    /// Graphics backend: vulkan, metal, dx12 or gl (default: any; also $SIEVE_BACKEND).
    #[arg(long)]
    pub backend: Option<String>,
    /// Use the adapter whose name contains this text (also $SIEVE_ADAPTER).
    #[arg(long)]
    pub adapter: Option<String>,
    /// Kernel set: auto (cpu on a CPU Vulkan driver such as lavapipe, tuned
    /// elsewhere), cpu, gpu (fixed rules per weight shape) or tuned (the gpu
    /// kernels, each weight shape's variant timed on the device when the
    /// model's engine is built) (also $SIEVE_KERNELS).
    #[arg(long, value_parser = ["auto", "cpu", "gpu", "tuned"])]
    pub kernels: Option<String>,
}

/// `--kernels` as a kernel set (None: $SIEVE_KERNELS, else auto).
pub fn kernel_set(arg: &Option<String>) -> Result<Option<KernelSet>> {
    arg.as_deref().map(KernelSet::parse).transpose()
}

impl ModelArgs {
    pub fn dir(&self) -> Result<PathBuf> {
        let found = sieve::files::locate(
            self.model.as_deref(),
            "SIEVE_MODEL",
            DEFAULT_MODEL,
            "config.json",
        );
        if let Some(dir) = found {
            return Ok(dir);
        }
        bail!(
            "no model given and the default model ({DEFAULT_MODEL}) is not set up; run `bash scripts/setup.sh` \
             in the sieve repository, or pass --model DIR|FILE.gguf"
        )
    }

    pub fn gpu(&self) -> Result<GpuOptions> {
        Ok(GpuOptions {
            backend: self.backend.clone(),
            adapter: self.adapter.clone(),
            max_binding_override: None,
            kernels: kernel_set(&self.kernels)?,
        })
    }

    pub fn load_options(&self) -> Result<LoadOptions> {
        Ok(LoadOptions {
            dtype: WeightFormat::parse(&self.dtype),
            kv_dtype: sieve::formats::KvFormat::parse(&self.kv_dtype),
            gpu: self.gpu()?,
            progress: Some(sieve::Progress::new(progress_bar_tick)),
        })
    }
}

/// The bounded KV cache options shared by `run` and `logits`.
#[derive(Args, Debug, Clone)]
pub struct CacheArgs {
    /// KV budget J: cache entries kept at each refresh. Enables eviction; the
    /// cache then never holds more than J + chunk entries.
    #[arg(long)]
    pub budget: Option<usize>,
    /// Tokens processed between refreshes (h).
    #[arg(long, default_value_t = 64)]
    pub chunk: usize,
    /// Entries at the first positions that are never evicted.
    #[arg(long, default_value_t = 4)]
    pub sinks: usize,
    /// Newest entries that are never evicted.
    #[arg(long, default_value_t = 64)]
    pub recent: usize,
    /// Eviction policy: full, window, random, h2o, tova, epikv, ccs, ccs-full
    /// (SPEC.md), a variant (docs/POLICIES.md): epikv-robust, ccs-context,
    /// epikv-recency, epikv-tova, window-sinks, ccs-sinks, or kvpress's
    /// knorm, keydiff, lagkv, snapkv, expected-attention.
    /// Default: window with --budget, else full.
    #[arg(long)]
    pub policy: Option<String>,
    /// EpiKV rolling z-score window.
    #[arg(long, default_value_t = 128)]
    pub epikv_window: usize,
    /// EpiKV: average z over whole layer bands instead of two layers.
    #[arg(long)]
    pub epikv_bands: bool,
    /// EpiKV: the two layers (1-based), as A,B.
    #[arg(long, value_delimiter = ',', num_args = 2)]
    pub epikv_layers: Option<Vec<usize>>,
    /// Seed of the random policy.
    #[arg(long, default_value_t = 0)]
    pub policy_seed: u64,
    /// LagKV's partition size (kvpress's lag_size).
    #[arg(long, default_value_t = 128)]
    pub lag_size: usize,
    /// SnapKV's observation window: the newest queries whose attention
    /// scores the cache (kvpress's window_size).
    #[arg(long, default_value_t = 64)]
    pub snapkv_window: usize,
    /// Expected Attention: the newest queries whose mean and covariance
    /// predict the future ones.
    #[arg(long, default_value_t = 64)]
    pub ea_window: usize,
    /// Expected Attention: the future positions the queries' rotation is
    /// averaged over (kvpress's n_future_positions).
    #[arg(long, default_value_t = 512)]
    pub ea_future: usize,
    /// Which entries the cache keeps: token (one set for every layer and
    /// head, SPEC.md), layer (a set per layer) or head (a set per layer
    /// and KV head, as kvpress keeps). Policies that score tokens keep the
    /// same set in each.
    #[arg(long, default_value = "token", value_parser = Granularity::parse)]
    pub granularity: Granularity,
    /// H2O/TOVA: build each layer's full attention weight matrix the way eager
    /// attention does (same result, quadratic memory; to reproduce the memory wall).
    #[arg(long)]
    pub materialize: bool,
    /// Write every refresh (present, protected and kept positions, scores) as JSON.
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

impl CacheArgs {
    /// None means the full cache.
    pub fn options(&self) -> Result<Option<CacheOptions>> {
        let policy = match (&self.policy, self.budget) {
            (Some(p), _) => Policy::parse(p).context("--policy")?,
            (None, Some(_)) => Policy::Window,
            (None, None) => Policy::Full,
        };
        if policy == Policy::Full {
            if self.budget.is_some() {
                bail!("--budget cannot be used with --policy full (which never evicts)");
            }
            if self.granularity != Granularity::Token {
                bail!(
                    "--granularity {} needs a bounded cache: add --budget J",
                    self.granularity.name()
                );
            }
            return Ok(None);
        }
        let Some(budget) = self.budget else {
            bail!(
                "--policy {} needs a KV budget: add --budget J",
                policy.name()
            );
        };
        let opts = self.settings(policy, budget);
        // The library names the options; the command line adds its flags.
        opts.validate()
            .context("in --budget, --chunk, --sinks, --recent, --lag-size, --snapkv-window, --ea-window, --ea-future or --granularity")?;
        Ok(Some(opts))
    }

    /// Every cache setting of these flags, with `policy` at `budget`
    /// (unchecked: `options` checks them; a server checks each request's).
    pub fn settings(&self, policy: Policy, budget: usize) -> CacheOptions {
        CacheOptions {
            budget,
            chunk: self.chunk,
            sinks: self.sinks,
            recent: self.recent,
            policy,
            seed: self.policy_seed,
            epikv_window: self.epikv_window,
            epikv_bands: self.epikv_bands,
            epikv_layers: self.epikv_layers.as_ref().map(|v| (v[0], v[1])),
            materialize: self.materialize,
            lag_size: self.lag_size,
            snapkv_window: self.snapkv_window,
            ea_window: self.ea_window,
            ea_future: self.ea_future,
            granularity: self.granularity,
        }
    }
}

/// A progress line on stderr while weights upload (only on a terminal).
fn progress_bar_tick(done: usize, total: usize) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprint!("\rloading weights {done}/{total}");
        if done == total {
            eprintln!();
        }
    }
}

/// Parses a comma-separated list of token ids; an empty item (`1,,2`, a
/// trailing comma) is an error, not skipped.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(|x| x.trim())
        .enumerate()
        .map(|(i, x)| {
            if x.is_empty() {
                bail!(
                    "--ids: item {} is empty (expected token ids separated by single commas)",
                    i + 1
                );
            }
            x.parse::<u32>()
                .map_err(|_| anyhow::anyhow!("--ids: '{x}' is not a token id"))
        })
        .collect()
}

/// Prints `text` and a newline to stdout; a closed pipe (`sieve ... | head`)
/// ends the program quietly with status 0 instead of a panic.
pub fn print_line(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        other => Ok(other?),
    }
}

pub use sieve::files::write_atomic;
