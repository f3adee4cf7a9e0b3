//! sieve's C API: load a model, hold conversations on it (each with its own
//! KV cache, bounded or not), stream answers through a callback that can
//! stop them, cancel from another thread, tokenize, read logits.
//!
//! Conventions (docs/C.md), the same for every function:
//! * Every fallible function returns a [`sieve_status`]; `SIEVE_OK` is 0.
//!   On an error, [`sieve_last_error`] gives the message on the calling
//!   thread (naming the option, file or limit) until its next failing call.
//! * Handles are opaque. `*_free` takes the address of the handle, frees it
//!   and sets it to NULL, so freeing twice through the same variable does
//!   nothing; NULL is accepted everywhere a handle is freed.
//! * Options come as structs filled by their `*_default()` functions; a
//!   NULL options pointer means the defaults. Strings are UTF-8, NUL
//!   terminated; an option string sieve does not know is refused
//!   (`SIEVE_ERROR_INVALID_OPTIONS`), never ignored.
//! * Output buffers are the caller's, with their capacity; the size needed
//!   is always written, and a buffer too small gives
//!   `SIEVE_ERROR_BUFFER_TOO_SMALL` with nothing else written.
//! * No Rust panic crosses into C: a bug inside a function that returns a
//!   status comes back as `SIEVE_ERROR_INTERNAL`; the `*_free` functions
//!   catch one too.
//! * The piece callback runs on the calling thread while the session is
//!   locked: from it, only `sieve_cancel` and `sieve_cancel_reset` may be
//!   called on that session (anything else on it waits forever), and it
//!   must return normally (no longjmp, no C++ exception).
//!
//! A `sieve_llm` may be shared by threads (sessions, tokenize, logits
//! concurrently); it must not be freed while another thread uses it. A `sieve_session` is one conversation: calls on it are
//! serialized, except [`sieve_cancel`], meant for another thread. A
//! session keeps the model alive: the `sieve_llm` may be freed first.

#![allow(non_camel_case_types)]
// Every pointer argument is checked for NULL, and documented as it must
// otherwise be valid; the functions are `extern "C"` entry points, not
// Rust API, so they are not marked `unsafe` (cbindgen's convention).
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{Arc, Mutex};

use sieve::session::Session;
use sieve::tokenizer::Tokenizer;
use sieve::{
    CacheOptions, CancelToken, ErrorKind, GenerateOptions, Llm, LoadOptions, Policy, Progress,
    SamplingParams, SessionOptions, StopReason,
};

/// What a call did: `SIEVE_OK` (0) or why it failed.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum sieve_status {
    SIEVE_OK = 0,
    /// A NULL pointer where a value is needed, or a string that is not
    /// UTF-8.
    SIEVE_ERROR_INVALID_ARGUMENT = 1,
    /// An output buffer smaller than the result; the size needed was
    /// written.
    SIEVE_ERROR_BUFFER_TOO_SMALL = 2,
    /// The model file or folder: missing, malformed or unsupported.
    SIEVE_ERROR_MODEL_LOADING = 3,
    /// Options out of range, inconsistent, or a value sieve does not know.
    SIEVE_ERROR_INVALID_OPTIONS = 4,
    /// The prompt does not fit the context that is left.
    SIEVE_ERROR_PROMPT_TOO_LONG = 5,
    /// The device cannot hold the buffers.
    SIEVE_ERROR_GPU_OUT_OF_MEMORY = 6,
    /// No usable adapter, or the device failed.
    SIEVE_ERROR_GPU = 7,
    /// The model's chat template is missing or does not render.
    SIEVE_ERROR_TEMPLATE = 8,
    /// Reading or writing a file.
    SIEVE_ERROR_IO = 9,
    /// The model produced NaN or infinite logits; the session starts over
    /// on its next chat.
    SIEVE_ERROR_NON_FINITE_LOGITS = 10,
    /// An earlier error left the session out of step: call
    /// `sieve_session_reset`.
    SIEVE_ERROR_NEEDS_RESET = 11,
    /// A bug in sieve (a panic caught at the boundary); the message says
    /// where. The handle it happened on should be freed.
    SIEVE_ERROR_INTERNAL = 12,
}

