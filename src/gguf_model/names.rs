//! The GGUF tensor names of each architecture and the Hugging Face names
//! they map to, checked against the shapes the hyperparameters imply; and
//! llama.cpp's permutation of the llama q/k rows, undone.
//!
//! llama.cpp's converter reorders the rows of the llama q/k projections so
//! that its RoPE, which rotates adjacent pairs `(2j, 2j+1)`, matches HF's
//! `rotate_half`, which rotates `(j, j + d/2)`; [`hf_source_row`] inverts
//! it. Qwen2 files are not permuted by llama.cpp and are left alone.

use anyhow::{bail, ensure, Context};
use std::collections::BTreeMap;

use super::meta::{Arch, ModelMeta};
use crate::formats::dequant::DEQUANTIZABLE_TYPES;
use crate::gguf::GgufFile;

/// One GGUF tensor of the model, under its Hugging Face name.
pub(crate) struct TensorPlan {
    /// Index into the file's tensors.
    pub index: usize,
    pub name: String,
    /// Row-major shape, e.g. `[out_features, in_features]`.
    pub shape: Vec<usize>,
    /// Undo llama.cpp's q/k row permutation with this many heads.
    pub qk_heads: Option<usize>,
}

/// What a GGUF tensor of the architecture becomes.
struct Target {
    name: String,
    shape: Vec<usize>,
    qk_heads: Option<usize>,
    required: bool,
}

impl ModelMeta<'_> {
    /// Maps the GGUF tensors to HF names and checks them against the shapes
    /// the hyperparameters imply: every tensor must be known, of a
    /// dequantizable type and of the right shape, and every required tensor
    /// present. In the file's order.
    pub fn tensors(&self, g: &GgufFile) -> anyhow::Result<Vec<TensorPlan>> {
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
        for (index, t) in g.tensors.iter().enumerate() {
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
            planned.push(TensorPlan {
                index,
                name: target.name,
                shape,
                qk_heads: target.qk_heads,
            });
        }
        if let Some((name, _)) = expected.iter().find(|(_, t)| t.required) {
            bail!("{file}: tensor `{name}` is missing");
        }
        Ok(planned)
    }
}

/// For output row `row` of an HF q/k projection, the row of the llama.cpp
/// (GGUF) matrix that holds it. llama.cpp's converter wrote
/// `W_gguf[h·d + 2j + i] = W_hf[h·d + i·d/2 + j]` for head `h`, `i ∈ {0,1}`,
/// `j ∈ [0, d/2)`: within each head it interleaved the two halves that HF's
/// `rotate_half` pairs up. This inverts it.
pub fn hf_source_row(row: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    let (head, within) = (row / head_dim, row % head_dim);
    let (i, j) = (within / half, within % half);
    head * head_dim + 2 * j + i
}

/// Rows in Hugging Face order: llama.cpp permuted the q/k rows of each of
/// `heads` heads (see [`hf_source_row`]).
pub fn unpermute_rows<T: Copy>(data: &[T], rows: usize, heads: Option<usize>) -> Vec<T> {
    let Some(heads) = heads else {
        return data.to_vec();
    };
    let row_len = data.len() / rows;
    (0..rows)
        .flat_map(|r| {
            let src = hf_source_row(r, rows / heads);
            data[src * row_len..(src + 1) * row_len].iter().copied()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
