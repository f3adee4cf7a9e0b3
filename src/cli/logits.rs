//! `sieve logits`: float32 logits of the last position of a token sequence,
//! written as a .npy file of shape [vocab].

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

use super::{parse_ids, write_atomic, CacheArgs, ModelArgs};
use sieve::model::Model;
use sieve::session::{last_logits, logits_cache};

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Comma-separated token ids.
    #[arg(long)]
    pub ids: String,
    /// Output .npy file.
    #[arg(long)]
    pub out: PathBuf,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = sieve::session::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
}

/// The bytes of a little-endian float32 .npy file of shape [n].
pub fn npy_f32(values: &[f32]) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        values.len()
    );
    // Magic (6) + version (2) + length (2) + header, padded with spaces to 64 bytes, ending in \n.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(bytemuck::cast_slice(values));
    out
}

pub fn main(a: LogitsArgs) -> Result<()> {
    let ids = parse_ids(&a.ids)?;
    if ids.is_empty() {
        anyhow::bail!("--ids is empty");
    }
    let cache_opts = a.cache.options()?;
    // A path that cannot take the output is refused before the model runs.
    sieve::files::check_output(&a.out, "--out")?;
    if let Some(path) = &a.cache.trace {
        sieve::files::check_output(path, "--trace")?;
    }
    let model = Model::load(&a.model.dir()?, &a.model.load_options()?)?;
    let mut cache = logits_cache(&model, &ids, cache_opts)?;
    cache.record = a.cache.trace.is_some();
    let logits = last_logits(model, &ids, &mut cache, a.prefill_chunk)?;
    write_atomic(&a.out, &npy_f32(&logits))?;
    if let Some(path) = &a.cache.trace {
        cache.write_trace(path)?;
    }
    eprintln!("wrote {} logits to {}", logits.len(), a.out.display());
    Ok(())
}
