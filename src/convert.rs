//! Converts a GGUF model (llama or qwen2 architecture, GPT-2 style BPE
//! tokenizer) into a Hugging Face model directory: `model.safetensors`,
//! `config.json`, `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json`.
//!
//! Weights are dequantized to f32 and written as f16 or f32 matrices; norm
//! weights and biases stay f32. The safetensors file is written by hand and
//! streamed one tensor at a time, so memory use is bounded by the largest
//! tensor rather than the model.
//!
//! llama.cpp's converter reorders the rows of the llama q/k projections so
//! that its RoPE, which rotates adjacent pairs `(2j, 2j+1)`, matches HF's
//! `rotate_half`, which rotates `(j, j + d/2)`; this module undoes that (see
//! `hf_source_row`). Qwen2 files are not permuted by llama.cpp and are left
//! alone.
//!
//! Everything is validated before anything is written, and the output is
//! assembled in a sibling directory that is renamed into place at the end, so
//! a failed conversion never leaves a half-written model under `out_dir`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Context};
use half::f16;
use serde_json::{json, Map, Value};

use crate::gguf::{GgufFile, GgufTensorInfo};

use crate::formats::dequant::DEQUANTIZABLE_TYPES;

/// Element type of the converted weight matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutDtype {
    #[default]
    F16,
    F32,
}

impl OutDtype {
    fn safetensors_name(self) -> &'static str {
        match self {
            Self::F16 => "F16",
            Self::F32 => "F32",
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            Self::F16 => "float16",
            Self::F32 => "float32",
        }
    }

    fn size(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

const SUPPORTED_ARCHITECTURES: &str = "llama, qwen2";
const SUPPORTED_TOKENIZERS: &str = "gpt2";

/// GGUF `tokenizer.ggml.token_type` values that become added tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen2,
}

impl Arch {
    fn from_gguf(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The prefix of the architecture's metadata keys.
    fn key_prefix(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// Whether llama.cpp's converter permuted the q/k rows (it does so only
    /// for the llama family; see the module docs).
    fn permutes_qk(self) -> bool {
        self == Self::Llama
    }
}

/// Hyperparameters read from the `{arch}.*` metadata.
struct Hparams {
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rms_norm_eps: f32,
    rope_theta: f32,
    /// Linear RoPE scaling factor, if any.
    rope_linear_factor: Option<f32>,
    context_length: usize,
}

impl Hparams {
    fn read(g: &GgufFile, arch: Arch) -> anyhow::Result<Self> {
        let key = |k: &str| format!("{}.{k}", arch.key_prefix());
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
        for (k, what) in [
            ("attention.value_length", "value head dimension"),
            (
                "rope.dimension_count",
                "RoPE dimension count (partial rotary is not supported)",
            ),
        ] {
            if let Some(d) = g.opt(&key(k), GgufFile::get_u32)? {
                ensure!(
                    d as usize == head_dim,
                    "{file}: {what} `{}` is {d}, expected the head dimension {head_dim}",
                    key(k)
                );
            }
        }

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
            context_length: usize_of("context_length")?,
        };
        Ok(params)
    }
}

/// The tokenizer metadata.
struct Vocab<'a> {
    tokens: Vec<&'a str>,
    /// One per token, or empty when the file has no token types.
    token_types: Vec<i64>,
    merges: Vec<&'a str>,
    pre: &'a str,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<&'a str>,
}

impl<'a> Vocab<'a> {
    fn read(g: &'a GgufFile) -> anyhow::Result<Self> {
        let file = g.path.display();
        let model = g.get_str("tokenizer.ggml.model")?;
        ensure!(
            model == "gpt2",
            "{file}: tokenizer model `{model}` is not supported (supported: {SUPPORTED_TOKENIZERS})"
        );
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let n_tokens = tokens.len() as u64;
        crate::config::check_dimension(
            &file.to_string(),
            "tokenizer.ggml.tokens (its length)",
            "vocab_size",
            n_tokens,
        )?;
        let token_types = g
            .opt("tokenizer.ggml.token_type", GgufFile::get_i64_array)?
            .unwrap_or_default();
        ensure!(
            token_types.is_empty() || token_types.len() == tokens.len(),
            "{file}: {} token types for {} tokens",
            token_types.len(),
            tokens.len()
        );
        let id = |k: &str| -> anyhow::Result<Option<u32>> {
            let id = g.opt(k, GgufFile::get_u32)?;
            if let Some(id) = id {
                ensure!(
                    (id as usize) < tokens.len(),
                    "{file}: `{k}` is {id}, outside the vocabulary of {} tokens",
                    tokens.len()
                );
            }
            Ok(id)
        };
        let vocab = Self {
            merges: g.get_str_array("tokenizer.ggml.merges")?,
            pre: g
                .opt("tokenizer.ggml.pre", GgufFile::get_str)?
                .unwrap_or("default"),
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: g
                .opt("tokenizer.ggml.add_bos_token", GgufFile::get_bool)?
                .unwrap_or(false),
            add_eos: g
                .opt("tokenizer.ggml.add_eos_token", GgufFile::get_bool)?
                .unwrap_or(false),
            chat_template: g.opt("tokenizer.chat_template", GgufFile::get_str)?,
            tokens,
            token_types,
        };
        ensure!(
            !vocab.add_bos || vocab.bos.is_some(),
            "{file}: `tokenizer.ggml.add_bos_token` is set but there is no BOS token id"
        );
        ensure!(
            !vocab.add_eos || vocab.eos.is_some(),
            "{file}: `tokenizer.ggml.add_eos_token` is set but there is no EOS token id"
        );
        Ok(vocab)
    }

