//! `sieve eval ruler`: RULER's synthetic tasks (src/eval/ruler.rs) at one
//! context length, with the full cache and each policy, compressed as
//! kvpress compresses (the context once, before the question, with
//! `--compression-ratios`) or at fixed budgets as the other sweeps do
//! (`--budgets`, refreshing while the context is read). Greedy answers are
//! scored as RULER scores them; results per task and on average, also in
//! kvpress's layout (`ruler_metrics.json`).

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

use super::{report, Progress, SweepArgs};
use sieve::cache::CacheOptions;
use sieve::eval::datasets::data_dir;
use sieve::eval::greedy_jobs;
use sieve::eval::ruler::{generate_with_tokenizer, postprocess, score, RulerSample, TASKS};
use sieve::eval::store::ResultStore;
use sieve::eviction::Policy;
use sieve::session::Llm;

#[derive(Args, Debug)]
pub struct RulerArgs {
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// Prompt length in tokens (the answer's tokens kept free within it).
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Tasks (default: all eleven generated here; RULER's qa_1 and qa_2 need
    /// datasets sieve does not have).
    #[arg(long, value_delimiter = ',')]
    pub tasks: Option<Vec<String>>,
    /// Samples per task.
    #[arg(long, default_value_t = 4)]
    pub samples: usize,
    /// Seed of the generated samples.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// kvpress's compression: the context read whole, then cut once to
    /// (1 - ratio) of its tokens before the question; replaces --budgets.
    #[arg(long, value_delimiter = ',')]
    pub compression_ratios: Option<Vec<f64>>,
    /// Haystack text (default: data/prose/moby_dick.txt).
    #[arg(long)]
    pub haystack: Option<PathBuf>,
    /// Generations stepped together; 1 runs each alone. Default: as many as
    /// fit, at most 32.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub batch: Option<usize>,
}

/// How a configuration bounds the cache.
#[derive(Clone, Copy, Debug)]
enum Bound {
    Full,
    /// The sweep's budget J, refreshing every chunk from the start.
    Budget(usize),
    /// kvpress's: (1 - ratio) of the context kept, cut once before the question.
    Ratio(f64),
}

struct Config {
    policy: Policy,
    bound: Bound,
}

impl Config {
    /// As the records and the report's rows name it: (policy, budget).
    fn label(&self) -> (String, Value) {
        let name = self.policy.name();
        match self.bound {
            Bound::Full => (name.to_string(), Value::Null),
            Bound::Budget(j) => (name.to_string(), json!(j)),
            Bound::Ratio(r) => (format!("{name} ratio={r}"), Value::Null),
        }
    }

