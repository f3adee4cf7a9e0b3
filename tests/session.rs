//! The library's generation API on the tiny Llama (random weights, vocabulary
//! of 512) with SmolLM2's byte-level tokenizer: seeds, stop strings, streaming,
//! cancellation, limits and multi-turn positions.

mod common;
use common::golden_dir;
use sieve::kernels::sample::SamplingParams;
use sieve::model::{LoadOptions, Model};
use sieve::session::{GenerateOptions, Session, SessionOptions, StopReason, SubmitAhead};
use sieve::tokenizer::Tokenizer;
use sieve::KernelSet;
use std::sync::Arc;

fn session() -> Session {
    let model = Model::load(
        &golden_dir().join("tiny-llama-gqa"),
        &LoadOptions::default(),
    )
    .unwrap();
    let tok = Arc::new(Tokenizer::load(&golden_dir().join("smollm2-135m"), &[]).unwrap());
    Session::new(
        model,
        tok,
        SessionOptions {
            max_context: 512,
            prefill_chunk: 16,
            cache: None,
        },
    )
    .unwrap()
}

const PROMPT: [u32; 6] = [300, 301, 302, 40, 41, 42];

fn sampled(seed: u64) -> Vec<u32> {
    let opts = GenerateOptions {
        max_new_tokens: 24,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 50,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed,
            ..Default::default()
        },
        stop_at_eos: false,
        ..Default::default()
    };
    session().generate(&PROMPT, &opts, |_| true).unwrap().ids
}

#[test]
fn a_seed_reproduces_a_sampled_generation() {
    let a = sampled(7);
    assert_eq!(a.len(), 24);
    assert_eq!(a, sampled(7));
    assert!(
        [8, 9, 10].iter().any(|&s| sampled(s) != a),
        "different seeds should give different text"
    );
}

#[test]
fn stop_strings_cut_the_text_and_are_not_emitted() {
    let greedy = GenerateOptions {
        max_new_tokens: 40,
        stop_at_eos: false,
        ..Default::default()
    };
    let full = session().generate(&PROMPT, &greedy, |_| true).unwrap();
    assert_eq!(full.stats.stop, StopReason::MaxTokens);
    // A stop string taken from the middle of the greedy text.
    let chars: Vec<char> = full.text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let want = &full.text[..full.text.find(&stop).unwrap()];
    let mut streamed = String::new();
    let opts = GenerateOptions {
        stop_strings: vec![stop.clone()],
        ..greedy
    };
    let out = session()
        .generate(&PROMPT, &opts, |p| {
            streamed.push_str(p);
            true
        })
        .unwrap();
    assert_eq!(out.stats.stop, StopReason::StopString);
    assert_eq!(out.text, want, "stop string {stop:?}");
    assert_eq!(streamed, want, "nothing past the stop string was streamed");
}

#[test]
fn the_callback_and_the_cancel_handle_stop_generation() {
    let opts = GenerateOptions {
        max_new_tokens: 40,
        stop_at_eos: false,
        ..Default::default()
    };
    let mut s = session();
    let mut pieces = 0;
    let out = s
        .generate(&PROMPT, &opts, |p| {
            pieces += !p.is_empty() as usize;
            pieces < 2
        })
        .unwrap();
    assert_eq!(out.stats.stop, StopReason::Cancelled);
    assert!(out.ids.len() < 40);
    // The handle (from any thread; here from the callback) stops after the
    // token being emitted: the text is exactly the first piece.
    let mut s = session();
    let cancel = s.cancel_token();
    let mut first = String::new();
    let out = s
        .generate(&PROMPT, &opts, |p| {
            first.push_str(p);
            cancel.cancel();
            true
        })
        .unwrap();
    assert_eq!(out.stats.stop, StopReason::Cancelled);
    assert_eq!(out.text, first);
    assert!(out.ids.len() < 40);
    // generate never clears the token: a cancel set before a call starts is
    // not lost (the call returns at once, feeding nothing) until it is reset.
    let held = s.tokens().to_vec();
    let out = s.generate(&PROMPT, &opts, |_| true).unwrap();
    assert_eq!(out.stats.stop, StopReason::Cancelled);
    assert!(out.ids.is_empty());
    assert_eq!(s.tokens(), held);
    cancel.reset();
    let out = s.generate(&PROMPT, &opts, |_| true).unwrap();
    assert_eq!(out.stats.stop, StopReason::MaxTokens);
}

