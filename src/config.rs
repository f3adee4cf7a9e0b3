//! Model configuration from a Hugging Face `config.json` (Llama and Qwen2 families).

use crate::kernels::attention::{MAX_HEADS_PER_KV, MAX_HEAD_DIM};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// The architectures sieve runs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["LlamaForCausalLM", "Qwen2ForCausalLM"];

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
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: String,
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
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q, k and v projections have biases (Qwen2).
    pub qkv_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn get_usize(v: &Value, key: &str, file: &Path) -> Result<usize> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .with_context(|| format!("{}: missing or non-integer field '{key}'", file.display()))
}

/// An optional number: absent or null gives `default`; anything other than a
/// number is an error naming the field.
fn get_f64_or(v: &Value, key: &str, default: f64, file: &Path) -> Result<f64> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x.as_f64().with_context(|| {
            format!(
                "{}: field '{key}' is {x}, expected a number",
                file.display()
            )
        }),
    }
}

/// An optional non-negative integer, as [`get_f64_or`].
fn get_usize_or(v: &Value, key: &str, default: usize, file: &Path) -> Result<usize> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x.as_u64().map(|x| x as usize).with_context(|| {
            format!(
                "{}: field '{key}' is {x}, expected a non-negative integer",
                file.display()
            )
        }),
    }
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
        let arch = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .with_context(|| format!("{}: no 'architectures' entry", path.display()))?;
        if !SUPPORTED_ARCHITECTURES.contains(&arch) {
            bail!(
                "{}: architecture '{arch}' is not supported; supported: {}",
                path.display(),
                SUPPORTED_ARCHITECTURES.join(", ")
            );
        }
        let hidden_size = get_usize(v, "hidden_size", path)?;
        let num_heads = get_usize(v, "num_attention_heads", path)?;
        let num_kv_heads = get_usize_or(v, "num_key_value_heads", num_heads, path)?;
        let head_dim = get_usize_or(v, "head_dim", hidden_size / num_heads.max(1), path)?;
        // transformers >= 5 moves rope settings into rope_parameters; accept both.
        let rope_params = v.get("rope_parameters");
        let rope_theta = match (v.get("rope_theta"), rope_params) {
            (None | Some(Value::Null), Some(r)) if r.get("rope_theta").is_some() => {
                get_f64_or(r, "rope_theta", 10000.0, path)?
            }
            _ => get_f64_or(v, "rope_theta", 10000.0, path)?,
        };
        let scaling = match v.get("rope_scaling").filter(|s| !s.is_null()) {
            Some(s) => Some(s),
            None => rope_params.filter(|r| {
                r.get("rope_type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t != "default")
            }),
        };
        let rope_scaling = match scaling {
            None => RopeScaling::None,
            Some(s) => {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let f = |k: &str| -> Result<f64> {
                    s.get(k)
                        .and_then(Value::as_f64)
                        .with_context(|| format!("{}: rope_scaling lacks '{k}'", path.display()))
                };
                match kind {
                    "llama3" => RopeScaling::Llama3 {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position_embeddings: f("original_max_position_embeddings")?,
                    },
                    "default" | "" => RopeScaling::None,
                    other => bail!(
                        "{}: rope_scaling type '{other}' is not supported (supported: llama3)",
                        path.display()
                    ),
                }
            }
        };
        let is_qwen2 = arch == "Qwen2ForCausalLM";
        let cfg = ModelConfig {
            architecture: arch.to_string(),
            hidden_size,
            intermediate_size: get_usize(v, "intermediate_size", path)?,
            num_layers: get_usize(v, "num_hidden_layers", path)?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: get_usize(v, "vocab_size", path)?,
            rms_norm_eps: get_f64_or(v, "rms_norm_eps", 1e-6, path)?,
            rope_theta,
            rope_scaling,
            max_position_embeddings: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(4096) as usize,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias: is_qwen2
                || v.get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            bos_token_id: token_ids(v.get("bos_token_id"), "bos_token_id", path)?
                .first()
                .copied(),
            eos_token_ids: token_ids(v.get("eos_token_id"), "eos_token_id", path)?,
        };
        cfg.validate(path)?;
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
        if let Some(bad) = self.rope_inv_freq().iter().find(|f| !f.is_finite()) {
            bail!("{p}: the RoPE settings give a frequency of {bad}; expected finite frequencies");
        }
        Ok(())
    }

    /// Width of the fused q|k|v projection output.
    pub fn qkv_dim(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }

    /// Inverse RoPE frequencies for pair index j (0..head_dim/2), with rope
    /// scaling applied exactly as transformers' `_compute_llama3_parameters`.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|j| {
                // transformers computes the base frequencies in float32.
                let base =
                    (1.0f32 / (self.rope_theta as f32).powf((2 * j) as f32 / d as f32)) as f64;
                let f = match &self.rope_scaling {
                    RopeScaling::None => base,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_architecture_is_named() {
        let v: Value = serde_json::json!({"architectures": ["MistralForCausalLM"]});
        let err = ModelConfig::from_json(&v, Path::new("x/config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("MistralForCausalLM") && err.contains("LlamaForCausalLM"),
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
        let f = cfg.rope_inv_freq();
        assert_eq!(f.len(), 64);
        assert!((f[0] - 1.0).abs() < 1e-7);
        let base_last = 1.0 / 500000f64.powf(126.0 / 128.0);
        assert!(((f[63] as f64) - base_last / 8.0).abs() < 1e-9 * 1e3);
        // A pair in the smooth band lies strictly between base/8 and base.
        let j = 32; // wavelength 2 pi / 500000^-0.5 = 4443, between 2048 and 8192
        let base = 1.0 / 500000f64.powf(2.0 * j as f64 / 128.0);
        assert!((f[j] as f64) < base && (f[j] as f64) > base / 8.0);
    }
}
