//! `sieve logits`: float32 logits of the last position of a token sequence,
//! written as a .npy file of shape [vocab].

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

use super::{parse_ids, write_atomic, ModelArgs};
use sieve::engine::{Engine, EngineOptions, StepOutput};
use sieve::model::Model;

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids.
    #[arg(long)]
    pub ids: String,
    /// Output .npy file.
    #[arg(long)]
    pub out: PathBuf,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
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
    let model = Model::load(&a.model.dir()?, &a.model.load_options())?;
    let max_pos = model.config.max_position_embeddings;
    if ids.len() > max_pos {
        anyhow::bail!(
            "{} ids exceed the model's context of {max_pos} positions",
            ids.len()
        );
    }
    let chunk = a.chunk.clamp(1, ids.len());
    let mut e = Engine::new(
        model,
        EngineOptions {
            max_slots: ids.len(),
            max_tokens: chunk,
            max_logit_rows: 1,
        },
    )?;
    let mut done = 0;
    for piece in ids.chunks(chunk) {
        let pos: Vec<u32> = (done..done + piece.len()).map(|p| p as u32).collect();
        e.step(piece, &pos, StepOutput::last(piece.len()))?;
        done += piece.len();
    }
    let logits = e.read_logits(1)?;
    write_atomic(&a.out, &npy_f32(&logits))?;
    eprintln!("wrote {} logits to {}", logits.len(), a.out.display());
    Ok(())
}