/// A cancel from another thread during a long prompt stops between prefill
/// chunks: the call returns without an answer (or, if the prompt was already
/// done, after at most one token), and the history holds what was fed.
#[test]
fn a_cancel_during_the_prompt_stops_between_chunks() {
    let mut s = session();
    let cancel = s.cancel_token();
    let prompt: Vec<u32> = (0..480).map(|i| 20 + (i * 7) % 480).collect();
    let opts = GenerateOptions {
        max_new_tokens: 40,
        stop_at_eos: false,
        ..Default::default()
    };
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        cancel.cancel();
    });
    let out = s.generate(&prompt, &opts, |_| true).unwrap();
    canceller.join().unwrap();
    assert_eq!(out.stats.stop, StopReason::Cancelled);
    assert!(
        out.ids.len() <= 1,
        "{} tokens after the cancel",
        out.ids.len()
    );
    let fed = s.tokens().len();
    eprintln!("cancelled after {fed} of {} prompt tokens", prompt.len());
    assert!(
        fed.is_multiple_of(16) || fed == prompt.len() + out.ids.len(),
        "{fed}"
    );
    assert_eq!(
        s.tokens()[..fed.min(prompt.len())],
        prompt[..fed.min(prompt.len())]
    );
}

/// The prompt progress callback sees every chunk, in order, and a cancel set
/// from it takes effect at once: the call returns before the next chunk with
/// exactly the fed tokens counted, in the stats and the history.
#[test]
fn prompt_progress_reports_each_chunk_and_a_cancel_stops_at_the_next() {
    use std::sync::Mutex;
    let mut s = session();
    let prompt: Vec<u32> = (0..70).map(|i| 20 + (i * 7) % 480).collect();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let opts = GenerateOptions {
        max_new_tokens: 3,
        stop_at_eos: false,
        on_prompt: Some(sieve::Progress::new(move |done, total| {
            record.lock().unwrap().push((done, total))
        })),
        ..Default::default()
    };
    let out = s.generate(&prompt, &opts, |_| true).unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [(16, 70), (32, 70), (48, 70), (64, 70), (70, 70)]
    );
    assert_eq!(out.stats.prompt_tokens, 70);

    s.reset();
    let cancel = s.cancel_token();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let opts = GenerateOptions {
        on_prompt: Some(sieve::Progress::new(move |done, total| {
            record.lock().unwrap().push((done, total));
            if done >= 32 {
                cancel.cancel();
            }
        })),
        ..opts
    };
    let out = s.generate(&prompt, &opts, |_| true).unwrap();
    assert_eq!(*seen.lock().unwrap(), [(16, 70), (32, 70)]);
    assert_eq!(out.stats.stop, StopReason::Cancelled);
    assert_eq!(out.stats.prompt_tokens, 32);
    assert!(out.ids.is_empty());
    assert_eq!(s.tokens(), &prompt[..32]);
}

/// Whatever stops a generation (the token limit, a stop string, the
/// callback), the session's history is the prompt and every emitted id, and
/// the cache holds exactly that: a second turn continues it as a fresh
/// session fed the whole history does.
#[test]
fn the_cache_holds_exactly_the_visible_history() {
    let opts = GenerateOptions {
        max_new_tokens: 9,
        stop_at_eos: false,
        ..Default::default()
    };
    let mut s = session();
    let first = s.generate(&PROMPT, &opts, |_| true).unwrap();
    assert_eq!(first.stats.stop, StopReason::MaxTokens);
    let history: Vec<u32> = PROMPT.iter().chain(&first.ids).copied().collect();
    assert_eq!(s.tokens(), history);
    let second = s.generate(&PROMPT, &opts, |_| true).unwrap();
    let whole: Vec<u32> = history.iter().chain(&PROMPT).copied().collect();
    let mut fresh = session();
    let mut again = fresh.generate(&whole, &opts, |_| true).unwrap();
    // Same greedy continuation from the same history.
    assert_eq!(second.ids, std::mem::take(&mut again.ids));
    // A stop by the callback: the emitted ids are in the history too.
    let mut s = session();
    let out = s.generate(&PROMPT, &opts, |_| false).unwrap();
    assert_eq!(out.stats.stop, StopReason::Cancelled);
    let history: Vec<u32> = PROMPT.iter().chain(&out.ids).copied().collect();
    assert_eq!(s.tokens(), history);
}

