//! `sieve eval merge`: combines the result folders of several shards (or of
//! runs of different policies) into one folder and report.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;
use std::path::PathBuf;

use super::report;
use sieve::eval::store::ResultStore;

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// Folder for the merged results and report.
    #[arg(long)]
    pub out: PathBuf,
    /// Result folders to merge (each with settings.json and results.jsonl).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
}

pub fn main(a: MergeArgs) -> Result<()> {
    let mut merged = None;
    for dir in &a.inputs {
        let path = dir.join("settings.json");
        if !path.exists() {
            bail!(
                "{} is not an eval result folder (no settings.json)",
                dir.display()
            );
        }
        let settings: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
            .with_context(|| format!("reading {}", path.display()))?;
        // Opening with its own settings cannot fail on them; it reads the results.
        let input = ResultStore::open(dir, &settings, &["shard", "limit"])?;
        // Reopening the merged folder with each input's settings checks that
        // they all agree (but for the shard and the limit; their policy and
        // budget lists add up). One store holds the folder's lock at a time.
        drop(merged.take());
        let mut out = ResultStore::open(&a.out, &settings, &["shard", "limit"])?;
        out.merge_from(&input)?;
        eprintln!("{}: {} results", dir.display(), input.records().len());
        merged = Some(out);
    }
    report(&merged.context("no input folders")?)
}
