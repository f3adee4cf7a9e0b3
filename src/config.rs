//! Model configuration from a Hugging Face `config.json`: the settings every
//! family shares (dimensions, RoPE and its scalings, token ids) are read
//! here; what is particular to a family is read by its file in
//! `crate::family`, into one [`LayerSpec`] per layer.

pub use crate::family::fields::ConfigFields;
use crate::family::{Family, LayerSpec};
use crate::kernels::attention::{
    MAX_HEADS_PER_KV, MAX_HEAD_DIM, NARROW_HEAD_DIM, WIDE_HEADS_PER_KV,
};
pub use crate::kernels::rope_kv::{LongRope, Rope};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Positions divided by `factor` (transformers' "linear").
    Linear {
        factor: f64,
    },
    /// LongRoPE (Phi-3, Phi-4-mini): each pair's frequency divided by its
    /// factor, `short_factor` for contexts up to
    /// `original_max_position_embeddings` and `long_factor` beyond; cos and
    /// sin times `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// The family's Hugging Face architecture name (config.json's
    /// `architectures[0]`, or the family's own where only `model_type` is given).
    pub architecture: String,
    /// The family that architecture belongs to: its tensor table and layers.
    pub family: &'static Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Dimensions of each head that RoPE rotates (`partial_rotary_factor`
    /// times head_dim; head_dim by default).
    pub rotary_dim: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// What each decoder layer computes, from the family.
    pub layers: Vec<LayerSpec>,
    /// Added to every norm weight when the weights are loaded: the family's
    /// `norm_offset` for Hugging Face files, 0 for GGUF files (llama.cpp's
    /// converter has added it).
    pub norm_weight_offset: f32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// Largest values sieve accepts for each dimension: far above any released
/// Llama or Qwen2 model, and small enough that no size computed from them
/// overflows (the largest tensor, vocab x hidden, stays below 2^50 bytes).
pub const LIMITS: &[(&str, usize)] = &[
    ("hidden_size", 1 << 16),
    ("intermediate_size", 1 << 18),
    ("num_hidden_layers", 1 << 10),
    ("num_attention_heads", 1 << 10),
    ("num_key_value_heads", 1 << 10),
    ("vocab_size", 1 << 22),
];

/// Checks one model dimension against [`LIMITS`] (`dimension` is its
/// config.json name): an error naming `source` (the file), `field` (its name
/// there: the config.json key, or the GGUF metadata key), the value and the
/// range. Config files and GGUF metadata are checked by this one rule.
pub fn check_dimension(source: &str, field: &str, dimension: &str, value: u64) -> Result<()> {
    let max = LIMITS
        .iter()
        .find(|(name, _)| *name == dimension)
        .map(|&(_, max)| max as u64)
        .unwrap_or_else(|| panic!("no limit for {dimension}"));
    if value == 0 || value > max {
        bail!("{source}: {field} is {value}; expected 1 to {max}");
    }
    Ok(())
}

/// A token id or a list of them (`bos_token_id`, `eos_token_id`); absent or
/// null is none. Anything else (a string, a negative or fractional number,
/// an id beyond u32) is an error naming `field` in `file`.
pub fn token_ids(v: Option<&Value>, field: &str, file: &Path) -> Result<Vec<u32>> {
    let one = |x: &Value| -> Result<u32> {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .with_context(|| {
                format!(
                    "{}: {field} holds {x}; expected token ids (integers 0 to {})",
                    file.display(),
                    u32::MAX
                )
            })
    };
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(x) => Ok(vec![one(x)?]),
    }
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        Self::from_json(&v, path)
    }

    pub fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let f = ConfigFields::new(v, path);
        // `architectures[0]` names the family; transformers 5 writes only
        // `model_type`.
        let family = match v.get("architectures").and_then(|a| a.get(0)) {
            Some(a) => {
                let arch = a.as_str().with_context(|| {
                    format!(
                        "{}: architectures[0] is {a}, expected a name",
                        path.display()
                    )
                })?;
                crate::family::by_architecture(arch).with_context(|| {
                    format!(
                        "{}: architecture '{arch}' is not supported; supported: {}",
                        path.display(),
                        crate::family::supported_architectures().join(", ")
                    )
                })?
            }
            None => {
                let model_type =
                    v.get("model_type")
                        .and_then(Value::as_str)
                        .with_context(|| {
                            format!(
                        "{}: neither 'architectures' nor 'model_type' says which model this is",
                        path.display()
                    )
                        })?;
                crate::family::by_model_type(model_type).with_context(|| {
                    format!(
                        "{}: model_type '{model_type}' is not supported; supported: {}",
                        path.display(),
                        crate::family::FAMILIES
                            .iter()
                            .map(|f| f.model_type)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })?
            }
        };
        let arch = family.architectures[0];
        let hidden_size = f.usize("hidden_size")?;
        let num_heads = f.usize("num_attention_heads")?;
        let num_kv_heads = f.usize_or("num_key_value_heads", num_heads)?;
        let head_dim = f.usize_or("head_dim", hidden_size / num_heads.max(1))?;
        let rope_theta = f.rope_f64_or("rope_theta", 10000.0)?;
        let partial = f.rope_f64_or("partial_rotary_factor", 1.0)?;
        if !(partial > 0.0 && partial <= 1.0) {
            bail!(
                "{}: partial_rotary_factor is {partial}; expected a number in (0, 1]",
                path.display()
            );
        }
        // transformers: int(head_dim * partial_rotary_factor); the 1e-9
        // keeps a factor written as a ratio (d / head_dim, as a GGUF's
        // rope.dimension_count gives it) from landing an ulp below d.
        let rotary_dim = (head_dim as f64 * partial + 1e-9) as usize;
        let num_layers = f.usize("num_hidden_layers")?;
        let max_position_embeddings = f.usize_or("max_position_embeddings", 4096)?;
        let rope_scaling = rope_scaling(&f, v, max_position_embeddings)?;
        let mut cfg = ModelConfig {
            architecture: arch.to_string(),
            family,
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            rotary_dim,
            max_position_embeddings,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            layers: vec![],
            norm_weight_offset: family.norm_offset,
            bos_token_id: token_ids(v.get("bos_token_id"), "bos_token_id", path)?
                .first()
                .copied(),
            eos_token_ids: token_ids(v.get("eos_token_id"), "eos_token_id", path)?,
        };
        // The shared checks first: the family's layers are built from
        // dimensions known to be sound.
        cfg.validate(path)?;
        cfg.layers = (family.layers)(&f, &cfg.rope(), num_layers)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let p = path.display();
        let dims = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("vocab_size", self.vocab_size),
        ];
        for (name, value) in dims {
            check_dimension(&p.to_string(), name, name, value as u64)?;
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            bail!(
                "{p}: rms_norm_eps is {}; expected a finite number above 0",
                self.rms_norm_eps
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!(
                "{p}: rope_theta is {}; expected a finite number above 0",
                self.rope_theta
            );
        }
        if self.head_dim == 0 {
            bail!("{p}: head_dim is 0; expected a positive multiple of 4");
        }
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            bail!(
                "{p}: num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if self.num_heads / self.num_kv_heads > MAX_HEADS_PER_KV {
            bail!("{p}: more than {MAX_HEADS_PER_KV} query heads per KV head is not supported");
        }
        if !self.head_dim.is_multiple_of(4) || self.head_dim > MAX_HEAD_DIM {
            bail!(
                "{p}: head_dim {} must be a multiple of 4 and at most {MAX_HEAD_DIM}",
                self.head_dim
            );
        }
        if self.head_dim > NARROW_HEAD_DIM && self.num_heads / self.num_kv_heads > WIDE_HEADS_PER_KV
        {
            bail!(
                "{p}: head_dim {} over {NARROW_HEAD_DIM} takes at most {WIDE_HEADS_PER_KV} query heads per KV head, not {}",
                self.head_dim,
                self.num_heads / self.num_kv_heads
            );
        }
        if !self.hidden_size.is_multiple_of(4) || !self.intermediate_size.is_multiple_of(4) {
            bail!("{p}: hidden_size and intermediate_size must be multiples of 4");
        }
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = self.rope_scaling
        {
            let all = [
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            ];
            // transformers divides by each and by high - low.
            if !(all.iter().all(|x| x.is_finite() && *x > 0.0)
                && high_freq_factor > low_freq_factor)
            {
                bail!(
                    "{p}: rope_scaling (llama3) has factor {factor}, low_freq_factor {low_freq_factor}, high_freq_factor {high_freq_factor}, original_max_position_embeddings {original_max_position_embeddings}; expected finite values above 0 and high_freq_factor > low_freq_factor"
                );
            }
        }
        if let RopeScaling::Linear { factor } = self.rope_scaling {
            if !(factor.is_finite() && factor > 0.0) {
                bail!("{p}: rope_scaling (linear) has factor {factor}; expected a finite number above 0");
            }
        }
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } = &self.rope_scaling
        {
            for (name, factors) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if factors.len() != self.rotary_dim / 2 {
                    bail!(
                        "{p}: rope_scaling (longrope) {name} has {} values; expected one per rotated pair ({})",
                        factors.len(),
                        self.rotary_dim / 2
                    );
                }
                if let Some(bad) = factors.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                    bail!("{p}: rope_scaling (longrope) {name} holds {bad}; expected finite values above 0");
                }
            }
            if *original_max_position_embeddings == 0 {
                bail!("{p}: original_max_position_embeddings is 0; expected 1 or more");
            }
            if !(attention_factor.is_finite() && *attention_factor > 0.0) {
                bail!("{p}: rope_scaling (longrope) gives an attention factor of {attention_factor}; expected a finite number above 0");
            }
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim == 0 {
            bail!(
                "{p}: partial_rotary_factor gives {} rotary dimensions of head_dim {}; expected an even number above 0",
                self.rotary_dim,
                self.head_dim
            );
        }
        if let Some(bad) = self.rope().inv_freq.iter().find(|f| !f.is_finite()) {
            bail!("{p}: the RoPE settings give a frequency of {bad}; expected finite frequencies");
        }
        Ok(())
    }

    /// Width of the fused q|k|v projection output.
    pub fn qkv_dim(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }

    /// The RoPE the shared keys describe (rope_theta, rope_scaling,
    /// partial_rotary_factor); the family places it on its layers.
    pub fn rope(&self) -> Rope {
        rope(self.rope_theta, &self.rope_scaling, self.rotary_dim)
    }

    /// Whether any layer has q, k and v biases.
    pub fn has_qkv_bias(&self) -> bool {
        self.layers.iter().any(|l| l.qkv_bias)
    }
}

