//! sieve: LLM inference on any GPU wgpu reaches, with a bounded KV cache.
//!
//! All model math runs in WGSL compute shaders under `shaders/`; the host side
//! loads weights, binds every kernel once and submits one command buffer per
//! step. Start with [`session::Llm`] for text generation, or [`engine::Engine`]
//! for token-level control.

pub mod cache;
pub mod config;
pub mod convert;
pub mod device;
pub mod engine;
pub mod error;
pub mod eval;
pub mod eviction;
pub mod files;
pub mod gguf;
pub mod gpu;
pub mod kernels;
pub mod model;
pub mod profile;
pub mod session;
pub mod shaders;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;
