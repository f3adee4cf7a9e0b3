//! `sieve shaders --dump DIR`: writes every kernel module sieve assembles
//! (each kernel with each weight format, weight store and KV format), one
//! `.wgsl` file each, as the WGSL specification wants it (its `enable`s
//! included), so that any WGSL compiler can be pointed at them; and
//! `index.json`, which lists each file with its kernel, format, store,
//! extensions and entry points (scripts/tint-check.sh reads it).

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

use sieve::shaders;

#[derive(Args, Debug)]
pub struct ShadersArgs {
    /// A folder to write the modules into: new, or empty.
    #[arg(long)]
    pub dump: PathBuf,
}

pub fn main(a: ShadersArgs) -> Result<()> {
    let dir = &a.dump;
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir)
            .with_context(|| format!("--dump {}: cannot read the folder", dir.display()))?;
        if entries.next().is_some() {
            bail!(
                "--dump {}: the folder is not empty; give a new or empty one",
                dir.display()
            );
        }
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--dump {}: cannot create the folder", dir.display()))?;
    let mut index = vec![];
    for m in shaders::modules() {
        let src = m.source();
        let name = m.file_name();
        let module = shaders::parse(&src)
            .map_err(|e| anyhow::anyhow!("{name}: {}", e.emit_to_string(&src)))?;
        let entries: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        index.push(serde_json::json!({
            "file": name,
            "kernel": m.shader.file,
            "format": m.packed.map(|p| p.name()),
            "store": m.packed.is_some_and(|p| matches!(p, shaders::Packed::Weights(_)))
                .then(|| m.store.name()),
            "enables": shaders::enables(m.shader),
            "entry_points": entries,
        }));
        let path = dir.join(&name);
        std::fs::write(&path, &src).with_context(|| format!("writing {}", path.display()))?;
    }
    let path = dir.join("index.json");
    std::fs::write(&path, serde_json::to_string_pretty(&index)?)
        .with_context(|| format!("writing {}", path.display()))?;
    super::print_line(&format!(
        "sieve shaders: {} modules in {}",
        index.len(),
        dir.display()
    ))
}