/// The RoPE scaling of config.json: `rope_scaling` (transformers 4), else
/// `rope_parameters` with a `rope_type` other than "default" (transformers 5).
fn rope_scaling(
    f: &ConfigFields,
    v: &Value,
    max_position_embeddings: usize,
) -> Result<RopeScaling> {
    let scaling = match v.get("rope_scaling").filter(|s| !s.is_null()) {
        Some(s) => Some(s),
        None => v.get("rope_parameters").filter(|r| {
            r.get("rope_type")
                .and_then(Value::as_str)
                .is_some_and(|t| t != "default")
        }),
    };
    let Some(s) = scaling else {
        return Ok(RopeScaling::None);
    };
    // The object read: transformers 4's `rope_scaling`, or 5's `rope_parameters`.
    let object = if v.get("rope_scaling").is_some_and(|x| !x.is_null()) {
        "rope_scaling"
    } else {
        "rope_parameters"
    };
    scaling_object(f, v, s, object, max_position_embeddings)
}

/// The scaling `s` says (`object` names it in errors): its `rope_type`
/// (or `type`) and that type's numbers.
pub fn scaling_object(
    f: &ConfigFields,
    v: &Value,
    s: &Value,
    object: &str,
    max_position_embeddings: usize,
) -> Result<RopeScaling> {
    let file = f.file();
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let number = |k: &str| -> Result<f64> {
        s.get(k)
            .and_then(Value::as_f64)
            .with_context(|| format!("{file}: {object}'s '{k}' is missing or not a number"))
    };
    let numbers = |k: &str| -> Result<Vec<f64>> {
        s.get(k)
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<_>>>())
            .with_context(|| {
                format!("{file}: {object}'s '{k}' is missing or not a list of numbers")
            })
    };
    Ok(match kind {
        "llama3" => RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")?,
        },
        "linear" => RopeScaling::Linear {
            factor: number("factor")?,
        },
        // transformers renames Phi-3's earlier name for it.
        "longrope" | "su" => {
            // As transformers: a config with `original_max_position_embeddings`
            // (Phi-3 keeps it beside rope_scaling) scales by the ratio of the
            // two context lengths; otherwise by rope_scaling's `factor`.
            let original = match s.get("original_max_position_embeddings") {
                Some(x) if !x.is_null() => Some(x),
                _ => v
                    .get("original_max_position_embeddings")
                    .filter(|x| !x.is_null()),
            };
            let (original, factor) = match original {
                Some(x) => {
                    let o = x.as_u64().with_context(|| {
                        format!("{file}: original_max_position_embeddings is {x}, expected a positive integer")
                    })? as usize;
                    (o, max_position_embeddings as f64 / o.max(1) as f64)
                }
                None => (
                    max_position_embeddings,
                    match s.get("factor") {
                        None | Some(Value::Null) => 1.0,
                        Some(_) => number("factor")?,
                    },
                ),
            };
            let attention_factor = match s.get("attention_factor").filter(|x| !x.is_null()) {
                Some(_) => number("attention_factor")?,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
            };
            RopeScaling::LongRope {
                short_factor: numbers("short_factor")?,
                long_factor: numbers("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            }
        }
        "default" | "" => RopeScaling::None,
        other => bail!(
            "{file}: rope_scaling type '{other}' is not supported (supported: llama3, linear, longrope)"
        ),
    })
}

