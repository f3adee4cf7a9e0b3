//! sieve: LLM inference on any GPU wgpu reaches, with a bounded KV cache.
//!
//! All model math runs in WGSL compute shaders (see `shaders/`).

pub mod config;
pub mod engine;
pub mod gpu;
pub mod kernels;
pub mod model;
pub mod shaders;
pub mod weights;
