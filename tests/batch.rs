//! Several sequences in one step (`engine::Batch`) against each sequence
//! run alone: the same greedy tokens (and logits, within 1e-4), with sequences of different prompts
//! and depths, a prompt read in the same step as other sequences' decode
//! tokens, and sequences joining and leaving, on both tiny golden models
//! with both kernel sets.

mod common;
use common::*;
use sieve::device::KernelSet;
use sieve::engine::{Batch, Engine, EngineOptions, SeqStep, StepOutput};
use sieve::formats::WeightFormat;
use sieve::gpu::GpuOptions;
use sieve::kernels::sample::SamplingParams;
use sieve::model::{LoadOptions, Model};
use std::sync::Arc;

const SLOTS: usize = 128;
const ROWS: usize = 32;

fn load(name: &str, kernels: KernelSet) -> Arc<Model> {
    let opts = LoadOptions {
        dtype: Some(WeightFormat::F32),
        gpu: GpuOptions {
            kernels: Some(kernels),
            ..Default::default()
        },
        ..Default::default()
    };
    Model::load(&golden_dir().join(name), &opts).unwrap()
}

fn options() -> EngineOptions {
    EngineOptions {
        max_slots: SLOTS,
        max_tokens: ROWS,
        max_logit_rows: ROWS,
        ..Default::default()
    }
}

fn greedy(counter: u32) -> Option<(SamplingParams, u32)> {
    Some((SamplingParams::default(), counter))
}

/// A prompt of `n` tokens that differs per `seed`.
fn prompt(model: &Model, seed: u32, n: usize) -> Vec<u32> {
    let vocab = model.config.vocab_size as u32;
    (0..n as u32)
        .map(|i| (seed * 977 + i * 131 + 7) % vocab)
        .collect()
}

/// The prompt read in one step, then `steps` greedy tokens, alone: the
/// tokens and the logits each came from.
fn alone(model: &Arc<Model>, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut e = Engine::new(model.clone(), options()).unwrap();
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    let out = StepOutput {
        sample: greedy(1),
        ..StepOutput::last(prompt.len())
    };
    let mut tok = e.step(prompt, &pos, out).unwrap().unwrap();
    let mut got = vec![tok];
    let mut logits = vec![e.read_logits(1).unwrap()];
    for s in 1..steps {
        let p = (prompt.len() + s - 1) as u32;
        let out = StepOutput {
            sample: greedy(1 + s as u32),
            ..StepOutput::last(1)
        };
        tok = e.step(&[tok], &[p], out).unwrap().unwrap();
        got.push(tok);
        logits.push(e.read_logits(1).unwrap());
    }
    (got, logits)
}

/// One sequence of the batched run.
struct Seq {
    engine: Engine,
    prompt: Vec<u32>,
    /// Tokens generated so far (the first from the prompt's step).
    got: Vec<u32>,
    /// Whether it reads the logits of all its rows (`SeqStep::logits`),
    /// and those of its last row at each step.
    reads_logits: bool,
    logits: Vec<Vec<f32>>,
    /// Steps to generate.
    steps: usize,
    /// The batched step at which its prompt is read.
    joins: usize,
}

impl Seq {
    /// Its part of the next step: the prompt, or the last token.
    fn part(&self) -> (Vec<u32>, Vec<u32>, u32) {
        match self.got.last() {
            None => {
                let pos = (0..self.prompt.len() as u32).collect();
                (self.prompt.clone(), pos, 1)
            }
            Some(&t) => {
                let p = (self.prompt.len() + self.got.len() - 1) as u32;
                (vec![t], vec![p], 1 + self.got.len() as u32)
            }
        }
    }
}

fn check(name: &str, kernels: KernelSet) {
    let model = load(name, kernels);
    let mut batch = Batch::new(model.clone(), ROWS, ROWS, SLOTS).unwrap();
    // (prompt length, tokens, the step it joins at): different depths, one
    // joining while the others decode, one leaving early.
    let plan = [(7, 12, 0), (19, 9, 0), (3, 14, 0), (11, 6, 4)];
    let mut seqs: Vec<Seq> = plan
        .iter()
        .enumerate()
        .map(|(i, &(n, steps, joins))| Seq {
            engine: batch.sequence(options()).unwrap(),
            prompt: prompt(&model, i as u32 + 1, n),
            got: vec![],
            reads_logits: i % 2 == 0,
            logits: vec![],
            steps,
            joins,
        })
        .collect();
    for step in 0.. {
        // The sequences that run this step: decode tokens first, then the
        // prompts read now (whose last rows sample too).
        let mut running: Vec<&mut Seq> = seqs
            .iter_mut()
            .filter(|s| s.joins <= step && s.got.len() < s.steps)
            .collect();
        if running.is_empty() {
            break;
        }
        running.sort_by_key(|s| !s.got.is_empty());
        running.reverse();
        let parts: Vec<_> = running.iter().map(|s| s.part()).collect();
        let mut work: Vec<(&mut Engine, SeqStep)> = running
            .iter_mut()
            .zip(&parts)
            .map(|(s, (ids, pos, counter))| {
                let step = SeqStep {
                    ids,
                    positions: pos,
                    sample: greedy(*counter),
                    logits: s.reads_logits,
                };
                (&mut s.engine, step)
            })
            .collect();
        let tokens = batch.step(&mut work).unwrap();
        drop(work);
        let mut row0 = 0;
        for ((s, t), (ids, _, _)) in running.iter_mut().zip(tokens).zip(&parts) {
            s.got.push(t.unwrap());
            row0 += ids.len();
            if s.reads_logits {
                s.logits.push(batch.read_logits(row0 - 1..row0).unwrap());
            }
        }
    }
    for (i, s) in seqs.iter().enumerate() {
        let (want, logits) = alone(&model, &s.prompt, s.steps);
        assert_eq!(s.got, want, "{name} {kernels:?}: sequence {i}");
        for (step, (got, want)) in s.logits.iter().zip(&logits).enumerate() {
            let diff = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-4,
                "{name} {kernels:?}: sequence {i} step {step}: logits differ by {diff}"
            );
        }
        assert_eq!(s.logits.len(), if s.reads_logits { s.steps } else { 0 });
    }
}