/// Why a generation ended.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum sieve_stop_reason {
    /// The model ended its answer (end-of-sequence token).
    SIEVE_STOP_EOS = 0,
    /// The text reached one of the stop strings (cut before it).
    SIEVE_STOP_STRING = 1,
    /// `max_tokens` were generated.
    SIEVE_STOP_MAX_TOKENS = 2,
    /// The callback returned false, or `sieve_cancel` was called.
    SIEVE_STOP_CANCELLED = 3,
    /// A full cache of `max_context` entries is full (a bounded cache
    /// never fills).
    SIEVE_STOP_CONTEXT_FULL = 4,
}

/// A model and its tokenizer on the GPU.
pub struct sieve_llm {
    llm: Llm,
}

/// A conversation on a model: its history and its own KV cache.
pub struct sieve_session {
    /// Set by `sieve_cancel` without taking the lock a running chat holds.
    cancel: CancelToken,
    tokenizer: Arc<Tokenizer>,
    inner: Mutex<Session>,
}

/// Called while the weights upload: `done` of `total` tensor groups.
pub type sieve_progress_fn =
    Option<extern "C" fn(done: usize, total: usize, user_data: *mut c_void)>;

/// Called with each piece of generated text as it is decoded: `piece` holds
/// `len` bytes of UTF-8 and a NUL after them, valid during the call.
/// Return true to go on, false to stop the generation (its reason is then
/// `SIEVE_STOP_CANCELLED`).
pub type sieve_piece_fn =
    Option<extern "C" fn(piece: *const c_char, len: usize, user_data: *mut c_void) -> bool>;

/// How `sieve_llm_load` loads a model. Strings may be NULL (the default).
#[repr(C)]
pub struct sieve_load_options {
    /// Storage format of the weight matrices on the GPU: "auto" (a GGUF
    /// file's own types where sieve has a layout for them, else f16),
    /// "f16", "f32", "q8_0", "q4_0", ... (as `sieve run --dtype`).
    pub dtype: *const c_char,
    /// Storage format of the KV cache: "f32" (default) or "f16".
    pub kv_dtype: *const c_char,
    /// Graphics backend: "vulkan", "metal", "dx12" or "gl" (default: any).
    pub backend: *const c_char,
    /// The adapter whose name contains this text (default: the first).
    pub adapter: *const c_char,
    /// Kernel set: "auto", "cpu", "gpu" or "tuned".
    pub kernels: *const c_char,
    /// Called as the weights upload, on the loading thread; may be NULL.
    pub progress: sieve_progress_fn,
    pub progress_user_data: *mut c_void,
}

/// A conversation's context and KV cache.
#[repr(C)]
pub struct sieve_session_options {
    /// Longest context (prompt and answers) of a full cache; 0 = the
    /// model's, at most 8192. Only for the full cache: with a policy it
    /// must be 0.
    pub max_context: usize,
    /// Eviction policy of a bounded cache ("window", "tova", "epikv",
    /// "snapkv", "expected-attention", ...; docs/POLICIES.md), or NULL /
    /// "full" for the full cache.
    pub policy: *const c_char,
    /// Entries the bounded cache keeps at each refresh (J).
    pub budget: usize,
    /// Tokens between refreshes (h); the cache holds at most budget +
    /// chunk entries.
    pub chunk: usize,
    /// Entries at the first positions never evicted.
    pub sinks: usize,
    /// Newest entries never evicted.
    pub recent: usize,
}

/// What a chat generates.
#[repr(C)]
pub struct sieve_generate_options {
    /// At most this many tokens.
    pub max_tokens: usize,
    /// 0 is greedy (the default).
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1 disables top-p.
    pub top_p: f32,
    /// Seed of the sampler.
    pub seed: u64,
    /// `n_stop` strings the answer stops before (not emitted); may be NULL
    /// when `n_stop` is 0.
    pub stop: *const *const c_char,
    pub n_stop: usize,
    /// Go on past the model's end-of-sequence token.
    pub ignore_eos: bool,
}

/// Counts and timings of one generation.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct sieve_generation_stats {
    /// Tokens of the prompt fed by this call.
    pub prompt_tokens: usize,
    /// Tokens emitted.
    pub generated_tokens: usize,
    /// Seconds to feed the prompt and sample the first token.
    pub prefill_seconds: f64,
    /// Seconds for the rest.
    pub decode_seconds: f64,
    pub stop: sieve_stop_reason,
}

/// A failure: its status and message.
struct Fail(sieve_status, String);

type Outcome = Result<(), Fail>;

