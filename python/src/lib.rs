//! `sieve._sieve`: the extension module under sieve's Python package
//! (python/sieve). It holds the mechanism: loading, token ids, logits as
//! numpy arrays, generation with the GIL released, streams on a worker
//! thread, sessions, the exceptions. The package's Python code gives it
//! its keyword arguments, presses and pipeline (docs/PYTHON.md).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use numpy::PyArray1;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyStopIteration};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use sieve::cache::{Granularity, RefreshRecord};
use sieve::scheduler::{jobs_that_fit, run_jobs};
use sieve::tokenizer::Message;
use sieve::{
    CacheOptions, CancelToken, ErrorKind, GenerateOptions, LoadOptions, Policy, Progress,
    SamplingParams, SessionOptions, StopReason,
};

create_exception!(
    sieve,
    SieveError,
    PyException,
    "Base class of sieve's errors."
);
create_exception!(
    sieve,
    BadModel,
    SieveError,
    "The model file or folder is missing, malformed or unsupported."
);
create_exception!(
    sieve,
    InvalidOptions,
    SieveError,
    "Options out of range, inconsistent, or a value sieve does not know."
);
create_exception!(
    sieve,
    PromptTooLong,
    SieveError,
    "The prompt does not fit the context that is left."
);
create_exception!(
    sieve,
    GpuOutOfMemory,
    SieveError,
    "The device cannot hold the buffers."
);
create_exception!(
    sieve,
    GpuError,
    SieveError,
    "No usable adapter, or the device failed."
);
create_exception!(
    sieve,
    TemplateError,
    SieveError,
    "The model's chat template is missing or does not render."
);
create_exception!(
    sieve,
    NonFiniteLogits,
    SieveError,
    "The model produced NaN or infinite logits."
);
create_exception!(
    sieve,
    NeedsReset,
    SieveError,
    "An earlier error left the session out of step: call reset()."
);

/// The Python exception of a library error.
fn py_err(e: sieve::Error) -> PyErr {
    let msg = e.to_string();
    match e.kind() {
        ErrorKind::ModelLoading => BadModel::new_err(msg),
        ErrorKind::InvalidOptions | ErrorKind::InvalidConstraint => InvalidOptions::new_err(msg),
        ErrorKind::PromptTooLong => PromptTooLong::new_err(msg),
        ErrorKind::GpuOutOfMemory => GpuOutOfMemory::new_err(msg),
        ErrorKind::Gpu => GpuError::new_err(msg),
        ErrorKind::Template => TemplateError::new_err(msg),
        ErrorKind::Io => pyo3::exceptions::PyOSError::new_err(msg),
        ErrorKind::NonFiniteLogits => NonFiniteLogits::new_err(msg),
        ErrorKind::NeedsReset => NeedsReset::new_err(msg),
        _ => SieveError::new_err(msg),
    }
}

fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidOptions::new_err(msg.into())
}

/// Reads the keys of `dict` into named slots, refusing a key no slot takes
/// (`what` names the dict in the error).
fn reject_unknown(dict: &Bound<'_, PyDict>, known: &[&str], what: &str) -> PyResult<()> {
    for key in dict.keys() {
        let key: String = key.extract()?;
        if !known.contains(&key.as_str()) {
            return Err(invalid(format!(
                "{what}: unknown option {key:?} (known: {})",
                known.join(", ")
            )));
        }
    }
    Ok(())
}

