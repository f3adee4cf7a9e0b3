//! `sieve eval`: eviction quality, one subcommand per measurement (SPEC.md
//! section 5). Every sweep runs each policy at each budget on the same work,
//! appends each finished unit to `<out>/results.jsonl` (so an interrupted run
//! resumes), and writes `report.md`, `report.json`, `report.csv` and a plot.

pub mod explain;
pub mod fidelity;
pub mod generate;
pub mod merge;
pub mod needle;
pub mod ruler;
pub mod task;

use anyhow::Result;
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::path::PathBuf;

use super::ModelArgs;
use sieve::cache::{CacheOptions, Granularity};
use sieve::eval::datasets::{task_prompt, TaskItem};
use sieve::eval::fidelity::RunConfig;
use sieve::eval::report::write_report;
use sieve::eval::store::ResultStore;
use sieve::eval::GreedyJob;
use sieve::eviction::Policy;
use sieve::session::Llm;

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub command: EvalCommand,
}

#[derive(Subcommand, Debug)]
pub enum EvalCommand {
    /// Teacher-forced fidelity to the full cache: KL, top-1 agreement, NLL increase.
    Fidelity(fidelity::FidelityArgs),
    /// Greedy generation: common prefix with the full cache and answer agreement.
    Generate(generate::GenerateArgs),
    /// Pass-key retrieval at several depths of a long filler text.
    Needle(needle::NeedleArgs),
    /// RULER's synthetic tasks (needles, variable tracking, word extraction).
    Ruler(ruler::RulerArgs),
    /// Accuracy on MATH-500, GSM8K or AIME 2024.
    Task(task::TaskArgs),
    /// Combine the results of several shards (or runs) into one report.
    Merge(merge::MergeArgs),
    /// An HTML page of a text shaded by what a policy kept and evicted.
    Explain(explain::ExplainArgs),
}

pub fn main(a: EvalArgs) -> Result<()> {
    match a.command {
        EvalCommand::Fidelity(a) => fidelity::main(a),
        EvalCommand::Generate(a) => generate::main(a),
        EvalCommand::Needle(a) => needle::main(a),
        EvalCommand::Ruler(a) => ruler::main(a),
        EvalCommand::Task(a) => task::main(a),
        EvalCommand::Merge(a) => merge::main(a),
        EvalCommand::Explain(a) => explain::main(a),
    }
}

/// What every sweep shares: the model, the policies and budgets, the cache
/// settings, the output folder.
#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Policies to compare (`full` is the reference where one is needed).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,window,random,h2o,tova,epikv,ccs,ccs-full"
    )]
    pub policies: Vec<String>,
    /// KV budgets J.
    #[arg(long, value_delimiter = ',', default_value = "128,256,512")]
    pub budgets: Vec<usize>,
    /// Tokens between refreshes (h).
    #[arg(long, default_value_t = 32)]
    pub chunk: usize,
    /// Entries at the first positions that are never evicted.
    #[arg(long, default_value_t = 4)]
    pub sinks: usize,
    /// Newest entries that are never evicted.
    #[arg(long, default_value_t = 64)]
    pub recent: usize,
    /// Seed of the random policy.
    #[arg(long, default_value_t = 0)]
    pub policy_seed: u64,
    /// Which entries the cache keeps: token, layer or head (`--granularity`
    /// of `sieve run`).
    #[arg(long, default_value = "token", value_parser = parse_granularity)]
    pub granularity: Granularity,
    /// Output folder: results.jsonl (resumable), report.md/.json/.csv, plots.
    #[arg(long)]
    pub out: PathBuf,
    /// Folder of the evaluation data (default: $SIEVE_DATA, else the repository's data/).
    #[arg(long)]
    pub data: Option<PathBuf>,
}

impl SweepArgs {
    /// The cache settings every config shares (policy and budget set per config).
    pub fn base(&self) -> CacheOptions {
        CacheOptions {
            sinks: self.sinks,
            recent: self.recent,
            seed: self.policy_seed,
            granularity: self.granularity,
            ..CacheOptions::new(Policy::Full, 0, self.chunk)
        }
    }

    /// Every (policy, budget) to run; `full` once, with no budget.
    pub fn configs(&self) -> Result<Vec<RunConfig>> {
        let base = self.base();
        let mut out = vec![];
        for p in &self.policies {
            let policy = Policy::parse(p)?;
            if policy == Policy::Full {
                out.push(RunConfig { policy, budget: 0 });
                continue;
            }
            for &budget in &self.budgets {
                let c = RunConfig { policy, budget };
                c.cache_options(&base).validate()?;
                out.push(c);
            }
        }
        Ok(out)
    }

