//! Llama (`LlamaForCausalLM`: Llama 2 and 3, SmolLM2 and others of its
//! layout): the layer every other family starts from. RMSNorm, attention
//! with grouped KV heads and RoPE (Llama 3's frequency scaling, read with
//! the other shared RoPE keys by `crate::config`), RMSNorm, SwiGLU MLP.
//! q/k/v biases only where `attention_bias` says so.

use anyhow::Result;

use super::{check_layer_types, Family, LayerSpec, Role};
use crate::config::{ConfigFields, Rope};

/// The Hugging Face names of the Llama layout, which Qwen2, Qwen3 and
/// SmolLM3 share (each adds its own tensors to it).
#[rustfmt::skip]
pub const TENSORS: &[(Role, &str)] = &[
    (Role::Embed,     "model.embed_tokens.weight"),
    (Role::FinalNorm, "model.norm.weight"),
    (Role::LmHead,    "lm_head.weight"),
    (Role::AttnNorm,  "model.layers.{l}.input_layernorm.weight"),
    (Role::Q,         "model.layers.{l}.self_attn.q_proj.weight"),
    (Role::K,         "model.layers.{l}.self_attn.k_proj.weight"),
    (Role::V,         "model.layers.{l}.self_attn.v_proj.weight"),
    (Role::QBias,     "model.layers.{l}.self_attn.q_proj.bias"),
    (Role::KBias,     "model.layers.{l}.self_attn.k_proj.bias"),
    (Role::VBias,     "model.layers.{l}.self_attn.v_proj.bias"),
    (Role::O,         "model.layers.{l}.self_attn.o_proj.weight"),
    (Role::MlpNorm,   "model.layers.{l}.post_attention_layernorm.weight"),
    (Role::Gate,      "model.layers.{l}.mlp.gate_proj.weight"),
    (Role::Up,        "model.layers.{l}.mlp.up_proj.weight"),
    (Role::Down,      "model.layers.{l}.mlp.down_proj.weight"),
];

pub const FAMILY: Family = Family {
    name: "llama",
    architectures: &["LlamaForCausalLM"],
    model_type: "llama",
    tensors: TENSORS,
    layers,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    check_layer_types(f, n_layers)?;
    let spec = LayerSpec {
        qkv_bias: f.bool_or("attention_bias", false)?,
        ..LayerSpec::llama(rope)
    };
    Ok(vec![spec; n_layers])
}