fn item<'py, T: for<'a> FromPyObject<'a, 'py>>(
    dict: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<Option<T>> {
    match dict.get_item(key)? {
        Some(v) if !v.is_none() => Ok(Some(v.extract::<T>().map_err(|e| {
            let e: PyErr = e.into();
            invalid(format!("{key}: {}", e.value(dict.py())))
        })?)),
        _ => Ok(None),
    }
}

/// A cache as the package's presses describe it (`Press._cache()`): a
/// policy with a budget, or with a compression ratio of the context.
#[derive(Clone, Copy)]
struct CacheSpec {
    opts: CacheOptions,
    ratio: Option<f64>,
}

const CACHE_KEYS: [&str; 13] = [
    "policy",
    "budget",
    "chunk",
    "compression_ratio",
    "sinks",
    "recent",
    "granularity",
    "seed",
    "lag_size",
    "window_size",
    "ea_window",
    "n_future_positions",
    "epikv_window",
];

fn cache_spec(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Option<CacheSpec>> {
    let Some(d) = dict else { return Ok(None) };
    reject_unknown(d, &CACHE_KEYS, "cache")?;
    let name: String = item(d, "policy")?.unwrap_or_else(|| "full".into());
    let policy = Policy::parse(&name).map_err(|e| invalid(format!("policy: {e:#}")))?;
    let budget: Option<usize> = item(d, "budget")?;
    let ratio: Option<f64> = item(d, "compression_ratio")?;
    if policy == Policy::Full {
        if budget.is_some() || ratio.is_some() {
            return Err(invalid(
                "the full cache never evicts: a budget or compression_ratio needs a policy",
            ));
        }
        return Ok(None);
    }
    if ratio.is_some() && d.get_item("chunk")?.is_some_and(|c| !c.is_none()) {
        return Err(invalid(
            "chunk: a compression_ratio cuts the context once, with no chunk to choose",
        ));
    }
    match (budget, ratio) {
        (Some(_), Some(_)) => {
            return Err(invalid("give a budget or a compression_ratio, not both"))
        }
        (None, None) => {
            return Err(invalid(format!(
                "policy {name} needs a budget or a compression_ratio"
            )))
        }
        _ => {}
    }
    let mut o = CacheOptions::new(policy, budget.unwrap_or(0), item(d, "chunk")?.unwrap_or(64));
    macro_rules! set {
        ($key:literal, $field:ident) => {
            if let Some(v) = item(d, $key)? {
                o.$field = v;
            }
        };
    }
    set!("sinks", sinks);
    set!("recent", recent);
    set!("seed", seed);
    set!("lag_size", lag_size);
    set!("window_size", snapkv_window);
    set!("ea_window", ea_window);
    set!("n_future_positions", ea_future);
    set!("epikv_window", epikv_window);
    if let Some(g) = item::<String>(d, "granularity")? {
        o.granularity = Granularity::parse(&g).map_err(|e| invalid(format!("{e:#}")))?;
    }
    if ratio.is_none() {
        o.validate().map_err(|e| invalid(format!("{e:#}")))?;
    }
    Ok(Some(CacheSpec { opts: o, ratio }))
}

impl CacheSpec {
    /// The cache of a prompt whose context is its first `n_context` ids
    /// and which is followed by `after` more (question and answer).
    fn options(&self, n_context: usize, after: usize) -> PyResult<CacheOptions> {
        match self.ratio {
            None => Ok(self.opts),
            Some(r) => self
                .opts
                .compressing(r, n_context, after)
                .map_err(|e| invalid(format!("{e:#}"))),
        }
    }
}

const GENERATE_KEYS: [&str; 7] = [
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "ignore_eos",
];

fn generate_options(dict: Option<&Bound<'_, PyDict>>) -> PyResult<GenerateOptions> {
    let mut g = GenerateOptions::default();
    let Some(d) = dict else { return Ok(g) };
    reject_unknown(d, &GENERATE_KEYS, "generate")?;
    let s = &mut g.sampling;
    if let Some(v) = item(d, "max_tokens")? {
        g.max_new_tokens = v;
    }
    let temperature: f32 = item(d, "temperature")?.unwrap_or(0.0);
    let top_p: f32 = item(d, "top_p")?.unwrap_or(1.0);
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(invalid(format!("temperature {temperature} is not >= 0")));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid(format!("top_p {top_p} is not in (0, 1]")));
    }
    *s = SamplingParams {
        temperature,
        top_p,
        top_k: item(d, "top_k")?.unwrap_or(0),
        seed: item(d, "seed")?.unwrap_or(0),
        ..SamplingParams::GREEDY
    };
    if let Some(stop) = item::<Vec<String>>(d, "stop")? {
        g.stop_strings = stop;
    }
    g.stop_at_eos = !item(d, "ignore_eos")?.unwrap_or(false);
    Ok(g)
}

