//! Synthetic models: the shape of a real model (a built-in name or any
//! config.json) with seeded random weights generated directly on the GPU, for
//! speed and memory measurements of models whose weights are not at hand.
//! Speed and memory do not depend on the values; the values are scaled
//! (uniform, about 1/sqrt(fan-in); norm weights 1) so that activations stay finite.

use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::formats::WeightFormat;
use crate::gpu::Gpu;
use crate::kernels::random_fill::{reference_value, Distribution, RandomFill};
use crate::model::{LoadOptions, Model};
use crate::weights::{GpuMatrix, WeightSource};

/// The built-in shapes: (name, config.json of the model it copies).
pub fn builtin_shapes() -> Vec<(&'static str, Value)> {
    let llama = |hidden, inter, layers, heads, kv, vocab, tied, theta: f64, scaling: Value| {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
            "tie_word_embeddings": tied, "rope_theta": theta, "rope_scaling": scaling,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "bos_token_id": 1, "eos_token_id": 2,
        })
    };
    let llama3 = |factor: f64| {
        json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    };
    let qwen2 = |hidden, inter, layers, heads, kv, vocab, tied| {
        json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
            "tie_word_embeddings": tied, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072, "bos_token_id": 151643, "eos_token_id": 151645,
        })
    };
    vec![
        (
            "smollm2-135m",
            llama(576, 1536, 30, 9, 3, 49152, true, 100000.0, Value::Null),
        ),
        (
            "llama-3.2-1b",
            llama(2048, 8192, 16, 32, 8, 128256, true, 500000.0, llama3(32.0)),
        ),
        ("qwen2.5-1.5b", qwen2(1536, 8960, 28, 12, 2, 151936, true)),
        (
            "llama-3.1-8b",
            llama(4096, 14336, 32, 32, 8, 128256, false, 500000.0, llama3(8.0)),
        ),
        ("qwen2.5-7b", qwen2(3584, 18944, 28, 28, 4, 152064, false)),
        (
            "qwen3-8b",
            json!({
                "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 151936, "tie_word_embeddings": false, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
                "bos_token_id": 151643, "eos_token_id": 151645,
            }),
        ),
        (
            // The text model of Gemma 3 4B (its vision tower left out).
            "gemma-3-4b",
            json!({
                "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "vocab_size": 262208, "tie_word_embeddings": true, "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": 1,
            }),
        ),
    ]
}

/// The configuration of a built-in shape name or of a config.json path.
pub fn shape_config(spec: &str) -> Result<ModelConfig> {
    if let Some((_, v)) = builtin_shapes().into_iter().find(|(n, _)| *n == spec) {
        return ModelConfig::from_json(&v, Path::new(spec));
    }
    let path = Path::new(spec);
    if path.exists() {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        return ModelConfig::from_file(&file);
    }
    let names: Vec<&str> = builtin_shapes().iter().map(|(n, _)| *n).collect();
    anyhow::bail!(
        "--synthetic {spec}: neither a built-in shape ({}) nor a config.json path",
        names.join(", ")
    )
}

/// FNV-1a of a tensor name mixed with the seed: each tensor its own stream.
fn tensor_seed(seed: u64, name: &str) -> u32 {
    let mut h = 0xcbf29ce484222325u64 ^ seed;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    (h ^ (h >> 32)) as u32
}

/// About how large |quant level x sub-block scale| is in random blocks of
/// `format` (quants spread over their range, for the signed ones around
/// their middle), so that a block scale of `scale / typical_level` gives
/// weights of about `scale`; 1 for the float formats.
fn typical_level(format: WeightFormat) -> f32 {
    match format {
        WeightFormat::F16 | WeightFormat::F32 => 1.0,
        WeightFormat::Q8_0 => 64.0,
        WeightFormat::Q4_0 => 4.0,
        WeightFormat::Q4_1 => 8.0,
        WeightFormat::Q5_0 => 8.0,
        // 6-bit sub-block scales (about 32) times 4- or 5-bit quants.
        WeightFormat::Q4_K => 32.0 * 8.0,
        WeightFormat::Q5_K => 32.0 * 16.0,
        // Signed 8-bit group scales (about 64) times quants centred on 32.
        WeightFormat::Q6_K => 64.0 * 16.0,
    }
}

/// Random weights generated on the GPU.
pub struct RandomWeights {
    fill: RandomFill,
    seed: u64,
}

