//! Model families. Each file of this folder is one family's home: the
//! Hugging Face architecture names it answers to, its tensor table (each
//! weight's role, Hugging Face name and GGUF name), its reading of
//! config.json into what each decoder layer computes ([`LayerSpec`]), and
//! how llama.cpp writes it as GGUF ([`GgufLayout`]). The loader takes the
//! weights by role from the table, and the engine builds every layer's
//! kernels from its spec, for the forward step, the counter-causal pass,
//! batched steps and synthetic models alike, so a family is wired in one
//! place. The settings shared by several families (the dimensions, RoPE and
//! its scalings) are read by `crate::config`; adding a family is a file
//! here, its line in [`FAMILIES`] and its golden test.

use anyhow::{bail, Result};
use serde_json::{Map, Value};

use crate::gguf::GgufFile;
use crate::kernels::rope_kv::Rope;
use fields::ConfigFields;

pub mod fields;
pub mod llama;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod smollm3;

/// What a weight does in the model. Per-layer roles name one tensor of
/// every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Token embeddings `[vocab, hidden]`.
    Embed,
    /// The norm after the last layer `[hidden]`.
    FinalNorm,
    /// The LM head `[vocab, hidden]`, absent when tied to the embeddings.
    LmHead,
    /// The norm before attention `[hidden]`.
    AttnNorm,
    /// The query, key and value projections `[heads * head_dim, hidden]`.
    Q,
    K,
    V,
    /// The three stacked in one tensor, rows q then k then v (Phi-3).
    Qkv,
    /// Their biases (families whose [`LayerSpec::qkv_bias`] says so).
    QBias,
    KBias,
    VBias,
    /// The output projection's bias ([`LayerSpec::o_bias`]).
    OBias,
    /// Per-head norms of the queries and keys `[head_dim]` (q/k norm).
    QNorm,
    KNorm,
    /// The attention output projection `[hidden, heads * head_dim]`.
    O,
    /// The norm before the MLP `[hidden]`.
    MlpNorm,
    /// The MLP's gate, up and down projections.
    Gate,
    Up,
    Down,
    /// Gate and up stacked in one tensor, rows gate then up (Phi-3).
    GateUp,
}

/// The sizes a tensor's shape is made of.
pub struct Dims {
    pub hidden: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Role {
    /// The row-major shape of the role's tensor.
    pub fn shape(self, d: &Dims) -> Vec<usize> {
        let (q, kv) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        match self {
            Role::Embed | Role::LmHead => vec![d.vocab, d.hidden],
            Role::FinalNorm | Role::AttnNorm | Role::MlpNorm | Role::OBias => vec![d.hidden],
            Role::Q => vec![q, d.hidden],
            Role::K | Role::V => vec![kv, d.hidden],
            Role::Qkv => vec![q + 2 * kv, d.hidden],
            Role::QBias => vec![q],
            Role::KBias | Role::VBias => vec![kv],
            Role::QNorm | Role::KNorm => vec![d.head_dim],
            Role::O => vec![d.hidden, q],
            Role::Gate | Role::Up => vec![d.ffn, d.hidden],
            Role::GateUp => vec![2 * d.ffn, d.hidden],
            Role::Down => vec![d.hidden, d.ffn],
        }
    }

    /// Whether the role names one tensor per layer.
    pub fn per_layer(self) -> bool {
        !matches!(self, Role::Embed | Role::FinalNorm | Role::LmHead)
    }
}

/// One model family.
pub struct Family {
    /// Short name (`sieve info` shows it beside the architecture).
    pub name: &'static str,
    /// The `architectures` entries of config.json it answers to.
    pub architectures: &'static [&'static str],
    /// Its `model_type`, which names the family where `architectures` is
    /// absent (configs written by transformers 5).
    pub model_type: &'static str,
    /// Each role's tensor: its Hugging Face name and its GGUF name as
    /// llama.cpp writes it ("" where it has none); `{l}` stands for the layer.
    pub tensors: &'static [(Role, &'static str, &'static str)],
    /// What each layer computes, from config.json (`rope` is the RoPE the
    /// shared keys describe, for the family to place).
    pub layers: fn(&ConfigFields, &Rope, usize) -> Result<Vec<LayerSpec>>,
    /// How llama.cpp writes the family as GGUF; None: sieve reads no GGUF
    /// file of it.
    pub gguf: Option<GgufLayout>,
}

/// A family's GGUF files as llama.cpp's converter writes them.
pub struct GgufLayout {
    /// `general.architecture`, also the prefix of the family's metadata keys.
    pub architecture: &'static str,
    /// The converter reordered the q/k rows of each head (the Llama
    /// layouts), which the loader undoes (`gguf_model::names`).
    pub permutes_qk: bool,
    /// The family's own config.json keys, from its metadata (beyond those
    /// every family shares, which `gguf_model::meta` writes).
    pub config: fn(&GgufFile, &mut Map<String, Value>) -> Result<()>,
    /// Tensors that hold settings rather than weights (Phi-3's RoPE factors),
    /// which `config` reads.
    pub setting_tensors: &'static [&'static str],
}

/// A [`GgufLayout::config`] with nothing to add.
pub fn no_gguf_keys(_: &GgufFile, _: &mut Map<String, Value>) -> Result<()> {
    Ok(())
}

