//! Helpers shared by the integration tests: golden data paths and .npz reading.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

/// `../shared/golden` next to the repository (where CI lays it out), or
/// `$SIEVE_GOLDEN_DIR` (scripts/gpu-bench.sh runs the test binaries on a
/// machine without the repository).
pub fn golden_dir() -> PathBuf {
    match std::env::var_os("SIEVE_GOLDEN_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/golden"),
    }
}

/// A fresh model folder converted from the tiny Llama GGUF of
/// `golden/quant` (512 tokens of SmolLM2's vocabulary, f32 weights): a
/// small real tokenizer and model for tests that change their files.
pub fn converted_tiny_llama(tag: &str) -> PathBuf {
    converted_quant_gguf("Q8_0", tag)
}

/// `golden/quant/tiny-llama-<format>.gguf` converted to f32 safetensors in
/// a fresh temporary folder named after `tag`.
pub fn converted_quant_gguf(format: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sieve-tiny-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let gguf = golden_dir().join(format!("quant/tiny-llama-{format}.gguf"));
    sieve::convert::convert_gguf(
        &gguf,
        &dir,
        sieve::convert::OutDtype::F32,
        &mut |_, _, _| {},
    )
    .unwrap();
    dir
}

pub enum Array {
    F32(Vec<usize>, Vec<f32>),
    I32(Vec<usize>, Vec<i32>),
}

pub struct Npz(pub HashMap<String, Array>);

impl Npz {
    pub fn open(path: &std::path::Path) -> Npz {
        let mut ar =
            npyz::npz::NpzArchive::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let names: Vec<String> = ar.array_names().map(String::from).collect();
        let mut map = HashMap::new();
        for name in names {
            let f = ar.by_name(&name).unwrap().unwrap();
            let shape: Vec<usize> = f.shape().iter().map(|&d| d as usize).collect();
            let arr = match f.dtype() {
                npyz::DType::Plain(t) if t.type_char() == npyz::TypeChar::Float => {
                    if t.num_bytes() == Some(8) {
                        let v = f.into_vec::<f64>().unwrap();
                        Array::F32(shape, v.into_iter().map(|x| x as f32).collect())
                    } else {
                        Array::F32(shape, f.into_vec::<f32>().unwrap())
                    }
                }
                npyz::DType::Plain(t) if t.type_char() == npyz::TypeChar::Int => {
                    Array::I32(shape, f.into_vec::<i32>().unwrap())
                }
                _ => continue,
            };
            map.insert(name, arr);
        }
        Npz(map)
    }

    pub fn f32(&self, name: &str) -> (&[usize], &[f32]) {
        match self.0.get(name) {
            Some(Array::F32(s, v)) => (s, v),
            _ => panic!("no f32 array {name}"),
        }
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        match self.0.get(name) {
            Some(Array::I32(_, v)) => v.iter().map(|&x| x as u32).collect(),
            _ => panic!("no int array {name}"),
        }
    }
}

/// How many times the bytes of a GGUF file's matrices (2-D tensors) `model`
/// holds on the GPU.
pub fn weight_bytes_over_gguf(model: &sieve::model::Model, gguf: &std::path::Path) -> f64 {
    let file = sieve::gguf::GgufFile::open(gguf).unwrap();
    let matrices: u64 = file
        .tensors
        .iter()
        .filter(|t| t.dims.len() == 2)
        .map(|t| t.n_bytes())
        .sum();
    model.weight_bytes as f64 / matrices as f64
}

pub fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Max |got - ref| / max|ref| over the last K = min(8, l) positions, for the
/// embedding output (index 0) and every layer, from an engine that captured
/// its hidden states while running all `l` tokens of `g` in one step.
pub fn hidden_state_errors(e: &sieve::engine::Engine, g: &Npz, l: usize) -> Vec<f32> {
    let c = &e.model.config;
    let (k, h) = (l.min(8), c.hidden_size);
    let (_, layer_out) = g.f32("layer_out");
    (0..=c.num_layers)
        .map(|layer| {
            let got = e.read_hidden(layer, l).unwrap();
            let got = &got[(l - k) * h..];
            let want: &[f32] = if layer == 0 {
                g.f32("embed_out").1
            } else {
                &layer_out[(layer - 1) * k * h..][..k * h]
            };
            max_abs_diff(got, want) / max_abs(want)
        })
        .collect()
}

/// A 2-layer Llama with random weights and the SmolLM2 tokenizer (vocab
/// 49152), so that text-level commands run in seconds. Written once per
/// test process: a test running beside the first caller waits for it
/// (without the lock, one test copied the folder while another was
/// writing it, and read a file the writer then renamed away).
pub fn tiny_text_model() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(write_tiny_text_model).clone()
}

