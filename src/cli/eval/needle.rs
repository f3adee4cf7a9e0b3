//! `sieve eval needle`: pass-key retrieval at several depths of a long filler
//! text, with the full cache and each policy and budget.

use anyhow::Result;
use clap::Args;
use serde_json::json;
use std::path::PathBuf;

use super::{budget_json, cache_of, report, unit_key, Progress, SweepArgs};
use sieve::eval::datasets::data_dir;
use sieve::eval::greedy;
use sieve::eval::needle::{needle_prompt, passkey, retrieved};
use sieve::eval::store::ResultStore;
use sieve::session::Llm;

#[derive(Args, Debug)]
pub struct NeedleArgs {
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Where the needle sits, as fractions of the filler (0 = start, 1 = end).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3,0.5,0.7,0.9")]
    pub depths: Vec<f64>,
    /// Pass keys tried per depth.
    #[arg(long, default_value_t = 2)]
    pub trials: usize,
    /// Seed of the pass keys.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Filler text (default: data/prose/moby_dick.txt).
    #[arg(long)]
    pub filler: Option<PathBuf>,
}

pub fn main(a: NeedleArgs) -> Result<()> {
    let s = &a.sweep;
    let configs = s.configs()?;
    let filler_path = match &a.filler {
        Some(f) => f.clone(),
        None => data_dir(s.data.as_deref())?
            .join("prose")
            .join("moby_dick.txt"),
    };
    let settings = s.settings(json!({
        "context": a.context, "seed": a.seed, "filler": filler_path.display().to_string(),
    }));
    let mut store = ResultStore::open(&s.out, &settings, &[])?;
    let llm = Llm::load(&s.model.dir()?, &s.model.load_options()?)?;
    let text = std::fs::read_to_string(&filler_path)
        .map_err(|e| anyhow::anyhow!("reading --filler {}: {e}", filler_path.display()))?;
    let filler = llm.tokenizer.encode(&text)?;
    let total = a.depths.len() * a.trials * configs.len();
    let progress = Progress::new(total as u64, "retrievals");
    let base = s.base();
    for &depth in &a.depths {
        for trial in 0..a.trials {
            let key_value = passkey(a.seed, trial as u64);
            let prompt = needle_prompt(&llm.tokenizer, &filler, a.context, depth, key_value)?;
            let item = format!("depth={depth}/trial={trial}");
            for c in &configs {
                let key = unit_key("needle", &item, c);
                if store.contains(&key) {
                    progress.inc(1);
                    continue;
                }
                progress.set_message(format!("{item} {} {}", c.policy.name(), c.budget));
                let g = greedy(&llm, &prompt, cache_of(c, &base), 8)?;
                let found = retrieved(&g.text, key_value);
                store.append(
                    &key,
                    json!({
                        "kind": "needle", "depth": depth, "trial": trial, "passkey": key_value,
                        "policy": c.policy.name(), "budget": budget_json(c),
                        "context": prompt.len(), "answer": g.text, "found": found,
                    }),
                )?;
                progress.inc(1);
            }
        }
    }
    progress.finish();
    report(&store)
}