impl WeightSource for RandomWeights {
    fn fill_rows(
        &self,
        gpu: &Gpu,
        m: &GpuMatrix,
        row0: usize,
        rows: usize,
        name: &str,
    ) -> Result<()> {
        let scale = 1.0 / (m.cols as f32).sqrt();
        for part in &m.parts {
            let d = Distribution {
                seed: tensor_seed(self.seed, name),
                scale: scale / typical_level(part.format),
                offset: 0.0,
            };
            let row_bytes = part.format.row_bytes(m.cols);
            let lo = row0.max(part.row0);
            let hi = (row0 + rows).min(part.row0 + part.rows);
            if lo >= hi {
                continue;
            }
            // Whole words covering the rows (an f16 row of odd length shares a
            // word with its neighbour; both get random values either way).
            let b0 = (lo - part.row0) as u64 * row_bytes;
            let b1 = (hi - part.row0) as u64 * row_bytes;
            let (w0, w1) = (b0 / 4, b1.div_ceil(4));
            self.fill
                .fill(gpu, &part.write_target(gpu), w0, w1 - w0, part.format, d)?;
            // One tensor at a time, as for files: bounded driver-side queues.
            gpu.queue.submit([]);
        }
        Ok(())
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        if name.contains("norm") {
            return Ok(vec![1.0; len]);
        }
        let d = Distribution {
            seed: tensor_seed(self.seed, name),
            scale: 0.02,
            offset: 0.0,
        };
        Ok((0..len as u32).map(|e| reference_value(d, e)).collect())
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}

/// A model of the shape `spec` (built-in name or config.json) with random
/// weights from `seed`, on the adapter `opts.gpu` chooses.
pub fn synthetic_model(spec: &str, opts: &LoadOptions, seed: u64) -> Result<Arc<Model>> {
    let config = shape_config(spec)?;
    let gpu = crate::kernels::runtime::Runtime::open(&opts.gpu)?;
    let source = RandomWeights {
        fill: RandomFill::new(&gpu)?,
        seed,
    };
    Model::upload(
        gpu,
        config,
        &source,
        Path::new(&format!("synthetic:{spec}")),
        opts,
    )
    .with_context(|| format!("building the synthetic model {spec}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineOptions, StepOutput};

    fn parameters(c: &ModelConfig) -> f64 {
        let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
        let q = (c.num_heads * c.head_dim) as f64;
        let head = if c.tie_word_embeddings { 0.0 } else { 1.0 };
        let bias = if c.has_qkv_bias() {
            c.qkv_dim() as f64
        } else {
            0.0
        };
        let layer = h * c.qkv_dim() as f64 + bias + q * h + 3.0 * h * i + 2.0 * h;
        (1.0 + head) * c.vocab_size as f64 * h + c.num_layers as f64 * layer + h
    }

    /// The built-in shapes have the published parameter counts.
    #[test]
    fn shapes_have_their_models_parameter_counts() {
        for (name, billions) in [
            ("smollm2-135m", 0.1345),
            ("llama-3.2-1b", 1.236),
            ("qwen2.5-1.5b", 1.544),
            ("llama-3.1-8b", 8.030),
            ("qwen2.5-7b", 7.616),
            ("qwen3-8b", 8.191),
            ("gemma-3-4b", 3.880),
        ] {
            let p = parameters(&shape_config(name).unwrap()) / 1e9;
            assert!(
                (p / billions - 1.0).abs() < 0.01,
                "{name}: {p:.4}B vs {billions}B"
            );
        }
        let err = shape_config("gpt-5").unwrap_err().to_string();
        assert!(err.contains("llama-3.1-8b"), "{err}");
    }

    /// The smallest shape builds on the GPU and gives finite, seed-dependent
    /// logits, with float weights and with quantized blocks generated in place.
    #[test]
    fn smallest_shape_runs() {
        // The matrices' values (the norms are vectors, not generated on the GPU).
        let values = 134_515_008u64 - (2 * 576 * 30 + 576);
        // Q4_0 rows in groups of 8 blocks (144 bytes): rows of 576 values
        // (q, k, v, o, gate, up, the embeddings) take 3, of 1,536 (down) 6.
        let (rows_576, rows_1536) = (30 * (576 + 2 * 192 + 576 + 2 * 1536) + 49152, 30 * 576);
        for (format, bytes) in [
            (WeightFormat::F16, 2 * values),
            (WeightFormat::Q4_0, (rows_576 * 3 + rows_1536 * 6) * 144),
        ] {
            let logits = |seed| {
                let opts = LoadOptions {
                    dtype: Some(format),
                    ..Default::default()
                };
                let m = synthetic_model("smollm2-135m", &opts, seed).unwrap();
                assert_eq!(m.weight_bytes, bytes, "{format:?}");
                let mut e = Engine::new(
                    m.clone(),
                    EngineOptions {
                        max_slots: 16,
                        max_tokens: 8,
                        max_logit_rows: 1,
                        ..Default::default()
                    },
                )
                .unwrap();
                let ids: Vec<u32> = (0..8).map(|i| i * 1000 + 7).collect();
                let pos: Vec<u32> = (0..8).collect();
                e.step(&ids, &pos, StepOutput::last(8)).unwrap();
                e.read_logits(1).unwrap()
            };
            let a = logits(1);
            assert_eq!(a.len(), 49152);
            assert!(a.iter().all(|x| x.is_finite()), "{format:?}");
            let sd = (a.iter().map(|x| x * x).sum::<f32>() / a.len() as f32).sqrt();
            assert!(sd > 1e-3 && sd < 100.0, "{format:?}: logit rms {sd}");
            let b = logits(2);
            assert!(
                a.iter().zip(&b).any(|(x, y)| x != y),
                "{format:?}: the seed changes the weights"
            );
        }
    }
}
