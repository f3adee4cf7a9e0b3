//! An OpenAI-compatible HTTP server (feature `server`): `POST
//! /v1/chat/completions` and `/v1/completions` (whole answers or SSE
//! streams), `GET /v1/models`, `/health` and `/metrics`. Requests run on a
//! [`Scheduler`](crate::scheduler::Scheduler) on a thread of its own
//! (`worker`), up to `parallel` sequences stepped together, each on a
//! cache from its KV pool; more wait in a bounded queue (429 past it).
//! Every refusal is OpenAI's error object with the right status.
//!
//! The server listens before the model is loaded: `/health` says 503
//! until it is, and so does every completion request.

mod api;
mod error;
mod tools;
mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use api::{Envelope, Generate, Kind};
pub use error::ApiError;
use worker::{Counters, Event, Job};

use crate::cache::{CacheOptions, Granularity};
use crate::eviction::Policy;
use crate::scheduler::SchedulerOptions;
use crate::session::{GenerateOptions, Generation, Llm, SubmitAhead};

/// How a server runs its model and admits requests.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The model's name in responses and `/v1/models`.
    pub model_name: String,
    /// Sequences stepped together (the scheduler's `max_sequences`).
    pub parallel: usize,
    /// Cache slots of each sequence (the longest context of a request
    /// with the full cache; a bounded cache takes budget + chunk).
    pub max_context: usize,
    /// Tokens of one step in all (decode tokens and prompt chunks).
    pub step_tokens: usize,
    /// The cache of a request that names none (policy `full`: the full
    /// cache), and the chunk, sinks and recent entries of one that does
    /// (`"sieve": {"policy", "budget"}`).
    pub cache: CacheOptions,
    /// Requests waiting for a free sequence at most; past it, 429.
    pub queue: usize,
    /// Requests must carry `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest request body in bytes (413 past it).
    pub body_limit: usize,
    /// Keep a finished request's cache for the next turn of its
    /// conversation (`SchedulerOptions::reuse`).
    pub reuse: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            model_name: "sieve".into(),
            parallel: 4,
            max_context: 4096,
            step_tokens: 256,
            cache: CacheOptions::new(Policy::Full, 0, 64),
            queue: 64,
            api_key: None,
            body_limit: 1 << 20,
            reuse: true,
        }
    }
}

/// The model and the worker's door, once loaded.
struct Loaded {
    llm: Llm,
    jobs: mpsc::Sender<Job>,
}

struct App {
    opts: ServerOptions,
    loaded: OnceLock<Loaded>,
    counters: Arc<Counters>,
    requests: AtomicU64,
    refused: AtomicU64,
}

/// Serves on `listener` until `shutdown` completes (then stops accepting
/// and lets the requests in flight finish). `load` runs on a thread of its
/// own while the server already answers `/health` with 503; its error ends
/// the server.
pub async fn serve(
    listener: tokio::net::TcpListener,
    opts: ServerOptions,
    load: impl FnOnce() -> crate::error::Result<Llm> + Send + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    if opts.parallel == 0 || opts.queue == 0 {
        anyhow::bail!(
            "--parallel ({}) and --queue ({}) must be at least 1",
            opts.parallel,
            opts.queue
        );
    }
    let app = Arc::new(App {
        opts: opts.clone(),
        loaded: OnceLock::new(),
        counters: Arc::new(Counters::default()),
        requests: AtomicU64::new(0),
        refused: AtomicU64::new(0),
    });
    let (failed_tx, mut failed_rx) = tokio::sync::mpsc::unbounded_channel::<anyhow::Error>();
    {
        let app = app.clone();
        std::thread::Builder::new()
            .name("sieve-model".into())
            .spawn(move || {
                let fail = |e: anyhow::Error| {
                    let _ = failed_tx.send(e);
                };
                let llm = match load() {
                    Ok(llm) => llm,
                    Err(e) => return fail(e.into()),
                };
                let sched = SchedulerOptions {
                    max_sequences: app.opts.parallel,
                    step_tokens: app.opts.step_tokens.max(app.opts.parallel),
                    max_context: app.opts.max_context,
                    cache: None,
                    reuse: app.opts.reuse,
                };
                let (tx, rx) = mpsc::channel();
                let loaded = Loaded {
                    llm: llm.clone(),
                    jobs: tx,
                };
                // The worker builds its scheduler (the KV pool) first; the
                // server says it is ready once that is done.
                let counters = app.counters.clone();
                let (ready_tx, ready_rx) = mpsc::channel();
                let worker = std::thread::Builder::new()
                    .name("sieve-worker".into())
                    .spawn(move || worker::run(llm, sched, rx, counters, ready_tx));
                if let Err(e) = worker {
                    return fail(e.into());
                }
                match ready_rx.recv() {
                    Ok(Ok(())) => {
                        let _ = app.loaded.set(loaded);
                    }
                    Ok(Err(e)) => fail(e),
                    Err(_) => fail(anyhow::anyhow!("the model's worker thread ended")),
                }
            })?;
    }
    let router = router(app.clone());
    let server = axum::serve(listener, router).with_graceful_shutdown(shutdown);
    tokio::select! {
        done = server => Ok(done?),
        Some(e) = failed_rx.recv() => Err(e.context("loading the model")),
    }
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .method_not_allowed_fallback(|| async {
            ApiError::status(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "this endpoint does not take that method (completions are POST, the rest GET)",
            )
        })
        .fallback(|| async {
            ApiError::status(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "no such endpoint (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, /health, /metrics)",
            )
        })
        .layer(DefaultBodyLimit::max(app.opts.body_limit))
        .with_state(app)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl App {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.opts.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given == Some(key.as_str()) {
            Ok(())
        } else {
            Err(ApiError::status(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "a valid API key is required (Authorization: Bearer KEY)",
            )
            .with_code("invalid_api_key"))
        }
    }

    fn loaded(&self) -> Result<&Loaded, ApiError> {
        self.loaded.get().ok_or_else(|| {
            ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the model is still loading",
            )
        })
    }
}

