//! A loaded model: configuration and weights on the GPU.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::family::Role;
use crate::formats::{KvFormat, WeightFormat};
use crate::gpu::{Gpu, GpuOptions};
use crate::kernels::runtime::Runtime;
use crate::progress::Progress;
use crate::weights::{GpuMatrix, TensorStore, WeightSource};

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Storage format of weight matrices on the GPU (default f16).
    pub dtype: Option<WeightFormat>,
    /// Storage format of the KV cache of every engine of this model (default
    /// f32: exact comparisons; f16 halves the cache's memory and bandwidth).
    pub kv_dtype: Option<KvFormat>,
    pub gpu: GpuOptions,
    /// Called once per tensor group uploaded: (done, total). A closure, so it
    /// can hold a channel or a widget handle.
    pub progress: Option<Progress>,
}

impl LoadOptions {
    /// The options named as the command line names them (`--dtype`,
    /// `--kv-dtype`, `--kernels`, `--backend`, `--adapter`; None is the
    /// default), for the bindings, whose callers pass strings. A name sieve
    /// does not know is [`ErrorKind::InvalidOptions`](crate::ErrorKind),
    /// naming the option and what it takes.
    pub fn from_names(
        dtype: Option<&str>,
        kv_dtype: Option<&str>,
        kernels: Option<&str>,
        backend: Option<&str>,
        adapter: Option<&str>,
    ) -> crate::Result<LoadOptions> {
        let invalid =
            |e: anyhow::Error| crate::Error::classify(e, crate::ErrorKind::InvalidOptions);
        let dtype = match dtype {
            None | Some("auto") => None,
            Some(name) => Some(WeightFormat::parse(name).ok_or_else(|| {
                invalid(anyhow::anyhow!(
                    "dtype {name:?}: expected auto or one of {}",
                    WeightFormat::ALL.map(|f| f.name()).join(", ")
                ))
            })?),
        };
        let kv_dtype = match kv_dtype {
            None => None,
            Some(name) => Some(KvFormat::parse(name).ok_or_else(|| {
                invalid(anyhow::anyhow!("kv_dtype {name:?}: expected f32 or f16"))
            })?),
        };
        if let Some(b) = backend {
            crate::gpu::parse_backend(b).map_err(invalid)?;
        }
        let kernels = kernels
            .map(crate::device::KernelSet::parse)
            .transpose()
            .map_err(|e| invalid(e.context("kernels")))?;
        Ok(LoadOptions {
            dtype,
            kv_dtype,
            gpu: GpuOptions {
                backend: backend.map(str::to_string),
                adapter: adapter.map(str::to_string),
                kernels,
                ..Default::default()
            },
            progress: None,
        })
    }
}

pub(crate) struct LayerWeights {
    pub attn_norm: wgpu::Buffer,
    /// q, k and v projections stacked by rows: `[qkv_dim, hidden]`.
    pub qkv: GpuMatrix,
    pub qkv_bias: Option<wgpu::Buffer>,
    pub o_bias: Option<wgpu::Buffer>,
    /// The per-head norms of the queries and keys `[head_dim]` each (q/k norm).
    pub qk_norm: Option<(wgpu::Buffer, wgpu::Buffer)>,
    /// This layer's RoPE inverse frequencies `[rotary_dim / 2]` (one value
    /// when the layer has no RoPE, so the binding is never empty).
    pub inv_freq: wgpu::Buffer,
    /// LongRoPE's frequencies for long contexts (`Rope::long`).
    pub inv_freq_long: Option<wgpu::Buffer>,
    pub o: GpuMatrix,
    pub mlp_norm: wgpu::Buffer,
    /// The norms of the attention and MLP outputs (`LayerSpec::sandwich_norms`).
    pub post_norms: Option<(wgpu::Buffer, wgpu::Buffer)>,
    /// gate and up projections stacked by rows: `[2 * ffn, hidden]`.
    pub gate_up: GpuMatrix,
    pub down: GpuMatrix,
}

pub struct Model {
    /// The device with the kernels chosen for it.
    pub gpu: Arc<Runtime>,
    pub config: ModelConfig,
    /// The model folder or GGUF file it was loaded from.
    pub dir: PathBuf,
    /// Storage format of the cached keys and values.
    pub kv_format: KvFormat,
    pub(crate) embed: GpuMatrix,
    /// None when the LM head is tied to the embedding.
    pub(crate) lm_head: Option<GpuMatrix>,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) final_norm: wgpu::Buffer,
    /// Bytes of weight matrices on the GPU (see [`weight_bytes`]).
    pub weight_bytes: u64,
}

