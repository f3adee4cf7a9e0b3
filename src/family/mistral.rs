//! Mistral and Ministral (`MistralForCausalLM`): the Llama layer with
//! `sliding_window` on every layer where it is set (Mistral 7B v0.1's
//! 4,096; later ones null). GGUF: llama.cpp writes them as `llama`.

use anyhow::Result;

use super::{llama, Family, LayerSpec};
use crate::family::fields::ConfigFields;
use crate::kernels::rope_kv::Rope;

pub const FAMILY: Family = Family {
    name: "mistral",
    architectures: &["MistralForCausalLM"],
    model_type: "mistral",
    tensors: llama::TENSORS,
    layers,
    gguf: None,
    norm_offset: 0.0,
    scales_embeddings: false,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    let window = llama::window_within_context(f)?;
    Ok(llama::layers(f, rope, n_layers)?
        .into_iter()
        .map(|spec| LayerSpec { window, ..spec })
        .collect())
}
