//! Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): the Llama layer with biases on
//! the q, k and v projections (always; config.json does not say) and none
//! on the output projection. GGUF: architecture `qwen2`, rows as in
//! Hugging Face.

use anyhow::Result;

use super::{
    check_layer_types, llama, no_gguf_keys, refuse_unsupported, Family, GgufLayout, LayerSpec,
};
use crate::family::fields::ConfigFields;
use crate::kernels::rope_kv::Rope;

pub const FAMILY: Family = Family {
    name: "qwen2",
    architectures: &["Qwen2ForCausalLM"],
    model_type: "qwen2",
    tensors: llama::TENSORS,
    layers,
    gguf: Some(GgufLayout {
        architecture: "qwen2",
        permutes_qk: false,
        config: no_gguf_keys,
        setting_tensors: &[],
    }),
    norm_offset: 0.0,
    scales_embeddings: false,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    check_layer_types(f, n_layers)?;
    refuse_unsupported(f)?;
    let spec = LayerSpec {
        qkv_bias: true,
        ..LayerSpec::llama(rope)
    };
    Ok(vec![spec; n_layers])
}