fn write_tiny_text_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sieve-tiny-text-{}", std::process::id()));
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let smol = golden_dir().join("smollm2-135m");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        std::fs::copy(smol.join(f), dir.join(f)).unwrap();
    }
    let (v, h, heads, kv, hd, inter, layers) = (49152usize, 64, 4, 2, 16, 128, 2);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": v, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut state = 0x2545F4914F6CDD1Du64;
    let mut random = |n: usize, scale: f32, offset: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                (offset + scale * u).to_le_bytes()
            })
            .collect()
    };
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![v, h],
            random(v * h, 0.1, 0.0),
        ),
        ("model.norm.weight".into(), vec![h], random(h, 0.1, 1.0)),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        for (n, shape) in [
            ("self_attn.q_proj.weight", vec![heads * hd, h]),
            ("self_attn.k_proj.weight", vec![kv * hd, h]),
            ("self_attn.v_proj.weight", vec![kv * hd, h]),
            ("self_attn.o_proj.weight", vec![h, heads * hd]),
            ("mlp.gate_proj.weight", vec![inter, h]),
            ("mlp.up_proj.weight", vec![inter, h]),
            ("mlp.down_proj.weight", vec![h, inter]),
        ] {
            let n_el = shape.iter().product();
            data.push((format!("{p}{n}"), shape, random(n_el, 0.15, 0.0)));
        }
        for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            data.push((format!("{p}{n}"), vec![h], random(h, 0.1, 1.0)));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(n, s, d)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .unwrap();
            (n.clone(), view)
        })
        .collect();
    let tmp = dir.join("model.safetensors.partial");
    safetensors::serialize_to_file(views, None, &tmp).unwrap();
    std::fs::rename(tmp, dir.join("model.safetensors")).unwrap();
    dir
}

/// Teacher forcing: prefills the prompt `ids` and `greedy` but its last id
/// in chunks that end at each of `positions` before the prompt's last
/// token, then one last chunk with logits for every greedy step. Returns
/// (logits at the stored positions, the prompt's last included; logits at
/// each greedy step).
pub fn teacher_forced(
    m: &std::sync::Arc<sieve::model::Model>,
    ids: &[u32],
    greedy: &[u32],
    positions: &[u32],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use sieve::engine::{Engine, EngineOptions, StepOutput};
    let l = ids.len();
    let steps = greedy.len();
    let all: Vec<u32> = ids.iter().chain(&greedy[..steps - 1]).copied().collect();
    let vocab = m.config.vocab_size;
    let mut e = Engine::new(
        m.clone(),
        EngineOptions {
            max_slots: all.len(),
            max_tokens: all.len(),
            max_logit_rows: steps,
            ..Default::default()
        },
    )
    .unwrap();
    let mut stored = vec![];
    let mut done = 0;
    for &p in positions.iter().filter(|&&p| (p as usize) < l - 1) {
        let end = p as usize + 1;
        let pos: Vec<u32> = (done as u32..end as u32).collect();
        e.step(&all[done..end], &pos, StepOutput::last(end - done))
            .unwrap();
        stored.push(e.read_logits(1).unwrap());
        done = end;
    }
    let pos: Vec<u32> = (done as u32..all.len() as u32).collect();
    e.step(
        &all[done..],
        &pos,
        StepOutput {
            logit_row0: l - 1 - done,
            n_logits: steps,
            sample: None,
        },
    )
    .unwrap();
    let step_logits: Vec<Vec<f32>> = e
        .read_logits(steps)
        .unwrap()
        .chunks(vocab)
        .map(|c| c.to_vec())
        .collect();
    stored.push(step_logits[0].clone());
    (stored, step_logits)
}

/// A real model's file: `$env_var`, else `default` under the repository.
/// Missing, it is a note and `None` (the caller's tests pass), except under
/// CI (CI=true), where it is a failure: CI must run `setup` first.
pub fn real_model_file(env_var: &str, default: &str, setup: &str) -> Option<PathBuf> {
    let p = std::env::var(env_var)
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(default));
    if p.exists() {
        return Some(p);
    }
    if std::env::var("CI").is_ok() {
        panic!("{} is missing: CI must run {setup} first", p.display());
    }
    eprintln!(
        "note: {} not found; run {setup} to enable its golden tests",
        p.display()
    );
    None
}

/// A `tuned` device that takes the mat-vec labelled `matvec` (and the
/// fixed rules' mat-mul and attention kernels) for every shape without
/// timing anything, as `SIEVE_TUNE_FORCE` does: to run a candidate the
/// timings might pick ("q8 64x2": the integer-dot mat-vec; "128x2": the
/// f32 one of the `gpu` rule).
#[allow(dead_code)]
pub fn forced_matvec_device(matvec: &str) -> std::sync::Arc<sieve::gpu::Gpu> {
    forced_device(&[("mat-vec", matvec)])
}

