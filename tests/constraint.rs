//! Constrained sampling end to end: the 20 schemas of tests/data/schemas.json
//! (nested objects, arrays with item bounds, enums, bounded numbers,
//! patterns, optional fields, `anyOf`, `$defs`, null) on SmolLM2 (the real
//! model) and a tiny random Llama, greedy and sampled, six at once on the
//! scheduler, with the full cache and with eviction. Every output that ends
//! by itself parses and is valid under its schema, checked by the
//! `jsonschema` crate (an implementation independent of llguidance). A
//! constrained answer is the same alone in a session and batched; regular
//! expressions and Lark grammars hold; bad constraints are refused with
//! their kind; `max_tokens` cuts a constraint with `MaxTokens`.

mod common;
use serde_json::Value;
use sieve::cache::CacheOptions;
use sieve::eviction::Policy;
use sieve::kernels::sample::SamplingParams;
use sieve::model::LoadOptions;
use sieve::scheduler::{Scheduler, SchedulerOptions};
use sieve::session::{GenerateOptions, Generation, Llm, SessionOptions, StopReason, SubmitAhead};
use sieve::tokenizer::Message;
use sieve::{Constraint, ErrorKind};

struct Case {
    name: String,
    prompt: String,
    schema: Value,
}

fn cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/schemas.json");
    let all: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    all.into_iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            prompt: c["prompt"].as_str().unwrap().to_string(),
            schema: c["schema"].clone(),
        })
        .collect()
}

/// A 2-layer Llama with random weights and SmolLM2's tokenizer: the golden
/// tiny models' 512-token vocabularies cannot spell a schema's keys the
/// way llguidance asks for them (as the tokenizer splits them, "name" is
/// one token, number 1,245 in SmolLM2's vocabulary).
fn tiny_llama() -> Llm {
    Llm::load(&common::tiny_text_model(), &LoadOptions::default()).unwrap()
}

fn tiny_prompt(seed: u32) -> Vec<u32> {
    (0..12).map(|i| 20 + (seed * 37 + i * 11) % 4000).collect()
}

fn smollm2() -> Option<Llm> {
    let gguf = common::real_model_file(
        "SIEVE_GGUF",
        "models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "scripts/setup.sh",
    )?;
    Some(Llm::load(&gguf, &LoadOptions::default()).unwrap())
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed,
        ..Default::default()
    }
}

fn options(schema: &Value, sampling: SamplingParams, max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampling,
        constraint: Some(Constraint::json_schema(schema)),
        ..Default::default()
    }
}

/// Runs `jobs` (prompt, options) on a scheduler, `parallel` at once, each
/// with `cache`; the generations in the jobs' order.
fn run_batched(
    llm: &Llm,
    jobs: &[(Vec<u32>, GenerateOptions)],
    parallel: usize,
    cache: Option<CacheOptions>,
) -> Vec<Generation> {
    let mut scheduler = Scheduler::new(
        llm,
        SchedulerOptions {
            max_sequences: parallel,
            step_tokens: 256,
            max_context: 512,
            cache,
            reuse: false,
        },
    )
    .unwrap();
    let mut ids = vec![];
    let mut done = std::collections::BTreeMap::new();
    let mut pending = jobs.iter();
    loop {
        while scheduler.active() < parallel {
            let Some((prompt, opts)) = pending.next() else {
                break;
            };
            ids.push(scheduler.add(prompt, opts.clone(), None, |_| true).unwrap());
        }
        if scheduler.active() == 0 {
            break;
        }
        for (id, g) in scheduler.step().unwrap() {
            done.insert(id, g);
        }
        assert!(scheduler.take_failed().is_empty());
    }
    ids.iter().map(|id| done.remove(id).unwrap()).collect()
}

/// The output of `g` for `case` parses and is valid under its schema, and
/// ended by itself.
fn check_valid(case: &Case, g: &Generation, what: &str) {
    assert!(
        matches!(
            g.stats.stop,
            StopReason::ConstraintComplete | StopReason::Eos
        ),
        "{what} {}: stopped by {:?} after {:?}",
        case.name,
        g.stats.stop,
        g.text
    );
    let value: Value = serde_json::from_str(&g.text)
        .unwrap_or_else(|e| panic!("{what} {}: {:?} is not JSON: {e}", case.name, g.text));
    let validator = jsonschema::validator_for(&case.schema).unwrap();
    if let Err(e) = validator.validate(&value) {
        panic!("{what} {}: {} is not valid: {e}", case.name, g.text);
    }
}

fn chat_ids(llm: &Llm, prompt: &str) -> Vec<u32> {
    llm.chat_prompt(&[Message::new("user", prompt)]).unwrap()
}