impl From<sieve::Error> for Fail {
    fn from(e: sieve::Error) -> Self {
        let status = match e.kind() {
            ErrorKind::ModelLoading => sieve_status::SIEVE_ERROR_MODEL_LOADING,
            ErrorKind::InvalidOptions | ErrorKind::InvalidConstraint => {
                sieve_status::SIEVE_ERROR_INVALID_OPTIONS
            }
            ErrorKind::PromptTooLong => sieve_status::SIEVE_ERROR_PROMPT_TOO_LONG,
            ErrorKind::GpuOutOfMemory => sieve_status::SIEVE_ERROR_GPU_OUT_OF_MEMORY,
            ErrorKind::Gpu => sieve_status::SIEVE_ERROR_GPU,
            ErrorKind::Template => sieve_status::SIEVE_ERROR_TEMPLATE,
            ErrorKind::Io => sieve_status::SIEVE_ERROR_IO,
            ErrorKind::NonFiniteLogits => sieve_status::SIEVE_ERROR_NON_FINITE_LOGITS,
            ErrorKind::NeedsReset => sieve_status::SIEVE_ERROR_NEEDS_RESET,
            _ => sieve_status::SIEVE_ERROR_INTERNAL,
        };
        Fail(status, e.to_string())
    }
}

fn invalid_argument(msg: impl Into<String>) -> Fail {
    Fail(sieve_status::SIEVE_ERROR_INVALID_ARGUMENT, msg.into())
}

fn invalid_options(msg: impl Into<String>) -> Fail {
    Fail(sieve_status::SIEVE_ERROR_INVALID_OPTIONS, msg.into())
}

thread_local! {
    /// The message of this thread's last failed call.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Runs an entry point's body: its status, the message kept for
/// `sieve_last_error`, and a panic caught before it reaches C.
fn run(body: impl FnOnce() -> Outcome) -> sieve_status {
    let outcome = catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Fail(
            sieve_status::SIEVE_ERROR_INTERNAL,
            format!("internal error in sieve (please report): {what}"),
        ))
    });
    match outcome {
        Ok(()) => sieve_status::SIEVE_OK,
        Err(Fail(status, msg)) => {
            // An interior NUL cannot end the message early in C.
            let msg = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
            LAST_ERROR.with(|e| *e.borrow_mut() = msg);
            status
        }
    }
}

/// `p` as a reference, or an error naming the argument.
fn arg<'a, T>(p: *const T, name: &str) -> Result<&'a T, Fail> {
    // SAFETY: the caller passes NULL or a valid pointer (the API's contract).
    unsafe { p.as_ref() }.ok_or_else(|| invalid_argument(format!("{name} is NULL")))
}

/// A NUL-terminated UTF-8 argument; NULL is an error naming it.
fn utf8<'a>(p: *const c_char, name: &str) -> Result<&'a str, Fail> {
    optional_utf8(p, name)?.ok_or_else(|| invalid_argument(format!("{name} is NULL")))
}

/// A NUL-terminated UTF-8 argument that may be NULL.
fn optional_utf8<'a>(p: *const c_char, name: &str) -> Result<Option<&'a str>, Fail> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: a non-NULL string argument is NUL terminated (the contract).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| invalid_argument(format!("{name} is not UTF-8")))
}

/// `n` values at `p`; NULL is allowed only when `n` is 0.
fn slice<'a, T>(p: *const T, n: usize, name: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid_argument(format!(
            "{name} is NULL and its length {n}"
        )));
    }
    // SAFETY: the caller's buffer holds n values (the contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Copies `values` into the caller's buffer of `capacity` after writing
/// the count needed to `needed`.
fn write_out<T: Copy>(
    values: &[T],
    out: *mut T,
    capacity: usize,
    needed: *mut usize,
    what: &str,
) -> Outcome {
    if !needed.is_null() {
        // SAFETY: a non-NULL count pointer is valid (the contract).
        unsafe { *needed = values.len() };
    }
    if values.len() > capacity {
        return Err(Fail(
            sieve_status::SIEVE_ERROR_BUFFER_TOO_SMALL,
            format!(
                "{what}: {} values do not fit a buffer of {capacity}",
                values.len()
            ),
        ));
    }
    if !values.is_empty() {
        if out.is_null() {
            return Err(invalid_argument(format!(
                "{what}: the output buffer is NULL"
            )));
        }
        // SAFETY: the caller's buffer holds `capacity` >= len values.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
    }
    Ok(())
}