/// The body's bytes, or the error for a body too large or unreadable.
fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!("the request body is larger than {limit} bytes")
        } else {
            format!("the request body could not be read: {e}")
        };
        ApiError::status(status, "invalid_request_error", message)
    })
}

async fn chat(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(app, headers, body, Kind::Chat).await
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(app, headers, body, Kind::Text).await
}

async fn complete(
    app: Arc<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Response {
    let id = app.requests.fetch_add(1, Ordering::Relaxed) + 1;
    match start(&app, headers, body, kind, id) {
        Ok((envelope, generate, events)) => {
            if generate.stream {
                stream(envelope, generate, events).into_response()
            } else {
                whole(envelope, events).await
            }
        }
        Err(e) => {
            app.refused.fetch_add(1, Ordering::Relaxed);
            e.into_response()
        }
    }
}

/// Checks a request and hands it to the worker.
fn start(
    app: &App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
    id: u64,
) -> Result<(Envelope, Generate, UnboundedReceiver<Event>), ApiError> {
    app.authorize(&headers)?;
    let bytes = body_bytes(body, app.opts.body_limit)?;
    let loaded = app.loaded()?;
    let body = api::parse_body(&bytes)?;
    let mut generate = api::parse_generate(&body)?;
    generate.logprobs = api::parse_logprobs(&body, kind)?;
    if let Some((constraint, param)) = &generate.constraint {
        check_constraint(&loaded.llm, constraint, param, generate.tools.as_ref())?;
    }
    let prompt = match kind {
        Kind::Text if generate.tools.is_some() => {
            return Err(ApiError::invalid(
                Some("tools"),
                "'tools' are for chat completions (/v1/chat/completions)",
            ))
        }
        Kind::Chat => {
            let mut messages = api::parse_messages(&body)?;
            if let Some(tools) = &generate.tools {
                tools::add_system_prompt(&mut messages, tools);
            }
            loaded
                .llm
                .chat_prompt(&messages)
                .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?
        }
        Kind::Text => {
            let text = api::parse_prompt(&body)?;
            loaded
                .llm
                .tokenizer
                .encode(&text)
                .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))?
        }
    };
    let cache = api::parse_cache(&body, &app.opts.cache, app.opts.max_context)?;
    let bounded = cache.policy != Policy::Full;
    let max_context = app.opts.max_context;
    let context_error = |message: String| {
        ApiError::invalid(Some(kind.prompt_param()), message).with_code("context_length_exceeded")
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(None, "the prompt has no tokens"));
    }
    let max_tokens = match (generate.max_tokens, bounded) {
        (Some(n), _) => n,
        (None, true) => max_context,
        (None, false) => max_context.saturating_sub(prompt.len()),
    };
    if !bounded && prompt.len().saturating_add(max_tokens) > max_context {
        return Err(context_error(format!(
            "this model's context is {max_context} tokens; the request has {} prompt tokens and asks for {max_tokens} more",
            prompt.len()
        )));
    }
    // Counted before the check, so that requests at once cannot all pass it.
    if app.counters.waiting.fetch_add(1, Ordering::Relaxed) >= app.opts.queue {
        app.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError {
            retry_after: Some(1),
            ..ApiError::status(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "{} requests are already waiting for a free sequence (--queue); retry later",
                    app.opts.queue
                ),
            )
            .with_code("rate_limit_exceeded")
        });
    }
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt,
        opts: GenerateOptions {
            max_new_tokens: max_tokens,
            sampling: generate.sampling,
            stop_strings: generate.stop.clone(),
            stop_at_eos: true,
            on_prompt: None,
            submit_ahead: SubmitAhead::Auto,
            constraint: generate.constraint.as_ref().map(|(c, _)| c.clone()),
            logprobs: generate.logprobs,
        },
        cache: Some(cache),
        events: tx,
    };
    if loaded.jobs.send(job).is_err() {
        app.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the model's worker has stopped",
        ));
    }
    let envelope = Envelope {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{id}"),
            Kind::Text => format!("cmpl-{id}"),
        },
        created: now(),
        model: app.opts.model_name.clone(),
        cache: match bounded {
            true => match cache.granularity {
                Granularity::Token => {
                    json!({"policy": cache.policy.name(), "budget": cache.budget})
                }
                g => {
                    json!({"policy": cache.policy.name(), "budget": cache.budget, "granularity": g.name()})
                }
            },
            false => json!({"policy": "full", "budget": null}),
        },
        tools: generate.tools.is_some(),
        logprobs: (generate.logprobs.is_some()).then(|| loaded.llm.tokenizer.clone()),
    };
    Ok((envelope, generate, rx))
}