/// Every family sieve runs.
pub const FAMILIES: &[&Family] = &[
    &llama::FAMILY,
    &qwen2::FAMILY,
    &qwen3::FAMILY,
    &smollm3::FAMILY,
    &phi3::FAMILY,
];

/// The family whose architectures include `architecture`.
pub fn by_architecture(architecture: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.architectures.contains(&architecture))
}

/// The family whose `model_type` is `model_type`.
pub fn by_model_type(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_type == model_type)
}

/// The family whose GGUF `general.architecture` is `name`.
pub fn by_gguf_architecture(name: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.gguf.as_ref().is_some_and(|g| g.architecture == name))
}

/// Every GGUF architecture sieve reads, for error messages.
pub fn supported_gguf_architectures() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .filter_map(|f| f.gguf.as_ref().map(|g| g.architecture))
        .collect()
}

/// Every supported `architectures` name, for error messages.
pub fn supported_architectures() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.architectures)
        .copied()
        .collect()
}

impl Family {
    /// The Hugging Face name of `role` in layer `layer` (ignored for the
    /// model-wide roles), or None when the family has no such tensor.
    pub fn tensor(&self, role: Role, layer: usize) -> Option<String> {
        self.tensors
            .iter()
            .find(|(r, _, _)| *r == role)
            .map(|(_, name, _)| name.replace("{l}", &layer.to_string()))
    }

    /// As [`Family::tensor`], for a role every family of this kind has.
    pub fn required(&self, role: Role, layer: usize) -> String {
        self.tensor(role, layer)
            .unwrap_or_else(|| panic!("family {} has no {role:?} tensor", self.name))
    }
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl PartialEq for Family {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

/// What one decoder layer computes beyond the Llama layer every family
/// shares (RMSNorm, attention, RMSNorm, SwiGLU MLP, residuals).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// The q, k and v projections have biases.
    pub qkv_bias: bool,
    /// The output projection has a bias.
    pub o_bias: bool,
    /// Each query and key head is RMS-normed (its own weight over head_dim)
    /// before RoPE.
    pub qk_norm: bool,
    /// The layer's rotary embedding; `rotary_dim` 0 for a layer without one.
    pub rope: Rope,
}

impl LayerSpec {
    /// A Llama layer with `rope`: no bias, no q/k norm.
    pub fn llama(rope: &Rope) -> Self {
        LayerSpec {
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            rope: rope.clone(),
        }
    }
}

/// `layer_types` (transformers 5; also in some transformers 4 configs):
/// one entry per layer, each "full_attention". Sliding-window layers are
/// refused by name until sieve has them.
pub fn check_layer_types(f: &ConfigFields, n_layers: usize) -> Result<()> {
    let Some(types) = f.array("layer_types")? else {
        return Ok(());
    };
    if types.len() != n_layers {
        bail!(
            "{}: layer_types has {} entries; expected one per layer ({n_layers})",
            f.file(),
            types.len()
        );
    }
    for (l, t) in types.iter().enumerate() {
        match t.as_str() {
            Some("full_attention") => {}
            Some("sliding_attention") => bail!(
                "{}: layer_types[{l}] is sliding_attention; sliding-window layers are not supported yet",
                f.file()
            ),
            _ => bail!(
                "{}: layer_types[{l}] is {t}; expected \"full_attention\"",
                f.file()
            ),
        }
    }
    Ok(())
}

/// Two tensor tables as one, at compile time (a family that adds tensors
/// to another's table).
pub(crate) const fn concat_tables<const N: usize>(
    a: &[(Role, &'static str, &'static str)],
    b: &[(Role, &'static str, &'static str)],
) -> [(Role, &'static str, &'static str); N] {
    let mut out = [(Role::Embed, "", ""); N];
    let mut i = 0;
    while i < a.len() {
        out[i] = a[i];
        i += 1;
    }
    while i < N {
        out[i] = b[i - a.len()];
        i += 1;
    }
    out
}

/// A `sliding_window` on a family whose every layer would use it: refused
/// by name until sieve has sliding windows, unless it reaches past
/// `max_position_embeddings` and so hides nothing (Phi-3.5-mini and
/// Phi-4-mini publish 262,144 with a context of 131,072).
pub fn refuse_sliding_window(f: &ConfigFields) -> Result<()> {
    let Some(w) = f.usize_opt("sliding_window")? else {
        return Ok(());
    };
    let context = f.usize_or("max_position_embeddings", 4096)?;
    if w < context {
        bail!(
            "{}: sliding_window is {w}, less than max_position_embeddings ({context}); sliding-window attention is not supported yet",
            f.file()
        );
    }
    Ok(())
}

/// Fields of the Llama-layout families that would change the computation
/// and that sieve does not have: refused by name, never ignored.
pub fn refuse_unsupported(f: &ConfigFields) -> Result<()> {
    if f.bool_or("mlp_bias", false)? {
        bail!(
            "{}: mlp_bias is true; biases on the MLP projections are not supported",
            f.file()
        );
    }
    if f.bool_or("use_sliding_window", false)? {
        bail!(
            "{}: use_sliding_window is true; sliding-window attention is not supported yet",
            f.file()
        );
    }
    Ok(())
}
