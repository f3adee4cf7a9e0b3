//! Output files are written whole or not at all.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically (a temporary file renamed into place),
/// so that no half-written output is ever left behind.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("partial-{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// A folder given explicitly, else named by the environment variable `env`,
/// else `rel` in the working directory or in the sieve repository, if it holds
/// `marker` (how the default model and the evaluation data are found).
pub fn locate(explicit: Option<&Path>, env: &str, rel: &str, marker: &str) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    if let Ok(p) = std::env::var(env) {
        return Some(PathBuf::from(p));
    }
    [
        PathBuf::from("."),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")),
    ]
    .into_iter()
    .map(|base| base.join(rel))
    .find(|p| p.join(marker).exists())
}
