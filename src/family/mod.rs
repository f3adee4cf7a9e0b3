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
pub mod gemma3;
pub mod llama;
pub mod mistral;
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
    /// The norms of the attention and MLP outputs before they join the
    /// residual `[hidden]` (Gemma 3's sandwich norms, [`LayerSpec::sandwich_norms`]).
    PostAttnNorm,
    PostMlpNorm,
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
            Role::FinalNorm
            | Role::AttnNorm
            | Role::MlpNorm
            | Role::PostAttnNorm
            | Role::PostMlpNorm
            | Role::OBias => vec![d.hidden],
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

    /// Whether the role is a norm's weight (which a family's `norm_offset`
    /// applies to).
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            Role::FinalNorm
                | Role::AttnNorm
                | Role::MlpNorm
                | Role::PostAttnNorm
                | Role::PostMlpNorm
                | Role::QNorm
                | Role::KNorm
        )
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
    /// Its norms multiply by `norm_offset + w` (Gemma's 1 + w; 0 for the
    /// others). The loader adds it to every norm weight of Hugging Face
    /// files; llama.cpp's converter has already added it in GGUF files.
    pub norm_offset: f32,
    /// The token embeddings are multiplied by sqrt(hidden) before the first
    /// layer (Gemma), but not where the LM head reuses them.
    pub scales_embeddings: bool,
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
    &gemma3::FAMILY,
    &mistral::FAMILY,
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

/// The gate activation of the MLP: act(gate) * up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): the Llama layout.
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`; Gemma).
    GeluTanh,
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
    /// Sliding-window attention: a query at position p sees the keys at
    /// positions p - window + 1 ..= p (by original position, so also after
    /// evictions); None: every earlier key.
    pub window: Option<usize>,
    /// The scores are multiplied by this; None: 1 / sqrt(head_dim). Gemma 3
    /// takes `query_pre_attn_scalar ** -0.5`.
    pub attn_scale: Option<f32>,
    /// The attention and MLP outputs are RMS-normed (`PostAttnNorm`,
    /// `PostMlpNorm`) before they join the residual (Gemma 3).
    pub sandwich_norms: bool,
    pub activation: Activation,
}

impl LayerSpec {
    /// A Llama layer with `rope`: no bias, no q/k norm.
    pub fn llama(rope: &Rope) -> Self {
        LayerSpec {
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            rope: rope.clone(),
            window: None,
            attn_scale: None,
            sandwich_norms: false,
            activation: Activation::Silu,
        }
    }
}

/// `layer_types` (transformers 5; also in some transformers 4 configs):
/// one entry per layer, "full_attention" or "sliding_attention"; for each
/// layer whether it slides, None when the key is absent.
pub fn layer_types(f: &ConfigFields, n_layers: usize) -> Result<Option<Vec<bool>>> {
    let Some(types) = f.array("layer_types")? else {
        return Ok(None);
    };
    if types.len() != n_layers {
        bail!(
            "{}: layer_types has {} entries; expected one per layer ({n_layers})",
            f.file(),
            types.len()
        );
    }
    let sliding = types
        .iter()
        .enumerate()
        .map(|(l, t)| match t.as_str() {
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => bail!(
                "{}: layer_types[{l}] is {t}; expected \"full_attention\" or \"sliding_attention\"",
                f.file()
            ),
        })
        .collect::<Result<Vec<bool>>>()?;
    Ok(Some(sliding))
}

/// `layer_types` of a family whose layers all attend fully: a sliding
/// entry is refused by name (its config would need the family's window
/// settings, which only Gemma 3 and Mistral read).
pub fn check_layer_types(f: &ConfigFields, n_layers: usize) -> Result<()> {
    if let Some(l) = layer_types(f, n_layers)?.and_then(|s| s.iter().position(|&w| w)) {
        bail!(
            "{}: layer_types[{l}] is sliding_attention; this family's layers attend fully (sliding windows are read for Gemma 3 and Mistral)",
            f.file()
        );
    }
    Ok(())
}

/// `sliding_window`: None when absent or null; 0 is refused by name.
pub fn sliding_window(f: &ConfigFields) -> Result<Option<usize>> {
    let w = f.usize_opt("sliding_window")?;
    if w == Some(0) {
        bail!(
            "{}: sliding_window is 0; expected a window of at least one token",
            f.file()
        );
    }
    Ok(w)
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
            "{}: use_sliding_window is true; Qwen2's windows on the layers past max_window_layers are not supported",
            f.file()
        );
    }
    Ok(())
}