    /// Settings that change the numbers: resuming requires the same ones.
    pub fn settings(&self, extra: Value) -> Value {
        let mut s = json!({
            "model": self.model.dir().map(|d| d.display().to_string()).unwrap_or_default(),
            "dtype": self.model.dtype,
            "chunk": self.chunk,
            "sinks": self.sinks,
            "recent": self.recent,
            "policy_seed": self.policy_seed,
            // Lists of what to run: other values extend the folder (store.rs).
            "policies": self.policies,
            "budgets": self.budgets,
        });
        // Recorded only for an f16 cache, so folders made before the cache
        // had a choice of format (f32) still resume, and mixing is refused.
        if self.model.kv_dtype != "f32" {
            s["kv_dtype"] = json!(self.model.kv_dtype);
        }
        // Likewise only off the default, so older token-granularity folders resume.
        if self.granularity != Granularity::Token {
            s["granularity"] = json!(self.granularity.name());
        }
        if let (Some(m), Some(e)) = (s.as_object_mut(), extra.as_object()) {
            m.extend(e.clone());
        }
        s
    }
}

/// `--granularity`'s value.
fn parse_granularity(name: &str) -> Result<Granularity> {
    Granularity::parse(name)
}

/// The cache of a config: None for the full cache.
pub fn cache_of(c: &RunConfig, base: &CacheOptions) -> Option<CacheOptions> {
    (c.policy != Policy::Full).then(|| c.cache_options(base))
}

/// One greedy generation an evaluation still has to run: its problem,
/// configuration, result key and prompt.
pub struct Unit<'a> {
    pub item: &'a TaskItem,
    pub config: &'a RunConfig,
    pub key: String,
    pub prompt: Vec<u32>,
}

/// The units of `items` x `configs` whose `key` is not in `store` yet
/// (those that are count as done in `progress`), and their generation
/// jobs (prompt and cache) for `greedy_jobs`.
pub fn pending_units<'a>(
    llm: &Llm,
    items: &'a [(usize, TaskItem)],
    configs: &[&'a RunConfig],
    (store, progress): (&ResultStore, &Progress),
    base: &CacheOptions,
    key: impl Fn(&TaskItem, &RunConfig) -> String,
) -> Result<(Vec<Unit<'a>>, Vec<GreedyJob>)> {
    let mut units = vec![];
    for (_, item) in items {
        let prompt = task_prompt(&llm.tokenizer, item)?;
        for &config in configs {
            let key = key(item, config);
            if store.contains(&key) {
                progress.inc(1);
            } else {
                let prompt = prompt.clone();
                units.push(Unit {
                    item,
                    config,
                    key,
                    prompt,
                });
            }
        }
    }
    let jobs = units
        .iter()
        .map(|u| (u.prompt.clone(), cache_of(u.config, base)))
        .collect();
    Ok((units, jobs))
}

/// The budget as stored in results: null for the full cache.
pub fn budget_json(c: &RunConfig) -> Value {
    if c.policy == Policy::Full {
        Value::Null
    } else {
        json!(c.budget)
    }
}

/// Unit key: kind, item and config.
pub fn unit_key(kind: &str, item: &str, c: &RunConfig) -> String {
    let budget = if c.policy == Policy::Full {
        "-".to_string()
    } else {
        c.budget.to_string()
    };
    format!("{kind}|{item}|{}|{budget}", c.policy.name())
}

/// A progress bar with the remaining time on a terminal, plain log lines otherwise.
pub struct Progress {
    bar: ProgressBar,
    terminal: bool,
}

impl Progress {
    pub fn new(total: u64, unit: &str) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let bar = if terminal {
            ProgressBar::new(total)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{{elapsed_precise}} [{{bar:30}}] {{pos}}/{{len}} {unit}, {{eta}} left  {{msg}}"
            ))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Progress { bar, terminal }
    }
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }
    pub fn set_message(&self, m: String) {
        self.bar.set_message(m);
    }
    /// A line above the bar (or on stderr without a terminal).
    pub fn line(&self, s: String) {
        if self.terminal {
            self.bar.println(s);
        } else {
            eprintln!("{s}");
        }
    }
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Writes the report files and prints the tables.
pub fn report(store: &ResultStore) -> Result<()> {
    let md = write_report(&store.dir, store.records())?;
    println!("{md}");
    eprintln!(
        "results: {} (report.md, report.json, report.csv, *.svg)",
        store.dir.display()
    );
    Ok(())
}