impl LayerWeights {
    /// The RoPE frequencies an engine uses: LongRoPE's long ones when it
    /// can see positions past the original context (`long`), else the
    /// layer's own.
    pub fn rope_frequencies(&self, long: bool) -> &wgpu::Buffer {
        match &self.inv_freq_long {
            Some(f) if long => f,
            _ => &self.inv_freq,
        }
    }
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

    /// Loads `config.json` and the safetensors weights of a Hugging Face
    /// model directory, or a GGUF file (`path` names the file).
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Arc<Model>> {
        // The files are checked before a device is opened.
        let (config, store) = Self::open_files(path)?;
        let gpu = Runtime::open(&opts.gpu)?;
        Self::upload(gpu, config, store.as_ref(), path, opts)
    }

    /// As [`Model::load`], on a `Gpu` that exists already (one made with
    /// [`Gpu::from_wgpu`] around an application's device, or one shared by
    /// several models); `opts.gpu` is not used.
    pub fn load_on(gpu: Arc<Gpu>, path: &Path, opts: &LoadOptions) -> Result<Arc<Model>> {
        let (config, store) = Self::open_files(path)?;
        Self::upload(Runtime::new(gpu), config, store.as_ref(), path, opts)
    }

    /// A GGUF model already opened ([`GgufModel::from_bytes`] for a file
    /// in memory), onto the GPU `opts` choose.
    ///
    /// [`GgufModel::from_bytes`]: crate::gguf_model::GgufModel::from_bytes
    pub fn from_gguf(g: &crate::gguf_model::GgufModel, opts: &LoadOptions) -> Result<Arc<Model>> {
        let gpu = Runtime::open(&opts.gpu)?;
        Self::upload(gpu, g.config.clone(), g, &g.file.path, opts)
    }

    /// The config and the weights of a model folder or GGUF file, checked
    /// against each other.
    fn open_files(path: &Path) -> Result<(ModelConfig, Box<dyn WeightSource>)> {
        if crate::gguf_model::is_gguf(path) {
            let g = crate::gguf_model::GgufModel::open(path)?;
            return Ok((g.config.clone(), Box::new(g)));
        }
        let dir = path;
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let store = TensorStore::open(dir)?;
        // A config that names fewer layers than the checkpoint holds would
        // silently run a truncated model.
        let extra = config.family.required(Role::AttnNorm, config.num_layers);
        if store.contains(&extra) {
            bail!(
                "{}: num_hidden_layers is {} but the weights hold more layers ({extra} exists)",
                dir.join("config.json").display(),
                config.num_layers
            );
        }
        Ok((config, Box::new(store)))
    }

