//! `sieve eval generate`: greedy generation under each policy and budget
//! against the full cache: the common prefix in tokens and whether the final
//! answers agree.

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;

use super::{budget_json, pending_units, report, unit_key, Progress, SweepArgs, Unit};
use sieve::eval::answers::{answers_match, extract};
use sieve::eval::datasets::{data_dir, shard_of, task_items};
use sieve::eval::fidelity::RunConfig;
use sieve::eval::store::ResultStore;
use sieve::eval::{common_prefix, greedy_jobs};
use sieve::eviction::Policy;
use sieve::session::Llm;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// Prompts: the problems of math500, gsm8k or aime2024.
    #[arg(long, default_value = "math500")]
    pub dataset: String,
    /// Number of prompts (the first ones).
    #[arg(long, default_value_t = 5)]
    pub limit: usize,
    /// Tokens generated per prompt at most.
    #[arg(long, default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Generations stepped together (prompts and configurations alike); 1 runs each
    /// alone. Default: as many as there are, at most 32 and as many as the
    /// device's memory holds.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub batch: Option<usize>,
}

pub fn main(a: GenerateArgs) -> Result<()> {
    let s = &a.sweep;
    let full = RunConfig {
        policy: Policy::Full,
        budget: 0,
    };
    let mut configs = s.configs()?;
    configs.retain(|c| c.policy != Policy::Full);
    configs.insert(0, full);
    let settings = s.settings(json!({"dataset": a.dataset, "max_new_tokens": a.max_new_tokens}));
    let mut store = ResultStore::open(&s.out, &settings, &[])?;
    let llm = Llm::load(&s.model.dir()?, &s.model.load_options()?)?;
    let (items, kind) = task_items(&data_dir(s.data.as_deref())?, &a.dataset)?;
    let items = shard_of(&items, Some(a.limit), None);
    let progress = Progress::new((items.len() * configs.len()) as u64, "generations");
    let base = s.base();
    // The full-cache runs first: every other run of a prompt is compared
    // with its prompt's.
    for reference_pass in [true, false] {
        let pass: Vec<_> = configs
            .iter()
            .filter(|c| (c.policy == Policy::Full) == reference_pass)
            .collect();
        let (units, jobs) = pending_units(
            &llm,
            &items,
            &pass,
            (&store, &progress),
            &base,
            |item, c| unit_key("generate", &item.id, c),
        )?;
        greedy_jobs(&llm, &jobs, a.max_new_tokens, a.batch, |i, g, _| {
            let Unit {
                item,
                config: c,
                key,
                prompt,
            } = &units[i];
            progress.set_message(format!("{} {} {}", item.id, c.policy.name(), c.budget));
            let answer = extract(&g.text, kind);
            let (prefix, agree) = if c.policy == Policy::Full {
                (g.ids.len(), answer.as_ref().map(|_| true))
            } else {
                let reference = store
                    .get(&unit_key("generate", &item.id, &full))
                    .context("the full-cache run of this prompt comes first")?;
                let ref_ids: Vec<u32> = serde_json::from_value(reference["ids"].clone())?;
                let ref_answer = reference["answer"].as_str();
                (
                    common_prefix(&ref_ids, &g.ids),
                    ref_answer.map(|r| answer.as_deref().is_some_and(|x| answers_match(x, r))),
                )
            };
            store.append(
                key,
                json!({
                    "kind": "generate", "item": item.id, "policy": c.policy.name(),
                    "budget": budget_json(c), "generated": g.ids.len(), "ids": g.ids,
                    "text": g.text, "answer": answer, "common_prefix": prefix,
                    "answer_agree": agree, "prompt_tokens": prompt.len(),
                }),
            )?;
            progress.inc(1);
            Ok(())
        })?;
    }
    progress.finish();
    report(&store)
}