/// SmolLM2, six at once: every third schema sampled with the full cache;
/// then four with a window cache small enough that the prompt itself is
/// evicted from. (All 20 greedy run through `sieve serve` in
/// tests/openai_client.py, validated by Python's jsonschema. The
/// probability's `multipleOf`: without it, one sampled run wrote
/// "0.1394337487311755...666666" to max_tokens, a number JSON allows.)
#[test]
fn schemas_hold_on_smollm2_sampled_and_evicting() {
    let Some(llm) = smollm2() else { return };
    let cases = cases();
    let sampled_cases: Vec<usize> = (0..cases.len()).step_by(3).collect();
    let run: Vec<_> = (sampled_cases.iter())
        .map(|&i| {
            let ids = chat_ids(&llm, &cases[i].prompt);
            (ids, options(&cases[i].schema, sampled(i as u64), 120))
        })
        .collect();
    let out = run_batched(&llm, &run, 6, None);
    for (&i, g) in sampled_cases.iter().zip(&out) {
        eprintln!("sampled {}: {:?} {}", cases[i].name, g.stats.stop, g.text);
    }
    for (&i, g) in sampled_cases.iter().zip(&out) {
        check_valid(&cases[i], g, "sampled");
    }
    let window = CacheOptions {
        sinks: 4,
        recent: 8,
        ..CacheOptions::new(Policy::parse("window").unwrap(), 24, 8)
    };
    let evicting = [0, 5, 10, 16];
    let run: Vec<_> = (evicting.iter())
        .map(|&i| {
            (
                chat_ids(&llm, &cases[i].prompt),
                options(&cases[i].schema, sampled(50), 120),
            )
        })
        .collect();
    let out = run_batched(&llm, &run, 6, Some(window));
    for (&i, g) in evicting.iter().zip(&out) {
        check_valid(&cases[i], g, "evicting");
    }
}

/// The tiny random Llama follows every schema too (its text is noise, so
/// this is where unusual tokens meet the masks), greedy and sampled, six at
/// once, and with an evicting policy.
#[test]
fn every_schema_holds_on_a_tiny_random_model() {
    let llm = tiny_llama();
    let cases = cases();
    let mut jobs = vec![];
    for (i, case) in cases.iter().enumerate() {
        let ids = tiny_prompt(i as u32);
        jobs.push((
            ids.clone(),
            options(&case.schema, SamplingParams::GREEDY, 400),
        ));
        jobs.push((ids, options(&case.schema, sampled(100 + i as u64), 400)));
    }
    let tova = CacheOptions {
        sinks: 2,
        recent: 4,
        ..CacheOptions::new(Policy::parse("tova").unwrap(), 24, 8)
    };
    for cache in [None, Some(tova)] {
        let out = run_batched(&llm, &jobs, 6, cache);
        let mut complete = 0;
        for (i, g) in out.iter().enumerate() {
            // A random model may wander in a string or a number without
            // end: cut by max_tokens, its text is a prefix, not checked.
            if g.stats.stop != StopReason::MaxTokens {
                check_valid(&cases[i / 2], g, "tiny");
                complete += 1;
            }
        }
        assert!(
            complete >= out.len() / 2,
            "{complete} of {} complete",
            out.len()
        );
    }
}

/// A constrained answer is the same alone in a session and among others on
/// the scheduler (same seed), greedy and sampled; and the same in a session
/// whether each step is submitted ahead of the token before it (its mask
/// computed while the GPU runs that step's layers) or not, with the full
/// cache and with an evicting one.
#[test]
fn constrained_answers_are_the_same_alone_and_batched() {
    let llm = tiny_llama();
    let cases = cases();
    let jobs: Vec<_> = (cases.iter().take(6).enumerate())
        .map(|(i, c)| {
            let sampling = if i % 2 == 0 {
                SamplingParams::GREEDY
            } else {
                sampled(i as u64)
            };
            (tiny_prompt(i as u32), options(&c.schema, sampling, 60))
        })
        .collect();
    let batched = run_batched(&llm, &jobs, 6, None);
    for ((prompt, opts), b) in jobs.iter().zip(&batched) {
        let mut s = llm
            .session(SessionOptions {
                max_context: 512,
                ..Default::default()
            })
            .unwrap();
        let alone = s.generate(prompt, opts, |_| true).unwrap();
        assert_eq!(alone.ids, b.ids);
        assert_eq!(alone.stats.stop, b.stats.stop);
    }
    let tova = CacheOptions {
        sinks: 2,
        recent: 4,
        ..CacheOptions::new(Policy::parse("tova").unwrap(), 24, 8)
    };
    for cache in [None, Some(tova)] {
        for (prompt, opts) in &jobs {
            let run = |submit_ahead| {
                let mut s = llm
                    .session(SessionOptions {
                        max_context: 512,
                        cache,
                        ..Default::default()
                    })
                    .unwrap();
                let opts = GenerateOptions {
                    submit_ahead,
                    ..opts.clone()
                };
                s.generate(prompt, &opts, |_| true).unwrap()
            };
            let (ahead, one_by_one) = (run(SubmitAhead::Always), run(SubmitAhead::Never));
            assert_eq!(ahead.ids, one_by_one.ids, "cache {cache:?}");
            assert!(ahead.stats.mask_seconds > 0.0);
        }
    }
}

