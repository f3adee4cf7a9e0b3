//! What a GGUF file's metadata says about its model: the architecture,
//! the hyperparameters, the vocabulary, and the documents of a Hugging
//! Face folder (config.json, the tokenizer's) that loading and conversion
//! both build from them.

use anyhow::{anyhow, bail, ensure};
use serde_json::{json, Value};

use super::vocab::Vocab;
use crate::family::{Family, GgufLayout};
use crate::gguf::GgufFile;

/// Hyperparameters read from the `{arch}.*` metadata.
pub(crate) struct Hparams {
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Linear RoPE scaling factor, if any.
    pub rope_linear_factor: Option<f32>,
    /// Dimensions of each head RoPE rotates (`rope.dimension_count`; the
    /// head dimension when absent).
    pub rotary_dim: usize,
    pub context_length: usize,
}

impl Hparams {
    pub fn read(g: &GgufFile, layout: &GgufLayout) -> anyhow::Result<Self> {
        let key = |k: &str| format!("{}.{k}", layout.architecture);
        let usize_of = |k: &str| -> anyhow::Result<usize> { Ok(g.get_u32(&key(k))? as usize) };
        let file = g.path.display();

        let hidden = usize_of("embedding_length")?;
        let heads = usize_of("attention.head_count")?;
        // llama.cpp defaults the KV head count to the query head count.
        let kv_heads = match g.opt(&key("attention.head_count_kv"), GgufFile::get_u32)? {
            Some(n) => n as usize,
            None => heads,
        };
        let ffn = usize_of("feed_forward_length")?;
        let layers = usize_of("block_count")?;
        // The same bounds as a config.json (crate::config::LIMITS), before
        // anything is sized from them (a block count of 2^31 grew to 9 GB).
        for (k, dimension, value) in [
            ("embedding_length", "hidden_size", hidden),
            ("feed_forward_length", "intermediate_size", ffn),
            ("block_count", "num_hidden_layers", layers),
            ("attention.head_count", "num_attention_heads", heads),
            ("attention.head_count_kv", "num_key_value_heads", kv_heads),
        ] {
            crate::config::check_dimension(&file.to_string(), &key(k), dimension, value as u64)?;
        }
        ensure!(
            hidden > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
            "{file}: bad attention shape: hidden {hidden}, {heads} heads, {kv_heads} KV heads"
        );
        let head_dim = match g.opt(&key("attention.key_length"), GgufFile::get_u32)? {
            Some(d) => d as usize,
            None => {
                ensure!(
                    hidden % heads == 0,
                    "{file}: hidden size {hidden} is not a multiple of the head count {heads}"
                );
                hidden / heads
            }
        };
        ensure!(
            head_dim > 0 && head_dim % 2 == 0,
            "{file}: head dimension {head_dim} must be even for RoPE"
        );
        if let Some(d) = g.opt(&key("attention.value_length"), GgufFile::get_u32)? {
            ensure!(
                d as usize == head_dim,
                "{file}: value head dimension `{}` is {d}, expected the head dimension {head_dim}",
                key("attention.value_length")
            );
        }
        let rotary_dim = match g.opt(&key("rope.dimension_count"), GgufFile::get_u32)? {
            Some(d) => {
                ensure!(
                    d > 0 && d % 2 == 0 && d as usize <= head_dim,
                    "{file}: `{}` is {d}; expected an even number from 2 to the head dimension {head_dim}",
                    key("rope.dimension_count")
                );
                d as usize
            }
            None => head_dim,
        };

        let rms_norm_eps = g.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        // llama.cpp's default when the key is absent.
        let rope_theta = g
            .opt(&key("rope.freq_base"), GgufFile::get_f32)?
            .unwrap_or(10_000.0);
        ensure!(
            rms_norm_eps.is_finite()
                && rms_norm_eps > 0.0
                && rope_theta.is_finite()
                && rope_theta > 0.0,
            "{file}: RMS norm epsilon {rms_norm_eps} and RoPE base {rope_theta} must be positive"
        );
        // llama3-style scaling has no keys: llama.cpp stores it as a
        // `rope_freqs.weight` tensor, which the tensor mapping rejects.
        let rope_linear_factor = match g.opt(&key("rope.scaling.type"), GgufFile::get_str)? {
            None | Some("none") => None,
            Some("linear") => Some(g.get_f32(&key("rope.scaling.factor"))?),
            Some(other) => bail!(
                "{file}: RoPE scaling type `{other}` is not supported (supported: none, linear)"
            ),
        };

        let params = Self {
            hidden,
            ffn,
            layers,
            heads,
            kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_linear_factor,
            rotary_dim,
            context_length: usize_of("context_length")?,
        };
        Ok(params)
    }
}

