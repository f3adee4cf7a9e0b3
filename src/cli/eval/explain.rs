//! `sieve eval explain`: runs a text through one policy and writes an HTML
//! page with every token shaded by whether it survived, when it was evicted,
//! and its score; and diagnoses the policy's refreshes against the oracles
//! (the full-cache run's future attention, recorded in a first pass).

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;

use super::super::{CacheArgs, ModelArgs};
use sieve::cache::{BoundedCache, CacheOptions, FeedOutput, Granularity, RefreshRecord};
use sieve::engine::Engine;
use sieve::eval::datasets::{data_dir, DocumentSource};
use sieve::eval::explain::{
    add_lost_attention, diagnose, fates, html, loss_by_category, RefreshDiagnosis,
};
use sieve::eval::fidelity::{record_future_attention, refresh_step};
use sieve::eval::store::write_atomic;
use sieve::eviction::oracle::FutureAttention;
use sieve::eviction::Policy;
use sieve::session::Llm;
use sieve::tokenizer::StreamDecoder;

#[derive(Args, Debug)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// The text to run.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Or a document of a built-in dataset (reasoning_traces or prose), with --doc.
    #[arg(long)]
    pub dataset: Option<String>,
    /// With --dataset: the document's index in the dataset's order (from 0).
    #[arg(long, default_value_t = 0)]
    pub doc: usize,
    /// Folder of the evaluation data (default: $SIEVE_DATA, else the repository's data/).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Only the first N tokens of the text.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// The HTML page to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Also write the diagnosis against the oracles here (JSON): per policy,
    /// per refresh, and where the evicted attention goes by kind of token,
    /// position and age.
    #[arg(long)]
    pub diagnostics: Option<PathBuf>,
    /// More policies to diagnose on the same document and oracle pass (their
    /// diagnosis goes to --diagnostics; the page is --policy's).
    #[arg(long, value_delimiter = ',')]
    pub also_diagnose: Vec<String>,
}

