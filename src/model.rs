//! A loaded model: configuration and weights on the GPU.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::gpu::{Gpu, GpuOptions};
use crate::progress::Progress;
use crate::shaders::WeightFormat;
use crate::weights::{GpuMatrix, TensorStore, WeightSource};

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Storage format of weight matrices on the GPU (default f16).
    pub dtype: Option<WeightFormat>,
    /// Storage format of the KV cache of every engine of this model (default
    /// f32: exact comparisons; f16 halves the cache's memory and bandwidth).
    pub kv_dtype: Option<WeightFormat>,
    pub gpu: GpuOptions,
    /// Called once per tensor group uploaded: (done, total). A closure, so it
    /// can hold a channel or a widget handle.
    pub progress: Option<Progress>,
}

pub(crate) struct LayerWeights {
    pub attn_norm: wgpu::Buffer,
    /// q, k and v projections stacked by rows: `[qkv_dim, hidden]`.
    pub qkv: GpuMatrix,
    pub qkv_bias: Option<wgpu::Buffer>,
    pub o: GpuMatrix,
    pub mlp_norm: wgpu::Buffer,
    /// gate and up projections stacked by rows: `[2 * ffn, hidden]`.
    pub gate_up: GpuMatrix,
    pub down: GpuMatrix,
}

pub struct Model {
    pub gpu: Arc<Gpu>,
    pub config: ModelConfig,
    pub dir: PathBuf,
    pub format: WeightFormat,
    /// Storage format of the cached keys and values.
    pub kv_format: WeightFormat,
    pub(crate) embed: GpuMatrix,
    /// None when the LM head is tied to the embedding.
    pub(crate) lm_head: Option<GpuMatrix>,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) final_norm: wgpu::Buffer,
    pub(crate) inv_freq: wgpu::Buffer,
    /// Bytes of weight matrices on the GPU (see [`weight_bytes`]).
    pub weight_bytes: u64,
}

impl Model {
    /// The attention heads of every layer, and the KV cache's storage format.
    pub fn heads(&self) -> crate::kernels::rope_kv::Heads {
        crate::kernels::rope_kv::Heads {
            n_heads: self.config.num_heads,
            n_kv: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            kv_format: self.kv_format,
        }
    }

