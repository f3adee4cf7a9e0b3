//! Gemma 3 (`Gemma3ForCausalLM`, model_type `gemma3_text`): every norm
//! multiplies by (1 + w); the attention and MLP outputs are RMS-normed
//! before they join the residual (sandwich norms: `post_attention_layernorm`
//! after attention, `pre_feedforward_layernorm` before the MLP and
//! `post_feedforward_layernorm` after it); q/k norm before RoPE; GELU (tanh)
//! gate; embeddings times sqrt(hidden); scores scaled by
//! `query_pre_attn_scalar ** -0.5`; sliding-window layers (`layer_types`,
//! else every `sliding_window_pattern`-th layer full) with RoPE base
//! `rope_local_base_freq` and no scaling, full layers with `rope_theta` and
//! `rope_scaling` (transformers 5: `rope_parameters` keyed by layer type).
//!
//! GGUF (architecture `gemma3`, a SentencePiece vocabulary): llama.cpp's
//! converter folds the (1 + w) into the norm weights and writes only the
//! window (`gemma3.attention.sliding_window`); the rest is fixed as
//! llama.cpp fixes it: every 6th layer full, the local base 10,000, the
//! query scale 1 / sqrt(head_dim) (1 / sqrt(hidden / heads) for the 62-layer
//! 27B). Without a window every layer is full, as in llama.cpp.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::{layer_types, sliding_window, Activation, Family, GgufLayout, LayerSpec, Role};
use crate::config::{rope, scaling_object, RopeScaling};
use crate::family::fields::ConfigFields;
use crate::gguf::GgufFile;
use crate::kernels::rope_kv::Rope;

#[rustfmt::skip]
const TENSORS: &[(Role, &str, &str)] = &[
    (Role::Embed,        "model.embed_tokens.weight",                           "token_embd.weight"),
    (Role::FinalNorm,    "model.norm.weight",                                   "output_norm.weight"),
    (Role::LmHead,       "lm_head.weight",                                      "output.weight"),
    (Role::AttnNorm,     "model.layers.{l}.input_layernorm.weight",             "blk.{l}.attn_norm.weight"),
    (Role::Q,            "model.layers.{l}.self_attn.q_proj.weight",            "blk.{l}.attn_q.weight"),
    (Role::K,            "model.layers.{l}.self_attn.k_proj.weight",            "blk.{l}.attn_k.weight"),
    (Role::V,            "model.layers.{l}.self_attn.v_proj.weight",            "blk.{l}.attn_v.weight"),
    (Role::QNorm,        "model.layers.{l}.self_attn.q_norm.weight",            "blk.{l}.attn_q_norm.weight"),
    (Role::KNorm,        "model.layers.{l}.self_attn.k_norm.weight",            "blk.{l}.attn_k_norm.weight"),
    (Role::O,            "model.layers.{l}.self_attn.o_proj.weight",            "blk.{l}.attn_output.weight"),
    (Role::PostAttnNorm, "model.layers.{l}.post_attention_layernorm.weight",    "blk.{l}.post_attention_norm.weight"),
    (Role::MlpNorm,      "model.layers.{l}.pre_feedforward_layernorm.weight",   "blk.{l}.ffn_norm.weight"),
    (Role::Gate,         "model.layers.{l}.mlp.gate_proj.weight",               "blk.{l}.ffn_gate.weight"),
    (Role::Up,           "model.layers.{l}.mlp.up_proj.weight",                 "blk.{l}.ffn_up.weight"),
    (Role::Down,         "model.layers.{l}.mlp.down_proj.weight",               "blk.{l}.ffn_down.weight"),
    (Role::PostMlpNorm,  "model.layers.{l}.post_feedforward_layernorm.weight",  "blk.{l}.post_ffw_norm.weight"),
];

pub const FAMILY: Family = Family {
    name: "gemma3",
    architectures: &["Gemma3ForCausalLM"],
    model_type: "gemma3_text",
    tensors: TENSORS,
    layers,
    gguf: Some(GgufLayout {
        architecture: "gemma3",
        permutes_qk: false,
        config: gguf_config,
        setting_tensors: &[],
    }),
    norm_offset: 1.0,
    scales_embeddings: true,
};

