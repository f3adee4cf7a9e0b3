//! The scheduler (many generations stepped together) against each
//! generation run alone in a `Session`: the same tokens, text and stop
//! reason, with different prompts, lengths, caches and policies, sequences
//! joining when a place frees up (on the KV cache its last sequence left),
//! and a cancel; and its refusals.

mod common;
use common::golden_dir;
use sieve::cache::CacheOptions;
use sieve::eviction::Policy;
use sieve::kernels::sample::SamplingParams;
use sieve::model::{LoadOptions, Model};
use sieve::scheduler::{Scheduler, SchedulerOptions, SequenceId};
use sieve::session::{GenerateOptions, Generation, Llm, SessionOptions, StopReason};
use sieve::tokenizer::Tokenizer;
use sieve::ErrorKind;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

fn llm() -> Llm {
    let model = Model::load(
        &golden_dir().join("tiny-llama-gqa"),
        &LoadOptions::default(),
    )
    .unwrap();
    let tokenizer = Arc::new(Tokenizer::load(&golden_dir().join("smollm2-135m"), &[]).unwrap());
    Llm { model, tokenizer }
}

/// A session of 256 slots reading prompts 16 tokens a step.
fn session(llm: &Llm, cache: Option<CacheOptions>) -> sieve::session::Session {
    llm.session(SessionOptions {
        max_context: 256,
        prefill_chunk: 16,
        cache,
    })
    .unwrap()
}

/// (prompt, options, cache) of each generation.
fn jobs() -> Vec<(Vec<u32>, GenerateOptions, Option<CacheOptions>)> {
    let opts = |max_new_tokens, repetition_penalty| GenerateOptions {
        max_new_tokens,
        sampling: SamplingParams {
            repetition_penalty,
            ..Default::default()
        },
        stop_at_eos: false,
        ..Default::default()
    };
    let bounded = |policy: &str| CacheOptions {
        sinks: 2,
        recent: 4,
        ..CacheOptions::new(Policy::parse(policy).unwrap(), 20, 6)
    };
    let prompt = |seed: u32, n: u32| -> Vec<u32> {
        (0..n).map(|i| 100 + (seed * 37 + i * 11) % 400).collect()
    };
    vec![
        (prompt(1, 9), opts(20, 1.0), None),
        (prompt(2, 40), opts(30, 1.0), Some(bounded("window"))),
        (prompt(3, 5), opts(12, 1.1), Some(bounded("epikv"))),
        (prompt(4, 31), opts(25, 1.0), Some(bounded("tova"))),
        (prompt(5, 17), opts(16, 1.0), None),
        // A kept set per (layer, KV head): its engine keeps its own slot
        // positions beside the pool's cache.
        (
            prompt(6, 33),
            opts(20, 1.0),
            Some(CacheOptions {
                granularity: sieve::cache::Granularity::Head,
                ..bounded("keydiff")
            }),
        ),
    ]
}

#[test]
fn stepped_together_each_generation_is_what_it_is_alone() {
    let llm = llm();
    let alone: Vec<Generation> = jobs()
        .into_iter()
        .map(|(prompt, opts, cache)| {
            session(&llm, cache)
                .generate(&prompt, &opts, |_| true)
                .unwrap()
        })
        .collect();
    let mut scheduler = Scheduler::new(
        &llm,
        SchedulerOptions {
            max_sequences: 3,
            step_tokens: 24,
            max_context: 256,
            cache: None,
            reuse: false,
        },
    )
    .unwrap();
    let streamed: Arc<Mutex<BTreeMap<u64, String>>> = Default::default();
    let mut ids: Vec<SequenceId> = vec![];
    let mut done: BTreeMap<SequenceId, Generation> = BTreeMap::new();
    let mut pending = jobs().into_iter();
    let mut next = pending.next();
    while next.is_some() || scheduler.active() > 0 {
        // Join whenever a place is free: the first three at once, the rest
        // as others finish.
        while let Some((prompt, opts, cache)) = next.take() {
            let out = streamed.clone();
            let n = ids.len() as u64;
            match scheduler.add(&prompt, opts.clone(), cache, move |piece| {
                out.lock().unwrap().entry(n).or_default().push_str(piece);
                true
            }) {
                Ok(id) => {
                    ids.push(id);
                    next = pending.next();
                }
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::InvalidOptions);
                    assert!(e.to_string().contains("all 3 sequences"), "{e}");
                    next = Some((prompt, opts, cache));
                    break;
                }
            }
        }
        done.extend(scheduler.step().unwrap());
    }
    assert_eq!(done.len(), alone.len());
    let streamed = streamed.lock().unwrap();
    for (i, want) in alone.iter().enumerate() {
        let got = &done[&ids[i]];
        assert_eq!(got.ids, want.ids, "generation {i}");
        assert_eq!(got.text, want.text, "generation {i}");
        assert_eq!(got.stats.stop, want.stats.stop, "generation {i}");
        assert_eq!(
            streamed.get(&(i as u64)).cloned().unwrap_or_default(),
            want.text
        );
    }
}