    /// Builds the model on `gpu` with weights from `store` (safetensors files,
    /// or random values for a synthetic model).
    pub fn upload(
        gpu: Arc<Runtime>,
        config: ModelConfig,
        store: &dyn WeightSource,
        dir: &Path,
        opts: &LoadOptions,
    ) -> Result<Arc<Model>> {
        let c = &config;
        // Each tensor in the format asked for, else as its file stores it
        // (GGUF), else f16; a stacked matrix keeps each tensor's format.
        let blocks_of = |sources: &[(String, usize)]| -> Vec<(usize, WeightFormat)> {
            let format_of = |name: &str| {
                opts.dtype
                    .or_else(|| store.stored_format(name))
                    .unwrap_or(WeightFormat::F16)
            };
            sources.iter().map(|(n, r)| (*r, format_of(n))).collect()
        };
        let plan = matrix_plan(c);
        let parts: Vec<MatrixParts> = plan
            .iter()
            .map(|m| (blocks_of(&m.sources), m.cols))
            .collect();
        check_fits(&gpu, &parts, dir)?;
        let h = c.hidden_size;
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
        let mut plan = plan.into_iter();
        // The next matrix of the plan, uploaded (they come in plan order).
        let mut next_matrix = |gpu: &Gpu| -> Result<GpuMatrix> {
            let m = plan.next().expect("the plan lists every matrix");
            let matrix = GpuMatrix::stacked(gpu, &m.label, m.cols, &blocks_of(&m.sources))?;
            let mut row = 0;
            for (name, rows) in &m.sources {
                store.fill_rows(gpu, &matrix, row, *rows, name)?;
                row += rows;
            }
            Ok(matrix)
        };
        let vector = |name: &str, len: usize| -> Result<wgpu::Buffer> {
            Ok(gpu.storage_from(name, &store.vector(name, len)?))
        };
        // A norm's weights, with the family's offset (Gemma's 1 + w) added.
        let norm = |name: &str, len: usize| -> Result<wgpu::Buffer> {
            let mut w = store.vector(name, len)?;
            w.iter_mut().for_each(|x| *x += c.norm_weight_offset);
            Ok(gpu.storage_from(name, &w))
        };
        let embed = next_matrix(&gpu)?;
        tick(&gpu);
        let mut layers = Vec::with_capacity(c.num_layers);
        let (qd, kd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let family = c.family;
        for (l, spec) in c.layers.iter().enumerate() {
            let name = |role| family.required(role, l);
            let qkv = next_matrix(&gpu)?;
            let qkv_bias = if spec.qkv_bias {
                let mut bias = Vec::with_capacity(c.qkv_dim());
                for (role, rows) in [(Role::QBias, qd), (Role::KBias, kd), (Role::VBias, kd)] {
                    bias.extend(store.vector(&name(role), rows)?);
                }
                Some(gpu.storage_from(&format!("layer {l} qkv bias"), &bias))
            } else {
                None
            };
            let qk_norm = if spec.qk_norm {
                Some((
                    norm(&name(Role::QNorm), c.head_dim)?,
                    norm(&name(Role::KNorm), c.head_dim)?,
                ))
            } else {
                None
            };
            let inv_freq = if spec.rope.inv_freq.is_empty() {
                vec![0.0]
            } else {
                spec.rope.inv_freq.clone()
            };
            let o = next_matrix(&gpu)?;
            let o_bias = if spec.o_bias {
                Some(vector(&name(Role::OBias), h)?)
            } else {
                None
            };
            let gate_up = next_matrix(&gpu)?;
            let down = next_matrix(&gpu)?;
            let post_norms = if spec.sandwich_norms {
                Some((
                    norm(&name(Role::PostAttnNorm), h)?,
                    norm(&name(Role::PostMlpNorm), h)?,
                ))
            } else {
                None
            };
            layers.push(LayerWeights {
                attn_norm: norm(&name(Role::AttnNorm), h)?,
                post_norms,
                qkv,
                qkv_bias,
                o_bias,
                qk_norm,
                inv_freq: gpu.storage_from(&format!("layer {l} rope-inv-freq"), &inv_freq),
                inv_freq_long: spec.rope.long.as_ref().map(|long| {
                    gpu.storage_from(&format!("layer {l} rope-inv-freq-long"), &long.inv_freq)
                }),
                o,
                mlp_norm: norm(&name(Role::MlpNorm), h)?,
                gate_up,
                down,
            });
            tick(&gpu);
        }
        let final_norm = norm(&family.required(Role::FinalNorm, 0), h)?;
        tick(&gpu);
        // Some tied checkpoints still carry lm_head.weight; use it only when untied.
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            let name = family.required(Role::LmHead, 0);
            if !store.contains(&name) {
                bail!(
                    "{}: tie_word_embeddings is false but the weights have no {name}",
                    dir.display()
                );
            }
            Some(next_matrix(&gpu)?)
        };
        tick(&gpu);
        let mut weight_bytes = embed.bytes() + lm_head.as_ref().map_or(0, |m| m.bytes());
        for l in &layers {
            weight_bytes += l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes();
        }
        crate::platform::wait_for_gpu(&gpu.device, &gpu.queue, None)
            .context("waiting for weight uploads")?;
        Ok(Arc::new(Model {
            gpu,
            config,
            dir: dir.to_path_buf(),
            kv_format: opts.kv_dtype.unwrap_or_default(),
            embed,
            lm_head,
            layers,
            final_norm,
            weight_bytes,
        }))
    }

    /// Every weight matrix.
    fn matrices(&self) -> impl Iterator<Item = &GpuMatrix> {
        let layers = self
            .layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]);
        std::iter::once(&self.embed)
            .chain(layers)
            .chain(self.lm_head.as_ref())
    }

    /// Bytes of weight matrices per storage format, largest share first.
    pub fn weight_formats(&self) -> Vec<(WeightFormat, u64)> {
        let mut out: Vec<(WeightFormat, u64)> = vec![];
        for (format, bytes) in self.matrices().flat_map(|m| m.format_bytes()) {
            match out.iter_mut().find(|(f, _)| *f == format) {
                Some((_, b)) => *b += bytes,
                None => out.push((format, bytes)),
            }
        }
        out.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
        out
    }

    /// The weight formats in a few words, e.g. `q4_1 (75.4 MB) + q8_0 (29.9 MB)`.
    pub fn formats_summary(&self) -> String {
        let parts: Vec<String> = self
            .weight_formats()
            .iter()
            .map(|(f, b)| format!("{} ({:.1} MB)", f.name(), *b as f64 / 1e6))
            .collect();
        parts.join(" + ")
    }

    pub(crate) fn head(&self) -> &GpuMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights read to decode one token: every layer matrix and the LM head.
    pub fn decode_weight_bytes(&self) -> u64 {
        self.decode_matrices().map(GpuMatrix::bytes).sum()
    }

    /// The same matrices in llama.cpp's own blocks (what a GGUF reader with
    /// the file's layout would read; Q4_0 on the GPU takes that much where
    /// rows are multiples of 256 values, the other block formats a few
    /// percent more, their blocks padded to whole words).
    pub fn decode_gguf_weight_bytes(&self) -> u64 {
        self.decode_matrices().map(GpuMatrix::gguf_bytes).sum()
    }

    /// The matrices a decode step reads: every layer's, and the LM head.
    fn decode_matrices(&self) -> impl Iterator<Item = &GpuMatrix> {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down])
            .chain([self.head()])
    }
}