    fn token(&self, id: Option<u32>) -> Option<&'a str> {
        id.map(|id| self.tokens[id as usize])
    }

    /// Control tokens (special) and user-defined tokens (not special), which
    /// the tokenizer must match whole before BPE, as llama.cpp does.
    fn added_tokens(&self) -> impl Iterator<Item = (usize, &'a str, bool)> + '_ {
        self.token_types.iter().enumerate().filter_map(|(id, &ty)| {
            let special = match ty {
                TOKEN_TYPE_CONTROL => true,
                TOKEN_TYPE_USER_DEFINED => false,
                _ => return None,
            };
            Some((id, self.tokens[id], special))
        })
    }

    /// `tokenizer.json` for the `tokenizers` library: byte-level BPE with the
    /// GGUF vocabulary (id = index) and merges (rank = index).
    fn tokenizer_json(&self, file: &Path) -> anyhow::Result<Value> {
        let file = file.display();
        let mut vocab = Map::new();
        for (id, &token) in self.tokens.iter().enumerate() {
            if let Some(first) = vocab.insert(token.to_string(), json!(id)) {
                bail!("{file}: token {token:?} appears twice in the vocabulary (ids {first} and {id})");
            }
        }
        let merges = self
            .merges
            .iter()
            .map(|merge| {
                let (left, right) = split_merge(merge).ok_or_else(|| {
                    anyhow!("{file}: merge {merge:?} is not two space-separated tokens")
                })?;
                // `tokenizers` refuses to load merges of unknown tokens; say
                // which one here rather than leave a file that cannot load.
                for part in [left, right, &format!("{left}{right}")] {
                    ensure!(
                        vocab.contains_key(part),
                        "{file}: merge {merge:?} uses {part:?}, which is not in the vocabulary"
                    );
                }
                Ok(json!([left, right]))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;

        let added_tokens: Vec<Value> = self
            .added_tokens()
            .map(|(id, content, special)| {
                json!({
                    "id": id,
                    "content": content,
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": special,
                })
            })
            .collect();

        let byte_level = json!({
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": true,
            "use_regex": true,
        });
        let pre_tokenizer = match self.pre {
            // SmolLM's HF tokenizer splits every digit off before the GPT-2
            // regex (llama.cpp's `smollm` pre-tokenizer does the same).
            "smollm" => json!({
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level],
            }),
            // Every other pre-tokenizer gets GPT-2's regex. That is exact for
            // `gpt2`/`default` only: others (e.g. `llama-bpe`, `qwen2`) split
            // digits and whitespace differently, so their tokenization can
            // differ from llama.cpp's on such text.
            _ => byte_level,
        };

        // As in HF's GPT-2 tokenizer.json. The BOS/EOS llama.cpp adds when
        // encoding are added by a template, as HF's Llama tokenizers do.
        let mut post_processor = json!({
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": false,
            "use_regex": true,
        });
        if self.add_bos || self.add_eos {
            post_processor = json!({
                "type": "Sequence",
                "processors": [post_processor, self.bos_eos_template()],
            });
        }

        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added_tokens,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": true,
                "trim_offsets": true,
                "use_regex": true,
            },
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": merges,
            },
        }))
    }

    /// A `TemplateProcessing` that wraps each sequence in the BOS/EOS tokens
    /// that `add_bos`/`add_eos` ask for.
    fn bos_eos_template(&self) -> Value {
        let bos = self.token(self.bos).filter(|_| self.add_bos);
        let eos = self.token(self.eos).filter(|_| self.add_eos);
        let special =
            |token: &str, type_id: u32| json!({"SpecialToken": {"id": token, "type_id": type_id}});
        let sequence = |type_id: u32| {
            let id = if type_id == 0 { "A" } else { "B" };
            let mut items: Vec<Value> = bos.map(|t| special(t, type_id)).into_iter().collect();
            items.push(json!({"Sequence": {"id": id, "type_id": type_id}}));
            items.extend(eos.map(|t| special(t, type_id)));
            items
        };
        let single = sequence(0);
        let pair: Vec<Value> = single.iter().cloned().chain(sequence(1)).collect();
        let special_tokens: Map<String, Value> = [(bos, self.bos), (eos, self.eos)]
            .into_iter()
            .filter_map(|(token, id)| Some((token?, id?)))
            .map(|(token, id)| {
                (
                    token.to_string(),
                    json!({"id": token, "ids": [id], "tokens": [token]}),
                )
            })
            .collect();
        json!({
            "type": "TemplateProcessing",
            "single": single,
            "pair": pair,
            "special_tokens": special_tokens,
        })
    }

    fn tokenizer_config_json(&self, model_max_length: usize) -> Value {
        let added_tokens_decoder: Map<String, Value> = self
            .added_tokens()
            .map(|(id, content, special)| {
                let entry = json!({
                    "content": content,
                    "lstrip": false,
                    "normalized": false,
                    "rstrip": false,
                    "single_word": false,
                    "special": special,
                });
                (id.to_string(), entry)
            })
            .collect();
        let mut config = json!({
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "add_prefix_space": false,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": self.token(self.bos),
            "eos_token": self.token(self.eos),
            "unk_token": self.token(self.unk),
            "pad_token": self.token(self.pad),
            "clean_up_tokenization_spaces": false,
            "model_max_length": model_max_length,
            // tokenizer.json describes the tokenizer completely; the generic
            // fast class uses it as is.
            "tokenizer_class": "PreTrainedTokenizerFast",
        });
        if let Some(template) = self.chat_template {
            config["chat_template"] = json!(template);
        }
        config
    }

    /// The special token ids that are present, for `config.json` and
    /// `generation_config.json`.
    fn special_ids(&self) -> Map<String, Value> {
        [
            ("bos_token_id", self.bos),
            ("eos_token_id", self.eos),
            ("pad_token_id", self.pad),
        ]
        .into_iter()
        .filter_map(|(key, id)| Some((key.to_string(), json!(id?))))
        .collect()
    }
}

/// Splits a GGUF merge `"left right"`. Byte-level BPE tokens never contain a
/// plain space, but like llama.cpp the split ignores the first character so
/// that a token that is a space itself still splits correctly.
fn split_merge(merge: &str) -> Option<(&str, &str)> {
    let first = merge.chars().next()?.len_utf8();
    let at = first + merge[first..].find(' ')?;
    Some((&merge[..at], &merge[at + 1..]))
}

/// The shortest decimal that round-trips through `f32`, as an `f64`, so that
/// metadata like the f32 epsilon 1e-5 is written as `1e-5` and not as its
/// exact binary value 9.999999747378752e-6.
fn f32_json(x: f32) -> Value {
    json!(x.to_string().parse::<f64>().unwrap_or(f64::from(x)))
}

/// For output row `row` of an HF q/k projection, the row of the llama.cpp
/// (GGUF) matrix that holds it. llama.cpp's converter wrote
/// `W_gguf[h·d + 2j + i] = W_hf[h·d + i·d/2 + j]` for head `h`, `i ∈ {0,1}`,
/// `j ∈ [0, d/2)`: within each head it interleaved the two halves that HF's
/// `rotate_half` pairs up. This inverts it.
pub(crate) fn hf_source_row(row: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    let (head, within) = (row / head_dim, row % head_dim);
    let (i, j) = (within / half, within % half);
    head * head_dim + 2 * j + i
}

