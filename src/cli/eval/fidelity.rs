//! `sieve eval fidelity`: teacher-forced fidelity of each policy and budget to
//! the full cache, per document, with a 95% interval across documents.

use anyhow::Result;
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

use super::{report, unit_key, Progress, SweepArgs};
use sieve::eval::datasets::{data_dir, DocumentSource};
use sieve::eval::fidelity::{fidelity_document, runs_that_fit};
use sieve::eval::store::ResultStore;
use sieve::eval::AUTO_BATCH_CAP;
use sieve::eviction::Policy;
use sieve::session::Llm;

#[derive(Args, Debug)]
pub struct FidelityArgs {
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// Built-in documents: reasoning_traces or prose.
    #[arg(long)]
    pub dataset: Option<String>,
    /// A text file to use as the one document instead.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Most documents to evaluate (in the dataset's order).
    #[arg(long, default_value_t = usize::MAX)]
    pub docs: usize,
    /// Leave out the first N documents (issue #14's development split is the
    /// first 5 reasoning traces: `--skip-docs 5` evaluates the held-out rest).
    #[arg(long, default_value_t = 0)]
    pub skip_docs: usize,
    /// Tokens per document (longer ones are cut; prose is split into pieces this long).
    #[arg(long, default_value_t = 1024)]
    pub doc_tokens: usize,
    /// Runs stepped together (the full cache and each configuration); 1
    /// runs each alone. Default: all, at most 32 and as many as the
    /// logits of a step fit one storage binding.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub batch: Option<usize>,
}

pub fn main(a: FidelityArgs) -> Result<()> {
    let s = &a.sweep;
    let source = DocumentSource::parse(a.dataset.as_deref(), a.text.as_deref())?;
    let configs: Vec<_> = s
        .configs()?
        .into_iter()
        .filter(|c| c.policy != Policy::Full)
        .collect();
    let settings = s.settings(json!({"source": source.name(), "doc_tokens": a.doc_tokens}));
    let mut store = ResultStore::open(&s.out, &settings, &[])?;
    let llm = Llm::load(&s.model.dir()?, &s.model.load_options()?)?;
    let data = data_dir(s.data.as_deref())?;
    let mut docs = source.documents(
        &llm.tokenizer,
        &data,
        a.docs.saturating_add(a.skip_docs),
        a.doc_tokens,
    )?;
    docs.drain(..a.skip_docs.min(docs.len()));
    let pending = |store: &ResultStore, doc: &str| -> Vec<_> {
        configs
            .iter()
            .copied()
            .filter(|c| !store.contains(&unit_key("fidelity", doc, c)))
            .collect()
    };
    let total: usize = docs
        .iter()
        .map(|d| {
            let todo = pending(&store, &d.id);
            // The full cache, each config, and the oracles' first pass.
            let passes = match todo.len() {
                0 => 0,
                n => 1 + n + todo.iter().any(|c| c.policy.needs_future()) as usize,
            };
            d.tokens.len() * passes
        })
        .sum();
    eprintln!(
        "fidelity: {} documents of up to {} tokens, {} configurations, {} tokens to run",
        docs.len(),
        a.doc_tokens,
        configs.len(),
        total
    );
    let progress = Progress::new(total as u64, "tokens");
    let base = s.base();
    for doc in &docs {
        let todo = pending(&store, &doc.id);
        if todo.is_empty() {
            continue;
        }
        progress.set_message(doc.id.clone());
        let t = Instant::now();
        let batch = a.batch.unwrap_or_else(|| {
            runs_that_fit(&llm.model, base.chunk, AUTO_BATCH_CAP).min(todo.len() + 1)
        });
        let sums = fidelity_document(&llm.model, &doc.tokens, &base, &todo, batch, |n| {
            progress.inc(n as u64)
        })?;
        let seconds = t.elapsed().as_secs_f64();
        for (c, m) in todo.iter().zip(sums) {
            let key = unit_key("fidelity", &doc.id, c);
            let record = if m.positions == 0 {
                progress.line(format!(
                    "{}: {} tokens, not longer than budget + chunk = {}: nothing to compare for {} at {}",
                    doc.id,
                    doc.tokens.len(),
                    c.budget + s.chunk,
                    c.policy.name(),
                    c.budget
                ));
                json!({"kind": "fidelity", "doc": doc.id, "policy": c.policy.name(), "budget": c.budget, "skipped": true})
            } else {
                json!({
                    "kind": "fidelity", "doc": doc.id, "policy": c.policy.name(), "budget": c.budget,
                    "tokens": doc.tokens.len(), "positions": m.positions,
                    "mean_kl": m.mean_kl(), "top1": m.top1_agreement(),
                    "nll_positions": m.nll_positions, "nll_full": m.mean_nll_full(),
                    "nll_increase": m.mean_nll_increase(), "sums": m,
                    "seconds_for_document": seconds,
                })
            };
            store.append(&key, record)?;
        }
        progress.line(format!(
            "{}: {} tokens, {} configurations in {:.0} s",
            doc.id,
            doc.tokens.len(),
            todo.len(),
            seconds
        ));
    }
    progress.finish();
    report(&store)
}
