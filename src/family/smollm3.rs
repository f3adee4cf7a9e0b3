//! SmolLM3 (`SmolLM3ForCausalLM`): the Llama layer, with RoPE left out of
//! some layers (NoPE): `no_rope_layers[l]` is 1 where layer l rotates and
//! 0 where it does not. Without the list, every `no_rope_layer_interval`-th
//! layer (default 4) has no RoPE, as transformers' SmolLM3Config makes it.

use anyhow::{bail, Result};

use super::{check_layer_types, llama, Family, LayerSpec};
use crate::config::{ConfigFields, Rope};

pub const FAMILY: Family = Family {
    name: "smollm3",
    architectures: &["SmolLM3ForCausalLM"],
    model_type: "smollm3",
    tensors: llama::TENSORS,
    layers,
};

fn layers(f: &ConfigFields, rope: &Rope, n_layers: usize) -> Result<Vec<LayerSpec>> {
    check_layer_types(f, n_layers)?;
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
    let attention_bias = f.bool_or("attention_bias", false)?;
    Ok(uses_rope
        .into_iter()
        .map(|rotates| LayerSpec {
            qkv_bias: attention_bias,
            rope: if rotates { rope.clone() } else { Rope::none() },
            ..LayerSpec::llama(rope)
        })
        .collect())
}