/// One tensor of the output file.
struct OutTensor<'a> {
    src: &'a GgufTensorInfo,
    name: String,
    /// Row-major shape, e.g. `[out_features, in_features]`.
    shape: Vec<usize>,
    dtype: OutDtype,
    /// Undo llama.cpp's q/k row permutation with this many heads.
    qk_heads: Option<usize>,
}

impl OutTensor<'_> {
    fn n_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// What a GGUF tensor of the architecture becomes.
struct Target {
    name: String,
    shape: Vec<usize>,
    qk_heads: Option<usize>,
    required: bool,
}

/// Everything known about the model before its tensors are read.
struct Model<'a> {
    arch: Arch,
    hp: Hparams,
    vocab: Vocab<'a>,
    /// The GGUF has no `output.weight`: the LM head is the embedding matrix.
    tied: bool,
    attention_bias: bool,
}

impl<'a> Model<'a> {
    fn read(g: &'a GgufFile) -> anyhow::Result<Self> {
        let arch_name = g.get_str("general.architecture")?;
        let arch = Arch::from_gguf(arch_name).ok_or_else(|| {
            anyhow!(
                "{}: architecture `{arch_name}` is not supported (supported: {SUPPORTED_ARCHITECTURES})",
                g.path.display()
            )
        })?;
        Ok(Self {
            arch,
            hp: Hparams::read(g, arch)?,
            vocab: Vocab::read(g)?,
            tied: g.tensor("output.weight").is_none(),
            // Qwen2 always has q/k/v biases; llama only with `attention_bias`.
            attention_bias: arch == Arch::Qwen2 || g.tensor("blk.0.attn_q.bias").is_some(),
        })
    }

    fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// Maps the GGUF tensors to HF names and checks them against the shapes
    /// the hyperparameters imply: every tensor must be known, of a
    /// dequantizable type and of the right shape, and every required tensor
    /// present.
    fn plan_tensors(&self, g: &'a GgufFile, dtype: OutDtype) -> anyhow::Result<Vec<OutTensor<'a>>> {
        let (arch, hp, vocab_size) = (self.arch, &self.hp, self.vocab_size());
        let file = g.path.display();
        let (hidden, q_rows, kv_rows) =
            (hp.hidden, hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim);
        let q_heads = arch.permutes_qk().then_some(hp.heads);
        let k_heads = arch.permutes_qk().then_some(hp.kv_heads);

        // (GGUF name, HF name, row-major shape, heads whose q/k rows to un-permute)
        #[rustfmt::skip]
        let mut per_layer = vec![
            ("attn_norm.weight",   "input_layernorm.weight",          vec![hidden],         None),
            ("ffn_norm.weight",    "post_attention_layernorm.weight", vec![hidden],         None),
            ("attn_q.weight",      "self_attn.q_proj.weight",         vec![q_rows, hidden], q_heads),
            ("attn_k.weight",      "self_attn.k_proj.weight",         vec![kv_rows, hidden], k_heads),
            ("attn_v.weight",      "self_attn.v_proj.weight",         vec![kv_rows, hidden], None),
            ("attn_output.weight", "self_attn.o_proj.weight",         vec![hidden, q_rows], None),
            ("ffn_gate.weight",    "mlp.gate_proj.weight",            vec![hp.ffn, hidden], None),
            ("ffn_up.weight",      "mlp.up_proj.weight",              vec![hp.ffn, hidden], None),
            ("ffn_down.weight",    "mlp.down_proj.weight",            vec![hidden, hp.ffn], None),
        ];
        if self.attention_bias {
            #[rustfmt::skip]
            per_layer.extend([
                ("attn_q.bias", "self_attn.q_proj.bias", vec![q_rows], q_heads),
                ("attn_k.bias", "self_attn.k_proj.bias", vec![kv_rows], k_heads),
                ("attn_v.bias", "self_attn.v_proj.bias", vec![kv_rows], None),
            ]);
            // HF's Llama `attention_bias` covers o_proj too; Qwen2 has none there.
            if arch == Arch::Llama {
                #[rustfmt::skip]
                per_layer.push(("attn_output.bias", "self_attn.o_proj.bias", vec![hidden], None));
            }
        }

        // (GGUF name, HF name, row-major shape, required)
        #[rustfmt::skip]
        let mut expected: BTreeMap<String, Target> = [
            ("token_embd.weight",  "model.embed_tokens.weight", vec![vocab_size, hidden], true),
            ("output_norm.weight", "model.norm.weight",         vec![hidden],             true),
            // Absent when the LM head is tied to the embeddings.
            ("output.weight",      "lm_head.weight",            vec![vocab_size, hidden], false),
        ]
        .into_iter()
        .map(|(gguf, hf, shape, required)| {
            let target = Target { name: hf.to_string(), shape, qk_heads: None, required };
            (gguf.to_string(), target)
        })
        .collect();
        for layer in 0..hp.layers {
            for (gguf, hf, shape, qk_heads) in &per_layer {
                let target = Target {
                    name: format!("model.layers.{layer}.{hf}"),
                    shape: shape.clone(),
                    qk_heads: *qk_heads,
                    required: true,
                };
                expected.insert(format!("blk.{layer}.{gguf}"), target);
            }
        }

        let mut planned = Vec::with_capacity(g.tensors.len());
        for t in &g.tensors {
            let Some(target) = expected.remove(&t.name) else {
                let hint = if t.name == "rope_freqs.weight" {
                    " (llama3-style RoPE frequency scaling is not supported)"
                } else {
                    ""
                };
                bail!(
                    "{file}: unexpected tensor `{}` for a {} model{hint}",
                    t.name,
                    arch.key_prefix()
                );
            };
            let shape = t
                .shape()
                .into_iter()
                .map(usize::try_from)
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("{file}: tensor `{}` is too large", t.name))?;
            ensure!(
                shape == target.shape,
                "{file}: tensor `{}` has shape {shape:?}, expected {:?}",
                t.name,
                target.shape
            );
            ensure!(
                DEQUANTIZABLE_TYPES.contains(&t.ggml_type),
                "{file}: tensor `{}` has type {}, which cannot be converted (supported: {})",
                t.name,
                t.ggml_type,
                DEQUANTIZABLE_TYPES.map(|t| t.name()).join(", ")
            );
            planned.push(OutTensor {
                src: t,
                name: target.name,
                // Vectors (norm weights, biases) are tiny and precision-sensitive.
                dtype: if shape.len() == 1 {
                    OutDtype::F32
                } else {
                    dtype
                },
                shape,
                qk_heads: target.qk_heads,
            });
        }
        if let Some((name, _)) = expected.iter().find(|(_, t)| t.required) {
            bail!("{file}: tensor `{name}` is missing");
        }
        // As safetensors' own writer does: larger elements first, then by name,
        // so that every tensor starts at a multiple of its element size.
        planned.sort_by(|a, b| {
            b.dtype
                .size()
                .cmp(&a.dtype.size())
                .then_with(|| a.name.cmp(&b.name))
        });
        Ok(planned)
    }