/// Sessions move to worker threads; models and tokenizers are shared.
#[test]
fn sessions_are_send_and_models_are_shared() {
    fn send<T: Send>() {}
    fn shared<T: Send + Sync>() {}
    send::<Session>();
    shared::<sieve::session::Llm>();
    shared::<sieve::session::CancelToken>();
    let mut s = session();
    let out = std::thread::spawn(move || {
        s.generate(&PROMPT, &GenerateOptions::default(), |_| true)
            .unwrap()
            .ids
    })
    .join()
    .unwrap();
    assert!(!out.is_empty());
}

#[test]
fn turns_continue_the_conversation_and_the_context_fills() {
    let mut s = session();
    let opts = GenerateOptions {
        max_new_tokens: 10,
        stop_at_eos: false,
        ..Default::default()
    };
    let first = s.generate(&PROMPT, &opts, |_| true).unwrap();
    assert_eq!(first.ids.len(), 10);
    let none = GenerateOptions {
        max_new_tokens: 0,
        ..opts.clone()
    };
    assert!(session()
        .generate(&PROMPT, &none, |_| true)
        .unwrap()
        .ids
        .is_empty());
    // The second turn sees the first: its answer differs from a fresh session's.
    let second = s.generate(&PROMPT, &opts, |_| true).unwrap();
    let fresh = session().generate(&PROMPT, &opts, |_| true).unwrap();
    assert_ne!(second.ids, fresh.ids);
    // A context of 512 tokens ends a long generation with ContextFull.
    let long = GenerateOptions {
        max_new_tokens: 10_000,
        stop_at_eos: false,
        ..Default::default()
    };
    let out = s.generate(&PROMPT, &long, |_| true).unwrap();
    assert_eq!(out.stats.stop, StopReason::ContextFull);
    assert_eq!(s.tokens().len(), 512, "every emitted token is in the cache");
    s.reset();
    assert_eq!(s.generate(&PROMPT, &opts, |_| true).unwrap().ids, fresh.ids);
    // reset() resets the sampling counter too: a seed gives a fresh session's text.
    let sampled = GenerateOptions {
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..Default::default()
        },
        ..opts.clone()
    };
    let want = session().generate(&PROMPT, &sampled, |_| true).unwrap().ids;
    s.reset();
    assert_eq!(s.generate(&PROMPT, &sampled, |_| true).unwrap().ids, want);
}

/// The load progress is a closure (here feeding a channel, as a GUI would):
/// it sees every step, in order, ending at the total.
#[test]
fn load_progress_is_a_closure() {
    let (tx, rx) = std::sync::mpsc::channel();
    let opts = LoadOptions {
        progress: Some(sieve::Progress::new(move |done, total| {
            tx.send((done, total)).unwrap();
        })),
        ..Default::default()
    };
    Model::load(&golden_dir().join("tiny-llama-gqa"), &opts).unwrap();
    let steps: Vec<(usize, usize)> = rx.try_iter().collect();
    let total = steps.last().unwrap().1;
    assert_eq!(steps, (1..=total).map(|d| (d, total)).collect::<Vec<_>>());
}

