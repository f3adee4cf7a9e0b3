//! Qwen3 (`Qwen3ForCausalLM`): the Llama layer with each query and key head
//! RMS-normed before RoPE (`q_norm`, `k_norm`, one weight over head_dim
//! each), no biases unless `attention_bias`, and a head_dim of its own
//! (config.json's `head_dim`, not hidden / heads).

use anyhow::Result;

use super::{check_layer_types, concat_tables, llama, Family, LayerSpec, Role};
use crate::config::{ConfigFields, Rope};

#[rustfmt::skip]
const TENSORS: &[(Role, &str)] = &[
    (Role::QNorm, "model.layers.{l}.self_attn.q_norm.weight"),
    (Role::KNorm, "model.layers.{l}.self_attn.k_norm.weight"),
];

/// Llama's table and the q/k norms.
const ALL_TENSORS: &[(Role, &str)] =
    &concat_tables::<{ llama::TENSORS.len() + TENSORS.len() }>(llama::TENSORS, TENSORS);

pub const FAMILY: Family = Family {
    name: "qwen3",
    architectures: &["Qwen3ForCausalLM"],
    model_type: "qwen3",
    tensors: ALL_TENSORS,
    layers,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    check_layer_types(f, n_layers)?;
    let spec = LayerSpec {
        qkv_bias: f.bool_or("attention_bias", false)?,
        qk_norm: true,
        ..LayerSpec::llama(rope)
    };
    Ok(vec![spec; n_layers])
}
