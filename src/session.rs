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

use crate::error::{bail_kind, Error, ErrorKind, Result};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use web_time::Instant;

use crate::cache::{BoundedCache, CacheOptions, FeedOutput};
use crate::constraint::{Constraint, ConstraintState};
use crate::device::DeviceProfile;
use crate::engine::{Engine, StepIds, Submitted};
use crate::eviction::Policy;
use crate::kernels::sample::{SamplingParams, TokenLogprobs, MAX_TOP_LOGPROBS};
use crate::model::{LoadOptions, Model};
use crate::progress::Progress;
use crate::tokenizer::{Message, StreamDecoder, Tokenizer};

/// A model and its tokenizer (clones share them).
#[derive(Clone)]
pub struct Llm {
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
}

impl Llm {
    /// Loads a Hugging Face model folder (config.json, safetensors weights,
    /// tokenizer.json and tokenizer_config.json) onto the GPU `opts` choose.
    /// Errors are [`ErrorKind::ModelLoading`], or [`ErrorKind::Gpu`] /
    /// [`ErrorKind::GpuOutOfMemory`] for the device.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Llm> {
        Self::load_with(dir, || Model::load(dir, opts))
    }

    /// As [`Llm::load`], on a `Gpu` made from the application's own device
    /// ([`Gpu::from_wgpu`](crate::gpu::Gpu::from_wgpu)), so sieve opens no
    /// second device.
    pub fn load_on(gpu: Arc<crate::gpu::Gpu>, dir: &Path, opts: &LoadOptions) -> Result<Llm> {
        Self::load_with(dir, || Model::load_on(gpu, dir, opts))
    }

    /// As [`Llm::load`], for a GGUF file's bytes already in memory (a
    /// browser page's file, a download): the weights, the tokenizer and the
    /// chat template all come from it; `name` names it in errors.
    pub fn from_gguf_bytes(name: &str, bytes: Vec<u8>, opts: &LoadOptions) -> Result<Llm> {
        (|| -> anyhow::Result<Llm> {
            let g = crate::gguf_model::GgufModel::from_bytes(name, bytes)?;
            let tokenizer = Arc::new(Tokenizer::from_gguf(&g)?);
            Ok(Llm {
                model: Model::from_gguf(&g, opts)?,
                tokenizer,
            })
        })()
        .map_err(|e| Error::classify(e, ErrorKind::ModelLoading))
    }

    /// The tokenizer of `dir`, then the weights `model` loads.
    fn load_with(dir: &Path, model: impl FnOnce() -> anyhow::Result<Arc<Model>>) -> Result<Llm> {
        (|| -> anyhow::Result<Llm> {
            // The tokenizer first: a missing tokenizer.json fails before the weights upload.
            let tokenizer = Arc::new(Tokenizer::for_model(dir)?);
            Ok(Llm {
                model: model()?,
                tokenizer,
            })
        })()
        .map_err(|e| Error::classify(e, ErrorKind::ModelLoading))
    }

    /// A new conversation (its own KV cache) on this model.
    pub fn session(&self, opts: SessionOptions) -> Result<Session> {
        Session::new(self.model.clone(), self.tokenizer.clone(), opts)
    }

    /// Compiles `constraint` for this model's tokenizer, as a generation
    /// would, to refuse a bad one before anything is queued
    /// ([`ErrorKind::InvalidConstraint`], naming what does not compile).
    pub fn check_constraint(&self, constraint: &Constraint) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        ConstraintState::new(constraint, &self.tokenizer, vocab)
            .map(drop)
            .map_err(|e| Error::classify(e, ErrorKind::InvalidConstraint))
    }

    /// Float32 logits of the last position of `ids` (vocabulary size
    /// values), fed from position 0 through a fresh cache: the full cache,
    /// or a bounded one refreshing as it fills. `sieve logits` writes
    /// these values. Errors are [`ErrorKind::InvalidOptions`] (no ids, an
    /// id outside the vocabulary, bad cache options),
    /// [`ErrorKind::PromptTooLong`] (more ids than the model's positions
    /// without a budget) and the device's.
    pub fn logits(&self, ids: &[u32], cache: Option<CacheOptions>) -> Result<Vec<f32>> {
        let mut cache = logits_cache(&self.model, ids, cache)?;
        last_logits(self.model.clone(), ids, &mut cache, DEFAULT_PREFILL_CHUNK)
            .map_err(|e| Error::classify(e, ErrorKind::InvalidOptions))
    }

    /// Token ids of a chat rendered with the model's template, ready for the
    /// assistant's answer.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        (|| -> anyhow::Result<Vec<u32>> {
            let text = self.tokenizer.apply_chat_template(messages, true)?;
            self.tokenizer.encode(&text)
        })()
        .map_err(|e| Error::classify(e, ErrorKind::Template))
    }
}

