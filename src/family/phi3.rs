//! Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama layer with q, k and
//! v in one tensor (`qkv_proj`, rows q then k then v) and gate and up in
//! one (`gate_up_proj`, rows gate then up), RoPE on part of each head
//! (`partial_rotary_factor`: Phi-4-mini's 0.75) and LongRoPE scaling, both
//! read with the shared RoPE keys by `crate::config`. Phi-3's sliding
//! window (Phi-3-mini-4k's 2,047) on every layer.
//!
//! GGUF: architecture `phi3`; the fused tensors keep their rows (llama.cpp
//! calls gate|up `ffn_up`); the RoPE dimensions in `phi3.rope.dimension_count`,
//! LongRoPE's factors in the tensors `rope_factors_long.weight` and
//! `rope_factors_short.weight`, its original context and attention factor
//! in `phi3.rope.scaling.*`.

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

use super::{check_layer_types, llama, refuse_unsupported, Family, GgufLayout, LayerSpec, Role};
use crate::family::fields::ConfigFields;
use crate::gguf::GgufFile;
use crate::kernels::rope_kv::Rope;

#[rustfmt::skip]
const TENSORS: &[(Role, &str, &str)] = &[
    (Role::Embed,     "model.embed_tokens.weight",                         "token_embd.weight"),
    (Role::FinalNorm, "model.norm.weight",                                 "output_norm.weight"),
    (Role::LmHead,    "lm_head.weight",                                    "output.weight"),
    (Role::AttnNorm,  "model.layers.{l}.input_layernorm.weight",           "blk.{l}.attn_norm.weight"),
    (Role::Qkv,       "model.layers.{l}.self_attn.qkv_proj.weight",        "blk.{l}.attn_qkv.weight"),
    (Role::O,         "model.layers.{l}.self_attn.o_proj.weight",          "blk.{l}.attn_output.weight"),
    (Role::MlpNorm,   "model.layers.{l}.post_attention_layernorm.weight",  "blk.{l}.ffn_norm.weight"),
    (Role::GateUp,    "model.layers.{l}.mlp.gate_up_proj.weight",          "blk.{l}.ffn_up.weight"),
    (Role::Down,      "model.layers.{l}.mlp.down_proj.weight",             "blk.{l}.ffn_down.weight"),
];

const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";
const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";

pub const FAMILY: Family = Family {
    name: "phi3",
    architectures: &["Phi3ForCausalLM"],
    model_type: "phi3",
    tensors: TENSORS,
    layers,
    gguf: Some(GgufLayout {
        architecture: "phi3",
        permutes_qk: false,
        config: gguf_config,
        setting_tensors: &[ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT],
    }),
    norm_offset: 0.0,
    scales_embeddings: false,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    check_layer_types(f, n_layers)?;
    refuse_unsupported(f)?;
    let spec = LayerSpec {
        window: llama::window_within_context(f)?,
        ..LayerSpec::llama(rope)
    };
    Ok(vec![spec; n_layers])
}

/// The sliding window (0 for none, as llama.cpp writes Phi-4's) and
/// LongRoPE as config.json says them.
fn gguf_config(g: &GgufFile, c: &mut Map<String, Value>) -> Result<()> {
    let key = |k: &str| format!("phi3.{k}");
    if let Some(w) = g.opt(&key("attention.sliding_window"), GgufFile::get_u32)? {
        if w > 0 {
            c.insert("sliding_window".into(), json!(w));
        }
    }
    let factors = |name: &str| -> Result<Option<Vec<f32>>> {
        match g.tensor(name) {
            Some(t) => Ok(Some(g.dequantize(t)?)),
            None => Ok(None),
        }
    };
    match (factors(ROPE_FACTORS_LONG)?, factors(ROPE_FACTORS_SHORT)?) {
        (None, None) => {}
        (Some(long), Some(short)) => {
            let original = g.get_u32(&key("rope.scaling.original_context_length"))?;
            // transformers 4 takes exactly these three keys for Phi-3.
            let mut scaling = json!({
                "type": "longrope", "long_factor": long, "short_factor": short,
            });
            // The attention factor as transformers derives it from the two
            // contexts, unless the file says otherwise.
            let context = g.get_u32(&key("context_length"))? as f64;
            let ratio = context / original.max(1) as f64;
            let derived = match ratio > 1.0 {
                true => (1.0 + ratio.ln() / (original as f64).ln()).sqrt(),
                false => 1.0,
            };
            if let Some(a) = g.opt(&key("rope.scaling.attn_factor"), GgufFile::get_f32)? {
                if (a as f64 - derived).abs() > 1e-6 {
                    scaling["attention_factor"] = json!(a);
                }
            }
            c.insert("rope_scaling".into(), scaling.clone());
            c.insert("original_max_position_embeddings".into(), json!(original));
            // transformers 5 reads `rope_parameters`.
            let mut parameters = scaling;
            let p = parameters.as_object_mut().expect("an object");
            p.remove("type");
            p.insert("rope_type".into(), json!("longrope"));
            p.insert("original_max_position_embeddings".into(), json!(original));
            if let Some(theta) = c.get("rope_theta") {
                p.insert("rope_theta".into(), theta.clone());
            }
            c.insert("rope_parameters".into(), parameters);
        }
        _ => bail!(
            "{}: one of {ROPE_FACTORS_LONG} and {ROPE_FACTORS_SHORT} without the other",
            g.path.display()
        ),
    }
    Ok(())
}