/// A cancelled sequence ends within a step with `Cancelled` and frees its
/// place; the others go on. Bad sequences are refused with their kind.
#[test]
fn cancels_and_refusals() {
    let llm = llm();
    let opts = SchedulerOptions {
        max_sequences: 2,
        step_tokens: 8,
        max_context: 64,
        cache: None,
        reuse: false,
    };
    let mut scheduler = Scheduler::new(&llm, opts).unwrap();
    let long = GenerateOptions {
        max_new_tokens: 40,
        stop_at_eos: false,
        ..Default::default()
    };
    let a = scheduler
        .add(&[300, 301, 302], long.clone(), None, |_| true)
        .unwrap();
    let b = scheduler
        .add(&[310, 311], long.clone(), None, |_| true)
        .unwrap();
    for _ in 0..3 {
        assert!(scheduler.step().unwrap().is_empty());
    }
    scheduler.cancel_token(a).unwrap().cancel();
    let finished = scheduler.step().unwrap();
    assert_eq!(finished.len(), 1);
    let (id, g) = &finished[0];
    assert_eq!((*id, g.stats.stop), (a, StopReason::Cancelled));
    assert!(g.stats.generated_tokens < 40);
    assert_eq!(scheduler.active(), 1);
    // Its place is free again.
    let c = scheduler.add(&[320], long.clone(), None, |_| true).unwrap();
    let rest: BTreeMap<SequenceId, Generation> = scheduler.run().unwrap().into_iter().collect();
    assert_eq!(rest[&b].stats.stop, StopReason::MaxTokens);
    assert_eq!(rest[&c].stats.stop, StopReason::MaxTokens);

    let refused = |prompt: &[u32], opts: GenerateOptions| {
        let mut s = Scheduler::new(
            &llm,
            SchedulerOptions {
                max_context: 16,
                ..opts_small()
            },
        )
        .unwrap();
        s.add(prompt, opts, None, |_| true).unwrap_err()
    };
    assert_eq!(refused(&[], long.clone()).kind(), ErrorKind::InvalidOptions);
    assert_eq!(
        refused(&[1_000_000], long.clone()).kind(),
        ErrorKind::InvalidOptions
    );
    let too_long: Vec<u32> = (0..17).collect();
    assert_eq!(
        refused(&too_long, long.clone()).kind(),
        ErrorKind::PromptTooLong
    );
    let bad_sampling = GenerateOptions {
        sampling: SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        ..long
    };
    assert_eq!(
        refused(&[5], bad_sampling).kind(),
        ErrorKind::InvalidOptions
    );
    let e = Scheduler::new(
        &llm,
        SchedulerOptions {
            step_tokens: 1,
            ..opts_small()
        },
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("step_tokens 1"), "{e}");
    // A cache larger than a sequence of the pool; a pool larger than the device.
    let mut s = Scheduler::new(&llm, opts_small()).unwrap();
    let e = s
        .add(
            &[5],
            GenerateOptions::default(),
            Some(CacheOptions::new(Policy::Window, 100, 8)),
            |_| true,
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidOptions);
    assert!(
        e.to_string().contains("108 slots") && e.to_string().contains("holds 64"),
        "{e}"
    );
    let e = Scheduler::new(
        &llm,
        SchedulerOptions {
            max_sequences: 4,
            max_context: 1 << 40,
            ..opts_small()
        },
    )
    .err()
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::GpuOutOfMemory);
    assert!(e.to_string().contains("KV pool of 4 sequences"), "{e}");
}