/// The JSON documents of a converted model folder, by file name.
pub(crate) type Documents = [(&'static str, Value); 4];

/// Everything known about the model before its tensors are read.
pub(crate) struct ModelMeta<'a> {
    pub family: &'static Family,
    pub layout: &'static GgufLayout,
    pub hp: Hparams,
    pub vocab: Vocab<'a>,
    /// The GGUF has no `output.weight`: the LM head is the embedding matrix.
    pub tied: bool,
    pub attention_bias: bool,
}

impl<'a> ModelMeta<'a> {
    pub fn read(g: &'a GgufFile) -> anyhow::Result<Self> {
        let arch_name = g.get_str("general.architecture")?;
        let family = crate::family::by_gguf_architecture(arch_name).ok_or_else(|| {
            anyhow!(
                "{}: architecture `{arch_name}` is not supported (supported: {})",
                g.path.display(),
                crate::family::supported_gguf_architectures().join(", ")
            )
        })?;
        let layout = family
            .gguf
            .as_ref()
            .expect("a family found by its GGUF name has a layout");
        Ok(Self {
            family,
            layout,
            hp: Hparams::read(g, layout)?,
            vocab: Vocab::read(g)?,
            tied: g.tensor("output.weight").is_none(),
            // Families with biases by choice (Llama, Qwen3, SmolLM3) say so
            // in config.json's `attention_bias`; Qwen2's are always there.
            attention_bias: g.tensor("blk.0.attn_q.bias").is_some(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// config.json, with `torch_dtype` the weights' (`float16`, `float32`).
    pub(crate) fn config_json(&self, g: &GgufFile, torch_dtype: &str) -> anyhow::Result<Value> {
        let (family, hp) = (self.family, &self.hp);
        let rope_scaling = match hp.rope_linear_factor {
            Some(factor) => {
                json!({"rope_type": "linear", "type": "linear", "factor": f32_json(factor)})
            }
            None => Value::Null,
        };
        // transformers >= 5 reads RoPE settings from `rope_parameters`, older
        // versions from `rope_theta`/`rope_scaling`; write both.
        let mut rope_parameters =
            json!({"rope_theta": f32_json(hp.rope_theta), "rope_type": "default"});
        if let Some(factor) = hp.rope_linear_factor {
            rope_parameters["rope_type"] = json!("linear");
            rope_parameters["factor"] = f32_json(factor);
        }
        let mut config = json!({
            "architectures": [family.architectures[0]],
            "model_type": family.model_type,
            "hidden_size": hp.hidden,
            "intermediate_size": hp.ffn,
            "num_hidden_layers": hp.layers,
            "num_attention_heads": hp.heads,
            "num_key_value_heads": hp.kv_heads,
            "head_dim": hp.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": f32_json(hp.rms_norm_eps),
            "rope_theta": f32_json(hp.rope_theta),
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": hp.context_length,
            "vocab_size": self.vocab_size(),
            "tie_word_embeddings": self.tied,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
        });
        config["attention_bias"] = json!(self.attention_bias);
        config["mlp_bias"] = json!(false);
        if hp.rotary_dim != hp.head_dim {
            config["partial_rotary_factor"] = json!(hp.rotary_dim as f64 / hp.head_dim as f64);
        }
        let Value::Object(map) = &mut config else {
            unreachable!("config.json is an object")
        };
        map.extend(self.vocab.special_ids());
        (self.layout.config)(g, map)?;
        Ok(config)
    }

    /// The JSON documents of a converted folder, config.json first;
    /// `torch_dtype` names the weights' type in config.json.
    pub fn documents(&self, g: &GgufFile, torch_dtype: &str) -> anyhow::Result<Documents> {
        Ok([
            ("config.json", self.config_json(g, torch_dtype)?),
            ("tokenizer.json", self.vocab.tokenizer_json(&g.path)?),
            (
                "tokenizer_config.json",
                self.vocab.tokenizer_config_json(self.hp.context_length),
            ),
            (
                "generation_config.json",
                Value::Object(self.vocab.special_ids()),
            ),
        ])
    }
}

/// The shortest decimal that round-trips through `f32`, as an `f64`, so that
/// metadata like the f32 epsilon 1e-5 is written as `1e-5` and not as its
/// exact binary value 9.999999747378752e-6.
fn f32_json(x: f32) -> Value {
    json!(x.to_string().parse::<f64>().unwrap_or(f64::from(x)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_metadata_is_written_as_its_shortest_decimal() {
        assert_eq!(f32_json(1e-5), json!(1e-5));
        assert_ne!(f32_json(1e-5), json!(f64::from(1e-5f32)));
        assert_eq!(f32_json(100000.0), json!(100000.0));
        assert_eq!(f32_json(1e-6), json!(1e-6));
    }
}