#[test]
fn batched_steps_match_each_sequence_alone() {
    for name in ["tiny-qwen2", "tiny-llama-gqa"] {
        for kernels in [KernelSet::Cpu, KernelSet::Gpu] {
            check(name, kernels);
        }
    }
    // The newer families' own kernels (q/k norm, RoPE's rotated dimensions)
    // are the same in both sets: one set each.
    check("tiny-qwen3", KernelSet::Gpu);
    check("tiny-smollm3", KernelSet::Cpu);
    check("tiny-phi3", KernelSet::Gpu);
    // Gemma 3: windows (by each sequence's own positions) and heads of 256.
    check("tiny-gemma3", KernelSet::Gpu);
}

/// A sequence of another batch, or a step past the batch's rows, is an
/// error naming what is wrong, and nothing runs.
#[test]
fn bad_batched_steps_are_errors() {
    let model = load("tiny-llama-gqa", KernelSet::Cpu);
    let mut batch = Batch::new(model.clone(), 8, 8, SLOTS).unwrap();
    let other = Batch::new(model.clone(), 8, 8, SLOTS).unwrap();
    let mut stranger = other.sequence(options_small()).unwrap();
    let mut own = batch.sequence(options_small()).unwrap();
    let ids = [1u32, 2, 3, 4, 5];
    let pos = [0u32, 1, 2, 3, 4];
    let part = SeqStep {
        ids: &ids,
        positions: &pos,
        sample: None,
        logits: false,
    };
    let err = batch.step(&mut [(&mut stranger, part)]).unwrap_err();
    assert!(
        format!("{err:#}").contains("not made by this batch"),
        "{err:#}"
    );
    let mut second = batch.sequence(options_small()).unwrap();
    let err = batch
        .step(&mut [(&mut own, part), (&mut second, part)])
        .unwrap_err();
    assert!(format!("{err:#}").contains("the batch takes 8"), "{err:#}");
    assert_eq!((own.n_cached, second.n_cached), (0, 0));
    let err = batch.sequence(options()).err().unwrap();
    assert!(format!("{err:#}").contains("at most 8 tokens"), "{err:#}");
}

fn options_small() -> EngineOptions {
    EngineOptions {
        max_tokens: 8,
        max_logit_rows: 8,
        ..options()
    }
}

