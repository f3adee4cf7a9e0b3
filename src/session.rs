//! The library API: load a model with its tokenizer, open a session, generate
//! text with a per-piece callback, cancel from another thread, inspect memory.
//!
//! ```no_run
//! use sieve::session::{Llm, SessionOptions, GenerateOptions};
//! use sieve::tokenizer::Message;
//! let llm = Llm::load(std::path::Path::new("models/smollm2-135m-instruct"), &Default::default())?;
//! let mut session = llm.session(SessionOptions::default())?;
//! let prompt = llm.chat_prompt(&[Message::new("user", "What is the capital of France?")])?;
//! let out = session.generate(&prompt, &GenerateOptions::default(), |piece| {
//!     print!("{piece}");
//!     true // keep going
//! })?;
//! eprintln!("{} tokens", out.stats.generated_tokens);
//! # anyhow::Ok(())
//! ```

use anyhow::{bail, Result};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::engine::{Engine, EngineOptions, StepOutput};
use crate::kernels::sample::SamplingParams;
use crate::model::{LoadOptions, Model};
use crate::tokenizer::{Message, StreamDecoder, Tokenizer};

/// A model and its tokenizer.
pub struct Llm {
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
}

impl Llm {
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Llm> {
        // The tokenizer first: a missing tokenizer.json fails before the weights upload.
        let cfg = crate::config::ModelConfig::from_file(&dir.join("config.json"))?;
        let tokenizer = Arc::new(Tokenizer::load(dir, &cfg.eos_token_ids)?);
        let model = Model::load(dir, opts)?;
        Ok(Llm { model, tokenizer })
    }

    pub fn session(&self, opts: SessionOptions) -> Result<Session> {
        Session::new(self.model.clone(), self.tokenizer.clone(), opts)
    }

    /// Token ids of a chat rendered with the model's template, ready for the
    /// assistant's answer.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let text = self.tokenizer.apply_chat_template(messages, true)?;
        self.tokenizer.encode(&text)
    }
}

/// Sizes of a session.
#[derive(Clone, Copy, Debug)]
pub struct SessionOptions {
    /// Longest context (prompt plus generated tokens). 0 = the model's
    /// max_position_embeddings, capped at 8192.
    pub max_context: usize,
    /// Tokens per prefill step.
    pub prefill_chunk: usize,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            max_context: 0,
            prefill_chunk: 256,
        }
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before any of these strings; they are not emitted.
    pub stop_strings: Vec<String>,
    /// Stop at the model's end-of-sequence tokens.
    pub stop_at_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 256,
            sampling: SamplingParams::default(),
            stop_strings: vec![],
            stop_at_eos: true,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    StopString,
    MaxTokens,
    Cancelled,
    ContextFull,
}

#[derive(Clone, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub stop: StopReason,
}

impl GenerationStats {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_seconds.max(1e-9)
    }
    pub fn decode_tokens_per_second(&self) -> f64 {
        // The first token comes from the prefill step.
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub text: String,
    pub ids: Vec<u32>,
    pub stats: GenerationStats,
}

/// GPU memory a session uses, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct MemoryReport {
    pub weights: u64,
    /// KV cache, activations, logits and scratch.
    pub buffers: u64,
}

/// A conversation with a model: its KV cache persists across `generate` calls.
pub struct Session {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    cancel: Arc<AtomicBool>,
    /// Tokens in the cache, in order (position = index).
    tokens: Vec<u32>,
    steps: u32,
}

impl Session {
    pub fn new(model: Arc<Model>, tokenizer: Arc<Tokenizer>, opts: SessionOptions) -> Result<Self> {
        let max_context = if opts.max_context == 0 {
            model.config.max_position_embeddings.min(8192)
        } else {
            opts.max_context
        };
        let chunk = opts.prefill_chunk.clamp(1, max_context);
        let engine = Engine::new(
            model,
            EngineOptions {
                max_slots: max_context,
                max_tokens: chunk,
                max_logit_rows: 1,
            },
        )?;
        Ok(Session {
            engine,
            tokenizer,
            cancel: Arc::new(AtomicBool::new(false)),
            tokens: vec![],
            steps: 0,
        })
    }

