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
//! What the file describes (names, shapes, hyperparameters, the tokenizer
//! files, llama.cpp's q/k row permutation) is read by `crate::gguf_model`,
//! which loading a GGUF directly uses too; this module only writes.
//!
//! Everything is validated before anything is written, and the output is
//! assembled in a sibling directory that is renamed into place at the end, so
//! a failed conversion never leaves a half-written model under `out_dir`.

use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, ensure, Context};
use half::f16;
use serde_json::Value;

use crate::gguf::{GgufFile, GgufTensorInfo};

use crate::gguf_model::meta::{Documents, ModelMeta};
use crate::gguf_model::names::hf_source_row;

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

/// One tensor of the output file.
struct OutTensor<'a> {
    src: &'a GgufTensorInfo,
    name: String,
    /// Row-major shape, e.g. `[out_features, in_features]`.
    shape: Vec<usize>,
    dtype: OutDtype,
    /// Undo llama.cpp's q/k row permutation with this many heads.
    qk_heads: Option<usize>,
    /// Added to every value (Gemma's norms: w, not llama.cpp's 1 + w).
    hf_shift: f32,
}

impl OutTensor<'_> {
    fn n_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Everything a conversion checks and builds before it writes anything: the
/// hyperparameters, the vocabulary, every tensor's name, type and shape, and
/// the JSON documents.
fn plan(g: &GgufFile, dtype: OutDtype) -> anyhow::Result<(Vec<OutTensor<'_>>, Documents)> {
    let meta = ModelMeta::read(g)?;
    let mut tensors: Vec<OutTensor> = meta
        .tensors(g)?
        .into_iter()
        .map(|t| OutTensor {
            src: &g.tensors[t.index],
            // Vectors (norm weights, biases) are tiny and precision-sensitive.
            dtype: if t.shape.len() == 1 {
                OutDtype::F32
            } else {
                dtype
            },
            name: t.name,
            shape: t.shape,
            qk_heads: t.qk_heads,
            hf_shift: t.hf_shift,
        })
        .collect();
    // As safetensors' own writer does: larger elements first, then by name,
    // so that every tensor starts at a multiple of its element size.
    tensors.sort_by(|a, b| {
        b.dtype
            .size()
            .cmp(&a.dtype.size())
            .then_with(|| a.name.cmp(&b.name))
    });
    Ok((tensors, meta.documents(g, dtype.torch_name())?))
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
        let mut values = g.dequantize(t.src)?;
        if t.hf_shift != 0.0 {
            values.iter_mut().for_each(|x| *x += t.hf_shift);
        }
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
    use serde_json::json;
    use std::time::Instant;
    use tokenizers::Tokenizer;

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

    /// Gemma 3: llama.cpp's 1 + w taken back to w in every norm (q/k norms
    /// too), the q/k rows left in order, and the settings llama.cpp fixes
    /// written as config.json keys.
    #[test]
    fn gemma3_conversion_unfolds_the_norm_offset() {
        let mut b = tiny_model("gemma3", false, false).u32("gemma3.attention.sliding_window", 16);
        for l in 0..2 {
            for (name, len) in [
                ("attn_q_norm.weight", HEAD_DIM),
                ("attn_k_norm.weight", HEAD_DIM),
                ("post_attention_norm.weight", HIDDEN),
                ("post_ffw_norm.weight", HIDDEN),
            ] {
                b = rows_tensor(b, &format!("blk.{l}.{name}"), &[len]);
            }
        }
        let dir = TempDir::new("convert-gemma3");
        let out = convert_bytes(&dir, &b.build(), OutDtype::F32).unwrap();
        let bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for name in [
            "model.norm.weight",
            "model.layers.1.input_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.layers.0.pre_feedforward_layernorm.weight",
            "model.layers.0.post_feedforward_layernorm.weight",
        ] {
            let values: Vec<f32> = rows_of(&st, name).concat();
            let want: Vec<f32> = (0..values.len()).map(|c| c as f32 - 1.0).collect();
            assert_eq!(values, want, "{name}");
        }
        assert_eq!(
            row_ids(&st, "model.layers.0.self_attn.q_proj.weight"),
            [0., 1., 2., 3., 4., 5., 6., 7.]
        );
        let config = read_json(&out.join("config.json"));
        assert_eq!(config["model_type"], "gemma3_text");
        assert_eq!(config["sliding_window"], 16);
        assert_eq!(config["sliding_window_pattern"], 6);
        assert_eq!(config["query_pre_attn_scalar"], HEAD_DIM);
        assert_eq!(config["hidden_activation"], "gelu_pytorch_tanh");
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

    /// A tensor the family would not compute with is refused by name, not
    /// dropped: Qwen2 has no output-projection bias.
    #[test]
    fn tensors_the_model_would_not_use_are_refused() {
        let dir = TempDir::new("convert-unused");
        let mut b = tiny_model("qwen2", true, false);
        for l in 0..2 {
            b = rows_tensor(b, &format!("blk.{l}.attn_output.bias"), &[HIDDEN]);
        }
        let err = convert_bytes(&dir, &b.build(), OutDtype::F16).unwrap_err();
        assert!(
            err.to_string().contains(
                "tensor `blk.0.attn_output.bias` is in the file, but a qwen2 model with this metadata does not use it"
            ),
            "{err}"
        );
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
                .str("general.architecture", "falcon")
                .build(),
        );
        assert!(
            msg.contains(
                "architecture `falcon` is not supported (supported: llama, qwen2, qwen3, smollm3, phi3, gemma3)"
            ),
            "{msg}"
        );
        assert!(msg.contains("model.gguf"), "{msg}");

        let unigram = tiny_model("llama", false, false)
            .remove("tokenizer.ggml.model")
            .str("tokenizer.ggml.model", "t5");
        let msg = convert_err("convert-t5", &unigram.build());
        assert!(
            msg.contains("tokenizer model `t5` (`tokenizer.ggml.model`) is not supported (supported: gpt2, llama)"),
            "{msg}"
        );
        // A SentencePiece vocabulary ranks its merges by the scores.
        let no_scores = tiny_model("llama", false, false)
            .remove("tokenizer.ggml.model")
            .str("tokenizer.ggml.model", "llama");
        let msg = convert_err("convert-spm", &no_scores.build());
        assert!(
            msg.contains("metadata key `tokenizer.ggml.scores` is missing"),
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
