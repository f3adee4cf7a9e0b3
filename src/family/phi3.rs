//! Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama layer with q, k and
//! v in one tensor (`qkv_proj`, rows q then k then v) and gate and up in
//! one (`gate_up_proj`, rows gate then up), RoPE on part of each head
//! (`partial_rotary_factor`: Phi-4-mini's 0.75) and LongRoPE scaling, both
//! read with the shared RoPE keys by `crate::config`. Phi-3's sliding
//! window (Phi-3-mini-4k) is refused until sieve has windows.

use anyhow::Result;

use super::{check_layer_types, refuse_sliding_window, Family, LayerSpec, Role};
use crate::config::{ConfigFields, Rope};

#[rustfmt::skip]
const TENSORS: &[(Role, &str)] = &[
    (Role::Embed,     "model.embed_tokens.weight"),
    (Role::FinalNorm, "model.norm.weight"),
    (Role::LmHead,    "lm_head.weight"),
    (Role::AttnNorm,  "model.layers.{l}.input_layernorm.weight"),
    (Role::Qkv,       "model.layers.{l}.self_attn.qkv_proj.weight"),
    (Role::O,         "model.layers.{l}.self_attn.o_proj.weight"),
    (Role::MlpNorm,   "model.layers.{l}.post_attention_layernorm.weight"),
    (Role::GateUp,    "model.layers.{l}.mlp.gate_up_proj.weight"),
    (Role::Down,      "model.layers.{l}.mlp.down_proj.weight"),
];

pub const FAMILY: Family = Family {
    name: "phi3",
    architectures: &["Phi3ForCausalLM"],
    model_type: "phi3",
    tensors: TENSORS,
    layers,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    check_layer_types(f, n_layers)?;
    refuse_sliding_window(f)?;
    Ok(vec![LayerSpec::llama(rope); n_layers])
}
