//! The library's generation API on the tiny Llama (random weights, vocabulary
//! of 512) with SmolLM2's byte-level tokenizer: seeds, stop strings, streaming,
//! cancellation, limits and multi-turn positions.

mod common;
use common::golden_dir;
use sieve::kernels::sample::SamplingParams;
use sieve::model::{LoadOptions, Model};
use sieve::session::{GenerateOptions, Session, SessionOptions, StopReason};
use sieve::tokenizer::Tokenizer;
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
    let cancel = s.cancel_handle();
    let mut first = String::new();
    let out = s
        .generate(&PROMPT, &opts, |p| {
            first.push_str(p);
            cancel.store(true, std::sync::atomic::Ordering::Relaxed);
            true
        })
        .unwrap();
    assert_eq!(out.stats.stop, StopReason::Cancelled);
    assert_eq!(out.text, first);
    assert!(out.ids.len() < 40);
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
    s.reset();
    assert_eq!(s.generate(&PROMPT, &opts, |_| true).unwrap().ids, fresh.ids);
}
