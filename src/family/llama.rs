//! Llama (`LlamaForCausalLM`: Llama 2 and 3, SmolLM2 and others of its
//! layout): the layer every other family starts from. RMSNorm, attention
//! with grouped KV heads and RoPE (Llama 3's frequency scaling, read with
//! the other shared RoPE keys by `crate::config`), RMSNorm, SwiGLU MLP.
//! Biases on q, k, v and the output projection where `attention_bias` says
//! so. GGUF: architecture `llama`, q/k rows permuted by llama.cpp.

use anyhow::Result;

use super::{
    check_layer_types, no_gguf_keys, refuse_unsupported, Family, GgufLayout, LayerSpec, Role,
};
use crate::family::fields::ConfigFields;
use crate::kernels::rope_kv::Rope;

/// The Llama layout's tensors, which Qwen2, Qwen3 and SmolLM3 share (each
/// adding its own to them).
#[rustfmt::skip]
pub const TENSORS: &[(Role, &str, &str)] = &[
    (Role::Embed,     "model.embed_tokens.weight",                         "token_embd.weight"),
    (Role::FinalNorm, "model.norm.weight",                                 "output_norm.weight"),
    (Role::LmHead,    "lm_head.weight",                                    "output.weight"),
    (Role::AttnNorm,  "model.layers.{l}.input_layernorm.weight",           "blk.{l}.attn_norm.weight"),
    (Role::Q,         "model.layers.{l}.self_attn.q_proj.weight",          "blk.{l}.attn_q.weight"),
    (Role::K,         "model.layers.{l}.self_attn.k_proj.weight",          "blk.{l}.attn_k.weight"),
    (Role::V,         "model.layers.{l}.self_attn.v_proj.weight",          "blk.{l}.attn_v.weight"),
    (Role::QBias,     "model.layers.{l}.self_attn.q_proj.bias",            "blk.{l}.attn_q.bias"),
    (Role::KBias,     "model.layers.{l}.self_attn.k_proj.bias",            "blk.{l}.attn_k.bias"),
    (Role::VBias,     "model.layers.{l}.self_attn.v_proj.bias",            "blk.{l}.attn_v.bias"),
    (Role::O,         "model.layers.{l}.self_attn.o_proj.weight",          "blk.{l}.attn_output.weight"),
    (Role::OBias,     "model.layers.{l}.self_attn.o_proj.bias",            "blk.{l}.attn_output.bias"),
    (Role::MlpNorm,   "model.layers.{l}.post_attention_layernorm.weight",  "blk.{l}.ffn_norm.weight"),
    (Role::Gate,      "model.layers.{l}.mlp.gate_proj.weight",             "blk.{l}.ffn_gate.weight"),
    (Role::Up,        "model.layers.{l}.mlp.up_proj.weight",               "blk.{l}.ffn_up.weight"),
    (Role::Down,      "model.layers.{l}.mlp.down_proj.weight",             "blk.{l}.ffn_down.weight"),
];

pub const FAMILY: Family = Family {
    name: "llama",
    architectures: &["LlamaForCausalLM"],
    model_type: "llama",
    tensors: TENSORS,
    layers,
    gguf: Some(GgufLayout {
        architecture: "llama",
        permutes_qk: true,
        config: no_gguf_keys,
        setting_tensors: &[],
    }),
    norm_offset: 0.0,
    scales_embeddings: false,
};

/// Llama's layers: `attention_bias` puts biases on q, k, v and the output
/// projection (transformers' LlamaAttention; Qwen3 and SmolLM3 read it the
/// same way).
pub fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    check_layer_types(f, n_layers)?;
    refuse_unsupported(f)?;
    let bias = f.bool_or("attention_bias", false)?;
    let spec = LayerSpec {
        qkv_bias: bias,
        o_bias: bias,
        ..LayerSpec::llama(rope)
    };
    Ok(vec![spec; n_layers])
}

/// `sliding_window` on every layer, as transformers' Mistral and Phi-3 apply
/// it; None where it reaches past `max_position_embeddings` and so hides
/// nothing within the model's context (Phi-3.5-mini and Phi-4-mini publish
/// 262,144 with a context of 131,072), which keeps such a model on the
/// kernels without a window.
pub fn window_within_context(f: &ConfigFields) -> Result<Option<usize>> {
    let context = f.usize_or("max_position_embeddings", 4096)?;
    Ok(super::sliding_window(f)?.filter(|&w| w < context))
}
