//! `sieve serve`: the OpenAI-compatible HTTP server (`sieve::server`) on
//! one model, its requests stepped together on bounded or full caches.

use anyhow::{Context, Result};
use clap::Args;

use super::{CacheArgs, ModelArgs};
use sieve::eviction::Policy;
use sieve::server::{serve, ServerOptions};
use sieve::session::Llm;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Address to listen on (only this machine by default).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests generated at once, stepped together.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Requests waiting for a free sequence at most (429 past it).
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Cache slots of each sequence: the longest context of a request with
    /// the full cache (with --budget, each takes budget + chunk).
    #[arg(long, default_value_t = 4096)]
    pub max_context: usize,
    /// Tokens of one step in all (decode tokens and prompt chunks).
    #[arg(long, default_value_t = 256)]
    pub step_tokens: usize,
    /// Requests must carry `Authorization: Bearer KEY` (also $SIEVE_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model's name in responses (default: its folder or file name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub body_limit: usize,
    /// Feed every request whole: no reuse of a finished request's cache by
    /// the next turn of its conversation.
    #[arg(long)]
    pub no_cache_reuse: bool,
}

pub fn main(a: ServeArgs) -> Result<()> {
    let dir = a.model.dir()?;
    let load_options = a.model.load_options()?;
    // The server's cache, and every other cache setting (chunk, sinks,
    // recent entries, the policies' parameters, the granularity) of a
    // request that asks for a policy of its own.
    let c = &a.cache;
    let full = c.budget.is_none() && c.policy.as_deref().is_none_or(|p| p == "full");
    let cache = match full {
        true => c.settings(Policy::Full, 0),
        false => (c.options()?).context("--policy and --budget give a bounded cache")?,
    };
    let model_name = a.alias.clone().unwrap_or_else(|| {
        dir.file_name()
            .map_or("sieve".into(), |n| n.to_string_lossy().to_string())
    });
    let opts = ServerOptions {
        model_name,
        parallel: a.parallel,
        max_context: a.max_context,
        step_tokens: a.step_tokens,
        cache,
        queue: a.queue,
        api_key: a.api_key.clone().or_else(|| {
            std::env::var("SIEVE_API_KEY")
                .ok()
                .filter(|k| !k.is_empty())
        }),
        body_limit: a.body_limit,
        reuse: !a.no_cache_reuse,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let address = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("--host {} --port {}: cannot listen there", a.host, a.port))?;
        let local = listener.local_addr()?;
        println!(
            "sieve serve: listening on http://{local} (loading {})",
            dir.display()
        );
        let load = move || {
            let llm = Llm::load(&dir, &load_options)?;
            eprintln!(
                "sieve serve: {} on {}; ready",
                dir.display(),
                llm.model.gpu.describe()
            );
            Ok(llm)
        };
        serve(listener, opts, load, shutdown()).await
    })
}

/// Ctrl-C or SIGTERM: stop accepting, finish what is in flight.
async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    eprintln!("sieve serve: stopping; finishing the requests in flight");
}