/// Tokens per prefill step unless a caller says otherwise.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// The cache [`Llm::logits`] feeds `ids` through: `opts` checked, or the
/// full cache, which must hold every id.
pub fn logits_cache(
    model: &Model,
    ids: &[u32],
    opts: Option<CacheOptions>,
) -> Result<BoundedCache> {
    if ids.is_empty() {
        return Err(Error::classify(
            anyhow::anyhow!("no token ids to compute logits of"),
            ErrorKind::InvalidOptions,
        ));
    }
    let max_pos = model.config.max_position_embeddings;
    if opts.is_none() && ids.len() > max_pos {
        return Err(Error::classify(
            anyhow::anyhow!(
                "{} ids exceed the model's context of {max_pos} positions (a bounded cache evicts)",
                ids.len()
            ),
            ErrorKind::PromptTooLong,
        ));
    }
    if let Some(o) = &opts {
        o.validate()
            .map_err(|e| Error::classify(e, ErrorKind::InvalidOptions))?;
    }
    let opts = opts.unwrap_or(CacheOptions::new(Policy::Full, 0, 0));
    BoundedCache::new(opts, model.config.num_layers)
        .map_err(|e| Error::classify(e, ErrorKind::InvalidOptions))
}

/// The logits of the last of `ids`, fed from position 0 through `cache`
/// in steps of at most `prefill_chunk` tokens (`Llm::logits`, `sieve
/// logits`; the cache keeps its trace when it records one).
pub fn last_logits(
    model: Arc<Model>,
    ids: &[u32],
    cache: &mut BoundedCache,
    prefill_chunk: usize,
) -> anyhow::Result<Vec<f32>> {
    let mut e = Engine::new(model, cache.engine_options(ids.len(), prefill_chunk, 1))?;
    cache.feed(&mut e, ids, 0, FeedOutput::Last, |_, _| Ok(()))?;
    e.read_logits(1)
}

/// Sizes of a session.
#[derive(Clone, Copy, Debug)]
pub struct SessionOptions {
    /// Longest context (prompt plus generated tokens) without a KV budget.
    /// 0 = the model's max_position_embeddings, capped at 8192.
    pub max_context: usize,
    /// Tokens per prefill step.
    pub prefill_chunk: usize,
    /// A bounded KV cache: the cache holds at most budget + chunk entries and
    /// the context is unbounded. None = the full cache of `max_context` slots.
    pub cache: Option<CacheOptions>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            max_context: 0,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            cache: None,
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
    /// Called after each prompt chunk with (prompt tokens fed, prompt
    /// length): a long prompt's progress, and the moments a cancel can take
    /// effect.
    pub on_prompt: Option<Progress>,
    /// Whether each decode step is submitted while the GPU still runs the
    /// one before (see [`SubmitAhead`]). The tokens and the cache are the
    /// same either way. A constrained step's forward pass is submitted
    /// ahead too; its sampler follows once the host has its mask.
    pub submit_ahead: SubmitAhead,
    /// What the output must match (a JSON schema, a regular expression, a
    /// grammar): each step samples only among the tokens that keep it
    /// inside, and the generation stops when it is complete
    /// ([`StopReason::ConstraintComplete`]). None: any text.
    pub constraint: Option<Constraint>,
    /// Report each emitted token's log-probability and this many most
    /// likely alternatives (at most 20; `Generation::logprobs`). None: no.
    pub logprobs: Option<usize>,
}

/// Refuses more top log-probabilities than the sampler reports.
pub(crate) fn check_logprobs(opts: &GenerateOptions) -> anyhow::Result<()> {
    if let Some(n) = opts.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
        bail_kind!(
            ErrorKind::InvalidOptions,
            "{n} top log-probabilities asked for; at most {MAX_TOP_LOGPROBS}"
        );
    }
    Ok(())
}

