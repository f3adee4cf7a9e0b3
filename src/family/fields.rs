//! The fields of a config.json as families and `crate::config` read them.

use anyhow::{Context, Result};
use serde_json::Value;
use std::path::Path;

/// The fields of one config.json, read with errors that name the file and
/// the field. RoPE keys are found at the top level (transformers 4) or in
/// `rope_parameters` (transformers 5).
pub struct ConfigFields<'a> {
    v: &'a Value,
    path: &'a Path,
}

impl<'a> ConfigFields<'a> {
    pub fn new(v: &'a Value, path: &'a Path) -> Self {
        ConfigFields { v, path }
    }

    /// The file, for error messages.
    pub fn file(&self) -> String {
        self.path.display().to_string()
    }

    /// The whole config.json.
    pub fn json(&self) -> &'a Value {
        self.v
    }

    /// A field, absent when missing or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|x| !x.is_null())
    }

    /// A RoPE field: at the top level, else in `rope_parameters`.
    fn rope_get(&self, key: &str) -> Option<&'a Value> {
        self.get(key).or_else(|| {
            self.v
                .get("rope_parameters")
                .and_then(|r| r.get(key))
                .filter(|x| !x.is_null())
        })
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .with_context(|| format!("{}: missing or non-integer field '{key}'", self.file()))
    }

    /// An optional non-negative integer: absent or null gives `default`;
    /// anything other than one is an error naming the field.
    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => x.as_u64().map(|x| x as usize).with_context(|| {
                format!(
                    "{}: field '{key}' is {x}, expected a non-negative integer",
                    self.file()
                )
            }),
        }
    }

    /// An optional non-negative integer, None when absent or null.
    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.usize(key).map(Some),
        }
    }

    /// An optional number, as [`ConfigFields::usize_or`].
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        number_or(self.get(key), key, default, &self.file())
    }

    /// An optional RoPE number (top level or `rope_parameters`).
    pub fn rope_f64_or(&self, key: &str, default: f64) -> Result<f64> {
        number_or(self.rope_get(key), key, default, &self.file())
    }

    /// An optional boolean, as [`ConfigFields::usize_or`].
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => x.as_bool().with_context(|| {
                format!(
                    "{}: field '{key}' is {x}, expected true or false",
                    self.file()
                )
            }),
        }
    }

    /// An optional list.
    pub fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(x) => x
                .as_array()
                .map(Some)
                .with_context(|| format!("{}: field '{key}' is {x}, expected a list", self.file())),
        }
    }
}

fn number_or(x: Option<&Value>, key: &str, default: f64, file: &str) -> Result<f64> {
    match x {
        None => Ok(default),
        Some(x) => x
            .as_f64()
            .with_context(|| format!("{file}: field '{key}' is {x}, expected a number")),
    }
}