/// Compiles a request's constraint before it is queued: a 400 naming
/// `param`, or for tools the parameters of the first tool whose calls do
/// not compile.
fn check_constraint(
    llm: &Llm,
    constraint: &crate::constraint::Constraint,
    param: &str,
    tools: Option<&crate::tools::ToolSet>,
) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().flat_map(|t| t.tools.iter()).enumerate() {
        let calls = crate::constraint::Constraint::json_schema(&tool.call_schema());
        if let Err(e) = llm.check_constraint(&calls) {
            let param = format!("tools[{i}].function.parameters");
            return Err(ApiError::invalid(Some(&param), format!("'{param}': {e}")));
        }
    }
    (llm.check_constraint(constraint)).map_err(|e| ApiError::invalid(Some(param), e.to_string()))
}

/// The error of a failed generation of a request of `kind`.
fn failure(e: crate::error::Error, kind: Kind) -> ApiError {
    use crate::error::ErrorKind;
    match e.kind() {
        ErrorKind::PromptTooLong => ApiError::invalid(Some(kind.prompt_param()), e.to_string())
            .with_code("context_length_exceeded"),
        ErrorKind::InvalidOptions => ApiError::invalid(None, e.to_string()),
        _ => ApiError::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        ),
    }
}

async fn whole(envelope: Envelope, mut events: UnboundedReceiver<Event>) -> Response {
    while let Some(event) = events.recv().await {
        match event {
            Event::Text(_) => {}
            Event::Done(g) => return Json(envelope.response(&g)).into_response(),
            Event::Failed(e) => return failure(e, envelope.kind).into_response(),
        }
    }
    ApiError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the generation ended without an answer",
    )
    .into_response()
}