/// A tiny chat model: the tiny Llama GGUF converted (512 tokens of SmolLM2's
/// vocabulary, specials included) with SmolLM2's chat template.
fn tiny_chat_llm(tag: &str) -> sieve::session::Llm {
    let dir = common::converted_tiny_llama(&format!("chat-{tag}"));
    let smol: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir().join("smollm2-135m/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let path = dir.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["chat_template"] = smol["chat_template"].clone();
    std::fs::write(&path, cfg.to_string()).unwrap();
    sieve::session::Llm::load(&dir, &LoadOptions::default()).unwrap()
}

/// A chat turn feeds only what the cache does not hold: the second turn's
/// prompt is exactly the new part of the rendered conversation (the end of
/// the first answer's turn and the new user message), and the answer is the
/// one a fresh session gives for the same history.
#[test]
fn chat_turns_feed_only_the_new_part() {
    let llm = tiny_chat_llm("turns");
    let opts = GenerateOptions {
        max_new_tokens: 6,
        stop_at_eos: false,
        ..Default::default()
    };
    let mut s = llm.session(SessionOptions::default()).unwrap();
    let first = s
        .chat("What is the capital of France?", &opts, |_| true)
        .unwrap();
    let n1 = s.tokens().len();
    let second = s.chat("And of Italy?", &opts, |_| true).unwrap();
    assert_eq!(s.messages().len(), 4);
    assert_eq!(s.messages()[1].content, first.text);
    let tok = &llm.tokenizer;
    let before = tok.apply_chat_template(&s.messages()[..1], true).unwrap()
        + &tok.decode(&first.ids).unwrap();
    let whole = tok.apply_chat_template(&s.messages()[..3], true).unwrap();
    let new_part = whole
        .strip_prefix(&before)
        .expect("the template extends the history");
    let fed = &s.tokens()[n1..n1 + second.stats.prompt_tokens];
    assert_eq!(tok.decode(fed).unwrap(), new_part);
    assert!(new_part.starts_with("<|im_end|>") && new_part.contains("And of Italy?"));
    let history = &s.tokens()[..n1 + second.stats.prompt_tokens];
    let mut fresh = llm.session(SessionOptions::default()).unwrap();
    assert_eq!(
        fresh.generate(history, &opts, |_| true).unwrap().ids,
        second.ids
    );
    // A raw generate in between: the next turn starts over, feeding the
    // whole conversation.
    s.generate(&[40, 41], &opts, |_| true).unwrap();
    let third = s.chat("Thanks.", &opts, |_| true).unwrap();
    let all = llm.chat_prompt(&s.messages()[..5]).unwrap();
    assert_eq!(third.stats.prompt_tokens, all.len());
    assert_eq!(s.tokens().len(), all.len() + third.ids.len());
}

/// Errors of the library API carry a kind an application can match.
#[test]
fn errors_have_kinds_an_application_can_match() {
    use sieve::error::ErrorKind;
    use sieve::session::Llm;
    fn kind<T>(r: Result<T, sieve::error::Error>) -> ErrorKind {
        r.map(|_| ()).unwrap_err().kind()
    }
    let missing = Llm::load(
        std::path::Path::new("/no/such/model"),
        &LoadOptions::default(),
    );
    assert_eq!(kind(missing), ErrorKind::ModelLoading);
    // The tiny converted model has no chat template.
    let dir = common::converted_tiny_llama("kinds");
    let llm = Llm::load(&dir, &LoadOptions::default()).unwrap();
    let chat = llm.chat_prompt(&[sieve::tokenizer::Message::new("user", "hi")]);
    assert_eq!(kind(chat), ErrorKind::Template);
    let too_big = llm.session(SessionOptions {
        max_context: 2_000_000_000,
        ..Default::default()
    });
    assert_eq!(kind(too_big), ErrorKind::GpuOutOfMemory);
    let bad_cache = llm.session(SessionOptions {
        cache: Some(sieve::cache::CacheOptions::new(
            sieve::eviction::Policy::Window,
            16,
            8,
        )),
        ..Default::default()
    });
    assert_eq!(kind(bad_cache), ErrorKind::InvalidOptions);
    let mut s = llm.session(SessionOptions::default()).unwrap();
    let cold = GenerateOptions {
        sampling: SamplingParams {
            temperature: 1e-9,
            ..Default::default()
        },
        ..Default::default()
    };
    assert_eq!(
        kind(s.generate(&[40], &cold, |_| true)),
        ErrorKind::InvalidOptions
    );
    let chat = s.chat("hi", &GenerateOptions::default(), |_| true);
    assert_eq!(kind(chat), ErrorKind::Template);
    assert!(s.messages().is_empty(), "a failed turn leaves no message");
}

/// An application's own wgpu device (as egui, iced or Bevy have one): sieve
/// runs on it without opening another and gives the same tokens; a device
/// created with limits below sieve's needs is refused, naming each limit.
#[test]
fn an_application_device_is_shared() {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapter =
        pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))
            .expect("an adapter");
    let open = |limits: wgpu::Limits| {
        pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            required_limits: limits,
            ..Default::default()
        }))
        .unwrap()
    };
    // Low limits: a clear error, no wgpu validation crash.
    let (device, queue) = open(wgpu::Limits::downlevel_defaults());
    let e = match sieve::gpu::Gpu::from_wgpu(&adapter, device, queue, None) {
        Ok(_) => panic!("a device with downlevel limits was accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("max_storage_buffers_per_shader_stage is 4, sieve needs"),
        "{e}"
    );
    // The adapter's limits: the same greedy tokens as sieve's own device.
    let (device, queue) = open(adapter.limits());
    let gpu = sieve::gpu::Gpu::from_wgpu(&adapter, device, queue, None).unwrap();
    let dir = golden_dir().join("tiny-llama-gqa");
    let model = Model::load_on(gpu, &dir, &LoadOptions::default()).unwrap();
    let tok = Arc::new(Tokenizer::load(&golden_dir().join("smollm2-135m"), &[]).unwrap());
    let mut shared = Session::new(model, tok.clone(), SessionOptions::default()).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 12,
        stop_at_eos: false,
        ..Default::default()
    };
    let got = shared.generate(&PROMPT, &opts, |_| true).unwrap().ids;
    let want = session().generate(&PROMPT, &opts, |_| true).unwrap().ids;
    assert_eq!(got, want);
    // wgpu's default limits (what an application that asks for nothing
    // gets; WebGPU's: 16 KiB of workgroup memory, the least any Vulkan,
    // Metal or DX12 device has): every kernel set runs there and gives the
    // same tokens.
    for set in [KernelSet::Cpu, KernelSet::Gpu, KernelSet::Tuned] {
        let (device, queue) = open(wgpu::Limits::default());
        let gpu = sieve::gpu::Gpu::from_wgpu(&adapter, device, queue, Some(set)).unwrap();
        let model = Model::load_on(gpu, &dir, &LoadOptions::default())
            .unwrap_or_else(|e| panic!("{set:?} kernels on wgpu's default limits: {e:#}"));
        let mut s = Session::new(model, tok.clone(), SessionOptions::default()).unwrap();
        let got = s.generate(&PROMPT, &opts, |_| true).unwrap().ids;
        assert_eq!(got, want, "{set:?} kernels on wgpu's default limits");
    }
}

