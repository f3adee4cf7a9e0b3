//! `sieve eval task`: accuracy on MATH-500, GSM8K or AIME 2024 under each
//! policy and budget; `--shard i/n` runs every n-th item (for many machines),
//! `sieve eval merge` combines the shards.

use anyhow::Result;
use clap::Args;
use serde_json::json;

use super::{budget_json, pending_units, report, unit_key, Progress, SweepArgs, Unit};
use sieve::eval::answers::{answers_match, extract};
use sieve::eval::datasets::{data_dir, parse_shard, shard_of, task_items};
use sieve::eval::greedy_jobs;
use sieve::eval::store::ResultStore;
use sieve::session::Llm;

#[derive(Args, Debug)]
pub struct TaskArgs {
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// math500, gsm8k or aime2024.
    #[arg(long)]
    pub dataset: String,
    /// Only the first N problems.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Run shard i of n (every n-th problem, starting at i; 0-based), e.g. 0/4.
    #[arg(long)]
    pub shard: Option<String>,
    /// Tokens generated per problem at most.
    #[arg(long, default_value_t = 1024)]
    pub max_new_tokens: usize,
    /// Generations stepped together (problems and configurations alike); 1 runs each
    /// alone. Default: as many as there are, at most 32 and as many as the
    /// device's memory holds.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub batch: Option<usize>,
}

pub fn main(a: TaskArgs) -> Result<()> {
    let s = &a.sweep;
    let configs = s.configs()?;
    let shard = a.shard.as_deref().map(parse_shard).transpose()?;
    let settings = s.settings(json!({
        "dataset": a.dataset, "max_new_tokens": a.max_new_tokens,
        "shard": a.shard, "limit": a.limit,
    }));
    let mut store = ResultStore::open(&s.out, &settings, &["shard", "limit"])?;
    let llm = Llm::load(&s.model.dir()?, &s.model.load_options()?)?;
    let (items, kind) = task_items(&data_dir(s.data.as_deref())?, &a.dataset)?;
    let items = shard_of(&items, a.limit, shard);
    let progress = Progress::new((items.len() * configs.len()) as u64, "problems");
    let base = s.base();
    let configs: Vec<_> = configs.iter().collect();
    let (units, jobs) = pending_units(
        &llm,
        &items,
        &configs,
        (&store, &progress),
        &base,
        |item, c| unit_key("task", &format!("{}/{}", a.dataset, item.id), c),
    )?;
    greedy_jobs(&llm, &jobs, a.max_new_tokens, a.batch, |i, g, seconds| {
        let Unit {
            item,
            config: c,
            key,
            ..
        } = &units[i];
        progress.set_message(format!("{} {} {}", item.id, c.policy.name(), c.budget));
        let predicted = extract(&g.text, kind);
        let correct = predicted
            .as_deref()
            .is_some_and(|p| answers_match(p, &item.reference));
        store.append(
            key,
            json!({
                "kind": "task", "dataset": a.dataset, "item": item.id,
                "policy": c.policy.name(), "budget": budget_json(c),
                "predicted": predicted, "reference": item.reference, "correct": correct,
                "no_answer": predicted.is_none(), "tokens": g.ids.len(),
                "seconds": seconds, "stop": format!("{:?}", g.stats.stop),
                "text": g.text,
            }),
        )?;
        progress.inc(1);
        Ok(())
    })?;
    progress.finish();
    report(&store)
}