    /// Set the returned flag to stop a running `generate` after its current token.
    pub fn cancel_handle(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// Forgets the conversation.
    pub fn reset(&mut self) {
        self.engine.reset();
        self.tokens.clear();
    }

    pub fn max_context(&self) -> usize {
        self.engine.opts.max_slots
    }

    pub fn memory(&self) -> MemoryReport {
        MemoryReport {
            weights: self.engine.model.weight_bytes,
            buffers: self.engine.buffer_bytes,
        }
    }

    pub fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Appends `prompt` to the conversation and generates the answer, calling
    /// `on_text` with each new piece of text; returning false from it stops.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        if prompt.is_empty() {
            bail!("the prompt is empty");
        }
        let max = self.max_context();
        if self.tokens.len() + prompt.len() > max {
            bail!(
                "the prompt has {} tokens and the conversation already holds {}; the context is {max} tokens (--max-context)",
                prompt.len(),
                self.tokens.len()
            );
        }
        self.cancel.store(false, Ordering::Relaxed);
        let seen: Vec<u32> = self.tokens.iter().chain(prompt).copied().collect();
        self.engine.reset_seen(&seen);
        let t0 = Instant::now();
        // Prefill in chunks; the last chunk samples the first new token.
        let chunk = self.engine.opts.max_tokens;
        let mut next = 0;
        let pieces: Vec<&[u32]> = prompt.chunks(chunk).collect();
        for (i, piece) in pieces.iter().enumerate() {
            let pos: Vec<u32> = (0..piece.len())
                .map(|j| (self.tokens.len() + j) as u32)
                .collect();
            let last = i + 1 == pieces.len();
            let out = if last {
                self.steps += 1;
                StepOutput {
                    sample: Some((opts.sampling, self.steps)),
                    ..StepOutput::last(piece.len())
                }
            } else {
                StepOutput::NONE
            };
            if let Some(t) = self.engine.step(piece, &pos, out)? {
                next = t;
            }
            self.tokens.extend_from_slice(piece);
        }
        let prefill_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut decoder = StreamDecoder::new();
        let mut ids = Vec::new();
        let mut pending = String::new();
        let mut text = String::new();
        let hold = opts.stop_strings.iter().map(|s| s.len()).max().unwrap_or(0);
        let stop = loop {
            if opts.stop_at_eos && self.tokenizer.eos_ids.contains(&next) {
                break StopReason::Eos;
            }
            ids.push(next);
            pending.push_str(&decoder.push(&self.tokenizer, next)?);
            if let Some(cut) = opts
                .stop_strings
                .iter()
                .filter_map(|s| pending.find(s.as_str()))
                .min()
            {
                pending.truncate(cut);
                text.push_str(&pending);
                on_text(&pending);
                pending.clear();
                break StopReason::StopString;
            }
            // Hold back a tail that could still become a stop string.
            let mut safe = pending.len().saturating_sub(hold.saturating_sub(1));
            while !pending.is_char_boundary(safe) {
                safe -= 1;
            }
            if safe > 0 {
                let emit: String = pending.drain(..safe).collect();
                text.push_str(&emit);
                if !on_text(&emit) {
                    break StopReason::Cancelled;
                }
            }
            if self.cancel.load(Ordering::Relaxed) {
                break StopReason::Cancelled;
            }
            if ids.len() >= opts.max_new_tokens {
                break StopReason::MaxTokens;
            }
            if self.tokens.len() >= max {
                break StopReason::ContextFull;
            }
            self.steps += 1;
            let pos = self.tokens.len() as u32;
            let out = StepOutput {
                sample: Some((opts.sampling, self.steps)),
                ..StepOutput::last(1)
            };
            let t = self.engine.step(&[next], &[pos], out)?;
            self.tokens.push(next);
            next = t.expect("a sampling step returns a token");
        };
        if stop != StopReason::StopString && !pending.is_empty() {
            text.push_str(&pending);
            on_text(&pending);
        }
        Ok(Generation {
            text,
            ids: ids.clone(),
            stats: GenerationStats {
                prompt_tokens: prompt.len(),
                generated_tokens: ids.len(),
                prefill_seconds,
                decode_seconds: t1.elapsed().as_secs_f64(),
                stop,
            },
        })
    }
}
