//! Log-probabilities of generated tokens against the model's own logits:
//! a greedy generation's reported values are the log-softmax of the
//! logits that produced each token (teacher forced, one pass), the chosen
//! token first among the top entries and the entries sorted; with a
//! penalty or a constraint, the distribution they describe is the one
//! sampled from (a constrained answer's top entries are allowed tokens
//! only); the same alone and batched.

mod common;
use sieve::model::LoadOptions;
use sieve::scheduler::{Scheduler, SchedulerOptions};
use sieve::session::{GenerateOptions, Llm, SessionOptions, SubmitAhead};
use sieve::{Constraint, SamplingParams};

fn llm() -> Llm {
    Llm::load(&common::tiny_text_model(), &LoadOptions::default()).unwrap()
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
    l.iter().map(|&x| x as f64 - m - z.ln()).collect()
}

#[test]
fn greedy_logprobs_are_the_log_softmax_of_the_logits() {
    let llm = llm();
    let prompt = llm.tokenizer.encode("The weather today is").unwrap();
    let mut s = llm.session(SessionOptions::default()).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 12,
        stop_at_eos: false,
        logprobs: Some(5),
        ..Default::default()
    };
    // Steps submitted ahead (a GPU's default) read each step's values from
    // its own staging buffer: the same as one at a time.
    let ahead = GenerateOptions {
        submit_ahead: SubmitAhead::Always,
        ..opts.clone()
    };
    let g = s.generate(&prompt, &ahead, |_| true).unwrap();
    let never = GenerateOptions {
        submit_ahead: SubmitAhead::Never,
        ..opts.clone()
    };
    s.reset();
    let g1 = s.generate(&prompt, &never, |_| true).unwrap();
    assert_eq!(g.ids, g1.ids);
    for (a, b) in g.logprobs.iter().zip(&g1.logprobs) {
        assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} {b:?}");
        let ids = |l: &sieve::kernels::sample::TokenLogprobs| {
            l.top.iter().map(|t| t.0).collect::<Vec<_>>()
        };
        assert_eq!(ids(a), ids(b));
    }
    assert_eq!(g.logprobs.len(), g.ids.len());
    let (_, steps) = common::teacher_forced(&llm.model, &prompt, &g.ids, &[]);
    for (k, ((id, lp), logits)) in g.ids.iter().zip(&g.logprobs).zip(&steps).enumerate() {
        let want = log_softmax(logits);
        assert!(
            (lp.logprob as f64 - want[*id as usize]).abs() < 2e-3,
            "step {k}: {} vs {}",
            lp.logprob,
            want[*id as usize]
        );
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0].0, *id, "step {k}: greedy takes the top entry");
        for w in lp.top.windows(2) {
            assert!(w[0].1 >= w[1].1, "step {k}: sorted");
        }
        for &(t, v) in &lp.top {
            assert!((v as f64 - want[t as usize]).abs() < 2e-3, "step {k}: {t}");
        }
    }
    // Off: nothing reported.
    let g = s
        .generate(
            &prompt,
            &GenerateOptions {
                logprobs: None,
                ..opts.clone()
            },
            |_| true,
        )
        .unwrap();
    assert!(g.logprobs.is_empty());
    // More than 20 top entries: refused.
    let too_many = GenerateOptions {
        logprobs: Some(21),
        ..opts.clone()
    };
    let e = s.generate(&prompt, &too_many, |_| true).unwrap_err();
    assert_eq!(e.kind(), sieve::ErrorKind::InvalidOptions);
}

/// Under a regex that allows digits only, every top entry is a digit token
/// and the chosen token's log-probability is taken over the allowed ones
/// (so it is above its unconstrained value); sampled with a frequency
/// penalty, alone and batched give the same values.
#[test]
fn logprobs_describe_the_distribution_sampled_from() {
    let llm = llm();
    let prompt = llm.tokenizer.encode("Digits:").unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 8,
        sampling: SamplingParams {
            temperature: 0.9,
            frequency_penalty: 0.7,
            seed: 4,
            ..Default::default()
        },
        constraint: Some(Constraint::regex("[0-9]{8}")),
        logprobs: Some(4),
        ..Default::default()
    };
    let mut s = llm.session(SessionOptions::default()).unwrap();
    let alone = s.generate(&prompt, &opts, |_| true).unwrap();
    assert_eq!(alone.ids.len(), 8);
    for lp in &alone.logprobs {
        for &(t, _) in &lp.top {
            let text = llm.tokenizer.decode(&[t]).unwrap();
            assert!(
                text.bytes().all(|b| b.is_ascii_digit()),
                "{text:?} is allowed"
            );
        }
        assert!(lp.logprob <= 0.0 && lp.logprob > -20.0, "{lp:?}");
    }
    let mut sched = Scheduler::new(
        &llm,
        SchedulerOptions {
            max_sequences: 2,
            step_tokens: 64,
            max_context: 128,
            cache: None,
            reuse: false,
        },
    )
    .unwrap();
    let other = GenerateOptions {
        logprobs: None,
        constraint: None,
        ..opts.clone()
    };
    sched.add(&prompt, other, None, |_| true).unwrap();
    let id = sched.add(&prompt, opts.clone(), None, |_| true).unwrap();
    let mut batched = None;
    while sched.active() > 0 {
        for (sid, g) in sched.step().unwrap() {
            if sid == id {
                batched = Some(g);
            }
        }
    }
    let batched = batched.unwrap();
    assert_eq!(batched.ids, alone.ids);
    for (a, b) in alone.logprobs.iter().zip(&batched.logprobs) {
        assert!((a.logprob - b.logprob).abs() < 1e-4);
        assert_eq!(
            a.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            b.top.iter().map(|t| t.0).collect::<Vec<_>>()
        );
    }
}
