//! SmolLM3 (`SmolLM3ForCausalLM`): the Llama layer, with RoPE left out of
//! some layers (NoPE): `no_rope_layers[l]` is 1 where layer l rotates and
//! 0 where it does not. Without the list, every `no_rope_layer_interval`-th
//! layer (default 4) has no RoPE, as transformers' SmolLM3Config makes it.
//! GGUF: architecture `smollm3`, the Llama tensors with llama.cpp's q/k
//! permutation; no key holds the NoPE layers, llama.cpp takes every 4th
//! (config.json written from it says `no_rope_layer_interval` 4).

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

use super::{llama, Family, GgufLayout, LayerSpec};
use crate::family::fields::ConfigFields;
use crate::gguf::GgufFile;
use crate::kernels::rope_kv::Rope;

pub const FAMILY: Family = Family {
    name: "smollm3",
    architectures: &["SmolLM3ForCausalLM"],
    model_type: "smollm3",
    tensors: llama::TENSORS,
    layers,
    gguf: Some(GgufLayout {
        architecture: "smollm3",
        permutes_qk: true,
        config: gguf_config,
        setting_tensors: &[],
    }),
    norm_offset: 0.0,
    scales_embeddings: false,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    let uses_rope: Vec<bool> = match f.array("no_rope_layers")? {
        Some(list) => {
            if list.len() != n_layers {
                bail!(
                    "{}: no_rope_layers has {} entries; expected one per layer ({n_layers})",
                    f.file(),
                    list.len()
                );
            }
            list.iter()
                .enumerate()
                .map(|(l, x)| match x.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => bail!(
                        "{}: no_rope_layers[{l}] is {x}; expected 1 (RoPE) or 0 (none)",
                        f.file()
                    ),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let interval = f.usize_or("no_rope_layer_interval", 4)?;
            if interval == 0 {
                bail!(
                    "{}: no_rope_layer_interval is 0; expected 1 or more",
                    f.file()
                );
            }
            (0..n_layers).map(|l| (l + 1) % interval != 0).collect()
        }
    };
    Ok(llama::layers(f, rope, n_layers)?
        .into_iter()
        .zip(uses_rope)
        .map(|(spec, rotates)| LayerSpec {
            rope: if rotates { spec.rope } else { Rope::none() },
            ..spec
        })
        .collect())
}

/// llama.cpp's SmolLM3 leaves RoPE out of every 4th layer, from no key.
fn gguf_config(_: &GgufFile, c: &mut Map<String, Value>) -> Result<()> {
    c.insert("no_rope_layer_interval".into(), json!(4));
    Ok(())
}