/// The RoPE of base `theta` with `scaling` over the first `rotary_dim`
/// dimensions of each head (a family with RoPE of its own per layer, as
/// Gemma 3's, builds each with it).
pub fn rope(theta: f64, scaling: &RopeScaling, rotary_dim: usize) -> Rope {
    let mut rope = Rope {
        rotary_dim,
        inv_freq: rope_inv_freq(theta, scaling, rotary_dim),
        attention_factor: 1.0,
        long: None,
    };
    if let RopeScaling::LongRope {
        long_factor,
        original_max_position_embeddings,
        attention_factor,
        ..
    } = scaling
    {
        rope.attention_factor = *attention_factor as f32;
        rope.long = Some(LongRope {
            inv_freq: long_rope_inv_freq(theta, rotary_dim, long_factor),
            original: *original_max_position_embeddings,
        });
    }
    rope
}

/// LongRoPE's frequencies with `factors`, as transformers'
/// `_compute_longrope_parameters` computes them (in float32):
/// 1 / (factor_j * theta^(2j / rotary_dim)).
fn long_rope_inv_freq(theta: f64, rotary_dim: usize, factors: &[f64]) -> Vec<f32> {
    let d = rotary_dim as f32;
    factors
        .iter()
        .enumerate()
        .map(|(j, &ext)| 1.0f32 / (ext as f32 * (theta as f32).powf((2 * j) as f32 / d)))
        .collect()
}

