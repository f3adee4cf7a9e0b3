//! A GGUF file loaded directly (`--model FILE.gguf`): its config, tokenizer
//! and special tokens built from its metadata (`meta.rs`, `vocab.rs`; the
//! same documents `convert-gguf` writes), its tensors found by their
//! Hugging Face names (`names.rs`) and read straight from the mapped file.
//!
//! Quantized tensors stay quantized on the GPU (src/formats) where the
//! tensor's type has a GPU layout (bf16 is held as f32). A matrix stacked
//! from tensors of different types (llama.cpp's `_M` mixes put `attn_v` in
//! a wider type than `attn_q`) keeps each part's own format.
//! `LoadOptions::dtype` overrides the choice for every matrix.

pub mod meta;
pub mod names;
pub mod vocab;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

use crate::config::ModelConfig;
use crate::formats::WeightFormat;
use crate::gguf::GgufFile;
use crate::gpu::Gpu;
use crate::weights::{GpuMatrix, WeightSource};
use meta::{Documents, ModelMeta};
use names::unpermute_rows;

/// An opened, checked GGUF model.
pub struct GgufModel {
    pub file: GgufFile,
    pub config: ModelConfig,
    /// The JSON documents a converted folder would hold, by file name.
    documents: Documents,
    /// Hugging Face tensor name -> (index into `file.tensors`, heads whose
    /// q/k rows llama.cpp permuted).
    tensors: HashMap<String, (usize, Option<usize>)>,
}

/// Whether `path` names a GGUF file (rather than a model folder).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file()
}

impl GgufModel {
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_file(GgufFile::open(path)?)
    }

    /// As [`GgufModel::open`], for a file's bytes already in memory (a
    /// browser page's file); `name` names it in messages.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self> {
        Self::from_file(GgufFile::from_bytes(name, bytes)?)
    }

    fn from_file(file: GgufFile) -> Result<Self> {
        let path = file.path.clone();
        let meta = ModelMeta::read(&file)?;
        let tensors = meta
            .tensors(&file)?
            .into_iter()
            .map(|t| (t.name, (t.index, t.qk_heads)))
            .collect();
        // Weights are read as f32 (or kept in their blocks), whatever
        // config.json would say.
        let documents = meta.documents(&file, "float32")?;
        let mut config = ModelConfig::from_json(&documents[0].1, &path)
            .with_context(|| format!("{}: the configuration its metadata gives", path.display()))?;
        // llama.cpp's converter adds Gemma's 1 to the norm weights.
        config.norm_weight_offset = 0.0;
        Ok(GgufModel {
            file,
            config,
            documents,
            tensors,
        })
    }

    /// The document a converted folder would hold as `name`
    /// (`tokenizer.json`, `tokenizer_config.json`, ...).
    pub fn document(&self, name: &str) -> Option<&Value> {
        self.documents
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
    }

    /// The tensor behind a Hugging Face name, checked to hold `shape`.
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&crate::gguf::GgufTensorInfo, Option<usize>)> {
        let &(i, heads) = self
            .tensors
            .get(name)
            .with_context(|| format!("{}: no tensor for {name}", self.file.path.display()))?;
        let t = &self.file.tensors[i];
        let have: Vec<u64> = t.shape();
        if have.iter().map(|&d| d as usize).ne(shape.iter().copied()) {
            bail!(
                "{}: tensor `{}` has shape {have:?}; the model needs {shape:?}",
                self.file.path.display(),
                t.name
            );
        }
        Ok((t, heads))
    }

    /// The tensor's values as f32, rows in Hugging Face order, every value finite.
    fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (t, heads) = self.tensor(name, shape)?;
        let values = self.file.dequantize(t)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            bail!(
                "{}: tensor `{}` holds {} at flat index {i}; weights must be finite",
                self.file.path.display(),
                t.name,
                values[i]
            );
        }
        Ok(unpermute_rows(&values, shape[0], heads))
    }
}

impl WeightSource for GgufModel {
    fn fill_rows(
        &self,
        gpu: &Gpu,
        m: &GpuMatrix,
        row0: usize,
        rows: usize,
        name: &str,
    ) -> Result<()> {
        let shape = [rows, m.cols];
        let (t, heads) = self.tensor(name, &shape)?;
        let format = m.format_at(row0).and_then(|f| f.block());
        if format.map(|b| b.ggml) == Some(t.ggml_type) {
            // Blocks go to the GPU as they are, repacked (rows hold whole blocks).
            let data = self.file.tensor_data(t)?;
            let blocks = unpermute_rows(data, rows, heads);
            return m.write_blocks(gpu, row0, &blocks, &t.name);
        }
        m.write_rows(gpu, row0, &self.values(name, &shape)?, &t.name)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.values(name, &[len])
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn stored_format(&self, name: &str) -> Option<WeightFormat> {
        let &(i, _) = self.tensors.get(name)?;
        Some(WeightFormat::of_ggml(self.file.tensors[i].ggml_type).unwrap_or(WeightFormat::F16))
    }
}