/// A `tuned` device that runs, without timing anything, the candidate
/// `label` for each (op, label) of `forced`, and for the other ops the
/// `gpu` rules' choices ("128x2", "Tiled", "Parallel", "Tiled").
#[allow(dead_code)]
pub fn forced_device(forced: &[(&str, &str)]) -> std::sync::Arc<sieve::gpu::Gpu> {
    use sieve::device::KernelSet;
    use sieve::gpu::{Gpu, GpuOptions};
    let mut gpu = Gpu::new(&GpuOptions {
        kernels: Some(KernelSet::Tuned),
        ..Default::default()
    })
    .unwrap();
    let settings = &mut std::sync::Arc::get_mut(&mut gpu).unwrap().settings;
    settings.tune_cache = None;
    settings.tune_force = [
        ("mat-vec", "128x2"),
        ("mat-mul", "Tiled"),
        ("attention decode", "Parallel"),
        ("attention prefill", "Tiled"),
    ]
    .map(|(op, rule)| {
        let label = forced.iter().find(|f| f.0 == op).map_or(rule, |f| f.1);
        (op.to_string(), label.to_string())
    })
    .to_vec();
    gpu
}

/// Decodes `steps` tokens one at a time (each a mat-vec step) after a
/// prefill of `prompt`: the logits of each step (the first from the
/// prefill's last row) and their argmax. Step s + 1 is fed `feed[s]`, or
/// this run's own argmax without `feed` (greedy).
#[allow(dead_code)]
pub fn decode_one_at_a_time(
    model: std::sync::Arc<sieve::model::Model>,
    prompt: &[u32],
    feed: Option<&[u32]>,
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    use sieve::engine::{Engine, EngineOptions, StepOutput};
    let mut e = Engine::new(
        model,
        EngineOptions {
            max_slots: prompt.len() + steps,
            max_tokens: prompt.len(),
            max_logit_rows: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let pos: Vec<u32> = (0..(prompt.len() + steps) as u32).collect();
    e.step(prompt, &pos[..prompt.len()], StepOutput::last(prompt.len()))
        .unwrap();
    let (mut logits, mut tokens) = (vec![], vec![]);
    for s in 0..steps {
        if s > 0 {
            let t = feed.map_or(tokens[s - 1], |f| f[s - 1]);
            let at = prompt.len() + s - 1;
            e.step(&[t], &pos[at..at + 1], StepOutput::last(1)).unwrap();
        }
        let l = e.read_logits(1).unwrap();
        tokens.push(argmax(&l) as u32);
        logits.push(l);
    }
    (logits, tokens)
}

/// Whether `gpu` runs the mat-vecs that read x prepared (they reduce with
/// subgroup operations); a note where not.
#[allow(dead_code)]
pub fn runs_prepared_matvecs(gpu: &sieve::gpu::Gpu) -> bool {
    if !gpu.profile.subgroups {
        eprintln!("note: this device has no subgroups: the q8 and f16-x mat-vecs do not run here");
    }
    gpu.profile.subgroups
}

/// The label of the mat-vec each timed (or forced) shape of `model` runs.
#[allow(dead_code)]
pub fn matvecs_chosen(model: &sieve::model::Model) -> Vec<String> {
    chosen(model, "mat-vec")
}

/// The label of the candidate each timed (or forced) shape of `op` runs.
#[allow(dead_code)]
pub fn chosen(model: &sieve::model::Model, op: &str) -> Vec<String> {
    model
        .gpu
        .tuner
        .results()
        .iter()
        .filter(|t| t.key.op() == op)
        .map(|t| t.labels[t.choice].clone())
        .collect()
}

/// An engine of `ids.len()` slots computing `signals`, fed `ids` through a
/// full cache in steps of up to `step` tokens without logits; the engine and
/// the cache (the signals' tests read what the engine computed on them).
#[allow(dead_code)]
pub fn fed_engine(
    model: &std::sync::Arc<sieve::model::Model>,
    ids: &[u32],
    step: usize,
    signals: sieve::engine::Signals,
    before_feed: impl FnOnce(&mut sieve::engine::Engine),
) -> (sieve::engine::Engine, sieve::cache::BoundedCache) {
    use sieve::cache::{BoundedCache, CacheOptions, FeedOutput};
    let n = ids.len();
    let opts = sieve::engine::EngineOptions {
        max_slots: n,
        max_tokens: step.min(n),
        max_logit_rows: 1,
        signals,
        ..Default::default()
    };
    let mut e = sieve::engine::Engine::new(model.clone(), opts).unwrap();
    before_feed(&mut e);
    let full = CacheOptions::new(sieve::eviction::Policy::Full, 0, n);
    let mut cache = BoundedCache::new(full, model.config.num_layers).unwrap();
    cache
        .feed(&mut e, ids, 0, FeedOutput::None, |_, _| Ok(()))
        .unwrap();
    (e, cache)
}