/// Regular expressions and Lark grammars hold in a session, greedy and
/// sampled; the generation ends when the pattern is complete.
#[test]
fn regexes_and_grammars_hold() {
    let llm = tiny_llama();
    let prompt = tiny_prompt(7);
    let grammar = r#"
start: "ID-" digits ("/" word)?
digits: /[0-9]{2,4}/
word: /[a-z]{1,6}/
"#;
    let cases = [
        (
            Constraint::regex("[0-9]{3}-[a-z]{2,5}"),
            "^[0-9]{3}-[a-z]{2,5}$",
        ),
        (Constraint::regex("(yes|no)"), "^(yes|no)$"),
        (
            Constraint::grammar(grammar),
            "^ID-[0-9]{2,4}(/[a-z]{1,6})?$",
        ),
    ];
    for (constraint, pattern) in cases {
        let rx = regex_lite(pattern);
        for sampling in [SamplingParams::GREEDY, sampled(5), sampled(6)] {
            let mut s = llm.session(SessionOptions::default()).unwrap();
            let opts = GenerateOptions {
                max_new_tokens: 40,
                sampling,
                constraint: Some(constraint.clone()),
                ..Default::default()
            };
            let g = s
                .generate(&prompt, &opts, |p| {
                    eprint!("[{p}]");
                    true
                })
                .unwrap_or_else(|e| panic!("{constraint:?} {sampling:?}: {e}"));
            assert!(
                rx(&g.text),
                "{constraint:?}: {:?} ({:?})",
                g.text,
                g.stats.stop
            );
            assert_ne!(g.stats.stop, StopReason::MaxTokens, "{:?}", g.text);
        }
    }
}

/// A minimal matcher for the anchored patterns above (digits, lowercase
/// letters, literal text, counted repetition, one optional group,
/// alternation of words), so the test does not check llguidance with
/// llguidance.
fn regex_lite(pattern: &str) -> impl Fn(&str) -> bool {
    let pattern = pattern.to_string();
    move |text: &str| match pattern.as_str() {
        "^[0-9]{3}-[a-z]{2,5}$" => {
            let (a, b) = text.split_once('-').unwrap_or(("", ""));
            a.len() == 3
                && a.bytes().all(|c| c.is_ascii_digit())
                && (2..=5).contains(&b.len())
                && b.bytes().all(|c| c.is_ascii_lowercase())
        }
        "^(yes|no)$" => text == "yes" || text == "no",
        "^ID-[0-9]{2,4}(/[a-z]{1,6})?$" => {
            let Some(rest) = text.strip_prefix("ID-") else {
                return false;
            };
            let (digits, word) = match rest.split_once('/') {
                Some((d, w)) => (d, Some(w)),
                None => (rest, None),
            };
            (2..=4).contains(&digits.len())
                && digits.bytes().all(|c| c.is_ascii_digit())
                && word.is_none_or(|w| {
                    (1..=6).contains(&w.len()) && w.bytes().all(|c| c.is_ascii_lowercase())
                })
        }
        _ => unreachable!("{pattern}"),
    }
}

