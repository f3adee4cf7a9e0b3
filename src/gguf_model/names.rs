//! The GGUF tensor names of each architecture and the Hugging Face names
//! they map to, checked against the shapes the hyperparameters imply; and
//! llama.cpp's permutation of the llama q/k rows, undone.
//!
//! llama.cpp's converter reorders the rows of the q/k projections of the
//! Llama layouts (llama, smollm3: `GgufLayout::permutes_qk`) so that its
//! RoPE, which rotates adjacent pairs `(2j, 2j+1)`, matches HF's
//! `rotate_half`, which rotates `(j, j + d/2)`; [`hf_source_row`] inverts
//! it. Qwen2, Qwen3 and Phi-3 files are not permuted and are left alone.

use anyhow::{bail, ensure, Context};
use std::collections::BTreeMap;

use super::meta::ModelMeta;
use crate::family::{Dims, LayerSpec, Role};
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
    /// Added to every value to give the Hugging Face weight: a norm of a
    /// family whose norms multiply by (offset + w) holds offset + w in a
    /// GGUF (llama.cpp's converter folds it in), w in a Hugging Face file.
    pub hf_shift: f32,
}

/// What a GGUF tensor of the architecture becomes.
struct Target {
    name: String,
    shape: Vec<usize>,
    qk_heads: Option<usize>,
    hf_shift: f32,
    required: bool,
    /// The model computes with it: a tensor it would not use is refused,
    /// not silently dropped (an output bias in a Qwen2 file).
    used: bool,
}

impl ModelMeta<'_> {
    /// Maps the GGUF tensors to HF names by the family's tensor table and
    /// checks them against the shapes the hyperparameters imply: every
    /// tensor must be known, of a dequantizable type and of the right
    /// shape, and every required tensor present. In the file's order.
    /// Setting tensors (Phi-3's RoPE factors) are read by the metadata and
    /// planned as no weight.
    pub fn tensors(&self, g: &GgufFile) -> anyhow::Result<Vec<TensorPlan>> {
        let (family, hp) = (self.family, &self.hp);
        let file = g.path.display();
        let dims = Dims {
            hidden: hp.hidden,
            ffn: hp.ffn,
            vocab: self.vocab_size(),
            heads: hp.heads,
            kv_heads: hp.kv_heads,
            head_dim: hp.head_dim,
        };
        let permuted = |role| -> Option<usize> {
            if !self.layout.permutes_qk {
                return None;
            }
            match role {
                Role::Q | Role::QBias => Some(hp.heads),
                Role::K | Role::KBias => Some(hp.kv_heads),
                _ => None,
            }
        };
        // What the layers compute says which optional tensors must be there.
        let config =
            crate::config::ModelConfig::from_json(&self.config_json(g, "float32")?, &g.path)
                .with_context(|| format!("{file}: the configuration its metadata gives"))?;
        let any = |has: fn(&LayerSpec) -> bool| config.layers.iter().any(has);
        // Whether the layers use the role's tensor (the LM head: only when
        // the file has it, else it is tied to the embeddings).
        let used = |role| match role {
            Role::QBias | Role::KBias | Role::VBias => any(|l| l.qkv_bias),
            Role::OBias => any(|l| l.o_bias),
            Role::QNorm | Role::KNorm => any(|l| l.qk_norm),
            _ => true,
        };
        let required = |role| role != Role::LmHead && used(role);
        let mut expected: BTreeMap<String, Target> = BTreeMap::new();
        for &(role, hf, gguf) in family.tensors {
            if gguf.is_empty() {
                continue;
            }
            let layers = if role.per_layer() { hp.layers } else { 1 };
            for layer in 0..layers {
                let l = layer.to_string();
                expected.insert(
                    gguf.replace("{l}", &l),
                    Target {
                        name: hf.replace("{l}", &l),
                        shape: role.shape(&dims),
                        qk_heads: permuted(role),
                        hf_shift: if role.is_norm() {
                            -family.norm_offset
                        } else {
                            0.0
                        },
                        required: required(role),
                        used: used(role),
                    },
                );
            }
        }

        let mut planned = Vec::with_capacity(g.tensors.len());
        for (index, t) in g.tensors.iter().enumerate() {
            if self.layout.setting_tensors.contains(&t.name.as_str()) {
                continue;
            }
            if expected.get(&t.name).is_some_and(|target| !target.used) {
                bail!(
                    "{file}: tensor `{}` is in the file, but a {} model with this metadata does not use it",
                    t.name,
                    self.layout.architecture
                );
            }
            let Some(target) = expected.remove(&t.name) else {
                let hint = if t.name == "rope_freqs.weight" {
                    " (llama3-style RoPE frequency scaling is not supported)"
                } else {
                    ""
                };
                bail!(
                    "{file}: unexpected tensor `{}` for a {} model{hint}",
                    t.name,
                    self.layout.architecture
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
                hf_shift: target.hf_shift,
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