/// Bounded caches with different policies in one batch: each sequence
/// reads its prompt alone through its cache (`BoundedCache::feed`), then
/// decodes in batched steps, refreshing (scoring, compacting) on its own
/// schedule between them; every sequence gets the tokens it gets alone.
#[test]
fn bounded_caches_with_different_policies_share_steps() {
    use sieve::cache::{BoundedCache, CacheOptions, FeedOutput, Granularity};
    use sieve::eviction::Policy;
    let model = load("tiny-llama-gqa", KernelSet::Gpu);
    let layers = model.config.num_layers;
    // Windows of 8 queries: the batched steps fill the query rings.
    // `policy@granularity`: kept sets per layer or per (layer, KV head).
    let cache_options = |name: &str| {
        let (policy, granularity) = name.split_once('@').unwrap_or((name, "token"));
        CacheOptions {
            sinks: 2,
            recent: 4,
            snapkv_window: 8,
            ea_window: 8,
            granularity: Granularity::parse(granularity).unwrap(),
            ..CacheOptions::new(Policy::parse(policy).unwrap(), 20, 6)
        }
    };
    let names = [
        "window",
        "epikv",
        "tova",
        "h2o",
        "ccs",
        "snapkv",
        "expected-attention",
        "snapkv@head",
        "keydiff@head",
        "expected-attention@layer",
        "full",
    ];
    let (prompt_len, steps) = (30, 40);
    let decode = |cache: &mut BoundedCache, engine: &mut Engine, prompt: &[u32]| {
        let out = FeedOutput::Sample(SamplingParams::default(), 1);
        let first = cache.feed(engine, prompt, 0, out, |_, _| Ok(())).unwrap();
        first.unwrap()
    };
    // Alone: the prompt, then one token at a time through `feed`.
    let want: Vec<Vec<u32>> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut cache = BoundedCache::new(cache_options(name), layers).unwrap();
            let opts = cache.engine_options(SLOTS, ROWS, ROWS);
            let mut engine = Engine::new(model.clone(), opts).unwrap();
            let prompt = prompt(&model, 40 + i as u32, prompt_len);
            let mut got = vec![decode(&mut cache, &mut engine, &prompt)];
            for s in 1..steps {
                let pos = (prompt_len + s - 1) as u32;
                let out = FeedOutput::Sample(SamplingParams::default(), 1 + s as u32);
                let last = *got.last().unwrap();
                let t = cache.feed(&mut engine, &[last], pos, out, |_, _| Ok(()));
                got.push(t.unwrap().unwrap());
            }
            got
        })
        .collect();
    let mut batch = Batch::new(model.clone(), ROWS, ROWS, SLOTS).unwrap();
    let mut seqs: Vec<(BoundedCache, Engine, Vec<u32>)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut cache = BoundedCache::new(cache_options(name), layers).unwrap();
            let opts = cache.engine_options(SLOTS, ROWS, ROWS);
            let mut engine = batch.sequence(opts).unwrap();
            let prompt = prompt(&model, 40 + i as u32, prompt_len);
            let first = decode(&mut cache, &mut engine, &prompt);
            (cache, engine, vec![first])
        })
        .collect();
    for s in 1..steps {
        let pos = (prompt_len + s - 1) as u32;
        let last: Vec<[u32; 1]> = seqs
            .iter()
            .map(|(_, _, got)| [*got.last().unwrap()])
            .collect();
        for (cache, engine, _) in seqs.iter_mut() {
            cache.make_room(engine, pos).unwrap();
        }
        let positions = [pos];
        let mut work: Vec<(&mut Engine, SeqStep)> = seqs
            .iter_mut()
            .zip(&last)
            .map(|((_, engine, _), ids)| {
                let step = SeqStep {
                    ids,
                    positions: &positions,
                    sample: greedy(1 + s as u32),
                    logits: false,
                };
                (engine, step)
            })
            .collect();
        let tokens = batch.step(&mut work).unwrap();
        drop(work);
        for ((cache, engine, got), (t, fed)) in seqs.iter_mut().zip(tokens.into_iter().zip(&last)) {
            cache.record_fed(engine, fed[0], pos).unwrap();
            got.push(t.unwrap());
        }
    }
    for (i, (_, engine, got)) in seqs.iter().enumerate() {
        // 70 tokens fed, at most budget + chunk = 26 cached: it evicted.
        assert!(
            names[i] == "full" || engine.n_cached <= 26,
            "{}: {} entries cached",
            names[i],
            engine.n_cached
        );
        assert_eq!(got, &want[i], "{}", names[i]);
    }
}

/// SmolLM2 (its GGUF, Q4_1 weights kept in their blocks): three prompts
/// stepped together give each the greedy tokens it gets alone, with both
/// kernel sets.
#[test]
fn smollm2_batched_matches_alone() {
    let gguf = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.exists() {
        assert!(
            std::env::var("CI").is_err(),
            "{} is missing",
            gguf.display()
        );
        eprintln!("note: {} is missing; skipped", gguf.display());
        return;
    }
    for kernels in [KernelSet::Cpu, KernelSet::Gpu] {
        let opts = LoadOptions {
            gpu: GpuOptions {
                kernels: Some(kernels),
                ..Default::default()
            },
            ..Default::default()
        };
        let llm = sieve::session::Llm::load(&gguf, &opts).unwrap();
        let model = llm.model.clone();
        let prompts: Vec<Vec<u32>> = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):"]
            .iter()
            .map(|text| llm.tokenizer.encode(text).unwrap())
            .collect();
        let steps = 6;
        let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&model, p, steps).0).collect();
        let mut batch = Batch::new(model.clone(), ROWS, ROWS, SLOTS).unwrap();
        let mut engines: Vec<Engine> = (0..3).map(|_| batch.sequence(options()).unwrap()).collect();
        let mut got: Vec<Vec<u32>> = vec![vec![]; 3];
        for s in 0..steps {
            let parts: Vec<(Vec<u32>, Vec<u32>)> = prompts
                .iter()
                .zip(&got)
                .map(|(p, g)| match g.last() {
                    None => (p.clone(), (0..p.len() as u32).collect()),
                    Some(&t) => (vec![t], vec![(p.len() + g.len() - 1) as u32]),
                })
                .collect();
            let mut work: Vec<(&mut Engine, SeqStep)> = engines
                .iter_mut()
                .zip(&parts)
                .map(|(e, (ids, pos))| {
                    let step = SeqStep {
                        ids,
                        positions: pos,
                        sample: greedy(1 + s as u32),
                        logits: false,
                    };
                    (e, step)
                })
                .collect();
            let tokens = batch.step(&mut work).unwrap();
            drop(work);
            for (g, t) in got.iter_mut().zip(tokens) {
                g.push(t.unwrap());
            }
        }
        assert_eq!(got, want, "SmolLM2, {kernels:?} kernels");
    }
}
