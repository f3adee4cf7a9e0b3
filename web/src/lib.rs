//! sieve in the browser: the chat page's entry points (web/index.html,
//! web/app.js). The library runs unchanged on the browser's WebGPU; where
//! it waits for the GPU it suspends through JSPI (`sieve::platform`), so
//! the two calls that reach the GPU, [`sieve_load`] and [`sieve_generate`],
//! are plain wasm exports that the page calls through
//! `WebAssembly.promising` (a promise that settles when they return). Their
//! inputs are set before (the model's bytes, the options, the prompt) and
//! their outputs read after (`status`), with wasm-bindgen calls; text
//! streams to the `on_text` callback.
//!
//! The check page (web/checks.html) runs sieve's kernel tests here, one a
//! call ([`sieve_check`]), on the browser's GPU.
//!
//! State lives in thread locals: a page has one thread. A call made while
//! the model is suspended in a step (`stop`, `status`) touches only
//! state no step holds.

use std::cell::{Cell, RefCell};

use sieve::cache::CacheOptions;
use sieve::eviction::Policy;
use sieve::model::LoadOptions;
use sieve::progress::Progress;
use sieve::session::{CancelToken, GenerateOptions, Llm, Session, SessionOptions};
use wasm_bindgen::prelude::*;

struct Chat {
    llm: Llm,
    session: Session,
}

thread_local! {
    static CHAT: RefCell<Option<Chat>> = const { RefCell::new(None) };
    /// The GGUF file's bytes, until `sieve_load` takes them.
    static MODEL: RefCell<Option<(String, Vec<u8>)>> = const { RefCell::new(None) };
    static CACHE: RefCell<Option<CacheOptions>> = const { RefCell::new(None) };
    static PROMPT: RefCell<String> = const { RefCell::new(String::new()) };
    static ON_TEXT: RefCell<Option<js_sys::Function>> = const { RefCell::new(None) };
    static ON_PROGRESS: RefCell<Option<js_sys::Function>> = const { RefCell::new(None) };
    static CANCEL: RefCell<Option<CancelToken>> = const { RefCell::new(None) };
    /// A JSON object: the last call's outcome (`error`, or its figures).
    static STATUS: RefCell<String> = const { RefCell::new(String::new()) };
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// The GGUF file to load next (`name` names it in errors).
#[wasm_bindgen]
pub fn set_model(name: String, bytes: Vec<u8>) {
    MODEL.with(|m| *m.borrow_mut() = Some((name, bytes)));
}

/// The function a model's upload reports to, `on_progress(done, total)`
/// (in layers and the tensors around them); the page repaints after each.
#[wasm_bindgen]
pub fn set_load_progress(on_progress: js_sys::Function) {
    ON_PROGRESS.with(|f| *f.borrow_mut() = Some(on_progress));
}

/// The KV cache of the next conversation: `full`, or a policy (`window`,
/// `h2o`, `tova`, `epikv`, `ccs`, ...) with a budget of `budget` entries
/// refreshed every `chunk` tokens. An error names what is wrong (before any
/// model is loaded).
#[wasm_bindgen]
pub fn set_cache(policy: &str, budget: usize, chunk: usize) -> Result<(), JsError> {
    let error = |e: anyhow::Error| JsError::new(&format!("{e:#}"));
    let policy = Policy::parse(policy).map_err(error)?;
    let cache = (policy != Policy::Full).then(|| CacheOptions::new(policy, budget, chunk));
    if let Some(c) = &cache {
        c.validate().map_err(error)?;
    }
    CACHE.with(|c| *c.borrow_mut() = cache);
    Ok(())
}

/// Where a panic is reported: the browser's console (a panic traps the
/// wasm instance; the page then asks for a reload).
#[wasm_bindgen(start)]
pub fn start() {
    std::panic::set_hook(Box::new(|info| {
        console_error(&format!("sieve panicked: {info}"))
    }));
}

#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = console, js_name = error)]
    fn console_error(message: &str);
}

/// The next user message, and the function each piece of the answer goes
/// to (`on_text(piece)`; returning `false` stops the answer).
#[wasm_bindgen]
pub fn set_prompt(text: String, on_text: js_sys::Function) {
    PROMPT.with(|p| *p.borrow_mut() = text);
    ON_TEXT.with(|f| *f.borrow_mut() = Some(on_text));
}

/// Stops the answer (or the prompt) in progress at its next token or chunk.
#[wasm_bindgen]
pub fn stop() {
    CANCEL.with(|c| {
        if let Some(c) = c.borrow().as_ref() {
            c.cancel()
        }
    });
}

/// The outcome of the last `sieve_load` or `sieve_generate`: a JSON object
/// with `error`, or its figures.
#[wasm_bindgen]
pub fn status() -> String {
    STATUS.with(|s| s.borrow().clone())
}

fn set_status(v: serde_json::Value) {
    STATUS.with(|s| *s.borrow_mut() = v.to_string());
}