pub fn main(a: ExplainArgs) -> Result<()> {
    let opts = a
        .cache
        .options()?
        .context("explain needs an evicting policy: give --policy and --budget")?;
    if opts.policy.needs_future() {
        bail!(
            "--policy {}: explain diagnoses a policy against the oracles; give another policy",
            opts.policy.name()
        );
    }
    // Checked before anything runs: the oracles' pass is the expensive part.
    let mut policies = vec![opts.policy];
    for name in &a.also_diagnose {
        let p = Policy::parse(name)?;
        if p == Policy::Full || p.needs_future() {
            bail!("--also-diagnose {name}: give an evicting policy that needs no future");
        }
        policies.push(p);
    }
    let llm = Llm::load(&a.model.dir()?, &a.model.load_options()?)?;
    let (name, ids) = document(&a, &llm)?;
    // The full-cache run's attention, with a row at every refresh.
    let step = refresh_step(&[opts.budget], opts.chunk);
    let future = record_future_attention(&llm.model, &ids, step)?;
    let mut decoder = StreamDecoder::new();
    let pieces = ids
        .iter()
        .map(|&id| decoder.push(&llm.tokenizer, id))
        .collect::<Result<Vec<_>>>()?;
    let mut diagnoses = serde_json::Map::new();
    let mut page = None;
    for policy in policies {
        let o = CacheOptions { policy, ..opts };
        let (trace, refreshes) = run_and_diagnose(&llm, &ids, o, &future)?;
        let n = refreshes.len().max(1) as f64;
        let sum = |g: fn(&RefreshDiagnosis) -> f64| refreshes.iter().map(g).sum::<f64>();
        let summary = json!({
            "refreshes": refreshes.len(),
            "mean_overlap_next": sum(|r| r.overlap_next) / n,
            "mean_overlap_rest": sum(|r| r.overlap_rest) / n,
            "lost_next": sum(|r| r.lost_next),
            "oracle_lost_next": sum(|r| r.oracle_lost_next),
            "lost_rest": sum(|r| r.lost_rest),
            "oracle_lost_rest": sum(|r| r.oracle_lost_rest),
        });
        eprintln!(
            "{}: overlap with the oracle {:.3} (next {} queries) / {:.3} (rest); future attention evicted {:.2} (the oracle: {:.2})",
            policy.name(),
            summary["mean_overlap_next"].as_f64().unwrap_or(0.0),
            opts.chunk,
            summary["mean_overlap_rest"].as_f64().unwrap_or(0.0),
            summary["lost_rest"].as_f64().unwrap_or(0.0),
            summary["oracle_lost_rest"].as_f64().unwrap_or(0.0),
        );
        let categories = loss_by_category(&trace, &future, &pieces, opts.epikv_window as u32)?;
        diagnoses.insert(
            policy.name().to_string(),
            json!({"summary": summary, "categories": categories, "refreshes": refreshes}),
        );
        if page.is_none() {
            page = Some((trace, refreshes));
        }
    }
    let (trace, refreshes) = page.context("no policy run")?;
    let mut f = fates(ids.len(), &trace);
    add_lost_attention(&mut f, &trace, &future)?;
    let title = format!(
        "{name}: {} at budget {} (chunk {}, sinks {}, recent {}, a kept set per {})",
        opts.policy.name(),
        opts.budget,
        opts.chunk,
        opts.sinks,
        opts.recent,
        match opts.granularity {
            Granularity::Token => "cache",
            Granularity::Layer => "layer",
            Granularity::Head => "(layer, KV head)",
        }
    );
    write_atomic(&a.out, html(&title, &pieces, &f, trace.len()).as_bytes())?;
    if let Some(path) = &a.cache.trace {
        // The refresh records, each with its diagnosis.
        let mut records = serde_json::to_value(&trace)?;
        if let Some(list) = records.as_array_mut() {
            for (r, d) in list.iter_mut().zip(&refreshes) {
                r["diagnosis"] = serde_json::to_value(d)?;
            }
        }
        write_atomic(path, serde_json::to_string(&records)?.as_bytes())?;
    }
    if let Some(path) = &a.diagnostics {
        let report = json!({
            "document": name, "tokens": ids.len(), "budget": opts.budget, "chunk": opts.chunk,
            "sinks": opts.sinks, "recent": opts.recent, "policies": diagnoses,
        });
        write_atomic(path, serde_json::to_string_pretty(&report)?.as_bytes())?;
    }
    eprintln!(
        "{}: {} tokens, {} refreshes, {} kept at the end",
        a.out.display(),
        ids.len(),
        trace.len(),
        f.iter().filter(|x| x.evicted_at.is_none()).count(),
    );
    Ok(())
}

/// The document explained: --text's tokens or --dataset's document --doc,
/// at most --max-tokens of it, with its name.
fn document(a: &ExplainArgs, llm: &Llm) -> Result<(String, Vec<u32>)> {
    let limit = a.max_tokens.unwrap_or(usize::MAX);
    Ok(match (&a.text, &a.dataset) {
        (Some(_), Some(_)) => bail!("give --text or --dataset, not both"),
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --text {}", path.display()))?;
            let mut ids = llm.tokenizer.encode(&text)?;
            ids.truncate(limit);
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            (name.to_string(), ids)
        }
        (None, dataset) => {
            let source = DocumentSource::parse(dataset.as_deref(), None)?;
            let data = data_dir(a.data.as_deref())?;
            let docs = source.documents(&llm.tokenizer, &data, a.doc.saturating_add(1), limit)?;
            match docs.into_iter().nth(a.doc) {
                Some(d) => (d.id, d.tokens),
                None => bail!("--doc {}: {} has fewer documents", a.doc, source.name()),
            }
        }
    })
}

/// Runs `ids` through `opts`' policy and diagnoses its refreshes.
fn run_and_diagnose(
    llm: &Llm,
    ids: &[u32],
    opts: CacheOptions,
    future: &FutureAttention,
) -> Result<(Vec<RefreshRecord>, Vec<RefreshDiagnosis>)> {
    let mut cache = BoundedCache::new(opts, llm.model.config.num_layers)?;
    cache.record = true;
    let mut engine = Engine::new(llm.model.clone(), cache.engine_options(ids.len(), 256, 1))?;
    cache.feed(&mut engine, ids, 0, FeedOutput::None, |_, _| Ok(()))?;
    engine.sync()?;
    let refreshes = diagnose(&cache.trace, future, opts.chunk)?;
    Ok((cache.trace, refreshes))
}