    fn config_json(&self, dtype: OutDtype) -> Value {
        let (arch, hp) = (self.arch, &self.hp);
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
            "architectures": [arch.hf_class()],
            "model_type": arch.key_prefix(),
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
            "torch_dtype": dtype.torch_name(),
            "dtype": dtype.torch_name(),
        });
        if arch == Arch::Llama {
            config["attention_bias"] = json!(self.attention_bias);
            config["mlp_bias"] = json!(false);
        }
        if let Value::Object(map) = &mut config {
            map.extend(self.vocab.special_ids());
        }
        config
    }
}

/// The JSON documents of a converted model folder, by file name.
pub(crate) type Documents = [(&'static str, Value); 4];

/// Everything a conversion checks and builds before it writes anything: the
/// hyperparameters, the vocabulary, every tensor's name, type and shape, and
/// the JSON documents.
fn plan(g: &GgufFile, dtype: OutDtype) -> anyhow::Result<(Vec<OutTensor<'_>>, Documents)> {
    let model = Model::read(g)?;
    let tensors = model.plan_tensors(g, dtype)?;
    let documents = [
        ("config.json", model.config_json(dtype)),
        ("tokenizer.json", model.vocab.tokenizer_json(&g.path)?),
        (
            "tokenizer_config.json",
            model.vocab.tokenizer_config_json(model.hp.context_length),
        ),
        (
            "generation_config.json",
            Value::Object(model.vocab.special_ids()),
        ),
    ];
    Ok((tensors, documents))
}

/// Hugging Face tensor name -> (index of its GGUF tensor, heads whose q/k
/// rows to un-permute).
pub(crate) type LoadingIndex = std::collections::HashMap<String, (usize, Option<usize>)>;

/// What loading `g` directly needs: each Hugging Face tensor name with the
/// index of its GGUF tensor and the heads whose q/k rows to un-permute, and
/// the JSON documents (config.json first).
pub(crate) fn plan_for_loading(g: &GgufFile) -> anyhow::Result<(LoadingIndex, Documents)> {
    let (tensors, documents) = plan(g, OutDtype::F32)?;
    let index = tensors
        .iter()
        .map(|t| {
            let i = g
                .tensors
                .iter()
                .position(|x| std::ptr::eq(x, t.src))
                .expect("planned tensors come from the file");
            (t.name.clone(), (i, t.qk_heads))
        })
        .collect();
    Ok((index, documents))
}

/// Whether `g` would convert: every check of [`convert_gguf`] but the output
/// folder's, and every tensor's data read and dequantized, without writing.
pub fn check_convertible(g: &GgufFile) -> anyhow::Result<()> {
    let (tensors, _) = plan(g, OutDtype::F32)?;
    for t in &tensors {
        g.dequantize(t.src)?;
    }
    Ok(())
}

/// Converts the GGUF model at `input` into a Hugging Face model directory at
/// `out_dir`, which must not exist or be empty. Matrices are written as
/// `dtype`; norm weights and biases always as f32. `progress(done, total,
/// name)` is called after each tensor is written.
pub fn convert_gguf(
    input: &Path,
    out_dir: &Path,
    dtype: OutDtype,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> anyhow::Result<()> {
    if out_dir.exists() {
        let mut entries = fs::read_dir(out_dir).with_context(|| {
            format!(
                "output path {} exists and is not a readable directory",
                out_dir.display()
            )
        })?;
        ensure!(
            entries.next().is_none(),
            "output directory {} already exists and is not empty; remove it or choose another",
            out_dir.display()
        );
    }

    let g = GgufFile::open(input)?;
    let (tensors, documents) = plan(&g, dtype)?;

    let partial = partial_dir(out_dir)?;
    fs::create_dir(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let unfinished = crate::files::Unfinished::new(partial.clone());
    write_safetensors(&g, &tensors, &partial.join("model.safetensors"), progress)?;
    for (name, doc) in &documents {
        let path = partial.join(name);
        let text = serde_json::to_string_pretty(doc)? + "\n";
        fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if out_dir.exists() {
        // Checked to be empty above; rename cannot replace it everywhere.
        fs::remove_dir(out_dir).with_context(|| format!("cannot replace {}", out_dir.display()))?;
    }
    fs::rename(&partial, out_dir).with_context(|| {
        format!(
            "cannot rename {} to {}",
            partial.display(),
            out_dir.display()
        )
    })?;
    unfinished.finish();
    Ok(())
}

/// `<out_dir>.partial-<pid>` next to `out_dir`: on the same file system, so
/// that the final rename is atomic. Creates the parent directory if needed.
fn partial_dir(out_dir: &Path) -> anyhow::Result<PathBuf> {
    let name = out_dir
        .file_name()
        .ok_or_else(|| anyhow!("output directory {} has no name", out_dir.display()))?;
    let mut partial_name = name.to_os_string();
    partial_name.push(format!(".partial-{}", std::process::id()));
    let partial = out_dir.with_file_name(partial_name);
    if let Some(parent) = partial.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    // Left over by an earlier run that died with this same process id.
    if partial.exists() {
        fs::remove_dir_all(&partial)
            .with_context(|| format!("cannot remove stale {}", partial.display()))?;
    }
    Ok(partial)
}

/// Writes a safetensors file: `u64` header length, JSON header padded with
/// spaces to a multiple of 8, then the tensors back to back, each dequantized
/// and encoded just before it is written.
fn write_safetensors(
    g: &GgufFile,
    tensors: &[OutTensor],
    path: &Path,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> anyhow::Result<()> {
    let header = safetensors_header(tensors);
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let io_err = || format!("cannot write {}", path.display());
    out.write_all(&(header.len() as u64).to_le_bytes())
        .with_context(io_err)?;
    out.write_all(header.as_bytes()).with_context(io_err)?;

    let mut row_bytes = Vec::new();
    for (done, t) in tensors.iter().enumerate() {
        let values = g.dequantize(t.src)?;
        let rows = t.shape[0];
        let row_len = values.len() / rows;
        for row in 0..rows {
            let src = match t.qk_heads {
                Some(heads) => hf_source_row(row, rows / heads),
                None => row,
            };
            let src = &values[src * row_len..(src + 1) * row_len];
            row_bytes.clear();
            match t.dtype {
                OutDtype::F16 => {
                    row_bytes.extend(src.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()))
                }
                OutDtype::F32 => row_bytes.extend(src.iter().flat_map(|&x| x.to_le_bytes())),
            }
            out.write_all(&row_bytes).with_context(io_err)?;
        }
        progress(done + 1, tensors.len(), &t.name);
    }
    out.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|file| file.sync_all())
        .with_context(io_err)
}

/// The safetensors JSON header, with `data_offsets` in the order the tensors
/// are written. Built by hand because `serde_json` maps sort their keys.
fn safetensors_header(tensors: &[OutTensor]) -> String {
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0;
    for t in tensors {
        let end = offset + t.n_bytes();
        let shape: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        write!(
            header,
            r#",{}:{{"dtype":"{}","shape":[{}],"data_offsets":[{offset},{end}]}}"#,
            Value::String(t.name.clone()),
            t.dtype.safetensors_name(),
            shape.join(","),
        )
        .expect("writing to a String cannot fail");
        offset = end;
    }
    header.push('}');
    let padded = header.len().next_multiple_of(8);
    header.extend(std::iter::repeat_n(' ', padded - header.len()));
    header
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::{GgufBuilder, TempDir};
    use safetensors::{Dtype, SafeTensors};
    use std::time::Instant;
    use tokenizers::Tokenizer;

    #[test]
    fn source_rows_invert_llama_cpp_permutation() {
        // llama.cpp's forward permutation, written as it is in its converter:
        // view the rows as [heads, 2, d/2], swap the last two axes.
        let (heads, d) = (3, 8);
        let mut gguf_of_hf = vec![0; heads * d];
        for h in 0..heads {
            for i in 0..2 {
                for j in 0..d / 2 {
                    gguf_of_hf[h * d + i * (d / 2) + j] = h * d + j * 2 + i;
                }
            }
        }
        for (hf_row, &gguf_row) in gguf_of_hf.iter().enumerate() {
            assert_eq!(hf_source_row(hf_row, d), gguf_row, "row {hf_row}");
        }
        assert_eq!(
            (0..4).map(|r| hf_source_row(r, 4)).collect::<Vec<_>>(),
            [0, 2, 1, 3]
        );
    }

    #[test]
    fn merges_split_like_llama_cpp() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("  x"), Some((" ", "x")));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
    }

    #[test]
    fn f32_metadata_is_written_as_its_shortest_decimal() {
        assert_eq!(f32_json(1e-5), json!(1e-5));
        assert_ne!(f32_json(1e-5), json!(f64::from(1e-5f32)));
        assert_eq!(f32_json(100000.0), json!(100000.0));
        assert_eq!(f32_json(1e-6), json!(1e-6));
    }

    const HIDDEN: u64 = 8;
    const FFN: u64 = 12;
    const HEADS: u64 = 2;
    const KV_HEADS: u64 = 1;
    const HEAD_DIM: u64 = HIDDEN / HEADS;
    const TOKENS: [&str; 6] = ["<s>", "</s>", "a", "b", "ab", "Ġ"];

    /// Values where row r of a tensor holds r * 100 + column, so that any
    /// row reordering or transposition is visible.
    fn rows_tensor(b: GgufBuilder, name: &str, dims: &[u64]) -> GgufBuilder {
        let (cols, rows) = (dims[0], dims.get(1).copied().unwrap_or(1));
        let values: Vec<f32> = (0..rows)
            .flat_map(|r| (0..cols).map(move |c| (r * 100 + c) as f32))
            .collect();
        b.f32_tensor(name, dims, &values)
    }

    /// A complete two-layer model of the given architecture.
    fn tiny_model(arch: &str, biases: bool, lm_head: bool) -> GgufBuilder {
        let key = |k: &str| format!("{arch}.{k}");
        let mut b = GgufBuilder::default()
            .str("general.architecture", arch)
            .u32(&key("block_count"), 2)
            .u32(&key("context_length"), 64)
            .u32(&key("embedding_length"), HIDDEN as u32)
            .u32(&key("feed_forward_length"), FFN as u32)
            .u32(&key("attention.head_count"), HEADS as u32)
            .u32(&key("attention.head_count_kv"), KV_HEADS as u32)
            .f32(&key("attention.layer_norm_rms_epsilon"), 1e-6)
            .f32(&key("rope.freq_base"), 1e6)
            .str("tokenizer.ggml.model", "gpt2")
            .str("tokenizer.ggml.pre", "default")
            .str_array("tokenizer.ggml.tokens", &TOKENS)
            .i32_array("tokenizer.ggml.token_type", &[3, 3, 1, 1, 1, 1])
            .str_array("tokenizer.ggml.merges", &["a b"])
            .u32("tokenizer.ggml.bos_token_id", 0)
            .u32("tokenizer.ggml.eos_token_id", 1)
            .str("tokenizer.chat_template", "{{ messages }}");
        let vocab = TOKENS.len() as u64;
        b = rows_tensor(b, "token_embd.weight", &[HIDDEN, vocab]);
        b = rows_tensor(b, "output_norm.weight", &[HIDDEN]);
        if lm_head {
            b = rows_tensor(b, "output.weight", &[HIDDEN, vocab]);
        }
        let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        for l in 0..2 {
            let mut tensors = vec![
                ("attn_norm.weight", vec![HIDDEN]),
                ("ffn_norm.weight", vec![HIDDEN]),
                ("attn_q.weight", vec![HIDDEN, q]),
                ("attn_k.weight", vec![HIDDEN, kv]),
                ("attn_v.weight", vec![HIDDEN, kv]),
                ("attn_output.weight", vec![q, HIDDEN]),
                ("ffn_gate.weight", vec![HIDDEN, FFN]),
                ("ffn_up.weight", vec![HIDDEN, FFN]),
                ("ffn_down.weight", vec![FFN, HIDDEN]),
            ];
            if biases {
                tensors.extend([
                    ("attn_q.bias", vec![q]),
                    ("attn_k.bias", vec![kv]),
                    ("attn_v.bias", vec![kv]),
                ]);
            }
            for (name, dims) in tensors {
                b = rows_tensor(b, &format!("blk.{l}.{name}"), &dims);
            }
        }
        b
    }

    fn convert_bytes(dir: &TempDir, bytes: &[u8], dtype: OutDtype) -> anyhow::Result<PathBuf> {
        let input = dir.write("model.gguf", bytes);
        let out = dir.0.join("hf");
        let mut calls = Vec::new();
        convert_gguf(&input, &out, dtype, &mut |done, total, name| {
            calls.push((done, total, name.to_string()))
        })?;
        let total = calls.len();
        for (i, (done, n, _)) in calls.iter().enumerate() {
            assert_eq!((*done, *n), (i + 1, total));
        }
        Ok(out)
    }

    fn read_json(path: &Path) -> Value {
        serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap()
    }

    /// Row `r` of a converted tensor, read back as f32.
    fn rows_of(st: &SafeTensors, name: &str) -> Vec<Vec<f32>> {
        let t = st.tensor(name).unwrap();
        let values: Vec<f32> = match t.dtype() {
            Dtype::F32 => t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            Dtype::F16 => t
                .data()
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => panic!("unexpected dtype {other:?}"),
        };
        let cols = t.shape().get(1).copied().unwrap_or(1);
        values.chunks(cols).map(<[f32]>::to_vec).collect()
    }

    /// The first value of each row, which identifies the GGUF row it came from.
    fn row_ids(st: &SafeTensors, name: &str) -> Vec<f32> {
        rows_of(st, name).iter().map(|r| r[0] / 100.0).collect()
    }

    #[test]
    fn llama_conversion_unpermutes_q_and_k_only() {
        let dir = TempDir::new("convert-llama");
        let out = convert_bytes(
            &dir,
            &tiny_model("llama", false, false).build(),
            OutDtype::F16,
        )
        .unwrap();
        let bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), 2 + 2 * 9);
        assert!(st.tensor("lm_head.weight").is_err());

        // head_dim 4: HF row h*4 + i*2 + j comes from GGUF row h*4 + 2j + i.
        assert_eq!(
            row_ids(&st, "model.layers.1.self_attn.q_proj.weight"),
            [0., 2., 1., 3., 4., 6., 5., 7.]
        );
        assert_eq!(
            row_ids(&st, "model.layers.0.self_attn.k_proj.weight"),
            [0., 2., 1., 3.]
        );
        assert_eq!(
            row_ids(&st, "model.layers.0.self_attn.v_proj.weight"),
            [0., 1., 2., 3.]
        );
        // No transpose: GGUF ne = [in, out] is HF [out, in], values intact.
        let down = st.tensor("model.layers.0.mlp.down_proj.weight").unwrap();
        assert_eq!(
            (down.dtype(), down.shape()),
            (Dtype::F16, &[HIDDEN as usize, FFN as usize][..])
        );
        assert_eq!(
            rows_of(&st, "model.layers.0.mlp.down_proj.weight")[3][11],
            311.0
        );
        let norm = st.tensor("model.layers.0.input_layernorm.weight").unwrap();
        assert_eq!(
            (norm.dtype(), norm.shape()),
            (Dtype::F32, &[HIDDEN as usize][..])
        );
        assert_eq!(
            st.tensor("model.embed_tokens.weight").unwrap().shape(),
            [TOKENS.len(), HIDDEN as usize]
        );

        let config = read_json(&out.join("config.json"));
        let expected = json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
            "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 64, "vocab_size": 6, "tie_word_embeddings": true,
            "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "rope_scaling": null,
            "torch_dtype": "float16", "attention_bias": false,
        });
        for (key, value) in expected.as_object().unwrap() {
            assert_eq!(&config[key], value, "config.json {key}");
        }
        assert!(config.get("pad_token_id").is_none());
        assert_eq!(
            read_json(&out.join("generation_config.json")),
            json!({"bos_token_id": 0, "eos_token_id": 1})
        );
        let tok_config = read_json(&out.join("tokenizer_config.json"));
        assert_eq!(tok_config["bos_token"], "<s>");
        assert_eq!(tok_config["pad_token"], Value::Null);
        assert_eq!(tok_config["chat_template"], "{{ messages }}");
        assert_eq!(tok_config["added_tokens_decoder"]["1"]["content"], "</s>");

        let tokenizer = Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        let enc = tokenizer.encode("ab a</s>", true).unwrap();
        assert_eq!(enc.get_ids(), [4, 5, 2, 1]);
        assert_eq!(tokenizer.decode(enc.get_ids(), false).unwrap(), "ab a</s>");
        assert_eq!(tokenizer.decode(enc.get_ids(), true).unwrap(), "ab a");
        assert!(fs::read_dir(&dir.0).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("partial")));
    }

    #[test]
    fn qwen2_conversion_keeps_row_order_and_biases() {
        let dir = TempDir::new("convert-qwen2");
        let out = convert_bytes(
            &dir,
            &tiny_model("qwen2", true, true).build(),
            OutDtype::F32,
        )
        .unwrap();
        let bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), 3 + 2 * 12);
        assert_eq!(
            row_ids(&st, "model.layers.0.self_attn.q_proj.weight"),
            [0., 1., 2., 3., 4., 5., 6., 7.]
        );
        let bias = st.tensor("model.layers.1.self_attn.k_proj.bias").unwrap();
        assert_eq!(
            (bias.dtype(), bias.shape()),
            (Dtype::F32, &[HEAD_DIM as usize][..])
        );
        // A 1-D tensor of row-major values: element c is c.
        assert_eq!(
            rows_of(&st, "model.layers.1.self_attn.k_proj.bias")[2],
            [2.0]
        );
        assert_eq!(st.tensor("lm_head.weight").unwrap().dtype(), Dtype::F32);
        let config = read_json(&out.join("config.json"));
        assert_eq!(config["architectures"], json!(["Qwen2ForCausalLM"]));
        assert_eq!(config["model_type"], "qwen2");
        assert_eq!(config["tie_word_embeddings"], false);
        assert_eq!(config["torch_dtype"], "float32");
    }

    #[test]
    fn llama_biases_are_unpermuted_and_required_together() {
        let dir = TempDir::new("convert-llama-bias");
        // q/k/v biases without the o_proj bias HF's attention_bias implies.
        let err = convert_bytes(
            &dir,
            &tiny_model("llama", true, false).build(),
            OutDtype::F16,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("`blk.0.attn_output.bias` is missing"),
            "{err}"
        );

        let mut b = tiny_model("llama", true, false);
        for l in 0..2 {
            b = rows_tensor(b, &format!("blk.{l}.attn_output.bias"), &[HIDDEN]);
        }
        let out = convert_bytes(&dir, &b.build(), OutDtype::F16).unwrap();
        let bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let q_bias: Vec<f32> = rows_of(&st, "model.layers.0.self_attn.q_proj.bias").concat();
        assert_eq!(q_bias, [0., 2., 1., 3., 4., 6., 5., 7.]);
        assert_eq!(read_json(&out.join("config.json"))["attention_bias"], true);
    }

    #[test]
    fn add_bos_token_is_applied_by_the_tokenizer() {
        let dir = TempDir::new("convert-bos");
        let b = tiny_model("llama", false, false).bool("tokenizer.ggml.add_bos_token", true);
        let out = convert_bytes(&dir, &b.build(), OutDtype::F16).unwrap();
        let tokenizer = Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        assert_eq!(tokenizer.encode("ab", true).unwrap().get_ids(), [0, 4]);
        assert_eq!(tokenizer.encode("ab", false).unwrap().get_ids(), [4]);
        assert_eq!(
            tokenizer.encode(("a", "b"), true).unwrap().get_ids(),
            [0, 2, 0, 3]
        );
        assert_eq!(
            read_json(&out.join("tokenizer_config.json"))["add_bos_token"],
            true
        );
    }

    fn convert_err(tag: &str, bytes: &[u8]) -> String {
        let dir = TempDir::new(tag);
        let err = match convert_bytes(&dir, bytes, OutDtype::F16) {
            Ok(_) => panic!("{tag}: conversion should fail"),
            Err(e) => e.to_string(),
        };
        // Nothing is left behind: no output, no partial directory.
        let leftovers: Vec<_> = fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, ["model.gguf"], "{tag}");
        err
    }

    #[test]
    fn unsupported_inputs_are_clear_errors() {
        let msg = convert_err(
            "convert-arch",
            &GgufBuilder::default()
                .str("general.architecture", "gemma3")
                .build(),
        );
        assert!(
            msg.contains("architecture `gemma3` is not supported (supported: llama, qwen2)"),
            "{msg}"
        );
        assert!(msg.contains("model.gguf"), "{msg}");

        let spm = tiny_model("llama", false, false)
            .remove("tokenizer.ggml.model")
            .str("tokenizer.ggml.model", "llama");
        let msg = convert_err("convert-spm", &spm.build());
        assert!(
            msg.contains("tokenizer model `llama` is not supported (supported: gpt2)"),
            "{msg}"
        );

        let extra = rows_tensor(
            tiny_model("llama", false, false),
            "blk.2.ffn_up.weight",
            &[HIDDEN, FFN],
        );
        let msg = convert_err("convert-extra", &extra.build());
        assert!(
            msg.contains("unexpected tensor `blk.2.ffn_up.weight` for a llama model"),
            "{msg}"
        );

        let rope_freqs = rows_tensor(
            tiny_model("llama", false, false),
            "rope_freqs.weight",
            &[HEAD_DIM / 2],
        );
        let msg = convert_err("convert-rope-freqs", &rope_freqs.build());
        assert!(msg.contains("llama3-style RoPE"), "{msg}");

        let wrong_shape = rows_tensor(
            tiny_model("llama", false, false),
            "output.weight",
            &[HIDDEN, 7],
        );
        let msg = convert_err("convert-shape", &wrong_shape.build());
        assert!(
            msg.contains("tensor `output.weight` has shape [7, 8], expected [6, 8]"),
            "{msg}"
        );

        // Issue #11: dimensions out of range are refused by the config
        // limits before anything is sized from them (2^31 blocks grew to 9 GB).
        for (k, v, want) in [
            (
                "block_count",
                1u32 << 31,
                "llama.block_count is 2147483648; expected 1 to 1024",
            ),
            ("block_count", 0, "llama.block_count is 0; expected 1 to"),
            (
                "embedding_length",
                u32::MAX,
                "llama.embedding_length is 4294967295",
            ),
            ("feed_forward_length", 0, "llama.feed_forward_length is 0"),
        ] {
            let bad = tiny_model("llama", false, false)
                .remove(&format!("llama.{k}"))
                .u32(&format!("llama.{k}"), v);
            let msg = convert_err("convert-limits", &bad.build());
            assert!(msg.contains(want), "{k} {v}: {msg}");
        }
    }

    #[test]
    fn truncated_input_is_an_error_naming_the_file() {
        let bytes = tiny_model("llama", false, false).build();
        for cut in [0, 3, 20, 200, bytes.len() / 2, bytes.len() - 1] {
            let msg = convert_err("convert-truncated", &bytes[..cut]);
            assert!(
                msg.contains("model.gguf: invalid GGUF file"),
                "cut {cut}: {msg}"
            );
        }
    }

    #[test]
    fn unsupported_tensor_type_fails_before_writing() {
        // A real model shape (ne0 = 256) whose FFN is Q2_K.
        let arch = "llama";
        let key = |k: &str| format!("{arch}.{k}");
        let mut b = GgufBuilder::default()
            .str("general.architecture", arch)
            .u32(&key("block_count"), 1)
            .u32(&key("context_length"), 64)
            .u32(&key("embedding_length"), 256)
            .u32(&key("feed_forward_length"), 256)
            .u32(&key("attention.head_count"), 4)
            .f32(&key("attention.layer_norm_rms_epsilon"), 1e-6)
            .str("tokenizer.ggml.model", "gpt2")
            .str_array("tokenizer.ggml.tokens", &["a"])
            .str_array("tokenizer.ggml.merges", &[]);
        for (name, dims) in [
            ("token_embd.weight", vec![256, 1]),
            ("output_norm.weight", vec![256]),
            ("blk.0.attn_norm.weight", vec![256]),
            ("blk.0.ffn_norm.weight", vec![256]),
            ("blk.0.attn_q.weight", vec![256, 256]),
            ("blk.0.attn_k.weight", vec![256, 256]),
            ("blk.0.attn_v.weight", vec![256, 256]),
            ("blk.0.attn_output.weight", vec![256, 256]),
            ("blk.0.ffn_gate.weight", vec![256, 256]),
            ("blk.0.ffn_down.weight", vec![256, 256]),
        ] {
            let n: u64 = dims.iter().product();
            b = b.f32_tensor(name, &dims, &vec![0.0; n as usize]);
        }
        b = b.tensor("blk.0.ffn_up.weight", &[256, 256], 10, vec![0; 84 * 256]);
        let msg = convert_err("convert-q2k", &b.build());
        assert!(
            msg.contains("`blk.0.ffn_up.weight` has type Q2_K, which cannot be converted"),
            "{msg}"
        );
    }

    #[test]
    fn existing_output_directory_must_be_empty() {
        let dir = TempDir::new("convert-exists");
        let input = dir.write("model.gguf", &tiny_model("llama", false, false).build());
        let out = dir.0.join("hf");
        fs::create_dir(&out).unwrap();
        fs::write(out.join("keep.txt"), "x").unwrap();
        let err = convert_gguf(&input, &out, OutDtype::F16, &mut |_, _, _| {}).unwrap_err();
        assert!(
            err.to_string().contains("already exists and is not empty"),
            "{err}"
        );
        assert!(out.join("keep.txt").exists());

        fs::remove_file(out.join("keep.txt")).unwrap();
        convert_gguf(&input, &out, OutDtype::F16, &mut |_, _, _| {}).unwrap();
        assert!(out.join("model.safetensors").exists());
    }

    /// FNV-1a over little-endian 64-bit words: a cheap fingerprint to pin
    /// the converted file against without a cryptographic hash crate.
    fn fingerprint(bytes: &[u8]) -> u64 {
        let mut chunks = bytes.chunks_exact(8);
        let mut hash = 0xcbf2_9ce4_8422_2325_u64;
        for word in chunks.by_ref() {
            hash =
                (hash ^ u64::from_le_bytes(word.try_into().unwrap())).wrapping_mul(0x100_0000_01b3);
        }
        for &byte in chunks.remainder() {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3);
        }
        hash
    }

    const MANIFEST: &str = env!("CARGO_MANIFEST_DIR");

    fn real_gguf() -> Option<PathBuf> {
        let path = std::env::var_os("SIEVE_GGUF")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(MANIFEST).join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
        path.exists().then_some(path)
    }

    fn golden_dir() -> PathBuf {
        Path::new(MANIFEST).join("../shared/golden/smollm2-135m")
    }

    #[test]
    fn converts_smollm2_like_the_golden_reference() {
        let (Some(gguf), true) = (real_gguf(), golden_dir().exists()) else {
            eprintln!("skipped: set SIEVE_GGUF or put SmolLM2-135M-Instruct.Q4_1.gguf in models/, and the golden data in ../shared");
            return;
        };
        let golden = golden_dir();
        let dir = TempDir::new("convert-smollm2");
        for dtype in [OutDtype::F32, OutDtype::F16] {
            let out = dir.0.join(format!("{dtype:?}"));
            let start = Instant::now();
            let mut seen = 0;
            convert_gguf(&gguf, &out, dtype, &mut |done, total, _| {
                assert_eq!((done, total), (seen + 1, 272));
                seen = done;
            })
            .unwrap();
            eprintln!(
                "converted {} to {dtype:?} in {:.2?}",
                gguf.display(),
                start.elapsed()
            );

            let bytes = fs::read(out.join("model.safetensors")).unwrap();
            // Recorded from files whose sha256 equals the golden f32 checkpoint's
            // (a672150f…31d03cd) and, for f16, whose variant with f16 norms equals
            // the golden f16 checkpoint's (d8d8571b…7f317904): the dequantization
            // and q/k un-permutation are bit-exact.
            let want = match dtype {
                OutDtype::F32 => 0x18a5_7aa3_2301_b8f0,
                OutDtype::F16 => 0x49f4_f82a_9e20_005a,
            };
            assert_eq!(
                fingerprint(&bytes),
                want,
                "{dtype:?} model.safetensors differs from the reference"
            );
            let st = SafeTensors::deserialize(&bytes).unwrap();
            assert_eq!(st.len(), 272);
            assert!(st.tensor("lm_head.weight").is_err());
            let matrix = if dtype == OutDtype::F16 {
                Dtype::F16
            } else {
                Dtype::F32
            };
            for (name, shape, dt) in [
                ("model.embed_tokens.weight", [49152, 576].as_slice(), matrix),
                ("model.norm.weight", &[576], Dtype::F32),
                ("model.layers.29.input_layernorm.weight", &[576], Dtype::F32),
                (
                    "model.layers.0.self_attn.q_proj.weight",
                    &[576, 576],
                    matrix,
                ),
                (
                    "model.layers.7.self_attn.k_proj.weight",
                    &[192, 576],
                    matrix,
                ),
                (
                    "model.layers.7.self_attn.v_proj.weight",
                    &[192, 576],
                    matrix,
                ),
                (
                    "model.layers.3.self_attn.o_proj.weight",
                    &[576, 576],
                    matrix,
                ),
                ("model.layers.3.mlp.gate_proj.weight", &[1536, 576], matrix),
                ("model.layers.3.mlp.up_proj.weight", &[1536, 576], matrix),
                ("model.layers.3.mlp.down_proj.weight", &[576, 1536], matrix),
            ] {
                let t = st.tensor(name).unwrap();
                assert_eq!((t.shape(), t.dtype()), (shape, dt), "{name}");
            }
        }
        let out = dir.0.join("F16");

        let config = read_json(&out.join("config.json"));
        let want = read_json(&golden.join("config.json"));
        for key in [
            "architectures",
            "model_type",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
            "vocab_size",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "hidden_act",
            "attention_bias",
            "mlp_bias",
        ] {
            assert_eq!(config[key], want[key], "config.json {key}");
        }
        let generation = read_json(&out.join("generation_config.json"));
        let want = read_json(&golden.join("generation_config.json"));
        for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            assert_eq!(generation[key], want[key], "generation_config.json {key}");
        }
        let tok_config = read_json(&out.join("tokenizer_config.json"));
        let want = read_json(&golden.join("tokenizer_config.json"));
        for key in [
            "add_bos_token",
            "add_eos_token",
            "added_tokens_decoder",
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "chat_template",
            "model_max_length",
        ] {
            assert_eq!(tok_config[key], want[key], "tokenizer_config.json {key}");
        }

        let tokenizer_json = read_json(&out.join("tokenizer.json"));
        let want = read_json(&golden.join("tokenizer.json"));
        for key in [
            "model",
            "normalizer",
            "pre_tokenizer",
            "post_processor",
            "decoder",
            "added_tokens",
        ] {
            assert!(
                tokenizer_json[key] == want[key],
                "tokenizer.json {key} differs from the golden one"
            );
        }

        let tokenizer = Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        let cases = read_json(&golden.join("tokenizer_cases.json"));
        let prompts = read_json(&golden.join("prompts_and_tokenization.json"));
        let cases = cases
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (&c["text"], &c["ids"]));
        let prompts = prompts
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (&p["text"], &p["input_ids"]));
        let mut checked = 0;
        for (text, ids) in cases.chain(prompts) {
            let text = text.as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            let enc = tokenizer.encode(text, true).unwrap();
            assert_eq!(enc.get_ids(), want, "encoding {text:?}");
            assert_eq!(
                tokenizer.decode(&want, false).unwrap(),
                text,
                "decoding {text:?}"
            );
            checked += 1;
        }
        assert_eq!(checked, 14 + 6);
    }
}