/// A finished generation: its text, token ids and statistics.
#[pyclass(frozen, module = "sieve")]
#[derive(Clone)]
struct Generation {
    /// With `trace=True`: the bounded cache's refreshes (the `trace`
    /// getter turns them into numpy arrays).
    refreshes: Option<Arc<Vec<RefreshRecord>>>,
    /// The generated text (cut before a stop string).
    #[pyo3(get)]
    text: String,
    /// The generated token ids.
    #[pyo3(get)]
    ids: Vec<u32>,
    /// Tokens of the prompt fed by this call.
    #[pyo3(get)]
    prompt_tokens: usize,
    /// Tokens generated.
    #[pyo3(get)]
    generated_tokens: usize,
    /// Seconds to read the prompt and sample the first token.
    #[pyo3(get)]
    prefill_seconds: f64,
    /// Seconds for the other tokens.
    #[pyo3(get)]
    decode_seconds: f64,
    /// Why it stopped: "eos", "stop" (a stop string), "length"
    /// (max_tokens), "cancelled" or "context_full".
    #[pyo3(get)]
    stop_reason: &'static str,
    /// The bounded cache's budget J (None for the full cache).
    #[pyo3(get)]
    cache_budget: Option<usize>,
    /// Entries the cache held when the generation ended (None from
    /// `batch`, whose caches go back to the scheduler's pool).
    #[pyo3(get)]
    cache_entries: Option<usize>,
}

#[pymethods]
impl Generation {
    /// Decode speed in tokens per second (the first token is the prefill's).
    #[getter]
    fn tokens_per_second(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }

    /// With `trace=True`, one dict per refresh of the bounded cache (the
    /// records `sieve run --trace` writes): `refresh`, `before_position`,
    /// and numpy arrays `present`, `protected`, `unprotected`, `kept`
    /// (uint32 positions), `scores` (float64, one per unprotected entry),
    /// `kept_lists` (at layer or head granularity, each keep list's kept
    /// positions; else None). None without `trace`.
    #[getter]
    fn trace<'py>(&self, py: Python<'py>) -> PyResult<Option<Vec<Bound<'py, PyDict>>>> {
        let Some(records) = &self.refreshes else {
            return Ok(None);
        };
        let array = |v: &[u32]| PyArray1::from_slice(py, v);
        let dicts = records.iter().map(|r| {
            let d = PyDict::new(py);
            d.set_item("refresh", r.refresh)?;
            d.set_item("before_position", r.before_position)?;
            d.set_item("present", array(&r.present))?;
            d.set_item("protected", array(&r.protected))?;
            d.set_item("unprotected", array(&r.unprotected))?;
            d.set_item("scores", PyArray1::from_slice(py, &r.scores))?;
            d.set_item("kept", array(&r.kept))?;
            let lists = r.kept_lists.as_ref();
            d.set_item(
                "kept_lists",
                lists.map(|l| l.iter().map(|k| array(k)).collect::<Vec<_>>()),
            )?;
            Ok(d)
        });
        dicts.collect::<PyResult<Vec<_>>>().map(Some)
    }

    fn __repr__(&self) -> String {
        format!(
            "Generation(text={:?}, generated_tokens={}, stop_reason={:?})",
            self.text, self.generated_tokens, self.stop_reason
        )
    }
}

impl Generation {
    /// `g` with the state of the cache it ran on, and its refreshes when
    /// the cache recorded them (taken: the next turn records its own).
    fn new(g: sieve::Generation, session: &mut sieve::Session) -> Self {
        let cache = session.cache();
        let budget = cache.capacity().is_some().then_some(cache.opts.budget);
        let refreshes = cache
            .record
            .then(|| Arc::new(std::mem::take(&mut cache.trace)));
        Generation {
            refreshes,
            ..Generation::of(g, budget, Some(cache.slots.len()))
        }
    }

    /// `g` with its cache's budget (None: the full cache) and entries.
    fn of(g: sieve::Generation, cache_budget: Option<usize>, cache_entries: Option<usize>) -> Self {
        Generation {
            refreshes: None,
            cache_budget,
            cache_entries,
            text: g.text,
            ids: g.ids,
            prompt_tokens: g.stats.prompt_tokens,
            generated_tokens: g.stats.generated_tokens,
            prefill_seconds: g.stats.prefill_seconds,
            decode_seconds: g.stats.decode_seconds,
            stop_reason: match g.stats.stop {
                StopReason::Eos | StopReason::ConstraintComplete => "eos",
                StopReason::StopString => "stop",
                StopReason::MaxTokens => "length",
                StopReason::Cancelled => "cancelled",
                StopReason::ContextFull => "context_full",
            },
        }
    }
}