/// A session whose tokenizer also ends a generation at `eos` (a token the
/// tiny random model does produce).
fn session_with_eos(eos: u32) -> Session {
    let model = Model::load(
        &golden_dir().join("tiny-llama-gqa"),
        &LoadOptions::default(),
    )
    .unwrap();
    let tok = Arc::new(Tokenizer::load(&golden_dir().join("smollm2-135m"), &[eos]).unwrap());
    let opts = SessionOptions {
        max_context: 48,
        prefill_chunk: 16,
        cache: None,
    };
    Session::new(model, tok, opts).unwrap()
}

/// Decode steps submitted ahead (the sampled token passed on on the GPU)
/// give the tokens, stop reasons and cache contents of one step at a time,
/// including the step undone behind an end-of-sequence token, a stop string,
/// sampling with a repetition penalty, a context that fills, a cancel while
/// a step is in flight, and per-kernel profiling (which turns it off).
#[test]
fn decode_steps_submitted_ahead_change_nothing() {
    let sampling = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        repetition_penalty: 1.2,
        seed: 3,
        ..Default::default()
    };
    let base = GenerateOptions {
        max_new_tokens: 20,
        stop_at_eos: false,
        ..Default::default()
    };
    // An end-of-sequence token: the 8th token of a plain greedy run (its
    // first occurrence ends the runs below early).
    let plain = session().generate(&PROMPT, &base, |_| true).unwrap().ids;
    let eos = plain[7];
    let stop: String = {
        let s = session().generate(&PROMPT, &base, |_| true).unwrap().text;
        let chars: Vec<char> = s.chars().collect();
        chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect()
    };
    let cases = [
        ("greedy to the token limit", base.clone()),
        (
            "greedy to end-of-sequence",
            GenerateOptions {
                stop_at_eos: true,
                ..base.clone()
            },
        ),
        (
            "sampled to end-of-sequence",
            GenerateOptions {
                stop_at_eos: true,
                sampling,
                ..base.clone()
            },
        ),
        (
            "a stop string",
            GenerateOptions {
                stop_strings: vec![stop],
                ..base.clone()
            },
        ),
        (
            "the context fills",
            GenerateOptions {
                max_new_tokens: 100,
                sampling,
                ..base.clone()
            },
        ),
    ];
    // A cancel through the handle while a step is in flight (the first
    // callback after three pieces of text).
    let cancelled = (
        "cancelled through the handle",
        GenerateOptions {
            sampling,
            ..base.clone()
        },
    );
    // Per-kernel profiling on: decode goes one step at a time.
    let profiled = ("profiled", base.clone());
    for (what, opts) in cases.into_iter().chain([cancelled, profiled]) {
        let run = |ahead: bool| {
            let opts = GenerateOptions {
                submit_ahead: if ahead {
                    SubmitAhead::Always
                } else {
                    SubmitAhead::Never
                },
                ..opts.clone()
            };
            let mut s = session_with_eos(eos);
            if what == "profiled" {
                s.engine().set_profiling(true);
            }
            let cancel = s.cancel_token();
            let mut pieces = 0;
            let on_text = |p: &str| {
                pieces += !p.is_empty() as usize;
                if what.starts_with("cancelled") && pieces == 3 {
                    cancel.cancel();
                }
                true
            };
            // Two turns: the second shows that what the first left in the
            // cache (and its sampling counter) is the same.
            let a = s.generate(&PROMPT, &opts, on_text).unwrap();
            s.cancel_token().reset();
            let b = s.generate(&PROMPT[..2], &opts, |_| true);
            let b = b.map(|g| (g.ids, g.stats.stop)).map_err(|e| e.kind());
            (
                a.ids,
                a.text,
                a.stats.stop,
                b,
                s.tokens().to_vec(),
                s.engine().n_cached,
            )
        };
        let (one, ahead) = (run(false), run(true));
        assert_eq!(ahead, one, "{what}");
        let want = match what {
            "greedy to the token limit" => Some(StopReason::MaxTokens),
            "greedy to end-of-sequence" => Some(StopReason::Eos),
            "a stop string" => Some(StopReason::StopString),
            "the context fills" => Some(StopReason::ContextFull),
            "cancelled through the handle" => Some(StopReason::Cancelled),
            _ => None,
        };
        assert!(want.is_none_or(|w| one.2 == w), "{what}: {:?}", one.2);
        assert_eq!(one.4.len(), one.5, "{what}: the cache holds the history");
    }
}