/// Refuses weights no device of this kind can hold before the first
/// buffer is created (sizes in u128: no overflow).
fn check_fits(gpu: &Gpu, parts: &[MatrixParts], dir: &Path) -> Result<()> {
    let bytes: u128 = parts
        .iter()
        .flat_map(|(blocks, cols)| blocks.iter().map(move |&b| (b, *cols)))
        .map(|((rows, f), cols)| rows as u128 * f.row_bytes(cols) as u128)
        .sum();
    let ceiling = gpu.memory_ceiling();
    if bytes > ceiling as u128 {
        let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
        let formats: std::collections::BTreeSet<&str> = parts
            .iter()
            .flat_map(|(blocks, _)| blocks)
            .map(|(_, f)| f.name())
            .collect();
        bail!(
            "{}: the weights need {:.1} GiB as {}, more than this device can hold ({:.1} GiB at most)",
            dir.display(),
            gib(bytes),
            formats.into_iter().collect::<Vec<_>>().join(" and "),
            gib(ceiling as u128)
        );
    }
    Ok(())
}

/// A matrix's (rows, format) parts and its columns.
type MatrixParts = (Vec<(usize, WeightFormat)>, usize);

/// One weight matrix of the model: its rows stacked from source tensors.
struct MatrixPlan {
    label: String,
    rows: usize,
    cols: usize,
    /// (tensor name, rows), stacked in order.
    sources: Vec<(String, usize)>,
}

/// Every weight matrix of a model with config `c`, in upload order: the
/// embedding, per layer qkv, o, gate|up and down, then the LM head if untied.
fn matrix_plan(c: &ModelConfig) -> Vec<MatrixPlan> {
    let (h, ffn) = (c.hidden_size, c.intermediate_size);
    let (qd, kd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let family = c.family;
    let one = |name: String, rows, cols| MatrixPlan {
        label: name.clone(),
        rows,
        cols,
        sources: vec![(name, rows)],
    };
    let mut plan = vec![one(family.required(Role::Embed, 0), c.vocab_size, h)];
    for l in 0..c.num_layers {
        let stacked = |label: &str, parts: &[(Role, usize)]| MatrixPlan {
            label: format!("layer {l} {label}"),
            rows: parts.iter().map(|(_, r)| r).sum(),
            cols: h,
            sources: parts
                .iter()
                .map(|&(role, rows)| (family.required(role, l), rows))
                .collect(),
        };
        // A family stores q|k|v and gate|up as one tensor each, or apart.
        let qkv: &[(Role, usize)] = match family.tensor(Role::Qkv, l) {
            Some(_) => &[(Role::Qkv, qd + 2 * kd)],
            None => &[(Role::Q, qd), (Role::K, kd), (Role::V, kd)],
        };
        let gate_up: &[(Role, usize)] = match family.tensor(Role::GateUp, l) {
            Some(_) => &[(Role::GateUp, 2 * ffn)],
            None => &[(Role::Gate, ffn), (Role::Up, ffn)],
        };
        plan.push(stacked("qkv", qkv));
        plan.push(one(family.required(Role::O, l), h, qd));
        plan.push(stacked("gate_up", gate_up));
        plan.push(one(family.required(Role::Down, l), h, ffn));
    }
    if !c.tie_word_embeddings {
        plan.push(one(family.required(Role::LmHead, 0), c.vocab_size, h));
    }
    plan
}

/// Bytes of the weight matrices of a model with config `c` stored as
/// `format` (what [`Model::weight_bytes`] counts once loaded; the norms and
/// biases add a few KiB), computed without overflow, before loading.
pub fn weight_bytes(c: &ModelConfig, format: WeightFormat) -> u128 {
    matrix_plan(c)
        .iter()
        .map(|m| m.rows as u128 * format.row_bytes(m.cols) as u128)
        .sum()
}
