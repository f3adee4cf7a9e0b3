//! sieve: LLM inference on any GPU wgpu reaches, with a bounded KV cache.
//!
//! All model math runs in WGSL compute shaders under `shaders/`; the host side
//! loads weights, binds every kernel once and submits one command buffer per
//! step. Start with [`Llm`] for text generation, or [`engine::Engine`]
//! for token-level control. Everything an application needs is re-exported
//! here at the crate root.
//!
//! A chat, streamed, with a bounded KV cache and a cancel button:
//!
//! ```no_run
//! use sieve::{CacheOptions, GenerateOptions, Llm, LoadOptions, Progress, Policy, SessionOptions};
//!
//! let opts = LoadOptions {
//!     progress: Some(Progress::new(|done, total| eprintln!("loading {done}/{total}"))),
//!     ..Default::default()
//! };
//! let llm = Llm::load("models/smollm2-135m-instruct".as_ref(), &opts)?;
//! let mut session = llm.session(SessionOptions {
//!     // At most 512 + 64 cache entries, however long the conversation.
//!     cache: Some(CacheOptions::new(Policy::Epikv, 512, 64)),
//!     ..Default::default()
//! })?;
//! let cancel = session.cancel_token(); // clone it to a UI thread: cancel.cancel()
//! let answer = session.chat("What is the capital of France?", &GenerateOptions::default(), |piece| {
//!     print!("{piece}");
//!     true
//! })?;
//! let next = session.chat("And of Italy?", &GenerateOptions::default(), |piece| {
//!     print!("{piece}");
//!     true
//! })?;
//! println!("\n{:?} then {:?}; {} tokens in the conversation", answer.stats.stop, next.stats.stop, session.tokens().len());
//! # let _ = cancel;
//! # Ok::<(), sieve::Error>(())
//! ```
//!
//! Errors are [`Error`]s whose [`ErrorKind`] says what went wrong:
//!
//! ```no_run
//! # use sieve::{ErrorKind, GenerateOptions, Llm, SessionOptions};
//! # let llm = Llm::load("models/smollm2-135m-instruct".as_ref(), &Default::default())?;
//! # let mut session = llm.session(SessionOptions::default())?;
//! # let prompt = vec![1u32; 10_000];
//! match session.generate(&prompt, &GenerateOptions::default(), |_| true) {
//!     Ok(out) => println!("{}", out.text),
//!     Err(e) if e.kind() == ErrorKind::PromptTooLong => eprintln!("shorten the prompt: {e}"),
//!     Err(e) => eprintln!("failed: {e}"),
//! }
//! # Ok::<(), sieve::Error>(())
//! ```

pub mod cache;
pub mod config;
pub mod constraint;
pub mod convert;
pub mod device;
pub mod engine;
pub mod error;
#[cfg(feature = "eval")]
pub mod eval;
pub mod eviction;
pub mod family;
pub mod files;
pub mod formats;
pub mod gguf;
pub mod gguf_model;
pub mod gpu;
pub mod kernels;
pub mod model;
pub mod platform;
pub mod profile;
pub mod progress;
pub mod scheduler;
#[cfg(feature = "server")]
pub mod server;
pub mod session;
pub mod shaders;
mod spirv;
pub mod synthetic;
pub mod tokenizer;
pub mod tools;
pub mod weights;

pub use cache::CacheOptions;
pub use constraint::Constraint;
pub use device::KernelSet;
pub use error::{Error, ErrorKind, Result};
pub use eviction::Policy;
pub use formats::WeightFormat;
pub use gpu::GpuOptions;
pub use kernels::sample::SamplingParams;
pub use model::LoadOptions;
pub use progress::Progress;
pub use session::{
    CancelToken, GenerateOptions, Generation, GenerationStats, Llm, MemoryReport, Session,
    SessionOptions, StopReason, SubmitAhead,
};
pub use tokenizer::Message;

/// The README's code blocks, compiled as doctests so the program it shows
/// keeps building.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