/// What llama.cpp reads from a `gemma3` file or fixes for it, as
/// config.json keys.
fn gguf_config(g: &GgufFile, c: &mut Map<String, Value>) -> Result<()> {
    let key = |k: &str| format!("gemma3.{k}");
    let gelu = json!("gelu_pytorch_tanh");
    c.insert("hidden_act".into(), gelu.clone());
    c.insert("hidden_activation".into(), gelu);
    match g.opt(&key("attention.sliding_window"), GgufFile::get_u32)? {
        Some(w) if w > 0 => {
            c.insert("sliding_window".into(), json!(w));
            c.insert("sliding_window_pattern".into(), json!(6));
        }
        _ => {
            let layers = g.get_u32(&key("block_count"))? as usize;
            c.insert("layer_types".into(), json!(vec!["full_attention"; layers]));
        }
    }
    c.insert("rope_local_base_freq".into(), json!(10000.0));
    let head_dim = c.get("head_dim").and_then(Value::as_u64).unwrap_or(0);
    let scalar = if g.get_u32(&key("block_count"))? == 62 {
        let hidden = c.get("hidden_size").and_then(Value::as_u64).unwrap_or(0);
        let heads = c
            .get("num_attention_heads")
            .and_then(Value::as_u64)
            .unwrap_or(1);
        hidden / heads.max(1)
    } else {
        head_dim
    };
    c.insert("query_pre_attn_scalar".into(), json!(scalar));
    Ok(())
}

fn layers(f: &ConfigFields, shared: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if f.get(key).is_some() {
            bail!(
                "{}: {key} is set; logit soft-capping is not supported",
                f.file()
            );
        }
    }
    if f.bool_or("use_bidirectional_attention", false)? {
        bail!(
            "{}: use_bidirectional_attention is true; sieve runs causal decoders only",
            f.file()
        );
    }
    match f.get("hidden_activation").and_then(Value::as_str) {
        None | Some("gelu_pytorch_tanh") => {}
        Some(other) => bail!(
            "{}: hidden_activation is {other:?}; expected \"gelu_pytorch_tanh\"",
            f.file()
        ),
    }
    let head_dim = shared.rotary_dim;
    let scalar = f.f64_or("query_pre_attn_scalar", head_dim as f64)?;
    if scalar <= 0.0 || !scalar.is_finite() {
        bail!(
            "{}: query_pre_attn_scalar is {scalar}; expected a positive number",
            f.file()
        );
    }
    let sliding = match layer_types(f, n_layers)? {
        Some(s) => s,
        None => {
            let pattern = match f.usize_opt("sliding_window_pattern")? {
                Some(p) => p,
                None => f.usize_or("_sliding_window_pattern", 6)?,
            };
            if pattern == 0 {
                bail!(
                    "{}: sliding_window_pattern is 0; expected 1 or more",
                    f.file()
                );
            }
            (0..n_layers).map(|l| (l + 1) % pattern != 0).collect()
        }
    };
    let window = sliding_window(f)?;
    if window.is_none() && sliding.contains(&true) {
        bail!("{}: sliding layers but no sliding_window", f.file());
    }
    let (local, global) = ropes(f, shared)?;
    Ok(sliding
        .into_iter()
        .map(|slides| LayerSpec {
            qkv_bias: false,
            o_bias: false,
            qk_norm: true,
            rope: if slides {
                local.clone()
            } else {
                global.clone()
            },
            window: if slides { window } else { None },
            attn_scale: Some((1.0 / scalar.sqrt()) as f32),
            sandwich_norms: true,
            activation: Activation::GeluTanh,
        })
        .collect())
}

/// The sliding layers' RoPE and the full layers'. transformers 4 writes
/// the full layers' as the shared keys (`rope_theta`, `rope_scaling`) and
/// the local base beside them; transformers 5 one `rope_parameters` object
/// per layer type.
fn ropes(f: &ConfigFields, shared: &Rope) -> Result<(Rope, Rope)> {
    let d = shared.rotary_dim;
    let by_type = f
        .get("rope_parameters")
        .filter(|r| r.get("full_attention").is_some() || r.get("sliding_attention").is_some());
    let Some(by_type) = by_type else {
        let local_base = f.f64_or("rope_local_base_freq", 10000.0)?;
        return Ok((rope(local_base, &RopeScaling::None, d), shared.clone()));
    };
    let max_position = f.usize_or("max_position_embeddings", 4096)?;
    let of = |kind: &str| -> Result<Rope> {
        let object = format!("rope_parameters.{kind}");
        let s = by_type
            .get(kind)
            .with_context(|| format!("{}: {object} is missing", f.file()))?;
        let theta = s
            .get("rope_theta")
            .and_then(Value::as_f64)
            .with_context(|| {
                format!(
                    "{}: {object}'s 'rope_theta' is missing or not a number",
                    f.file()
                )
            })?;
        let scaling = scaling_object(f, f.json(), s, &object, max_position)?;
        Ok(rope(theta, &scaling, d))
    };
    Ok((of("sliding_attention")?, of("full_attention")?))
}