/// Stores a new handle in `*out`.
fn give<T>(out: *mut *mut T, value: T) {
    // SAFETY: `out` was checked non-NULL by the caller of `give`.
    unsafe { *out = Box::into_raw(Box::new(value)) };
}

/// Frees the handle at `*handle` and sets it to NULL; a panic while
/// dropping it is caught (the handle is gone either way).
fn take<T>(handle: *mut *mut T) {
    if handle.is_null() {
        return;
    }
    // SAFETY: `*handle` is NULL or a handle this library made and has not
    // freed (freeing sets it to NULL).
    let p = unsafe { std::mem::replace(&mut *handle, std::ptr::null_mut()) };
    if !p.is_null() {
        // SAFETY: `p` came from `Box::into_raw` in `give`.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(p) })));
    }
}

/// The user's pointer, carried into the progress closure (called on the
/// loading thread only).
struct UserData(*mut c_void);
// SAFETY: the pointer is only handed back to the caller's own callback.
unsafe impl Send for UserData {}
unsafe impl Sync for UserData {}

impl UserData {
    fn get(&self) -> *mut c_void {
        self.0
    }
}

/// sieve's version, "MAJOR.MINOR.PATCH" (static storage).
#[no_mangle]
pub extern "C" fn sieve_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of the calling thread's last failed call ("" if none). Valid
/// until that thread's next failing call.
#[no_mangle]
pub extern "C" fn sieve_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The default load options: every string NULL, no progress callback.
#[no_mangle]
pub extern "C" fn sieve_load_options_default() -> sieve_load_options {
    sieve_load_options {
        dtype: std::ptr::null(),
        kv_dtype: std::ptr::null(),
        backend: std::ptr::null(),
        adapter: std::ptr::null(),
        kernels: std::ptr::null(),
        progress: None,
        progress_user_data: std::ptr::null_mut(),
    }
}

/// The default session options: a full cache of the model's context (at
/// most 8192); for a bounded cache set `policy` and `budget` (chunk 64,
/// sinks 4 and recent 64, as `sieve run`).
#[no_mangle]
pub extern "C" fn sieve_session_options_default() -> sieve_session_options {
    sieve_session_options {
        max_context: 0,
        policy: std::ptr::null(),
        budget: 0,
        chunk: 64,
        sinks: 4,
        recent: 64,
    }
}

/// The default generate options: greedy, at most 256 tokens, stopping at
/// the model's end of sequence.
#[no_mangle]
pub extern "C" fn sieve_generate_options_default() -> sieve_generate_options {
    sieve_generate_options {
        max_tokens: 256,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        stop: std::ptr::null(),
        n_stop: 0,
        ignore_eos: false,
    }
}

fn load_options(o: &sieve_load_options) -> Result<LoadOptions, Fail> {
    let mut opts = LoadOptions::from_names(
        optional_utf8(o.dtype, "dtype")?,
        optional_utf8(o.kv_dtype, "kv_dtype")?,
        optional_utf8(o.kernels, "kernels")?,
        optional_utf8(o.backend, "backend")?,
        optional_utf8(o.adapter, "adapter")?,
    )?;
    opts.progress = o.progress.map(|f| {
        let data = UserData(o.progress_user_data);
        // `data` whole, not its field (a closure captures just the field).
        Progress::new(move |done, total| f(done, total, data.get()))
    });
    Ok(opts)
}

/// Loads a model: a Hugging Face folder (config.json, safetensors weights,
/// tokenizer.json) or a GGUF file. `options` may be NULL. On success
/// `*llm` holds the model; free it with `sieve_llm_free`.
#[no_mangle]
pub extern "C" fn sieve_llm_load(
    path: *const c_char,
    options: *const sieve_load_options,
    llm: *mut *mut sieve_llm,
) -> sieve_status {
    run(|| {
        if llm.is_null() {
            return Err(invalid_argument("llm (the output handle) is NULL"));
        }
        let path = utf8(path, "path")?;
        let defaults = sieve_load_options_default();
        // SAFETY: NULL or a valid options struct (the contract).
        let options = unsafe { options.as_ref() }.unwrap_or(&defaults);
        let opts = load_options(options)?;
        let loaded = Llm::load(Path::new(path), &opts)?;
        give(llm, sieve_llm { llm: loaded });
        Ok(())
    })
}