/// Submitting decode steps ahead: each step is submitted while the GPU
/// still runs the one before (the sampled token passed on on the GPU), so
/// that the host's recording of a step does not leave the GPU idle. With a
/// bounded cache, every step but the one that finds the cache full (it waits
/// for the refresh, whose policy scores what the steps before wrote). A step
/// submitted ahead of a token that is not emitted (end of sequence, cancel)
/// is undone, with what it changed for the policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SubmitAhead {
    /// On a GPU, off on a CPU implementation of the graphics API (lavapipe,
    /// SwiftShader), where the host and the "GPU" share the same cores. On
    /// lavapipe the submit of a step made while another is in flight
    /// returned only when that one was done, so nothing overlapped; and a
    /// Stop in the desktop app (a window presenting on the same device)
    /// sometimes waited for two steps (docs/ARCHITECTURE.md).
    #[default]
    Auto,
    Always,
    /// One step at a time.
    Never,
}

impl SubmitAhead {
    /// The choice for a device: `Auto` decided from its profile.
    pub fn enabled(self, device: &DeviceProfile) -> bool {
        match self {
            SubmitAhead::Auto => !device.cpu_implementation,
            SubmitAhead::Always => true,
            SubmitAhead::Never => false,
        }
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 256,
            sampling: SamplingParams::default(),
            stop_strings: vec![],
            stop_at_eos: true,
            on_prompt: None,
            submit_ahead: SubmitAhead::Auto,
            constraint: None,
            logprobs: None,
        }
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model sampled an end-of-sequence token (not emitted, not cached).
    Eos,
    /// The text reached one of `GenerateOptions::stop_strings` (cut before it).
    StopString,
    /// `GenerateOptions::max_new_tokens` were generated.
    MaxTokens,
    /// The callback returned false, or the [`CancelToken`] was set.
    Cancelled,
    /// The full cache of `SessionOptions::max_context` slots is full (a
    /// bounded cache never fills).
    ContextFull,
    /// The output completed its [`GenerateOptions::constraint`]: nothing
    /// more could follow.
    ConstraintComplete,
}

/// Counts and timings of one generation.
#[derive(Clone, Debug)]
pub struct GenerationStats {
    /// Tokens of the prompt fed by this call (fewer than the prompt's when
    /// cancelled while the prompt was processed).
    pub prompt_tokens: usize,
    /// Tokens of the prompt found in a cache and not fed again (a
    /// `Scheduler` reusing a finished sequence's cache; 0 for a `Session`,
    /// whose history is not part of the prompt).
    pub cached_tokens: usize,
    /// Tokens emitted (the length of `Generation::ids`).
    pub generated_tokens: usize,
    /// Seconds to feed the prompt and sample the first token.
    pub prefill_seconds: f64,
    /// Seconds for the rest of the tokens.
    pub decode_seconds: f64,
    /// Seconds the host spent computing a constraint's token masks (part
    /// of the two above; 0 without a constraint).
    pub mask_seconds: f64,
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

/// The result of [`Session::generate`] or [`Session::chat`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// The text streamed to the callback (cut before a stop string).
    pub text: String,
    /// Every emitted token id; all of them are in the session's history.
    pub ids: Vec<u32>,
    /// With `GenerateOptions::logprobs`: each emitted token's
    /// log-probability and top alternatives (one per id); else empty.
    pub logprobs: Vec<TokenLogprobs>,
    pub stats: GenerationStats,
}

/// GPU memory a session uses, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct MemoryReport {
    /// Weight matrices (shared by every session of the model).
    pub weights: u64,
    /// KV cache, activations, logits and scratch.
    pub buffers: u64,
}