/// Inverse RoPE frequencies for pair index j (0..rotary_dim/2), with
/// rope scaling applied exactly as transformers' `_compute_llama3_parameters`
/// and `_compute_linear_scaling_rope_parameters`.
pub fn rope_inv_freq(theta: f64, scaling: &RopeScaling, rotary_dim: usize) -> Vec<f32> {
    if let RopeScaling::LongRope { short_factor, .. } = scaling {
        return long_rope_inv_freq(theta, rotary_dim, short_factor);
    }
    let d = rotary_dim as f64;
    (0..rotary_dim / 2)
        .map(|j| {
            // transformers computes the base frequencies in float32.
            let base = (1.0f32 / (theta as f32).powf((2 * j) as f32 / d as f32)) as f64;
            let f = match scaling {
                RopeScaling::None | RopeScaling::LongRope { .. } => base,
                RopeScaling::Linear { factor } => base / factor,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: old,
                } => {
                    let low_wavelen = old / low_freq_factor;
                    let high_wavelen = old / high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / base;
                    if wavelen < high_wavelen {
                        base
                    } else if wavelen > low_wavelen {
                        base / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * base / factor + smooth * base
                    }
                }
            };
            f as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_architecture_is_named() {
        let v: Value = serde_json::json!({"architectures": ["FalconForCausalLM"]});
        let err = ModelConfig::from_json(&v, Path::new("x/config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("FalconForCausalLM") && err.contains("LlamaForCausalLM"),
            "{err}"
        );
    }

    #[test]
    fn llama3_scaling_matches_reference_values() {
        // Llama 3.1 8B settings; the reference numbers are transformers' llama3 rule
        // evaluated by hand: j = 0 (short wavelength) unchanged, last pair divided by 8.
        let v = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        });
        let cfg = ModelConfig::from_json(&v, Path::new("config.json")).unwrap();
        let f = cfg.rope().inv_freq;
        assert_eq!(f.len(), 64);
        assert!((f[0] - 1.0).abs() < 1e-7);
        let base_last = 1.0 / 500000f64.powf(126.0 / 128.0);
        assert!(((f[63] as f64) - base_last / 8.0).abs() < 1e-9 * 1e3);
        // A pair in the smooth band lies strictly between base/8 and base.
        let j = 32; // wavelength 2 pi / 500000^-0.5 = 4443, between 2048 and 8192
        let base = 1.0 / 500000f64.powf(2.0 * j as f64 / 128.0);
        assert!((f[j] as f64) < base && (f[j] as f64) > base / 8.0);
    }
    /// A small config of `arch` with `extra` keys merged in.
    fn config(arch: &str, extra: Value) -> Result<ModelConfig> {
        let mut v = serde_json::json!({
            "architectures": [arch], "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 512, "max_position_embeddings": 4096
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v, Path::new("m/config.json"))
    }

    fn error(arch: &str, extra: Value) -> String {
        format!("{:#}", config(arch, extra).unwrap_err())
    }

    /// Each family's malformed or unsupported fields are refused, naming
    /// the file and the field.
    #[test]
    fn family_fields_are_checked_by_name() {
        for (arch, extra, expect) in [
            (
                "LlamaForCausalLM",
                serde_json::json!({"layer_types": ["full_attention"]}),
                "layer_types has 1 entries; expected one per layer (4)",
            ),
            (
                "Qwen3ForCausalLM",
                serde_json::json!({"layer_types": ["full_attention", "full_attention", "sliding_attention", "full_attention"]}),
                "layer_types[2] is sliding_attention; this family's layers attend fully",
            ),
            (
                "SmolLM3ForCausalLM",
                serde_json::json!({"no_rope_layers": [1, 0, 1]}),
                "no_rope_layers has 3 entries; expected one per layer (4)",
            ),
            (
                "SmolLM3ForCausalLM",
                serde_json::json!({"no_rope_layers": [1, 0, 2, 1]}),
                "no_rope_layers[2] is 2; expected 1 (RoPE) or 0 (none)",
            ),
            (
                "SmolLM3ForCausalLM",
                serde_json::json!({"no_rope_layer_interval": 0}),
                "no_rope_layer_interval is 0",
            ),
            (
                "Phi3ForCausalLM",
                serde_json::json!({"partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024,
                    "rope_scaling": {"type": "longrope", "short_factor": [1.0, 2.0], "long_factor": vec![1.0; 12]}}),
                "short_factor has 2 values; expected one per rotated pair (12)",
            ),
            (
                "MistralForCausalLM",
                serde_json::json!({"sliding_window": 0}),
                "sliding_window is 0; expected a window of at least one token",
            ),
            (
                "Gemma3ForCausalLM",
                serde_json::json!({"sliding_window": 16, "final_logit_softcapping": 30.0}),
                "final_logit_softcapping is set; logit soft-capping is not supported",
            ),
            (
                "Gemma3ForCausalLM",
                serde_json::json!({"sliding_window": 16, "hidden_activation": "gelu"}),
                "hidden_activation is \"gelu\"; expected \"gelu_pytorch_tanh\"",
            ),
            (
                "Gemma3ForCausalLM",
                serde_json::json!({"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}),
                "layer_types has 2 entries; expected one per layer (4)",
            ),
            (
                "Gemma3ForCausalLM",
                serde_json::json!({"sliding_window_pattern": 2}),
                "sliding layers but no sliding_window",
            ),
            (
                "LlamaForCausalLM",
                serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
                "rope_scaling type 'yarn' is not supported (supported: llama3, linear, longrope)",
            ),
            (
                "LlamaForCausalLM",
                serde_json::json!({"partial_rotary_factor": 1.5}),
                "partial_rotary_factor is 1.5; expected a number in (0, 1]",
            ),
            (
                "FalconForCausalLM",
                serde_json::json!({}),
                "architecture 'FalconForCausalLM' is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, SmolLM3ForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM, MistralForCausalLM",
            ),
        ] {
            let e = error(arch, extra.clone());
            assert!(e.contains("m/config.json") && e.contains(expect), "{arch} {extra}: {e}");
        }
        // transformers 5 names the family by model_type alone.
        let v = serde_json::json!({"model_type": "falcon", "hidden_size": 128});
        let e = format!(
            "{:#}",
            ModelConfig::from_json(&v, Path::new("m/config.json")).unwrap_err()
        );
        assert!(e.contains("model_type 'falcon' is not supported; supported: llama, qwen2, qwen3, smollm3, phi3, gemma3_text, mistral"), "{e}");
    }

    /// A window as long as the context hides nothing (Phi-4-mini's 262,144
    /// over 131,072): dropped. A shorter one applies to every layer
    /// (Phi-3-mini-4k's 2,047, Mistral 7B v0.1's 4,096), and Gemma 3's to
    /// all but every `sliding_window_pattern`-th layer.
    #[test]
    fn windows_apply_where_they_hide_something() {
        let windows = |arch: &str, extra: serde_json::Value| -> Vec<Option<usize>> {
            let c = config(arch, extra).unwrap();
            c.layers.iter().map(|l| l.window).collect()
        };
        let big = serde_json::json!({"sliding_window": 262144, "max_position_embeddings": 131072});
        assert_eq!(windows("Phi3ForCausalLM", big), vec![None; 4]);
        let phi3_mini = serde_json::json!({"sliding_window": 2047});
        assert_eq!(windows("Phi3ForCausalLM", phi3_mini), vec![Some(2047); 4]);
        let mistral = serde_json::json!({"sliding_window": 4096, "max_position_embeddings": 32768});
        assert_eq!(windows("MistralForCausalLM", mistral), vec![Some(4096); 4]);
        let later_mistral = serde_json::json!({"sliding_window": null});
        assert_eq!(windows("MistralForCausalLM", later_mistral), vec![None; 4]);
        let gemma = serde_json::json!({"sliding_window": 512, "sliding_window_pattern": 2});
        assert_eq!(
            windows("Gemma3ForCausalLM", gemma),
            vec![Some(512), None, Some(512), None]
        );
    }

    /// LongRoPE as transformers computes it: frequencies divided by each
    /// pair's factor, the attention factor from the two context lengths,
    /// the long factors beside the short ones.
    #[test]
    fn longrope_follows_transformers() {
        let short: Vec<f64> = (0..12).map(|j| 1.0 + j as f64 / 10.0).collect();
        let long: Vec<f64> = (0..12).map(|j| 2.0 + j as f64).collect();
        let c = config(
            "Phi3ForCausalLM",
            serde_json::json!({"partial_rotary_factor": 0.75, "rope_theta": 10000.0,
                "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}}),
        )
        .unwrap();
        let rope = &c.layers[0].rope;
        assert_eq!(rope.rotary_dim, 24);
        let want = (1.0f64 + (32f64).ln() / (4096f64).ln()).sqrt();
        assert!((rope.attention_factor as f64 - want).abs() < 1e-6);
        for j in 0..12 {
            let base = 10000f64.powf(-((2 * j) as f64) / 24.0);
            assert!((rope.inv_freq[j] as f64 - base / short[j]).abs() < 1e-6 * base);
            let l = &rope.long.as_ref().unwrap().inv_freq;
            assert!((l[j] as f64 - base / long[j]).abs() < 1e-6 * base);
        }
        assert_eq!(rope.long.as_ref().unwrap().original, 4096);
    }
}