/// An SSE stream of chunks, then `[DONE]`. A failure after the stream has
/// started is an error chunk. When the client goes, the stream is dropped,
/// and with it the worker's channel: its sequence is cancelled.
fn stream(
    envelope: Envelope,
    generate: Generate,
    mut events: UnboundedReceiver<Event>,
) -> Sse<impl tokio_stream::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Value>(64);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(v).await.is_ok() }
        };
        if envelope.kind == Kind::Chat && !send(envelope.role_chunk()).await {
            return;
        }
        let mut generation: Option<Generation> = None;
        // With tools the text is split into content and calls.
        let mut calls = envelope.tools.then(tools::ToolStream::default);
        let deltas = |d: Vec<tools::Delta>| -> Vec<Value> {
            d.into_iter()
                .map(|d| match d {
                    tools::Delta::Content(t) => envelope.text_chunk(&t),
                    tools::Delta::Call(c) => envelope.call_chunk(c),
                })
                .collect()
        };
        loop {
            // A client that goes drops the stream: stop reading events, so
            // that the worker sees the request gone (even before a token).
            let event = tokio::select! {
                event = events.recv() => event,
                _ = tx.closed() => return,
            };
            let Some(event) = event else { break };
            let chunks = match (event, calls.as_mut()) {
                (Event::Text(t), None) => vec![envelope.text_chunk(&t)],
                (Event::Text(t), Some(c)) => deltas(c.push(&envelope.id, &t)),
                (Event::Done(g), c) => {
                    let mut chunks = vec![];
                    let mut called = false;
                    if let Some(c) = c {
                        chunks = deltas(c.finish());
                        called = c.called();
                    }
                    chunks.push(envelope.finish_chunk(&g, called));
                    generation = Some(g);
                    chunks
                }
                (Event::Failed(e), _) => vec![failure(e, envelope.kind).body()],
            };
            for chunk in chunks {
                if !send(chunk).await {
                    return;
                }
            }
        }
        if let (Some(g), true) = (&generation, generate.include_usage) {
            send(envelope.usage_chunk(g)).await;
        }
        send(Value::String("[DONE]".into())).await;
    });
    let chunks = tokio_stream::wrappers::ReceiverStream::new(rx);
    let events = tokio_stream::StreamExt::map(chunks, |v| {
        Ok(match v {
            Value::String(done) => SseEvent::default().data(done),
            v => SseEvent::default().data(v.to_string()),
        })
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{
        "id": app.opts.model_name, "object": "model", "created": 0, "owned_by": "sieve",
    }]}))
    .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    match app.loaded.get() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

/// Prometheus text.
async fn metrics(State(app): State<Arc<App>>) -> Response {
    let c = &app.counters;
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let size = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as u64;
    let mut text = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, values: &[(String, u64)]| {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, value) in values {
            text.push_str(&format!("{name}{labels} {value}\n"));
        }
    };
    let one = |v: u64| [(String::new(), v)];
    let counter = "counter";
    metric(
        "sieve_requests_total",
        counter,
        "Completion requests received.",
        &one(load(&app.requests)),
    );
    metric(
        "sieve_requests_refused_total",
        counter,
        "Requests refused before they ran.",
        &one(load(&app.refused)),
    );
    metric(
        "sieve_requests_finished_total",
        counter,
        "Generations that ended.",
        &one(load(&c.finished)),
    );
    metric(
        "sieve_requests_cancelled_total",
        counter,
        "Requests cancelled (the client went, while running or waiting).",
        &one(load(&c.cancelled)),
    );
    metric(
        "sieve_requests_failed_total",
        counter,
        "Generations that failed.",
        &one(load(&c.failed)),
    );
    metric(
        "sieve_prompt_tokens_total",
        counter,
        "Prompt tokens fed.",
        &one(load(&c.prompt_tokens)),
    );
    metric(
        "sieve_generated_tokens_total",
        counter,
        "Tokens generated.",
        &one(load(&c.generated_tokens)),
    );
    metric(
        "sieve_queue_length",
        "gauge",
        "Requests waiting for a free sequence.",
        &one(size(&c.waiting)),
    );
    metric(
        "sieve_sequences_busy",
        "gauge",
        "Sequences running.",
        &one(size(&c.busy)),
    );
    metric(
        "sieve_sequences_parked",
        "gauge",
        "Finished sequences whose caches are kept for a next turn.",
        &one(size(&c.parked)),
    );
    metric(
        "sieve_kv_entries",
        "gauge",
        "Cache entries held by running and parked sequences.",
        &one(size(&c.kv_entries)),
    );
    let evicted: Vec<(String, u64)> = c
        .evicted
        .lock()
        .map(|e| {
            e.iter()
                .map(|(p, n)| (format!("{{policy=\"{p}\"}}"), *n))
                .collect()
        })
        .unwrap_or_default();
    metric(
        "sieve_evicted_entries_total",
        counter,
        "Cache entries evicted, per policy.",
        &evicted,
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}