/// Frees a model and sets `*llm` to NULL; sessions made from it stay
/// usable. NULL and `*llm == NULL` do nothing.
#[no_mangle]
pub extern "C" fn sieve_llm_free(llm: *mut *mut sieve_llm) {
    take(llm);
}

/// The model's vocabulary size: the length of `sieve_logits`' output.
#[no_mangle]
pub extern "C" fn sieve_llm_vocab_size(llm: *const sieve_llm) -> usize {
    // SAFETY: NULL or a valid handle (the contract).
    unsafe { llm.as_ref() }.map_or(0, |l| l.llm.model.config.vocab_size)
}

/// The bounded cache `o` asks for, None for the full cache.
fn cache_options(o: &sieve_session_options) -> Result<Option<CacheOptions>, Fail> {
    let policy = match optional_utf8(o.policy, "policy")? {
        None => Policy::Full,
        Some(name) => Policy::parse(name).map_err(|e| invalid_options(format!("policy: {e:#}")))?,
    };
    if policy == Policy::Full {
        if o.budget != 0 {
            return Err(invalid_options(
                "budget is set but policy is full (NULL), which never evicts: name a policy",
            ));
        }
        return Ok(None);
    }
    if o.max_context != 0 {
        return Err(invalid_options(
            "max_context sizes the full cache; a bounded cache holds budget + chunk entries",
        ));
    }
    if o.budget == 0 {
        return Err(invalid_options(format!(
            "policy {} needs a budget (entries kept)",
            policy.name()
        )));
    }
    let opts = CacheOptions {
        sinks: o.sinks,
        recent: o.recent,
        ..CacheOptions::new(policy, o.budget, o.chunk)
    };
    opts.validate()
        .map_err(|e| invalid_options(format!("{e:#}")))?;
    Ok(Some(opts))
}

/// Opens a conversation on `llm` with its own KV cache. `options` may be
/// NULL (a full cache). Free it with `sieve_session_free`.
#[no_mangle]
pub extern "C" fn sieve_session_new(
    llm: *const sieve_llm,
    options: *const sieve_session_options,
    session: *mut *mut sieve_session,
) -> sieve_status {
    run(|| {
        if session.is_null() {
            return Err(invalid_argument("session (the output handle) is NULL"));
        }
        let llm = &arg(llm, "llm")?.llm;
        let defaults = sieve_session_options_default();
        // SAFETY: NULL or a valid options struct (the contract).
        let o = unsafe { options.as_ref() }.unwrap_or(&defaults);
        let s = llm.session(SessionOptions {
            max_context: o.max_context,
            cache: cache_options(o)?,
            ..Default::default()
        })?;
        give(
            session,
            sieve_session {
                cancel: s.cancel_token(),
                tokenizer: llm.tokenizer.clone(),
                inner: Mutex::new(s),
            },
        );
        Ok(())
    })
}

/// Frees a session and sets `*session` to NULL. No call may be running on
/// it. NULL and `*session == NULL` do nothing.
#[no_mangle]
pub extern "C" fn sieve_session_free(session: *mut *mut sieve_session) {
    take(session);
}

/// Forgets the conversation (history and cache); the session's options
/// stay.
#[no_mangle]
pub extern "C" fn sieve_session_reset(session: *const sieve_session) -> sieve_status {
    run(|| {
        lock(arg(session, "session")?)?.reset();
        Ok(())
    })
}

/// Stops the session's running generation from any thread, at the next
/// token or prompt chunk. It stays set, so every later chat on the session
/// stops at once (`SIEVE_STOP_CANCELLED`) until `sieve_cancel_reset`: a
/// cancel made just before a chat starts is not lost.
#[no_mangle]
pub extern "C" fn sieve_cancel(session: *const sieve_session) -> sieve_status {
    run(|| {
        arg(session, "session")?.cancel.cancel();
        Ok(())
    })
}

/// Clears `sieve_cancel`, so the next chat runs.
#[no_mangle]
pub extern "C" fn sieve_cancel_reset(session: *const sieve_session) -> sieve_status {
    run(|| {
        arg(session, "session")?.cancel.reset();
        Ok(())
    })
}

fn lock(s: &sieve_session) -> Result<std::sync::MutexGuard<'_, Session>, Fail> {
    // A panic inside an earlier call poisons the lock: say so, don't panic.
    s.inner.lock().map_err(|_| {
        Fail(
            sieve_status::SIEVE_ERROR_INTERNAL,
            "the session failed inside an earlier call; free it".into(),
        )
    })
}