/// A bounded-cache session on the tiny Llama (J = 10, h = 3, 2 sinks, 4
/// recent: a refresh every third token) whose tokenizer also ends a
/// generation at `eos`, recording its refreshes.
fn bounded_session(policy: sieve::eviction::Policy, eos: Option<u32>) -> Session {
    let model = Model::load(
        &golden_dir().join("tiny-llama-gqa"),
        &LoadOptions::default(),
    )
    .unwrap();
    let eos: Vec<u32> = eos.into_iter().collect();
    let tok = Arc::new(Tokenizer::load(&golden_dir().join("smollm2-135m"), &eos).unwrap());
    let cache = sieve::cache::CacheOptions {
        sinks: 2,
        recent: 4,
        ..sieve::cache::CacheOptions::new(policy, 10, 3)
    };
    let opts = SessionOptions {
        max_context: 0,
        prefill_chunk: 16,
        cache: Some(cache),
    };
    let mut s = Session::new(model, tok, opts).unwrap();
    s.cache().record = true;
    s
}

/// With an evicting policy, decode steps are submitted ahead between
/// refreshes (the step after a full cache waits for the refresh). That
/// changes nothing: the tokens, stop reasons, the cache's entries and every
/// refresh's scores and kept set are those of one step at a time, for
/// policies that keep state on the GPU (attention-weight sums, EpiKV's
/// previous hidden states) or read each step's signal back, including after
/// a step undone behind an end-of-sequence token (the next turn's first
/// refresh reads the state that step would have changed) and a second turn.
#[test]
fn bounded_cache_decode_submitted_ahead_changes_nothing() {
    use sieve::eviction::Policy;
    let greedy = GenerateOptions {
        max_new_tokens: 24,
        stop_at_eos: false,
        ..Default::default()
    };
    let sampled = GenerateOptions {
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.2,
            seed: 5,
            ..Default::default()
        },
        ..greedy.clone()
    };
    for policy in [
        Policy::Window,
        Policy::H2o,
        Policy::Tova,
        Policy::Epikv,
        Policy::Ccs,
        Policy::WindowSinks,
        Policy::EpikvTova,
    ] {
        let plain = bounded_session(policy, None)
            .generate(&PROMPT, &greedy, |_| true)
            .unwrap()
            .ids;
        // End-of-sequence tokens that end a greedy run with the step feeding
        // them in flight, to be undone: after the 6-token prompt, generated
        // token k is fed ahead for k = 1..=6 (up to C = 13 entries), then
        // token 7 finds the cache full (refresh), token 8 is fed from the
        // host and token 9 ahead; and so on every h = 3. Tokens first
        // generated at such a k (the stop comes at the first occurrence).
        let stops: Vec<usize> = [2, 3, 4, 5, 6, 9, 12, 15]
            .into_iter()
            .filter(|&k| !plain[..k].contains(&plain[k]))
            .take(3)
            .collect();
        assert!(
            !stops.is_empty(),
            "{}: no end-of-sequence token",
            policy.name()
        );
        let mut cases = vec![(None, greedy.clone()), (None, sampled.clone())];
        for &k in &stops {
            let eos = GenerateOptions {
                stop_at_eos: true,
                ..greedy.clone()
            };
            cases.push((Some((k, plain[k])), eos));
        }
        for (stop_at, opts) in cases {
            let eos = stop_at.map(|(_, token)| token);
            let run = |ahead: bool| {
                let opts = GenerateOptions {
                    submit_ahead: if ahead {
                        SubmitAhead::Always
                    } else {
                        SubmitAhead::Never
                    },
                    ..opts.clone()
                };
                let mut s = bounded_session(policy, eos);
                let a = s.generate(&PROMPT, &opts, |_| true).unwrap();
                // Long enough for the first entries it feeds to be scored.
                let on = GenerateOptions {
                    stop_at_eos: false,
                    max_new_tokens: 12,
                    ..opts.clone()
                };
                let b = s.generate(&PROMPT[..2], &on, |_| true).unwrap();
                let trace = serde_json::to_string(&s.cache().trace).unwrap();
                let cache_size = s.cache().slots.len();
                assert_eq!(
                    cache_size,
                    s.engine().n_cached,
                    "the cache's entries are the engine's"
                );
                // A reset session is a fresh one, the policy's state included.
                s.reset();
                let again = s.generate(&PROMPT, &opts, |_| true).unwrap();
                assert_eq!(again.ids, a.ids, "{} after a reset", policy.name());
                (
                    a.ids,
                    a.stats.stop,
                    b.ids,
                    s.tokens().to_vec(),
                    cache_size,
                    trace,
                )
            };
            let (one, ahead) = (run(false), run(true));
            let what = format!("{} (end of sequence {eos:?})", policy.name());
            assert_eq!(ahead, one, "{what}");
            if let Some((k, _)) = stop_at {
                assert_eq!(one.1, StopReason::Eos, "{what}");
                assert_eq!(one.0.len(), k, "{what}: the stop");
            } else {
                assert!(
                    one.5.matches("\"refresh\"").count() >= 8,
                    "{what}: refreshes during the decode"
                );
            }
        }
    }
}