/// Runs `f` unless a call is running; its error goes to `status`. Returns 1
/// on success, 0 on failure.
fn run(f: impl FnOnce() -> Result<serde_json::Value, String>) -> u32 {
    if BUSY.with(|b| b.replace(true)) {
        set_status(serde_json::json!({"error": "sieve is busy with another call"}));
        return 0;
    }
    let outcome = f();
    BUSY.with(|b| b.set(false));
    match outcome {
        Ok(v) => {
            set_status(v);
            1
        }
        Err(e) => {
            set_status(serde_json::json!({ "error": e }));
            0
        }
    }
}

/// Loads the model `set_model` gave (or keeps the one loaded when none was
/// given) and starts a new conversation with the cache of `set_cache`.
/// Call through `WebAssembly.promising`.
#[no_mangle]
pub extern "C" fn sieve_load() -> u32 {
    run(|| {
        // The old conversation goes first, and the old model when a new one
        // comes: the GPU holds one at a time.
        CANCEL.with(|c| *c.borrow_mut() = None);
        let old = CHAT.with(|c| c.borrow_mut().take());
        let llm = match MODEL.with(|m| m.borrow_mut().take()) {
            Some((name, bytes)) => {
                drop(old);
                // The upload's progress goes to the page, which gets to
                // repaint its bar after each layer.
                let progress = Progress::new(|done, total| {
                    ON_PROGRESS.with(|f| {
                        if let Some(f) = f.borrow().as_ref() {
                            let _ = f.call2(&JsValue::NULL, &done.into(), &total.into());
                        }
                    });
                    sieve::platform::let_browser_run();
                });
                let opts = LoadOptions {
                    progress: Some(progress),
                    ..Default::default()
                };
                Llm::from_gguf_bytes(&name, bytes, &opts).map_err(|e| format!("{e:#}"))?
            }
            None => old.ok_or("no model given (set_model)")?.llm,
        };
        let cache = CACHE.with(|c| *c.borrow());
        let session = llm
            .session(SessionOptions {
                cache,
                ..Default::default()
            })
            .map_err(|e| format!("{e:#}"))?;
        let figures = serde_json::json!({
            "adapter": llm.model.gpu.describe(),
            "weights_bytes": session.memory().weights,
            "buffers_bytes": session.memory().buffers,
        });
        CANCEL.with(|c| *c.borrow_mut() = Some(session.cancel_token()));
        CHAT.with(|c| *c.borrow_mut() = Some(Chat { llm, session }));
        Ok(figures)
    })
}

/// Answers the message `set_prompt` gave (the conversation goes on), at most
/// `max_tokens` tokens, greedy. Call through `WebAssembly.promising`.
#[no_mangle]
pub extern "C" fn sieve_generate(max_tokens: u32) -> u32 {
    run(|| {
        let prompt = PROMPT.with(|p| p.borrow().clone());
        // A Stop of the last answer does not stop this one.
        CANCEL.with(|c| c.borrow().as_ref().map(CancelToken::reset));
        let on_text = ON_TEXT
            .with(|f| f.borrow().clone())
            .ok_or("no callback given (set_prompt)")?;
        CHAT.with(|c| {
            let mut chat = c.borrow_mut();
            let chat = chat.as_mut().ok_or("no model loaded (sieve_load)")?;
            let opts = GenerateOptions {
                max_new_tokens: max_tokens as usize,
                ..Default::default()
            };
            let g = chat
                .session
                .chat(&prompt, &opts, |piece| {
                    on_text
                        .call1(&JsValue::NULL, &JsValue::from_str(piece))
                        .map(|r| r.as_bool() != Some(false))
                        .unwrap_or(false)
                })
                .map_err(|e| format!("{e:#}"))?;
            let s = &g.stats;
            let memory = chat.session.memory();
            Ok(serde_json::json!({
                "text": g.text,
                "prompt_tokens": s.prompt_tokens,
                "generated_tokens": s.generated_tokens,
                "prefill_tokens_per_second": s.prefill_tokens_per_second(),
                "decode_tokens_per_second": s.decode_tokens_per_second(),
                "stop": format!("{:?}", s.stop),
                "conversation_tokens": chat.session.tokens().len(),
                "weights_bytes": memory.weights,
                "buffers_bytes": memory.buffers,
                "model": chat.llm.model.config.architecture.clone(),
            }))
        })
    })
}

/// The names of sieve's kernel checks (the kernel tests,
/// `sieve::kernels::checks`), as a JSON array: [`sieve_check`] takes an
/// index into it.
#[wasm_bindgen]
pub fn check_names() -> String {
    let names: Vec<&str> = sieve::kernels::checks::all()
        .iter()
        .map(|c| c.name())
        .collect();
    serde_json::json!(names).to_string()
}

/// Runs kernel check `index` on this browser's GPU; `status` then has its
/// `name`, `notes` (what it left out here) and `seconds`. A failing check
/// panics, which traps this instance (the check page reloads and goes on).
/// Call through `WebAssembly.promising`.
#[no_mangle]
pub extern "C" fn sieve_check(index: u32) -> u32 {
    run(|| {
        let checks = sieve::kernels::checks::all();
        let check = checks
            .get(index as usize)
            .ok_or_else(|| format!("no check {index}: there are {}", checks.len()))?;
        let t0 = js_sys::Date::now();
        let notes = check.run();
        Ok(serde_json::json!({
            "name": check.name(),
            "notes": notes,
            "seconds": (js_sys::Date::now() - t0) / 1000.0,
        }))
    })
}
