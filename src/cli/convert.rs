//! `sieve convert-gguf`: a GGUF file to a Hugging Face model directory.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

use sieve::convert::{convert_gguf, OutDtype};

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Input .gguf file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K tensors).
    pub input: PathBuf,
    /// Output directory (must not exist or be empty).
    pub out_dir: PathBuf,
    /// Storage type of the matrices in model.safetensors.
    #[arg(long, value_parser = ["f16", "f32"], default_value = "f16")]
    pub dtype: String,
}

pub fn main(a: ConvertArgs) -> Result<()> {
    let dtype = if a.dtype == "f32" {
        OutDtype::F32
    } else {
        OutDtype::F16
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>40} [{bar:30}] {pos}/{len} tensors")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let mut progress = |done: usize, total: usize, name: &str| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(name.to_string());
    };
    convert_gguf(&a.input, &a.out_dir, dtype, &mut progress)?;
    bar.finish_and_clear();
    eprintln!("wrote {}", a.out_dir.display());
    Ok(())
}