fn generate_options(o: &sieve_generate_options) -> Result<GenerateOptions, Fail> {
    let stop = slice(o.stop, o.n_stop, "stop")?
        .iter()
        .enumerate()
        .map(|(i, &p)| utf8(p, &format!("stop[{i}]")).map(str::to_string))
        .collect::<Result<Vec<_>, _>>()?;
    for (name, value, ok) in [
        ("temperature", o.temperature, o.temperature >= 0.0),
        ("top_p", o.top_p, o.top_p > 0.0 && o.top_p <= 1.0),
    ] {
        if !ok {
            return Err(invalid_options(format!("{name} {value} is out of range")));
        }
    }
    Ok(GenerateOptions {
        max_new_tokens: o.max_tokens,
        sampling: SamplingParams {
            temperature: o.temperature,
            top_k: o.top_k,
            top_p: o.top_p,
            seed: o.seed,
            ..SamplingParams::GREEDY
        },
        stop_strings: stop,
        stop_at_eos: !o.ignore_eos,
        ..Default::default()
    })
}

fn stop_reason(s: StopReason) -> sieve_stop_reason {
    match s {
        StopReason::Eos | StopReason::ConstraintComplete => sieve_stop_reason::SIEVE_STOP_EOS,
        StopReason::StopString => sieve_stop_reason::SIEVE_STOP_STRING,
        StopReason::MaxTokens => sieve_stop_reason::SIEVE_STOP_MAX_TOKENS,
        StopReason::Cancelled => sieve_stop_reason::SIEVE_STOP_CANCELLED,
        StopReason::ContextFull => sieve_stop_reason::SIEVE_STOP_CONTEXT_FULL,
    }
}

/// How a chat or completion runs: its options, callback and statistics.
struct Turn {
    options: GenerateOptions,
    callback: sieve_piece_fn,
    user_data: *mut c_void,
    stats: *mut sieve_generation_stats,
}

impl Turn {
    fn new(
        options: *const sieve_generate_options,
        callback: sieve_piece_fn,
        user_data: *mut c_void,
        stats: *mut sieve_generation_stats,
    ) -> Result<Self, Fail> {
        let defaults = sieve_generate_options_default();
        // SAFETY: NULL or a valid options struct (the contract).
        let o = unsafe { options.as_ref() }.unwrap_or(&defaults);
        Ok(Turn {
            options: generate_options(o)?,
            callback,
            user_data,
            stats,
        })
    }

    /// The piece handed to C: its bytes and a NUL.
    fn emit(&self, piece: &str, buffer: &mut Vec<u8>) -> bool {
        let Some(f) = self.callback else {
            return true;
        };
        buffer.clear();
        buffer.extend_from_slice(piece.as_bytes());
        buffer.push(0);
        f(buffer.as_ptr().cast(), piece.len(), self.user_data)
    }

    fn report(&self, g: &sieve::Generation) {
        if self.stats.is_null() {
            return;
        }
        // SAFETY: a non-NULL stats pointer is valid (the contract).
        unsafe {
            *self.stats = sieve_generation_stats {
                prompt_tokens: g.stats.prompt_tokens,
                generated_tokens: g.stats.generated_tokens,
                prefill_seconds: g.stats.prefill_seconds,
                decode_seconds: g.stats.decode_seconds,
                stop: stop_reason(g.stats.stop),
            }
        };
    }
}

/// One turn of the conversation: `message` as the user's, rendered with
/// the model's chat template after the history, the answer streamed to
/// `callback` (may be NULL) piece by piece and added to the history.
/// `options` and `stats` may be NULL.
#[no_mangle]
pub extern "C" fn sieve_session_chat(
    session: *const sieve_session,
    message: *const c_char,
    options: *const sieve_generate_options,
    callback: sieve_piece_fn,
    user_data: *mut c_void,
    stats: *mut sieve_generation_stats,
) -> sieve_status {
    run(|| {
        let s = arg(session, "session")?;
        let message = utf8(message, "message")?;
        let turn = Turn::new(options, callback, user_data, stats)?;
        let mut buffer = vec![];
        let g = lock(s)?.chat(message, &turn.options, |piece| {
            turn.emit(piece, &mut buffer)
        })?;
        turn.report(&g);
        Ok(())
    })
}