fn load_options(
    dtype: Option<&str>,
    kv_dtype: Option<&str>,
    kernels: Option<&str>,
    backend: Option<&str>,
    adapter: Option<&str>,
    progress: Option<Py<PyAny>>,
) -> PyResult<LoadOptions> {
    let mut opts =
        LoadOptions::from_names(dtype, kv_dtype, kernels, backend, adapter).map_err(py_err)?;
    opts.progress = progress.map(|f| {
        Progress::new(move |done, total| {
            Python::attach(|py| {
                if let Err(e) = f.call1(py, (done, total)) {
                    e.write_unraisable(py, Some(f.bind(py)));
                }
            })
        })
    });
    Ok(opts)
}

/// A model and its tokenizer on the GPU (python/sieve's `Llm` wraps it).
#[pyclass(frozen, module = "sieve._sieve")]
struct Llm {
    llm: sieve::Llm,
}

#[pymethods]
impl Llm {
    #[new]
    // The load options as Python keyword arguments.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (path, dtype=None, kv_dtype=None, kernels=None, backend=None, adapter=None, progress=None))]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        dtype: Option<&str>,
        kv_dtype: Option<&str>,
        kernels: Option<&str>,
        backend: Option<&str>,
        adapter: Option<&str>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let opts = load_options(dtype, kv_dtype, kernels, backend, adapter, progress)?;
        let llm = py
            .detach(|| sieve::Llm::load(Path::new(&path), &opts))
            .map_err(py_err)?;
        Ok(Llm { llm })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.llm.model.config.vocab_size
    }

    /// The model's longest context (max_position_embeddings).
    #[getter]
    fn max_context(&self) -> usize {
        self.llm.model.config.max_position_embeddings
    }

    #[getter]
    fn has_chat_template(&self) -> bool {
        self.llm.tokenizer.has_chat_template()
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn tokenize(&self, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let t = &self.llm.tokenizer;
        if add_special_tokens {
            t.encode(text)
        } else {
            t.encode_continuation(text)
        }
        .map_err(|e| invalid(format!("{e:#}")))
    }

    fn detokenize(&self, ids: Vec<u32>) -> PyResult<String> {
        check_ids(&self.llm, &ids)?;
        self.llm
            .tokenizer
            .decode(&ids)
            .map_err(|e| invalid(format!("{e:#}")))
    }

    /// `messages`: (role, content) pairs.
    fn apply_chat_template(
        &self,
        messages: Vec<(String, String)>,
        add_generation_prompt: bool,
    ) -> PyResult<String> {
        let m: Vec<Message> = messages.iter().map(|(r, c)| Message::new(r, c)).collect();
        self.llm
            .tokenizer
            .apply_chat_template(&m, add_generation_prompt)
            .map_err(|e| TemplateError::new_err(format!("{e:#}")))
    }

    /// The float32 logits of the last of `ids` as a numpy array (moved, not
    /// copied, into numpy).
    #[pyo3(signature = (ids, cache=None))]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        cache: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let cache = match cache_spec(cache)? {
            Some(CacheSpec { ratio: Some(_), .. }) => {
                return Err(invalid(
                    "logits read the ids and nothing after them, so a compression_ratio never cuts: give the press a budget",
                ))
            }
            spec => spec.map(|s| s.opts),
        };
        let llm = &self.llm;
        let values = py.detach(|| llm.logits(&ids, cache)).map_err(py_err)?;
        Ok(PyArray1::from_vec(py, values))
    }

    /// Generates after `ids` on a fresh cache; with a compression ratio the
    /// first `n_context` ids are the context it compresses.
    #[pyo3(signature = (ids, n_context, options=None, cache=None, trace=false))]
    fn generate(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        n_context: usize,
        options: Option<&Bound<'_, PyDict>>,
        cache: Option<&Bound<'_, PyDict>>,
        trace: bool,
    ) -> PyResult<Generation> {
        let job = self.job(py, ids, n_context, options, cache, trace)?;
        py.detach(move || job.run(|_| true))
    }

    /// As `generate`, streamed: an iterator of text pieces.
    #[pyo3(signature = (ids, n_context, options=None, cache=None, trace=false))]
    fn stream(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        n_context: usize,
        options: Option<&Bound<'_, PyDict>>,
        cache: Option<&Bound<'_, PyDict>>,
        trace: bool,
    ) -> PyResult<Stream> {
        let job = self.job(py, ids, n_context, options, cache, trace)?;
        let cancel = job.session.cancel_token();
        Ok(Stream::start(cancel, move |on_piece| job.run(on_piece)))
    }

    /// Generations after each of `prompts` (ids; the first `n_contexts[i]`
    /// of prompt i are the context a compression ratio compresses), up to
    /// `max_sequences` stepped together on one scheduler (None: as many as
    /// fit, at most 32), each on a fresh cache; in the order of `prompts`.
    #[pyo3(signature = (prompts, n_contexts, options=None, cache=None, max_sequences=None))]
    fn batch(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
        n_contexts: Vec<usize>,
        options: Option<&Bound<'_, PyDict>>,
        cache: Option<&Bound<'_, PyDict>>,
        max_sequences: Option<usize>,
    ) -> PyResult<Vec<Generation>> {
        let options = generate_options(options)?;
        let spec = cache_spec(cache)?;
        if prompts.len() != n_contexts.len() {
            return Err(invalid("one n_context per prompt"));
        }
        let mut jobs = Vec::with_capacity(prompts.len());
        for (ids, n_context) in prompts.into_iter().zip(n_contexts) {
            let cache =
                Llm::job_cache(spec.as_ref(), ids.len(), n_context, options.max_new_tokens)?;
            jobs.push((ids, cache));
        }
        if jobs.is_empty() {
            return Ok(vec![]);
        }
        let llm = &self.llm;
        let max_sequences = match max_sequences {
            Some(0) => return Err(invalid("max_sequences must be at least 1")),
            Some(n) => n,
            None => jobs_that_fit(&llm.model, &jobs, options.max_new_tokens).max(1),
        };
        let mut done: Vec<Option<sieve::Generation>> = (0..jobs.len()).map(|_| None).collect();
        py.detach(|| {
            run_jobs(llm, &jobs, &options, max_sequences, |i, g, _| {
                done[i] = Some(g);
                Ok::<_, sieve::Error>(())
            })
        })
        .map_err(py_err)?;
        (done.into_iter().zip(&jobs))
            .map(|(g, (_, cache))| {
                let g =
                    g.ok_or_else(|| SieveError::new_err("a batch generation did not finish"))?;
                Ok(Generation::of(g, cache.map(|c| c.budget), None))
            })
            .collect()
    }

    /// A conversation with its own cache (a budget, not a ratio).
    #[pyo3(signature = (max_context=0, cache=None))]
    fn session(
        &self,
        py: Python<'_>,
        max_context: usize,
        cache: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Session> {
        let cache = match cache_spec(cache)? {
            Some(CacheSpec { ratio: Some(_), .. }) => {
                return Err(invalid(
                    "a session holds a conversation, not one context to compress: give its press a budget, not a compression_ratio",
                ))
            }
            Some(_) if max_context != 0 => {
                return Err(invalid(
                    "max_context sizes the full cache; a press's budget sizes a bounded one",
                ))
            }
            spec => spec.map(|s| s.opts),
        };
        let s = self.new_session(py, max_context, cache)?;
        Ok(Session {
            cancel: s.cancel_token(),
            inner: Arc::new(Mutex::new(s)),
        })
    }
}