    /// Loads `config.json` and the safetensors weights of a Hugging Face model directory.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Arc<Model>> {
        // The files are checked before a device is opened.
        let (config, store) = Self::open_files(dir)?;
        let gpu = Gpu::new(&opts.gpu)?;
        Self::upload(gpu, config, &store, dir, opts)
    }

    /// As [`Model::load`], on a `Gpu` that exists already (one made with
    /// [`Gpu::from_wgpu`] around an application's device, or one shared by
    /// several models); `opts.gpu` is not used.
    pub fn load_on(gpu: Arc<Gpu>, dir: &Path, opts: &LoadOptions) -> Result<Arc<Model>> {
        let (config, store) = Self::open_files(dir)?;
        Self::upload(gpu, config, &store, dir, opts)
    }

    /// The config and the weight files of a model folder, checked against
    /// each other.
    fn open_files(dir: &Path) -> Result<(ModelConfig, TensorStore)> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let store = TensorStore::open(dir)?;
        // A config that names fewer layers than the checkpoint holds would
        // silently run a truncated model.
        let extra = format!("model.layers.{}.input_layernorm.weight", config.num_layers);
        if store.contains(&extra) {
            bail!(
                "{}: num_hidden_layers is {} but the weights hold more layers ({extra} exists)",
                dir.join("config.json").display(),
                config.num_layers
            );
        }
        Ok((config, store))
    }

    /// Builds the model on `gpu` with weights from `store` (safetensors files,
    /// or random values for a synthetic model).
    pub fn upload(
        gpu: Arc<Gpu>,
        config: ModelConfig,
        store: &dyn WeightSource,
        dir: &Path,
        opts: &LoadOptions,
    ) -> Result<Arc<Model>> {
        let c = &config;
        let format = opts.dtype.unwrap_or(WeightFormat::F16);
        // Weights no device of this kind can hold are refused before the
        // first buffer is created (sizes in u128: no overflow).
        let bytes = weight_bytes(c, format);
        let ceiling = gpu.memory_ceiling();
        if bytes > ceiling as u128 {
            let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
            bail!(
                "{}: the weights need {:.1} GiB as {}, more than this device can hold ({:.1} GiB at most)",
                dir.display(),
                gib(bytes),
                format.name(),
                gib(ceiling as u128)
            );
        }
        let (h, ffn) = (c.hidden_size, c.intermediate_size);
        let total = 3 + c.num_layers;
        let mut done = 0;
        let mut tick = |gpu: &Gpu| {
            // Flush staged uploads so host staging memory stays at about one tensor.
            gpu.queue.submit([]);
            done += 1;
            if let Some(p) = &opts.progress {
                p.report(done, total);
            }
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<GpuMatrix> {
            let m = GpuMatrix::new(&gpu, name, rows, cols, format)?;
            store.fill_rows(&gpu, &m, 0, rows, name)?;
            Ok(m)
        };
        let vector = |name: &str, len: usize| -> Result<wgpu::Buffer> {
            Ok(gpu.storage_from(name, &store.vector(name, len)?))
        };
        let embed = matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        tick(&gpu);
        let mut layers = Vec::with_capacity(c.num_layers);
        let (qd, kd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}.");
            let qkv = GpuMatrix::new(&gpu, &format!("{p}qkv"), qd + 2 * kd, h, format)?;
            let mut row = 0;
            let mut bias = Vec::new();
            for (proj, rows) in [("q_proj", qd), ("k_proj", kd), ("v_proj", kd)] {
                let name = format!("{p}self_attn.{proj}.weight");
                store.fill_rows(&gpu, &qkv, row, rows, &name)?;
                row += rows;
                if c.qkv_bias {
                    bias.extend(store.vector(&format!("{p}self_attn.{proj}.bias"), rows)?);
                }
            }
            let gate_up = GpuMatrix::new(&gpu, &format!("{p}gate_up"), 2 * ffn, h, format)?;
            for (i, proj) in ["gate_proj", "up_proj"].iter().enumerate() {
                let name = format!("{p}mlp.{proj}.weight");
                store.fill_rows(&gpu, &gate_up, i * ffn, ffn, &name)?;
            }
            layers.push(LayerWeights {
                attn_norm: vector(&format!("{p}input_layernorm.weight"), h)?,
                qkv,
                qkv_bias: c
                    .qkv_bias
                    .then(|| gpu.storage_from(&format!("{p}qkv_bias"), &bias)),
                o: matrix(&format!("{p}self_attn.o_proj.weight"), h, qd)?,
                mlp_norm: vector(&format!("{p}post_attention_layernorm.weight"), h)?,
                gate_up,
                down: matrix(&format!("{p}mlp.down_proj.weight"), h, ffn)?,
            });
            tick(&gpu);
        }
        let final_norm = vector("model.norm.weight", h)?;
        tick(&gpu);
        // Some tied checkpoints still carry lm_head.weight; use it only when untied.
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            if !store.contains("lm_head.weight") {
                bail!(
                    "{}: tie_word_embeddings is false but the weights have no lm_head.weight",
                    dir.display()
                );
            }
            Some(matrix("lm_head.weight", c.vocab_size, h)?)
        };
        tick(&gpu);
        let inv_freq = gpu.storage_from("rope-inv-freq", &c.rope_inv_freq());
        let mut weight_bytes = embed.bytes() + lm_head.as_ref().map_or(0, |m| m.bytes());
        for l in &layers {
            weight_bytes += l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes();
        }
        gpu.device
            .poll(wgpu::PollType::wait_indefinitely())
            .context("waiting for weight uploads")?;
        Ok(Arc::new(Model {
            gpu,
            config,
            dir: dir.to_path_buf(),
            format,
            kv_format: opts.kv_dtype.unwrap_or(WeightFormat::F32),
            embed,
            lm_head,
            layers,
            final_norm,
            inv_freq,
            weight_bytes,
        }))
    }

    pub(crate) fn head(&self) -> &GpuMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights read to decode one token: every layer matrix and the LM head.
    pub fn decode_weight_bytes(&self) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        layers + self.head().bytes()
    }
}

/// Bytes of the weight matrices of a model with config `c` stored as
/// `format` (what [`Model::weight_bytes`] counts once loaded; the norms and
/// biases add a few KiB), computed without overflow, before loading.
pub fn weight_bytes(c: &ModelConfig, format: WeightFormat) -> u128 {
    let (h, ffn, vocab) = (
        c.hidden_size as u128,
        c.intermediate_size as u128,
        c.vocab_size as u128,
    );
    let q = (c.num_heads * c.head_dim) as u128;
    let heads = 1 + !c.tie_word_embeddings as u128;
    let layer = c.qkv_dim() as u128 * h + h * q + 3 * ffn * h;
    (heads * vocab * h + c.num_layers as u128 * layer) * format.bytes_per_value() as u128
}