/// A GGUF file's bytes in memory (as a browser page has them) load as the
/// file does: the same tokenizer, chat prompt and greedy tokens; damaged
/// bytes are an error naming the file; nothing is read from disk.
#[test]
fn a_gguf_in_memory_loads_as_the_file_does() {
    use sieve::session::Llm;
    use sieve::tokenizer::Message;
    // The default model's file (scripts/setup.sh): what the browser page loads.
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let bytes = std::fs::read(&file).unwrap();
    let opts = LoadOptions::default();
    let from_file = Llm::load(&file, &opts).unwrap();
    let in_memory = Llm::from_gguf_bytes("page.gguf", bytes.clone(), &opts).unwrap();
    let chat = [Message::new("user", "What is the capital of France?")];
    let prompt = from_file.chat_prompt(&chat).unwrap();
    assert_eq!(in_memory.chat_prompt(&chat).unwrap(), prompt);
    let generate = |llm: &Llm| {
        let mut s = llm.session(SessionOptions::default()).unwrap();
        let opts = GenerateOptions {
            max_new_tokens: 4,
            stop_at_eos: false,
            ..Default::default()
        };
        s.generate(&prompt, &opts, |_| true).unwrap().ids
    };
    assert_eq!(generate(&in_memory), generate(&from_file));
    let e = Llm::from_gguf_bytes("page.gguf", bytes[..bytes.len() / 3].to_vec(), &opts)
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("page.gguf"), "{e}");
}