/// Bad schemas, regular expressions and grammars are refused before any
/// step with `InvalidConstraint`, by the session, the scheduler and
/// `Llm::check_constraint`; a constraint cut by max_tokens ends with
/// `MaxTokens`.
#[test]
fn bad_constraints_are_refused_and_cuts_end_with_max_tokens() {
    let llm = tiny_llama();
    let prompt = tiny_prompt(8);
    for bad in [
        Constraint::json_schema(
            &serde_json::json!({"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
        ),
        Constraint::json_schema(&serde_json::json!({"$ref": "#/$defs/missing"})),
        Constraint::json_schema(&serde_json::json!([1, 2])),
        Constraint::regex("(unclosed"),
        Constraint::grammar("start: undefined_rule"),
        Constraint::grammar("this is not lark"),
    ] {
        let e = llm.check_constraint(&bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConstraint, "{bad:?}: {e}");
        let opts = GenerateOptions {
            constraint: Some(bad.clone()),
            ..Default::default()
        };
        let mut s = llm.session(SessionOptions::default()).unwrap();
        let e = s.generate(&prompt, &opts, |_| true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConstraint, "{bad:?}: {e}");
        assert!(s.tokens().is_empty(), "nothing was fed");
        let mut sched = Scheduler::new(
            &llm,
            SchedulerOptions {
                max_sequences: 1,
                step_tokens: 16,
                max_context: 64,
                cache: None,
                reuse: false,
            },
        )
        .unwrap();
        let e = sched.add(&prompt, opts, None, |_| true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConstraint, "{bad:?}: {e}");
    }
    let schema = &cases()[3].schema;
    let mut s = llm.session(SessionOptions::default()).unwrap();
    let g = s
        .generate(&prompt, &options(schema, SamplingParams::GREEDY, 3), |_| {
            true
        })
        .unwrap();
    assert_eq!((g.stats.stop, g.ids.len()), (StopReason::MaxTokens, 3));
    assert!(g.text.starts_with('{'), "{:?}", g.text);
}

fn weather_tools(choice: sieve::tools::ToolChoice, parallel: bool) -> sieve::tools::ToolSet {
    use sieve::tools::{Tool, ToolSet};
    ToolSet {
        tools: vec![
            Tool {
                name: "get_weather".into(),
                description: Some("The weather in a city".into()),
                parameters: serde_json::json!({"type": "object", "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": false}),
            },
            Tool {
                name: "get_time".into(),
                description: None,
                parameters: serde_json::json!({"type": "object", "properties": {
                    "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                    "required": ["zone"], "additionalProperties": false}),
            },
        ],
        choice,
        parallel,
    }
}

/// Tool-call grammars: a required choice gives only calls, each a tool of
/// the set with arguments valid under its parameters; a named choice calls
/// that tool; auto gives text or calls, and whatever follows `<tool_call>`
/// is a valid call. Greedy and sampled on the random tiny model.
#[test]
fn tool_call_grammars_hold() {
    use sieve::tools::{parse, ToolChoice};
    let llm = tiny_llama();
    let validators: Vec<_> = weather_tools(ToolChoice::Auto, true)
        .tools
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                jsonschema::validator_for(&t.parameters).unwrap(),
            )
        })
        .collect();
    let choices = [
        (ToolChoice::Required, true),
        (ToolChoice::Required, false),
        (ToolChoice::Named("get_time".into()), false),
        (ToolChoice::Auto, true),
    ];
    for (choice, parallel) in choices {
        let set = weather_tools(choice.clone(), parallel);
        let constraint = set.constraint().unwrap();
        llm.check_constraint(&constraint).unwrap();
        for (k, sampling) in [SamplingParams::GREEDY, sampled(21)]
            .into_iter()
            .enumerate()
        {
            let mut s = llm.session(SessionOptions::default()).unwrap();
            let opts = GenerateOptions {
                max_new_tokens: 100,
                sampling,
                constraint: Some(constraint.clone()),
                ..Default::default()
            };
            let g = s
                .generate(&tiny_prompt(30 + k as u32), &opts, |_| true)
                .unwrap();
            let what = format!(
                "{choice:?} parallel {parallel} run {k}: {:?} {:?}",
                g.stats.stop, g.text
            );
            let (content, calls) = parse(&g.text);
            // Every `<tool_call>` written is a call (none is left as
            // text), but one max_tokens cut short.
            let cut = (g.stats.stop == StopReason::MaxTokens) as usize;
            let written = g.text.matches("<tool_call>").count();
            assert!(
                (calls.len()..=calls.len() + cut).contains(&written),
                "{what}"
            );
            if choice != ToolChoice::Auto {
                // Random weights may call again and again when they may.
                assert!(parallel || g.stats.stop != StopReason::MaxTokens, "{what}");
                assert_eq!(content, None, "{what}");
                assert!(!calls.is_empty(), "{what}");
                assert!(parallel || calls.len() == 1, "{what}");
            }
            for call in &calls {
                if let ToolChoice::Named(name) = &choice {
                    assert_eq!(&call.name, name, "{what}");
                }
                let (_, v) = validators
                    .iter()
                    .find(|(n, _)| *n == call.name)
                    .expect(&what);
                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                assert!(v.is_valid(&args), "{what}");
            }
        }
    }
    assert_eq!(weather_tools(ToolChoice::None, true).constraint(), None);
}
