//! `sieve eval explain`: runs a text through one policy and writes an HTML
//! page with every token shaded by whether it survived, when it was evicted,
//! and its score.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

use super::super::{CacheArgs, ModelArgs};
use sieve::cache::{BoundedCache, FeedOutput};
use sieve::engine::Engine;
use sieve::eval::explain::{fates, html};
use sieve::eval::store::write_atomic;
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
    pub text: PathBuf,
    /// Only the first N tokens of the text.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// The HTML page to write.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn main(a: ExplainArgs) -> Result<()> {
    let opts = a
        .cache
        .options()?
        .context("explain needs an evicting policy: give --policy and --budget")?;
    let llm = Llm::load(&a.model.dir()?, &a.model.load_options()?)?;
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("reading --text {}", a.text.display()))?;
    let mut ids = llm.tokenizer.encode(&text)?;
    if let Some(n) = a.max_tokens {
        ids.truncate(n);
    }
    let mut cache = BoundedCache::new(opts, llm.model.config.num_layers)?;
    cache.record = true;
    let mut engine = Engine::new(llm.model.clone(), cache.engine_options(ids.len(), 256, 1))?;
    cache.feed(&mut engine, &ids, 0, FeedOutput::None, |_, _| Ok(()))?;
    engine.sync()?;
    let mut decoder = StreamDecoder::new();
    let pieces = ids
        .iter()
        .map(|&id| decoder.push(&llm.tokenizer, id))
        .collect::<Result<Vec<_>>>()?;
    let f = fates(ids.len(), &cache.trace);
    let title = format!(
        "{}: {} at budget {} (chunk {}, sinks {}, recent {})",
        a.text.file_name().unwrap_or_default().to_string_lossy(),
        opts.policy.name(),
        opts.budget,
        opts.chunk,
        opts.sinks,
        opts.recent
    );
    write_atomic(
        &a.out,
        html(&title, &pieces, &f, cache.trace.len()).as_bytes(),
    )?;
    if let Some(path) = &a.cache.trace {
        cache.write_trace(path)?;
    }
    eprintln!(
        "{}: {} tokens, {} refreshes, {} kept at the end",
        a.out.display(),
        ids.len(),
        cache.trace.len(),
        f.iter().filter(|x| x.evicted_at.is_none()).count()
    );
    Ok(())
}