/// Stops a running [`Session::generate`] from any thread: checked between
/// prefill chunks and after every generated token. `generate` never clears
/// it: once cancelled, every `generate` returns at once with
/// [`StopReason::Cancelled`] until [`CancelToken::reset`] is called, so a
/// cancel set just before a call starts is not lost.
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
    /// Lets the next `generate` run.
    pub fn reset(&self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

/// A conversation with a model: its KV cache persists across `generate`
/// calls, and holds exactly the tokens of [`Session::tokens`].
pub struct Session {
    engine: Engine,
    cache: BoundedCache,
    tokenizer: Arc<Tokenizer>,
    cancel: CancelToken,
    /// Every token fed so far (position = index); evicted ones included.
    tokens: Vec<u32>,
    steps: u32,
    /// The chat so far ([`Session::chat`]).
    chat: Chat,
    /// The error after which the cache no longer holds exactly `tokens` (a
    /// step ran on the GPU but failed before its entries were recorded, as
    /// with non-finite logits): `generate` refuses until `reset`.
    out_of_step: Option<String>,
    /// The running generation's constraint.
    constraint: Option<ConstraintState>,
    /// The running generation's log-probabilities: of the tokens emitted,
    /// and of the one sampled and not yet emitted.
    emitted_logprobs: Vec<TokenLogprobs>,
    next_logprobs: Option<TokenLogprobs>,
}

/// What [`Session::chat`] remembers: the messages, and the text of the
/// tokens in the cache as the template renders it, so a turn feeds only
/// what is new.
#[derive(Default)]
struct Chat {
    messages: Vec<Message>,
    /// The rendered conversation up to the end of the last answer.
    rendered: String,
    /// `tokens.len()` after the last chat turn: a `generate` in between
    /// makes the chat start over.
    tokens: usize,
}

impl Session {
    /// Errors are [`ErrorKind::InvalidOptions`] or [`ErrorKind::GpuOutOfMemory`].
    pub fn new(model: Arc<Model>, tokenizer: Arc<Tokenizer>, opts: SessionOptions) -> Result<Self> {
        Self::build(model, tokenizer, opts)
            .map_err(|e| Error::classify(e, ErrorKind::InvalidOptions))
    }

    fn build(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        opts: SessionOptions,
    ) -> anyhow::Result<Self> {
        let num_layers = model.config.num_layers;
        let cache = BoundedCache::new(
            opts.cache.unwrap_or(CacheOptions::new(Policy::Full, 0, 0)),
            num_layers,
        )?;
        let full_slots = if opts.max_context == 0 {
            model.config.max_position_embeddings.min(8192)
        } else {
            opts.max_context
        };
        let engine = Engine::new(
            model,
            cache.engine_options(full_slots, opts.prefill_chunk, 1),
        )?;
        Ok(Session {
            engine,
            cache,
            tokenizer,
            cancel: CancelToken::default(),
            tokens: vec![],
            steps: 0,
            chat: Chat::default(),
            out_of_step: None,
            constraint: None,
            emitted_logprobs: vec![],
            next_logprobs: None,
        })
    }

    /// The token that stops this session's `generate` (clone it to another
    /// thread; see [`CancelToken`]).
    pub fn cancel_token(&self) -> CancelToken {
        self.cancel.clone()
    }

    /// Every token of the conversation so far, prompts and answers, in
    /// position order: what the cache has processed (a bounded cache keeps
    /// only some of their keys and values, but all of them were fed).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forgets the conversation: afterwards the session behaves exactly as a
    /// fresh one (same seeds give the same text). The cancel token is left
    /// as it is.
    pub fn reset(&mut self) {
        self.cache.reset(&mut self.engine);
        self.tokens.clear();
        self.steps = 0;
        self.chat = Chat::default();
        self.out_of_step = None;
    }

    /// The messages of the chat so far ([`Session::chat`]), answers included.
    pub fn messages(&self) -> &[Message] {
        &self.chat.messages
    }

    /// Adds a message (a system prompt before the first turn, say) to the
    /// chat without generating; it is fed with the next [`Session::chat`].
    pub fn push_message(&mut self, message: Message) {
        self.chat.messages.push(message);
    }

    /// One chat turn: appends the user's message, renders the conversation
    /// with the model's chat template and feeds only the part the cache does
    /// not hold yet, generates the answer (streamed to `on_text`) and adds it
    /// to [`Session::messages`]. When the template does not reproduce the
    /// text already in the cache (a template that trims answers, or a
    /// `generate` call in between), the session starts over and feeds the
    /// whole conversation: slower, never wrong.
    pub fn chat(
        &mut self,
        user: &str,
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        self.chat.messages.push(Message::new("user", user));
        // The new part only, or (when the cache's text is not a prefix of the
        // rendering) the whole conversation: encoded once, whichever it is.
        let prepared = (|| -> anyhow::Result<(String, bool, Vec<u32>)> {
            let full = self
                .tokenizer
                .apply_chat_template(&self.chat.messages, true)?;
            let continues = self.chat.tokens == self.tokens.len()
                && !self.tokens.is_empty()
                && self.out_of_step.is_none()
                && full.starts_with(&self.chat.rendered);
            let ids = if continues {
                self.tokenizer
                    .encode_continuation(&full[self.chat.rendered.len()..])?
            } else {
                self.tokenizer.encode(&full)?
            };
            Ok((full, continues, ids))
        })();
        let (full, continues, prompt) = match prepared {
            Ok(p) => p,
            Err(e) => {
                self.chat.messages.pop();
                return Err(Error::classify(e, ErrorKind::Template));
            }
        };
        if !continues {
            let messages = std::mem::take(&mut self.chat.messages);
            self.reset();
            self.chat.messages = messages;
        }
        let before = self.tokens.len();
        let out = match self.generate(&prompt, opts, on_text) {
            Ok(out) => out,
            Err(e) => {
                // The turn did not happen: forget its message and start
                // over next time (part of the prompt may have been fed).
                self.chat.messages.pop();
                self.chat.tokens = usize::MAX;
                return Err(e);
            }
        };
        let answer = self
            .tokenizer
            .decode(&out.ids)
            .map_err(|e| Error::classify(e, ErrorKind::Template))?;
        self.chat.rendered = full + &answer;
        // A cancel during the prompt fed only part of it: start over next time.
        let whole = before + prompt.len() + out.ids.len() == self.tokens.len();
        self.chat.tokens = if whole { self.tokens.len() } else { usize::MAX };
        self.chat
            .messages
            .push(Message::new("assistant", &out.text));
        Ok(out)
    }

    /// The longest conversation in tokens (None with a KV budget: unbounded).
    pub fn max_context(&self) -> Option<usize> {
        match self.cache.capacity() {
            Some(_) => None,
            None => Some(self.engine.opts.max_slots),
        }
    }

    /// The bounded cache (its refresh records when `cache().record` is set).
    pub fn cache(&mut self) -> &mut BoundedCache {
        &mut self.cache
    }

    /// GPU memory of the model's weights and of this session's buffers.
    pub fn memory(&self) -> MemoryReport {
        MemoryReport {
            weights: self.engine.model.weight_bytes,
            buffers: self.engine.buffer_bytes,
        }
    }

    /// The engine under the session (token-level control; bypassing the
    /// session's history keeps `tokens()` from describing the cache).
    pub fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Takes back a decode step submitted ahead of a token that was not
    /// emitted (and its sampling counter).
    fn undo_ahead(&mut self, step: Option<Submitted>) -> anyhow::Result<()> {
        if let Some(step) = step {
            self.engine.undo(step)?;
            self.steps -= 1;
        }
        Ok(())
    }

    /// An error met while a decode step is in flight: the step is undone
    /// and the error returned (not a failed undo's).
    fn fail_with_ahead(&mut self, step: Option<Submitted>, e: anyhow::Error) -> anyhow::Error {
        let _ = self.undo_ahead(step);
        e
    }

    /// Appends `prompt` to the conversation and generates the answer, calling
    /// `on_text` with each new piece of text; returning false from it stops.
    /// Errors are [`ErrorKind::PromptTooLong`], [`ErrorKind::InvalidOptions`]
    /// (sampling settings), [`ErrorKind::NonFiniteLogits`],
    /// [`ErrorKind::Gpu`], or [`ErrorKind::NeedsReset`] after an error that
    /// left the cache out of step with [`Session::tokens`].
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        if let Some(why) = &self.out_of_step {
            return Err(Error::classify(
                anyhow::anyhow!("the session's cache no longer matches its tokens since an earlier error ({why}): reset the session before generating again"),
                ErrorKind::NeedsReset,
            ));
        }
        let out = self.generate_inner(prompt, opts, on_text);
        if let Err(e) = &out {
            // Errors before a step, or after its entries were recorded,
            // leave the two in step; one between (the step ran, its
            // logits or signals could not be used) does not.
            if !self.cache.in_step_with(&self.engine, self.tokens.len()) {
                self.out_of_step = Some(format!("{e:#}"));
            }
        }
        out.map_err(|e| Error::classify(e, ErrorKind::Gpu))
    }

    fn generate_inner(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> anyhow::Result<Generation> {
        let max = self.check_prompt(prompt, opts)?;
        let vocab = self.engine.model.config.vocab_size;
        self.constraint = (opts.constraint.as_ref())
            .map(|c| ConstraintState::new(c, &self.tokenizer, vocab))
            .transpose()?;
        self.engine.set_logprobs(opts.logprobs);
        self.emitted_logprobs.clear();
        let t0 = Instant::now();
        let fed = self.feed_prompt(prompt, opts);
        let mask_seconds = |s: &Self| s.constraint.as_ref().map_or(0.0, |c| c.mask_seconds);
        let next = match fed? {
            Ok(next) => next,
            Err(fed) => {
                let stats = GenerationStats {
                    prompt_tokens: fed,
                    cached_tokens: 0,
                    generated_tokens: 0,
                    prefill_seconds: t0.elapsed().as_secs_f64(),
                    decode_seconds: 0.0,
                    mask_seconds: mask_seconds(self),
                    stop: StopReason::Cancelled,
                };
                return Ok(Generation {
                    text: String::new(),
                    ids: vec![],
                    logprobs: vec![],
                    stats,
                });
            }
        };
        let prefill_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut text = StopText::new(&opts.stop_strings);
        let mut ids = Vec::new();
        let stop = self.decode(next, opts, max, &mut ids, &mut text, &mut on_text)?;
        let text = text.finish(stop, &mut on_text);
        Ok(Generation {
            text,
            stats: GenerationStats {
                prompt_tokens: prompt.len(),
                cached_tokens: 0,
                generated_tokens: ids.len(),
                prefill_seconds,
                decode_seconds: t1.elapsed().as_secs_f64(),
                mask_seconds: mask_seconds(self),
                stop,
            },
            ids,
            logprobs: std::mem::take(&mut self.emitted_logprobs),
        })
    }

    /// Refuses a prompt before any step: empty, too long for the context,
    /// or with a token outside the vocabulary (found by the engine in a
    /// later step of a chunk, it would leave the steps before it fed).
    /// Returns the longest context (None: unbounded).
    fn check_prompt(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> anyhow::Result<Option<usize>> {
        if prompt.is_empty() {
            bail_kind!(ErrorKind::InvalidOptions, "the prompt is empty");
        }
        opts.sampling.validate()?;
        check_logprobs(opts)?;
        let max = self.max_context();
        if let Some(max) = max.filter(|&m| self.tokens.len() + prompt.len() > m) {
            bail_kind!(
                ErrorKind::PromptTooLong,
                "the prompt has {} tokens and the conversation already holds {}; the context is {max} tokens (a longer max_context, or a bounded cache with a KV budget)",
                prompt.len(),
                self.tokens.len()
            );
        }
        let vocab = self.engine.model.config.vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            bail_kind!(
                ErrorKind::InvalidOptions,
                "prompt token id {bad} is outside the model's vocabulary of {vocab} tokens"
            );
        }
        Ok(max)
    }

    /// Feeds the prompt in chunks, so that a cancel is seen between them;
    /// only the last one samples. What was fed stays in the history.
    /// Returns the first sampled token, or (cancelled) how many prompt
    /// tokens were fed.
    fn feed_prompt(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> anyhow::Result<std::result::Result<u32, usize>> {
        if self.cancel.is_cancelled() {
            return Ok(Err(0));
        }
        let seen: Vec<u32> = self.tokens.iter().chain(prompt).copied().collect();
        self.engine.reset_seen(&seen);
        let chunk = self.engine.opts.max_tokens.max(1);
        let mut next = None;
        for (i, piece) in prompt.chunks(chunk).enumerate() {
            if self.cancel.is_cancelled() {
                return Ok(Err(i * chunk));
            }
            let last = (i + 1) * chunk >= prompt.len();
            let out = if last {
                self.set_allowed()?;
                self.steps += 1;
                FeedOutput::Sample(opts.sampling, self.steps)
            } else {
                FeedOutput::None
            };
            let first = self.tokens.len() as u32;
            next = self
                .cache
                .feed(&mut self.engine, piece, first, out, |_, _| Ok(()))?;
            self.tokens.extend_from_slice(piece);
            if let Some(progress) = &opts.on_prompt {
                progress.report((i * chunk + piece.len()).min(prompt.len()), prompt.len());
            }
        }
        self.next_logprobs = self.engine.take_logprobs();
        Ok(Ok(next.expect("a sampling feed returns a token")))
    }

    /// Why the generation ends before emitting `next`, if it does.
    fn end_before(
        &self,
        next: u32,
        emitted: usize,
        opts: &GenerateOptions,
        max: Option<usize>,
    ) -> Option<StopReason> {
        if emitted >= opts.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if opts.stop_at_eos && self.tokenizer.eos_ids.contains(&next) {
            Some(StopReason::Eos)
        } else if max.is_some_and(|m| self.tokens.len() >= m) {
            Some(StopReason::ContextFull)
        } else {
            None
        }
    }

    /// The decode loop after the prompt: emits `next`, feeds it, samples the
    /// one after, until a stop. Each emitted token is fed before the loop
    /// decides whether to go on, so the cache always holds exactly prompt +
    /// emitted ids; a sampled token that cannot be fed (full context, end of
    /// sequence) is not emitted. With steps submitted ahead, `ahead` is the
    /// step already feeding `next` (submitted before `next` was read back);
    /// it is undone when `next` is not emitted. A step that needs a refresh
    /// first waits for the one before (nothing is submitted ahead of a
    /// refresh). With a constraint, each step's sampling is submitted after
    /// its forward pass: the mask depends on `next`, and the host computes
    /// it while the GPU runs the layers.
    fn decode(
        &mut self,
        mut next: u32,
        opts: &GenerateOptions,
        max: Option<usize>,
        ids: &mut Vec<u32>,
        text: &mut StopText,
        on_text: &mut impl FnMut(&str) -> bool,
    ) -> anyhow::Result<StopReason> {
        let mut ahead: Option<Submitted> = None;
        let submit_ahead = opts.submit_ahead.enabled(&self.engine.model.gpu.profile);
        loop {
            if let Some(end) = self.end_before(next, ids.len(), opts, max) {
                self.undo_ahead(ahead.take())?;
                return Ok(end);
            }
            ids.push(next);
            if opts.logprobs.is_some() {
                let lp = self.next_logprobs.take().unwrap_or_default();
                self.emitted_logprobs.push(lp);
            }
            let stopped = match text.push(&self.tokenizer, next, on_text) {
                Ok(stopped) => stopped,
                Err(e) => return Err(self.fail_with_ahead(ahead.take(), e)),
            };
            let stopped = match self.constraint_complete_after(next) {
                Ok(complete) => stopped.or(complete),
                Err(e) => return Err(self.fail_with_ahead(ahead.take(), e)),
            };
            let pos = self.tokens.len() as u32;
            let mut fed = match ahead.take() {
                Some(step) => step,
                None => {
                    // Nothing is in flight: a full bounded cache refreshes
                    // here (with steps submitted ahead, those after this
                    // one are until it is full again).
                    self.cache.make_room(&mut self.engine, pos)?;
                    self.submit_step(StepIds::Host(&[next]), pos, opts.sampling)?
                }
            };
            if let Err(e) = self.submit_masked_sample(&mut fed) {
                if fed.sample_pending() {
                    return Err(self.fail_with_ahead(Some(fed), e));
                }
                // The mask failed and the step sampled freely: `next` was
                // emitted and stays fed (a step fed from the host cannot be
                // undone under a policy that keeps state), its choice dropped.
                if self.engine.complete(fed).is_ok() {
                    self.tokens.push(next);
                    let _ = self.cache.record_fed(&self.engine, next, pos);
                }
                return Err(e);
            }
            // The step after `fed`, feeding the token `fed` samples, unless
            // the generation is known to end before it.
            if submit_ahead
                && stopped.is_none()
                && !self.cancel.is_cancelled()
                && self.engine.can_chain()
                && self.cache.fits_without_refresh(&self.engine, 1)
                && ids.len() < opts.max_new_tokens
                && max.is_none_or(|m| self.tokens.len() + 1 < m)
            {
                match self.submit_step(StepIds::LastSampled, pos + 1, opts.sampling) {
                    Ok(step) => ahead = Some(step),
                    Err(e) => {
                        // `next` was emitted: it stays fed, as in `feed`.
                        if self.engine.complete(fed).is_ok() {
                            self.tokens.push(next);
                            let _ = self.cache.record_fed(&self.engine, next, pos);
                        }
                        return Err(e);
                    }
                }
            }
            let sampled = match self.engine.complete(fed) {
                Ok(t) => t.expect("a sampling step returns a token"),
                Err(e) => return Err(self.fail_with_ahead(ahead.take(), e)),
            };
            self.next_logprobs = self.engine.take_logprobs();
            self.tokens.push(next);
            if let Err(e) = self.cache.record_fed(&self.engine, next, pos) {
                return Err(self.fail_with_ahead(ahead.take(), e));
            }
            next = sampled;
            if let Some(stop) = stopped {
                return Ok(stop);
            }
            if self.cancel.is_cancelled() {
                self.undo_ahead(ahead.take())?;
                return Ok(StopReason::Cancelled);
            }
        }
    }

    /// Submits a one-token decode step at `pos` that samples, with its
    /// sampling counter; a constrained one leaves its sampling for
    /// `submit_masked_sample`.
    fn submit_step(
        &mut self,
        ids: StepIds,
        pos: u32,
        sampling: SamplingParams,
    ) -> anyhow::Result<Submitted> {
        self.steps += 1;
        let out = FeedOutput::Sample(sampling, self.steps).step_output(1);
        let submitted = match self.constraint {
            Some(_) => self.engine.submit_forward(ids, &[pos], out),
            None => self.engine.submit(ids, &[pos], out),
        };
        submitted.inspect_err(|_| self.steps -= 1)
    }

    /// Submits a constrained step's sampling with the mask of the tokens it
    /// may choose (nothing to do without a constraint). When the mask
    /// fails, the step samples from every token and the error is returned
    /// after it was submitted.
    fn submit_masked_sample(&mut self, step: &mut Submitted) -> anyhow::Result<()> {
        if self.constraint.is_none() {
            return Ok(());
        }
        let masked = self.set_allowed();
        if masked.is_err() {
            self.engine.set_allowed(None)?;
        }
        crate::engine::submit_samples(&mut [(&mut self.engine, step)])?;
        masked
    }

    /// Sets the tokens the next sampling step may choose: the constraint's
    /// mask, or every token (no constraint, or one that is complete and
    /// whose generation ends after this step).
    fn set_allowed(&mut self) -> anyhow::Result<()> {
        let mask = match self.constraint.as_mut() {
            Some(c) => c.next_mask()?,
            None => None,
        };
        self.engine.set_allowed(mask.as_deref())
    }

    /// Feeds an emitted token to the constraint; whether that completed it.
    fn constraint_complete_after(&mut self, token: u32) -> anyhow::Result<Option<StopReason>> {
        let Some(c) = self.constraint.as_mut() else {
            return Ok(None);
        };
        c.accept(token)?;
        Ok(c.is_complete().then_some(StopReason::ConstraintComplete))
    }
}

/// The text of a generation as it streams: pieces are decoded token by
/// token, cut before the first stop string, and a tail that could still
/// become one is held back.
pub(crate) struct StopText {
    decoder: StreamDecoder,
    stop_strings: Vec<String>,
    /// The longest stop string's length in bytes.
    hold: usize,
    /// Decoded text not yet passed on.
    pending: String,
    /// Everything passed on.
    text: String,
}

impl StopText {
    pub(crate) fn new(stop_strings: &[String]) -> Self {
        StopText {
            decoder: StreamDecoder::new(),
            stop_strings: stop_strings.to_vec(),
            hold: stop_strings.iter().map(|s| s.len()).max().unwrap_or(0),
            pending: String::new(),
            text: String::new(),
        }
    }

    /// Adds an emitted token; passes on what is safe. Returns the reason to
    /// stop after this token: a stop string reached, or the callback
    /// returned false.
    pub(crate) fn push(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
        on_text: &mut impl FnMut(&str) -> bool,
    ) -> anyhow::Result<Option<StopReason>> {
        self.pending.push_str(&self.decoder.push(tokenizer, id)?);
        let pending = &mut self.pending;
        if let Some(cut) = self
            .stop_strings
            .iter()
            .filter_map(|s| pending.find(s.as_str()))
            .min()
        {
            pending.truncate(cut);
            self.text.push_str(pending);
            on_text(pending);
            pending.clear();
            return Ok(Some(StopReason::StopString));
        }
        let mut safe = pending.len().saturating_sub(self.hold.saturating_sub(1));
        while !pending.is_char_boundary(safe) {
            safe -= 1;
        }
        if safe > 0 {
            let emit: String = pending.drain(..safe).collect();
            self.text.push_str(&emit);
            if !on_text(&emit) {
                return Ok(Some(StopReason::Cancelled));
            }
        }
        Ok(None)
    }

    /// Passes on the held-back tail (none after a stop string) and returns
    /// the whole text.
    pub(crate) fn finish(
        mut self,
        stop: StopReason,
        on_text: &mut impl FnMut(&str) -> bool,
    ) -> String {
        if stop != StopReason::StopString && !self.pending.is_empty() {
            self.text.push_str(&self.pending);
            on_text(&self.pending);
        }
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_ahead_auto_is_off_on_a_cpu_driver_only() {
        let device = |cpu| DeviceProfile::for_tests(cpu, false, false);
        let (cpu, gpu) = (device(true), device(false));
        assert!(!SubmitAhead::Auto.enabled(&cpu));
        assert!(SubmitAhead::Auto.enabled(&gpu));
        for d in [&cpu, &gpu] {
            assert!(SubmitAhead::Always.enabled(d));
            assert!(!SubmitAhead::Never.enabled(d));
        }
    }
}