/// Continues the session's text with `prompt` as it is (no chat
/// template; a base model's completion), streaming the continuation as
/// `sieve_session_chat` does.
#[no_mangle]
pub extern "C" fn sieve_session_complete(
    session: *const sieve_session,
    prompt: *const c_char,
    options: *const sieve_generate_options,
    callback: sieve_piece_fn,
    user_data: *mut c_void,
    stats: *mut sieve_generation_stats,
) -> sieve_status {
    run(|| {
        let s = arg(session, "session")?;
        let prompt = utf8(prompt, "prompt")?;
        let turn = Turn::new(options, callback, user_data, stats)?;
        let mut inner = lock(s)?;
        let ids = if inner.tokens().is_empty() {
            s.tokenizer.encode(prompt)
        } else {
            s.tokenizer.encode_continuation(prompt)
        }
        .map_err(|e| invalid_argument(format!("prompt: {e:#}")))?;
        let mut buffer = vec![];
        let g = inner.generate(&ids, &turn.options, |piece| turn.emit(piece, &mut buffer))?;
        turn.report(&g);
        Ok(())
    })
}

/// The token ids of `text` (no chat template; a BOS token where the
/// tokenizer asks for one) into `ids`, which holds `capacity`; `*n_ids`
/// gets the count. `ids` may be NULL with `capacity` 0 to ask the count.
#[no_mangle]
pub extern "C" fn sieve_tokenize(
    llm: *const sieve_llm,
    text: *const c_char,
    ids: *mut u32,
    capacity: usize,
    n_ids: *mut usize,
) -> sieve_status {
    run(|| {
        let llm = &arg(llm, "llm")?.llm;
        let t = utf8(text, "text")?;
        let out = llm
            .tokenizer
            .encode(t)
            .map_err(|e| invalid_argument(format!("text: {e:#}")))?;
        write_out(&out, ids, capacity, n_ids, "sieve_tokenize")
    })
}

/// The text of `n_ids` token ids into `text`, which holds `capacity` bytes:
/// UTF-8 and a NUL; `*len` gets the length without the NUL, so the
/// capacity needed is `*len + 1`.
#[no_mangle]
pub extern "C" fn sieve_detokenize(
    llm: *const sieve_llm,
    ids: *const u32,
    n_ids: usize,
    text: *mut c_char,
    capacity: usize,
    len: *mut usize,
) -> sieve_status {
    run(|| {
        let llm = &arg(llm, "llm")?.llm;
        let ids = slice(ids, n_ids, "ids")?;
        let vocab = llm.model.config.vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(invalid_options(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let s = llm
            .tokenizer
            .decode(ids)
            .map_err(|e| invalid_options(format!("{e:#}")))?;
        let mut bytes = s.into_bytes();
        if !len.is_null() {
            // SAFETY: a non-NULL length pointer is valid (the contract).
            unsafe { *len = bytes.len() };
        }
        bytes.push(0);
        write_out(
            &bytes,
            text.cast::<u8>(),
            capacity,
            std::ptr::null_mut(),
            "sieve_detokenize",
        )
    })
}

/// Float32 logits of the last of `n_ids` token ids, fed from position 0
/// through a fresh cache (`cache` NULL: the full cache; else a bounded one
/// as a session's options describe it), as `sieve logits` computes them:
/// `sieve_llm_vocab_size` values into `logits`, which holds `capacity`.
#[no_mangle]
pub extern "C" fn sieve_logits(
    llm: *const sieve_llm,
    ids: *const u32,
    n_ids: usize,
    cache: *const sieve_session_options,
    logits: *mut f32,
    capacity: usize,
    n_logits: *mut usize,
) -> sieve_status {
    run(|| {
        let llm = &arg(llm, "llm")?.llm;
        let ids = slice(ids, n_ids, "ids")?;
        // SAFETY: NULL or a valid options struct (the contract).
        let cache = match unsafe { cache.as_ref() } {
            Some(o) => cache_options(o)?,
            None => None,
        };
        let vocab = llm.model.config.vocab_size;
        if logits.is_null() && capacity > 0 {
            return Err(invalid_argument("logits is NULL and its capacity not 0"));
        }
        if capacity < vocab {
            // Refused before the model runs.
            return write_out(
                &vec![0f32; vocab],
                logits,
                capacity,
                n_logits,
                "sieve_logits",
            );
        }
        let values = llm.logits(ids, cache)?;
        write_out(&values, logits, capacity, n_logits, "sieve_logits")
    })
}