    /// The cache of a prompt whose context is its first `n_context` tokens
    /// and whose question and answer take `after` more.
    fn cache(
        &self,
        base: &CacheOptions,
        n_context: usize,
        after: usize,
    ) -> Result<Option<CacheOptions>> {
        Ok(match self.bound {
            Bound::Full => None,
            Bound::Budget(budget) => Some(CacheOptions {
                policy: self.policy,
                budget,
                ..*base
            }),
            Bound::Ratio(r) => Some(
                CacheOptions {
                    policy: self.policy,
                    ..*base
                }
                .compressing(r, n_context, after)
                .with_context(|| format!("--compression-ratios {r}"))?,
            ),
        })
    }
}

fn configs(a: &RulerArgs, base: &CacheOptions) -> Result<Vec<Config>> {
    let mut out = vec![];
    for name in &a.sweep.policies {
        let policy = Policy::parse(name)?;
        if policy == Policy::Full {
            out.push(Config {
                policy,
                bound: Bound::Full,
            });
            continue;
        }
        match &a.compression_ratios {
            Some(ratios) => {
                for &r in ratios {
                    if !(r > 0.0 && r < 1.0) {
                        bail!("--compression-ratios: {r} is not between 0 and 1 (exclusive)");
                    }
                    out.push(Config {
                        policy,
                        bound: Bound::Ratio(r),
                    });
                }
            }
            None => {
                for &j in &a.sweep.budgets {
                    let opts = CacheOptions {
                        policy,
                        budget: j,
                        ..*base
                    };
                    opts.validate().with_context(|| format!("--budgets {j}"))?;
                    out.push(Config {
                        policy,
                        bound: Bound::Budget(j),
                    });
                }
            }
        }
    }
    Ok(out)
}

pub fn main(a: RulerArgs) -> Result<()> {
    let s = &a.sweep;
    let base = s.base();
    let configs = configs(&a, &base)?;
    let tasks: Vec<String> = match &a.tasks {
        Some(t) => t.clone(),
        None => TASKS.iter().map(|t| t.to_string()).collect(),
    };
    let haystack = match &a.haystack {
        Some(f) => f.clone(),
        None => data_dir(s.data.as_deref())?
            .join("prose")
            .join("moby_dick.txt"),
    };
    let settings = s.settings(json!({
        "context": a.context, "seed": a.seed, "haystack": haystack.display().to_string(),
        "compression_ratios": a.compression_ratios,
    }));
    let mut store = ResultStore::open(&s.out, &settings, &[])?;
    let llm = Llm::load(&s.model.dir()?, &s.model.load_options()?)?;
    let prose = std::fs::read_to_string(&haystack)
        .map_err(|e| anyhow::anyhow!("reading --haystack {}: {e}", haystack.display()))?;
    let total = tasks.len() * a.samples * configs.len();
    let progress = Progress::new(total as u64, "answers");
    for task in &tasks {
        // One batch per task: each has its own answer length.
        let mut units: Vec<(String, &Config, RulerSample)> = vec![];
        let mut jobs = vec![];
        for index in 0..a.samples {
            let sample =
                generate_with_tokenizer(task, &llm.tokenizer, &prose, a.context, index, a.seed)?;
            // The question starts after the last line break (no template's
            // question or answer prefix holds one); context and question are
            // tokenized apart and joined, as kvpress does, so the cut falls
            // exactly between them.
            let split = sample.prompt.rfind('\n').map_or(0, |i| i + 1);
            let mut ids = llm.tokenizer.encode(&sample.prompt[..split])?;
            let n_context = ids.len();
            ids.extend(llm.tokenizer.encode_continuation(&sample.prompt[split..])?);
            let after = ids.len() - n_context + sample.max_new_tokens;
            for c in &configs {
                let (policy, budget) = c.label();
                let key = format!("ruler|{task}/{index}|{policy}|{budget}");
                if store.contains(&key) {
                    progress.inc(1);
                    continue;
                }
                jobs.push((ids.clone(), c.cache(&base, n_context, after)?));
                units.push((key, c, sample.clone()));
            }
        }
        let Some(max_new) = units.first().map(|u| u.2.max_new_tokens) else {
            continue;
        };
        progress.set_message(task.clone());
        greedy_jobs(&llm, &jobs, max_new, a.batch, |i, g, seconds| {
            let (key, c, sample) = &units[i];
            let answer = postprocess(&g.text);
            let value = score(sample.metric, &answer, &sample.answers);
            let (policy, budget) = c.label();
            store.append(
                key,
                json!({
                    "kind": "ruler", "task": task, "index": sample.index,
                    "policy": policy, "budget": budget,
                    "context": jobs[i].0.len(), "answer": g.text, "answers": sample.answers,
                    "string_match": value * 100.0, "seconds": seconds,
                }),
            )?;
            progress.inc(1);
            Ok(())
        })?;
    }
    progress.finish();
    write_kvpress_metrics(&store)?;
    report(&store)
}

/// `<out>/ruler_metrics.json`: per configuration, kvpress's layout of its
/// RULER metrics (`{task: {"string_match": mean}}`, rounded to 2 decimals;
/// kvpress writes one such file per run folder, this one holds every
/// configuration). The average over tasks is in the report.
fn write_kvpress_metrics(store: &ResultStore) -> Result<()> {
    let mut sums: BTreeMap<String, BTreeMap<String, (f64, usize)>> = BTreeMap::new();
    for r in store.records().iter().filter(|r| r["kind"] == "ruler") {
        let (Some(policy), Some(task), Some(v)) = (
            r["policy"].as_str(),
            r["task"].as_str(),
            r["string_match"].as_f64(),
        ) else {
            continue;
        };
        let config = match r["budget"].as_u64() {
            Some(j) => format!("{policy} J={j}"),
            None => policy.to_string(),
        };
        let cell = sums.entry(config).or_default().entry(task.into());
        let (sum, n) = cell.or_default();
        *sum += v;
        *n += 1;
    }
    let mut out = Map::new();
    for (config, tasks) in sums {
        let mut m = Map::new();
        for (task, (sum, n)) in &tasks {
            let mean = (sum / *n as f64 * 100.0).round() / 100.0;
            m.insert(task.clone(), json!({"string_match": mean}));
        }
        out.insert(config, Value::Object(m));
    }
    let path = store.dir.join("ruler_metrics.json");
    std::fs::write(&path, serde_json::to_string_pretty(&Value::Object(out))?)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}