fn opts_small() -> SchedulerOptions {
    SchedulerOptions {
        max_sequences: 2,
        step_tokens: 8,
        max_context: 64,
        cache: None,
        reuse: false,
    }
}

/// Two sequences of 256 slots, 16 tokens a step.
fn small_scheduler(llm: &Llm, reuse: bool) -> Scheduler {
    let opts = SchedulerOptions {
        max_sequences: 2,
        step_tokens: 16,
        max_context: 256,
        cache: None,
        reuse,
    };
    Scheduler::new(llm, opts).unwrap()
}

/// A scheduler can live on a worker thread.
#[test]
fn a_scheduler_is_send() {
    fn send<T: Send>() {}
    send::<Scheduler>();
}

/// With `reuse`, a finished sequence's cache serves a later prompt that
/// continues it: only the new part is fed (`cached_tokens` counts the
/// rest), and the tokens are those of a `Session` that continues the
/// conversation; a full cache also serves a prompt that shares only a
/// prefix with it. A cache of other options is not reused, and a parked
/// cache gives way when the pool needs its place.
#[test]
fn a_finished_sequence_serves_the_prompt_that_continues_it() {
    let llm = llm();
    let first: Vec<u32> = (0..20).map(|i| 100 + (i * 13) % 300).collect();
    let more: Vec<u32> = vec![401, 402, 403, 404, 405];
    let opts = |n| GenerateOptions {
        max_new_tokens: n,
        stop_at_eos: false,
        ..Default::default()
    };
    let window = CacheOptions {
        sinks: 2,
        recent: 4,
        ..CacheOptions::new(Policy::Window, 16, 6)
    };
    for cache in [None, Some(window)] {
        // A session continuing the conversation.
        let mut session = session(&llm, cache);
        let turn1 = session.generate(&first, &opts(10), |_| true).unwrap();
        let turn2 = session.generate(&more, &opts(8), |_| true).unwrap();
        let mut scheduler = Scheduler::new(
            &llm,
            SchedulerOptions {
                max_sequences: 1,
                step_tokens: 16,
                max_context: 256,
                cache: None,
                reuse: true,
            },
        )
        .unwrap();
        scheduler.add(&first, opts(10), cache, |_| true).unwrap();
        let (_, g1) = scheduler.run().unwrap().remove(0);
        assert_eq!(g1.ids, turn1.ids);
        let history: Vec<u32> = first.iter().chain(&g1.ids).copied().collect();
        let prompt: Vec<u32> = history.iter().chain(&more).copied().collect();
        scheduler.add(&prompt, opts(8), cache, |_| true).unwrap();
        let (_, g2) = scheduler.run().unwrap().remove(0);
        assert_eq!(g2.stats.cached_tokens, history.len(), "{cache:?}");
        assert_eq!(g2.stats.prompt_tokens, more.len());
        assert_eq!(g2.ids, turn2.ids, "{cache:?}");
        if cache.is_some() {
            // Other options: fed afresh (the parked cache gives way).
            let other = CacheOptions::new(Policy::Window, 20, 6);
            let other = CacheOptions {
                sinks: 2,
                recent: 4,
                ..other
            };
            scheduler
                .add(&prompt, opts(2), Some(other), |_| true)
                .unwrap();
            let (_, g) = scheduler.run().unwrap().remove(0);
            assert_eq!(g.stats.cached_tokens, 0);
            continue;
        }
        // A prompt sharing only the first 12 tokens: the full cache keeps
        // those, and the answer is that of the prompt alone.
        let branch: Vec<u32> = first[..12].iter().chain(&more).copied().collect();
        scheduler.add(&branch, opts(6), None, |_| true).unwrap();
        let (_, g) = scheduler.run().unwrap().remove(0);
        assert_eq!(g.stats.cached_tokens, 12);
        let mut alone = llm
            .session(SessionOptions {
                max_context: 256,
                prefill_chunk: 16,
                cache: None,
            })
            .unwrap();
        assert_eq!(
            g.ids,
            alone.generate(&branch, &opts(6), |_| true).unwrap().ids
        );
    }
}