fn check_ids(llm: &sieve::Llm, ids: &[u32]) -> PyResult<()> {
    let vocab = llm.model.config.vocab_size;
    match ids.iter().find(|&&i| i as usize >= vocab) {
        Some(bad) => Err(invalid(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

/// One generation on a fresh session, ready to run on any thread.
struct Job {
    session: sieve::Session,
    ids: Vec<u32>,
    options: GenerateOptions,
}

impl Job {
    fn run(mut self, mut on_piece: impl FnMut(&str) -> bool) -> PyResult<Generation> {
        let g = self
            .session
            .generate(&self.ids, &self.options, |p| on_piece(p))
            .map_err(py_err)?;
        Ok(Generation::new(g, &mut self.session))
    }
}

impl Llm {
    /// A session (allocating its cache) without the GIL.
    fn new_session(
        &self,
        py: Python<'_>,
        max_context: usize,
        cache: Option<CacheOptions>,
    ) -> PyResult<sieve::Session> {
        let llm = &self.llm;
        py.detach(|| {
            llm.session(SessionOptions {
                max_context,
                cache,
                ..Default::default()
            })
        })
        .map_err(py_err)
    }

    /// The cache of a prompt of `len` ids whose first `n_context` are the
    /// context, answered in up to `max_new` tokens.
    fn job_cache(
        spec: Option<&CacheSpec>,
        len: usize,
        n_context: usize,
        max_new: usize,
    ) -> PyResult<Option<CacheOptions>> {
        if n_context > len {
            return Err(invalid(format!(
                "n_context {n_context} is longer than the {len} ids"
            )));
        }
        spec.map(|c| c.options(n_context, len - n_context + max_new))
            .transpose()
    }

    fn job(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        n_context: usize,
        options: Option<&Bound<'_, PyDict>>,
        cache: Option<&Bound<'_, PyDict>>,
        trace: bool,
    ) -> PyResult<Job> {
        let options = generate_options(options)?;
        let spec = cache_spec(cache)?;
        let cache = Llm::job_cache(spec.as_ref(), ids.len(), n_context, options.max_new_tokens)?;
        // A full cache of the prompt and answer, within the model's context
        // (a longer prompt is refused as too long).
        let max_context = (ids.len() + options.max_new_tokens)
            .min(self.llm.model.config.max_position_embeddings)
            .max(1);
        if trace && cache.is_none() {
            return Err(invalid(
                "trace records a bounded cache's refreshes; the full cache has none: give a press",
            ));
        }
        let mut session = self.new_session(py, max_context, cache)?;
        session.cache().record = trace;
        Ok(Job {
            session,
            ids,
            options,
        })
    }
}

/// A conversation: its history and its own KV cache.
#[pyclass(frozen, module = "sieve._sieve")]
struct Session {
    cancel: CancelToken,
    inner: Arc<Mutex<sieve::Session>>,
}

fn lock(s: &Mutex<sieve::Session>) -> PyResult<MutexGuard<'_, sieve::Session>> {
    s.lock()
        .map_err(|_| SieveError::new_err("the session failed inside an earlier call"))
}

/// One turn of `session`'s conversation.
fn chat(
    session: &Mutex<sieve::Session>,
    message: &str,
    options: &GenerateOptions,
    on_piece: &mut dyn FnMut(&str) -> bool,
) -> PyResult<Generation> {
    let mut s = lock(session)?;
    // A cancel is for the generation running when it is made: one left
    // over from an earlier call (or a stream dropped after it ended) does
    // not stop this one.
    s.cancel_token().reset();
    let g = s.chat(message, options, on_piece).map_err(py_err)?;
    Ok(Generation::new(g, &mut s))
}

#[pymethods]
impl Session {
    /// One turn: `message` as the user's, on the model's chat template.
    #[pyo3(signature = (message, options=None))]
    fn chat(
        &self,
        py: Python<'_>,
        message: String,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Generation> {
        let options = generate_options(options)?;
        let inner = self.inner.clone();
        py.detach(move || chat(&inner, &message, &options, &mut |_| true))
    }

    /// As `chat`, streamed.
    #[pyo3(signature = (message, options=None))]
    fn stream_chat(
        &self,
        message: String,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Stream> {
        let options = generate_options(options)?;
        let inner = self.inner.clone();
        Ok(Stream::start(self.cancel.clone(), move |on_piece| {
            chat(&inner, &message, &options, on_piece)
        }))
    }

    /// Stops the generation running on this session (from any thread).
    fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Forgets the conversation.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        // The lock waits for a running chat: without the GIL.
        py.detach(|| lock(&self.inner).map(|mut s| s.reset()))
    }

    /// The conversation's messages as (role, content) pairs.
    #[getter]
    fn messages(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        py.detach(|| {
            Ok(lock(&self.inner)?
                .messages()
                .iter()
                .map(|m| (m.role.clone(), m.content.clone()))
                .collect())
        })
    }

    /// Every token id in the cache's history.
    #[getter]
    fn tokens(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        py.detach(|| Ok(lock(&self.inner)?.tokens().to_vec()))
    }
}

enum Event {
    Piece(String),
    Done(PyResult<Generation>),
}

/// Text pieces of a generation running on a worker thread. Iterating
/// waits with the GIL released; `cancel()` (from any thread, so the class
/// is frozen: a method never holds the object while another runs),
/// `close()`, or dropping the stream stops the generation.
///
/// The worker hands each piece over and waits until it is taken (a
/// rendezvous channel), so it is never more than one token ahead of the
/// reader: a reader that stops stops the GPU work.
#[pyclass(frozen, module = "sieve._sieve")]
struct Stream {
    cancel: CancelToken,
    /// Set while the generation runs: a stream that ended must not cancel,
    /// since a session's token is shared with its next call.
    running: Arc<AtomicBool>,
    events: Mutex<Option<Receiver<Event>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    result: Mutex<Option<Generation>>,
}

impl Stream {
    fn start(
        cancel: CancelToken,
        run: impl FnOnce(&mut dyn FnMut(&str) -> bool) -> PyResult<Generation> + Send + 'static,
    ) -> Stream {
        let (tx, rx) = sync_channel(0);
        let running = Arc::new(AtomicBool::new(true));
        let flag = running.clone();
        let worker = std::thread::spawn(move || {
            let pieces = tx.clone();
            let mut on_piece = |p: &str| pieces.send(Event::Piece(p.to_string())).is_ok();
            // A panic inside sieve ends the stream with an error, not as if
            // the answer were complete.
            let out = catch_unwind(AssertUnwindSafe(|| run(&mut on_piece))).unwrap_or_else(|_| {
                Err(SieveError::new_err(
                    "internal error in sieve while generating (please report)",
                ))
            });
            flag.store(false, Ordering::SeqCst);
            let _ = tx.send(Event::Done(out));
        });
        Stream {
            cancel,
            running,
            events: Mutex::new(Some(rx)),
            worker: Mutex::new(Some(worker)),
            result: Mutex::new(None),
        }
    }

    /// Stops the generation if it still runs.
    fn stop(&self) {
        if self.running.load(Ordering::SeqCst) {
            self.cancel.cancel();
        }
    }

    /// The worker's handle once, to join it.
    fn take_worker(&self) -> Option<JoinHandle<()>> {
        self.worker.lock().ok().and_then(|mut w| w.take())
    }

    fn finished(&self) -> Option<Generation> {
        self.result.lock().ok().and_then(|r| r.clone())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.stop();
        // Without a reader the worker's next hand-over fails and it ends.
        if let Ok(mut rx) = self.events.lock() {
            rx.take();
        }
        if let Some(w) = self.take_worker() {
            let _ = w.join();
        }
    }
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<String> {
        // One reader at a time; after the end, every call ends at once.
        let events = &self.events;
        let event = py.detach(|| {
            let rx = events.lock().ok()?;
            if self.finished().is_some() {
                return None;
            }
            rx.as_ref()?.recv().ok()
        });
        match event {
            Some(Event::Piece(p)) => Ok(p),
            Some(Event::Done(out)) => {
                if let Some(w) = self.take_worker() {
                    py.detach(|| {
                        let _ = w.join();
                    });
                }
                let g = out?;
                if let Ok(mut r) = self.result.lock() {
                    *r = Some(g);
                }
                Err(PyStopIteration::new_err(()))
            }
            // The end was read before, or the worker is gone.
            None => Err(PyStopIteration::new_err(())),
        }
    }

    /// Stops the generation from any thread; iteration then ends.
    fn cancel(&self) {
        self.stop();
    }

    /// Stops the generation and waits for it; returns its `Generation`.
    fn close(&self, py: Python<'_>) -> PyResult<Option<Generation>> {
        self.stop();
        // Drain to the end: the worker's last event is its result.
        loop {
            match self.__next__(py) {
                Ok(_) => {}
                Err(e) if e.is_instance_of::<PyStopIteration>(py) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(self.finished())
    }

    /// The finished generation (None until the iteration ends).
    #[getter]
    fn result(&self) -> Option<Generation> {
        self.finished()
    }
}

#[pymodule]
fn _sieve(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Llm>()?;
    m.add_class::<Session>()?;
    m.add_class::<Stream>()?;
    m.add_class::<Generation>()?;
    for (name, ty) in [
        ("SieveError", py.get_type::<SieveError>()),
        ("BadModel", py.get_type::<BadModel>()),
        ("InvalidOptions", py.get_type::<InvalidOptions>()),
        ("PromptTooLong", py.get_type::<PromptTooLong>()),
        ("GpuOutOfMemory", py.get_type::<GpuOutOfMemory>()),
        ("GpuError", py.get_type::<GpuError>()),
        ("TemplateError", py.get_type::<TemplateError>()),
        ("NonFiniteLogits", py.get_type::<NonFiniteLogits>()),
        ("NeedsReset", py.get_type::<NeedsReset>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}
