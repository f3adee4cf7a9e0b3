//! Qwen3 (`Qwen3ForCausalLM`): the Llama layer with each query and key head
//! RMS-normed before RoPE (`q_norm`, `k_norm`, one weight over head_dim
//! each), biases only where `attention_bias` says so, and a head_dim of its
//! own (config.json's `head_dim`, not hidden / heads). GGUF: architecture
//! `qwen3`, rows as in Hugging Face (llama.cpp's converter takes Qwen2's
//! path), the head_dim in `qwen3.attention.key_length`.

use anyhow::Result;

use super::{concat_tables, llama, no_gguf_keys, Family, GgufLayout, LayerSpec, Role};
use crate::family::fields::ConfigFields;
use crate::kernels::rope_kv::Rope;

#[rustfmt::skip]
const TENSORS: &[(Role, &str, &str)] = &[
    (Role::QNorm, "model.layers.{l}.self_attn.q_norm.weight", "blk.{l}.attn_q_norm.weight"),
    (Role::KNorm, "model.layers.{l}.self_attn.k_norm.weight", "blk.{l}.attn_k_norm.weight"),
];

/// Llama's table and the q/k norms.
const ALL_TENSORS: &[(Role, &str, &str)] =
    &concat_tables::<{ llama::TENSORS.len() + TENSORS.len() }>(llama::TENSORS, TENSORS);

pub const FAMILY: Family = Family {
    name: "qwen3",
    architectures: &["Qwen3ForCausalLM"],
    model_type: "qwen3",
    tensors: ALL_TENSORS,
    layers,
    gguf: Some(GgufLayout {
        architecture: "qwen3",
        permutes_qk: false,
        config: no_gguf_keys,
        setting_tensors: &[],
    }),
    norm_offset: 0.0,
    scales_embeddings: false,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    Ok(llama::layers(f, rope, n_layers)?
        .into_iter()
        .map(|spec| LayerSpec {
            qk_norm: true,
            ..spec
        })
        .collect())
}