/// A short prompt added while a long one is being read gets its answer
/// within a few steps: prompt chunks go shortest first, the long prompt
/// takes the rest of each step.
#[test]
fn a_short_prompt_is_not_stuck_behind_a_long_one() {
    let llm = llm();
    let mut scheduler = small_scheduler(&llm, false);
    let opts = |n| GenerateOptions {
        max_new_tokens: n,
        stop_at_eos: false,
        ..Default::default()
    };
    let long: Vec<u32> = (0..160).map(|i| 100 + i % 300).collect();
    let long_id = scheduler.add(&long, opts(1), None, |_| true).unwrap();
    assert!(scheduler.step().unwrap().is_empty());
    let short_id = scheduler.add(&[7, 8, 9], opts(1), None, |_| true).unwrap();
    let mut finished = vec![];
    for _ in 0..3 {
        finished.extend(scheduler.step().unwrap().into_iter().map(|(id, _)| id));
    }
    assert_eq!(finished, vec![short_id], "the short prompt waited");
    let rest = scheduler.run().unwrap();
    assert_eq!(rest[0].0, long_id);
}

/// While the pool has a free cache, a prompt that shares only a prefix
/// with a parked conversation (a chat template's first tokens, say) does
/// not take and cut its cache: the conversation's next turn still finds it
/// whole.
#[test]
fn a_parked_conversation_is_not_cut_while_a_cache_is_free() {
    let llm = llm();
    let mut scheduler = small_scheduler(&llm, true);
    let opts = GenerateOptions {
        max_new_tokens: 4,
        stop_at_eos: false,
        ..Default::default()
    };
    let a: Vec<u32> = (0..12).map(|i| 100 + i).collect();
    scheduler.add(&a, opts.clone(), None, |_| true).unwrap();
    let (_, first) = scheduler.run().unwrap().remove(0);
    // Another conversation with the same first 5 tokens.
    let b: Vec<u32> = a[..5].iter().chain(&[300, 301, 302]).copied().collect();
    scheduler.add(&b, opts.clone(), None, |_| true).unwrap();
    let (_, other) = scheduler.run().unwrap().remove(0);
    assert_eq!(other.stats.cached_tokens, 0);
    // The first conversation's next turn.
    let next: Vec<u32> = a
        .iter()
        .chain(&first.ids)
        .chain(&[400, 401])
        .copied()
        .collect();
    scheduler.add(&next, opts, None, |_| true).unwrap();
    let (_, second) = scheduler.run().unwrap().remove(0);
    assert_eq!(second.stats.cached_tokens, a.len() + first.ids.len());
}

/// Short prompts arriving without end do not starve a long one: it reads a
/// chunk every few steps (shortest first alone, it gets none while four
/// short prompts at a time take every step's tokens), also when so many
/// wait that short ones are overdue too (the longest wait goes first: 31
/// steps with 12 sequences, 98 when the overdue went shortest first).
#[test]
fn a_long_prompt_is_not_starved_by_short_ones() {
    for (sequences, bound) in [(5, 25), (12, 45)] {
        long_prompt_among_short_ones(sequences, bound);
    }
}

fn long_prompt_among_short_ones(sequences: usize, bound: usize) {
    let llm = llm();
    let opts = SchedulerOptions {
        max_sequences: sequences,
        step_tokens: 16,
        max_context: 256,
        cache: None,
        reuse: false,
    };
    let mut scheduler = Scheduler::new(&llm, opts).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 1,
        stop_at_eos: false,
        ..Default::default()
    };
    let long: Vec<u32> = (0..64).map(|i| 100 + i).collect();
    let long_id = scheduler.add(&long, opts.clone(), None, |_| true).unwrap();
    let short: Vec<u32> = (0..16).map(|i| 300 + i).collect();
    for step in 0..400 {
        while scheduler.active() < sequences {
            scheduler.add(&short, opts.clone(), None, |_| true).unwrap();
        }
        if scheduler
            .step()
            .unwrap()
            .iter()
            .any(|(id, _)| *id == long_id)
        {
            // 4 chunks of 16; with 5 sequences each after at most 4 steps
            // without one.
            assert!(
                step <= bound,
                "{sequences} sequences: the long prompt took {step} steps"
            );
            return;
        }
    }
    panic!("{sequences} sequences: the long prompt never finished while short ones kept coming");
}
