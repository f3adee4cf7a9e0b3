//! `sieve bench`: prefill and decode speed, the device's streaming-read
//! bandwidth and the decode bound it implies, and memory; as a table and JSON.
//! On a model directory or on a synthetic model of a given shape (random
//! weights generated on the GPU); with eviction (`eviction.rs`) and at long
//! contexts (`context.rs`).

mod batch;
mod constraint;
mod context;
mod eviction;

use anyhow::Result;
use clap::Args;
use serde_json::json;
use sieve::kernels::read_bandwidth::Bandwidth;
use std::path::PathBuf;
use std::time::Instant;

use super::{write_atomic, ModelArgs};
use sieve::engine::{Engine, EngineOptions, StepIds, StepOutput};
use sieve::kernels::sample::SamplingParams;
use sieve::model::Model;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths for prefill, processed as one step each.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pub prefill: Vec<usize>,
    /// Context depths at which decode speed is measured.
    #[arg(long, value_delimiter = ',', default_value = "0,1024,4096")]
    pub depths: Vec<usize>,
    /// Timed runs of each prefill after one warm-up run; the median counts
    /// (the first step of a shape pays for pipeline and cache warm-up).
    #[arg(long, default_value_t = 3)]
    pub prefill_runs: usize,
    /// Decode steps timed at each depth (after one warm-up step).
    #[arg(long, default_value_t = 8)]
    pub decode_steps: usize,
    /// Also write the JSON report to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Eviction policies to measure (refresh latency, decode speed); empty =
    /// none. `name@layer` or `name@head`: kept sets per layer or per
    /// (layer, KV head) (`--granularity`).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Cache sizes C at which one refresh is timed (the cache is filled by a
    /// real prefill of C tokens under the policy first); 0 = none.
    #[arg(long, value_delimiter = ',', default_value = "512")]
    pub refresh_sizes: Vec<usize>,
    /// Chunk h for the eviction measurements (budget J = C - h).
    #[arg(long, default_value_t = 64)]
    pub chunk: usize,
    /// Budget J for the decode-speed comparison with eviction.
    #[arg(long, default_value_t = 512)]
    pub budget: usize,
    /// Tokens generated per policy in the decode-speed comparison, and
    /// batched decode steps timed with each policy's bounded cache
    /// (--batch; refreshes every --chunk steps); 0 = skip both.
    #[arg(long, default_value_t = 0)]
    pub generate: usize,
    /// Benchmark a model of this shape with random weights made on the GPU
    /// instead of loading one: smollm2-135m, llama-3.2-1b, qwen2.5-1.5b,
    /// llama-3.1-8b, qwen2.5-7b, qwen3-8b, gemma-3-4b, or a path to a
    /// config.json.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Long-context decode: context lengths N at which decode speed and memory
    /// are measured with the full cache and with each --policies entry at each
    /// --context-budgets budget.
    #[arg(long, value_delimiter = ',')]
    pub context: Vec<usize>,
    /// Budgets J for the long-context measurements.
    #[arg(long, value_delimiter = ',', default_value = "2048,4096,8192")]
    pub context_budgets: Vec<usize>,
    /// Long-context: also run h2o/tova with the materialized attention matrix
    /// (eager attention's memory) next to the fused path.
    #[arg(long)]
    pub materialize: bool,
    /// Long-context: tokens per prefill step while filling a bounded cache
    /// (the materialized matrix grows with it: heads x step x (J + h)).
    #[arg(long, default_value_t = 256)]
    pub fill_step: usize,
    /// Batched decode: numbers of sequences stepped together (each one
    /// token a step), timed at each --depths depth; empty = none.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Constrained decoding: each JSON schema of this file (a list of
    /// {"name", "prompt", "schema"}, as tests/data/schemas.json) answered
    /// greedily under the schema and without it, side by side, with the
    /// masks' host time per token. Needs the model's tokenizer.
    #[arg(long)]
    pub schemas: Option<PathBuf>,
}

/// Peak resident memory of this process (VmHWM), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn main(a: BenchArgs) -> Result<()> {
    // Checked before the model loads.
    if a.batch.contains(&0) {
        anyhow::bail!("--batch {:?}: every batch size must be at least 1", a.batch);
    }
    let model = match &a.synthetic {
        Some(shape) => sieve::synthetic::synthetic_model(shape, &a.model.load_options()?, a.seed)?,
        None => Model::load(&a.model.dir()?, &a.model.load_options()?)?,
    };
    let report = run(&model, &a)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(path) = &a.json {
        write_atomic(path, serde_json::to_string_pretty(&report)?.as_bytes())?;
    }
    Ok(())
}

/// Runs the benchmark on a loaded model; prints the table, returns the JSON.
pub fn run(model: &std::sync::Arc<Model>, a: &BenchArgs) -> Result<serde_json::Value> {
    let c = model.config.clone();
    let gpu = model.gpu.clone();
    let max_prefill = a.prefill.iter().copied().max().unwrap_or(1).max(1);
    let max_depth = a.depths.iter().copied().max().unwrap_or(0);
    let mut e = Engine::new(
        model.clone(),
        EngineOptions {
            // Room for the timed steps and the 4 profiled ones at the deepest depth.
            max_slots: (max_depth + a.decode_steps.max(4) + 2).max(max_prefill),
            max_tokens: max_prefill,
            max_logit_rows: 1,
            ..Default::default()
        },
    )?;
    println!(
        "sieve bench: {} ({} weights, {} KV cache) on {}",
        model.dir.display(),
        model.formats_summary(),
        model.kv_format.name(),
        gpu.describe()
    );
    println!("kernels: {}", gpu.describe_kernels());
    // With `--kernels tuned` the engine timed each weight shape's
    // candidates when it was built ('*': chosen; microseconds of GPU time).
    let timings = gpu.tuner.results();
    for t in &timings {
        println!("kernel timing: {}", sieve::kernels::tune::describe(t));
    }
    if !timings.is_empty() {
        let wall: f64 = timings.iter().map(|t| t.wall_seconds).sum();
        println!(
            "kernel timings took {:.0} ms of the engine's build",
            wall * 1e3
        );
    }
    let (paths, best) = read_bandwidth(&gpu)?;
    let bw = best.bytes_per_second;
    // Token ids do not change the work; use a fixed spread of ids.
    let ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|i| ((i * 7919 + 13) % c.vocab_size) as u32)
            .collect()
    };
    let prefill = prefill_table(&mut e, a, &ids)?;
    let decode = decode_table(&mut e, model, a, bw)?;
    let kernels = kernel_breakdown(&mut e, &ids(max_prefill), a.depths.first().copied())?;
    let step_ms = decode
        .first()
        .map_or(f64::NAN, |d| 1e3 / d["tokens_per_second"].as_f64().unwrap());
    let policies = a
        .policies
        .iter()
        .map(|p| eviction::BenchPolicy::parse(p))
        .collect::<Result<Vec<_>>>()?;
    let refresh = eviction::refresh(model, &policies, &a.refresh_sizes, a.chunk, step_ms)?;
    let generation = eviction::decode(model, &policies, a.budget, a.chunk, a.generate)?;
    let long_context = context::sweep(model, &policies, a)?;
    let mut setups: Vec<batch::Setup> = a.depths.iter().map(|&d| batch::Setup::Depth(d)).collect();
    let batched = batch::sweep(model, &a.batch, &setups, a.decode_steps)?;
    setups = policies
        .iter()
        .filter(|p| !p.is_full())
        .map(|&policy| batch::Setup::Evicting {
            policy,
            budget: a.budget,
            chunk: a.chunk,
        })
        .collect();
    let batched_evicting = batch::sweep(model, &a.batch, &setups, a.generate)?;
    let constrained = match &a.schemas {
        Some(path) => constraint::sweep(model, path)?,
        None => serde_json::Value::Null,
    };
    let gpu_bytes = model.weight_bytes + e.buffer_bytes;
    let rss = peak_rss_bytes();
    println!(
        "GPU buffers: {:.1} MiB ({:.1} MiB weights; {:.1} MB read per decoded token, {:.1} MB in the GGUF blocks of the same formats); peak process memory {}",
        gpu_bytes as f64 / 1048576.0,
        model.weight_bytes as f64 / 1048576.0,
        model.decode_weight_bytes() as f64 / 1e6,
        model.decode_gguf_weight_bytes() as f64 / 1e6,
        rss.map_or("n/a".into(), |r| format!("{:.1} MiB", r as f64 / 1048576.0))
    );
    Ok(json!({
        "model": model.dir.display().to_string(),
        "weights": model.formats_summary(),
        "weight_bytes_per_token": model.decode_weight_bytes(),
        "gguf_weight_bytes_per_token": model.decode_gguf_weight_bytes(),
        "kv_cache": model.kv_format.name(),
        "adapter": gpu.describe(),
        "kernels": gpu.describe_kernels(),
        "kernel_timings": timings.iter().map(timing_json).collect::<Vec<_>>(),
        "read_bandwidth_bytes_per_second": bw,
        "read_bandwidth_path": best.path.name(),
        "read_bandwidth_by_path": paths.iter().map(|p| json!({
            "path": p.path.name(), "bytes_per_second": p.bytes_per_second, "bytes": p.bytes
        })).collect::<Vec<_>>(),
        "prefill": prefill,
        "decode": decode,
        "gpu_buffer_bytes": gpu_bytes,
        "weight_bytes": model.weight_bytes,
        "peak_process_bytes": rss,
        "refresh": refresh,
        "decode_with_eviction": generation,
        "long_context": long_context,
        "batched_decode": batched,
        "batched_decode_with_eviction": batched_evicting,
        "kernel_breakdown": kernels,
        "constrained_decode": constrained,
    }))
}

/// The streaming read bandwidth of each path a kernel can read weights
/// through, and the fastest (the decode bound; printed).
fn read_bandwidth(gpu: &sieve::gpu::Gpu) -> Result<(Vec<Bandwidth>, Bandwidth)> {
    // The bound is the faster of the two ways a kernel can stream weights
    // (src/kernels/read_bandwidth.rs).
    let paths = sieve::kernels::read_bandwidth::measure(gpu, 5)?;
    let best = sieve::kernels::read_bandwidth::fastest(&paths)
        .ok_or_else(|| anyhow::anyhow!("the read-bandwidth probe measured no path"))?;
    let each: Vec<String> = paths
        .iter()
        .map(|p| format!("{} {:.2} GB/s", p.path.name(), p.bytes_per_second / 1e9))
        .collect();
    println!(
        "streaming read bandwidth: {:.2} GB/s, through a {} ({}; each the median of 5 reads of {} MiB, {} clock)",
        best.bytes_per_second / 1e9,
        best.path.name(),
        each.join(", "),
        best.bytes >> 20,
        if best.gpu_timed { "GPU" } else { "host" }
    );
    Ok((paths, best))
}

/// The prefill rows of the table: the median of `prefill_runs` runs of
/// each prompt length, after a warm-up run.
fn prefill_table(
    e: &mut Engine,
    a: &BenchArgs,
    ids: &dyn Fn(usize) -> Vec<u32>,
) -> Result<Vec<serde_json::Value>> {
    let mut prefill = vec![];
    println!("| test | tokens/s | ms/token |");
    println!("|---|---|---|");
    for &n in &a.prefill {
        let mut times = vec![];
        for run in 0..=a.prefill_runs.max(1) {
            e.reset();
            let pos: Vec<u32> = (0..n as u32).collect();
            let t = Instant::now();
            e.step(&ids(n), &pos, StepOutput::last(n))?;
            e.sync()?;
            if run > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let s = times[times.len() / 2];
        println!(
            "| prefill {n} | {:.2} | {:.1} |",
            n as f64 / s,
            s * 1e3 / n as f64
        );
        prefill.push(json!({
            "tokens": n, "seconds": s, "tokens_per_second": n as f64 / s,
            "runs_seconds": times, "warm_up_runs": 1
        }));
    }
    Ok(prefill)
}

/// The decode rows of the table: steps submitted ahead (the headline) and
/// one synchronous step at a time, at each depth, against the
/// read-bandwidth bound `bw` (bytes per second).
fn decode_table(
    e: &mut Engine,
    model: &Model,
    a: &BenchArgs,
    bw: f64,
) -> Result<Vec<serde_json::Value>> {
    let c = &model.config;
    let mut decode = vec![];
    let kv_row_bytes = 2 * c.num_layers as u64 * model.heads().kv_row_bytes();
    for &d in &a.depths {
        // Decode cost does not depend on the cached values: start at depth d
        // without prefilling (the slots hold whatever an earlier run left).
        e.reset();
        e.n_cached = d;
        let greedy = SamplingParams::default();
        let mut tok = 1u32;
        let mut time = 0.0;
        let mut record = 0.0;
        for s in 0..=a.decode_steps {
            let t = Instant::now();
            let out = StepOutput {
                sample: Some((greedy, s as u32)),
                ..StepOutput::last(1)
            };
            tok = e.step(&[tok], &[(d + s) as u32], out)?.unwrap_or(0);
            if s > 0 {
                time += t.elapsed().as_secs_f64();
                record += e.last_record_seconds;
            }
        }
        let sync_tps = a.decode_steps as f64 / time;
        let record_ms = record * 1e3 / a.decode_steps as f64;
        // The headline: steps submitted while the GPU runs the one before,
        // as a generation decodes; the synchronous step (record, submit,
        // wait) beside it counts the host's recording as idle GPU time.
        let tps = a.decode_steps as f64 / decode_ahead(e, d, a.decode_steps)?;
        let bytes =
            model.decode_weight_bytes() + kv_row_bytes * (d as u64 + a.decode_steps as u64 / 2);
        let bound = bw / bytes as f64;
        println!(
            "| decode at depth {d} | {tps:.2} | {:.1} | ({:.0}% of the {:.2} tok/s read-bandwidth bound, {:.0} MB/token; steps submitted ahead; {sync_tps:.2} tok/s one synchronous step at a time, {record_ms:.2} ms of each recording and submitting commands on the CPU)",
            1e3 / tps,
            100.0 * tps / bound,
            bound,
            bytes as f64 / 1e6
        );
        decode.push(json!({
            "depth": d, "tokens_per_second": tps, "bytes_per_token": bytes,
            "bandwidth_bound_tokens_per_second": bound, "fraction_of_bound": tps / bound,
            "record_ms_per_step": record_ms, "submitted_ahead_tokens_per_second": tps,
            "synchronous_tokens_per_second": sync_tps
        }));
    }
    Ok(decode)
}

/// Seconds for `steps` decode steps at depth `d`, each submitted while the
/// GPU still runs the one before and fed the token that one samples (as
/// `Session::generate` decodes), after one warm-up step.
fn decode_ahead(e: &mut Engine, d: usize, steps: usize) -> Result<f64> {
    e.reset();
    e.n_cached = d;
    let out = |s: usize| StepOutput {
        sample: Some((SamplingParams::default(), s as u32)),
        ..StepOutput::last(1)
    };
    let warm_up = e.submit(StepIds::Host(&[1]), &[d as u32], out(0))?;
    e.complete(warm_up)?;
    let t = Instant::now();
    let mut in_flight = e.submit(StepIds::LastSampled, &[d as u32 + 1], out(1))?;
    for s in 2..=steps {
        let next = e.submit(StepIds::LastSampled, &[(d + s) as u32], out(s))?;
        e.complete(in_flight)?;
        in_flight = next;
    }
    e.complete(in_flight)?;
    Ok(t.elapsed().as_secs_f64())
}

/// GPU time per kernel (timestamp queries) for one prefill step of the
/// longest prompt and for decode steps at the first depth, as a table.
fn kernel_breakdown(
    e: &mut Engine,
    prompt: &[u32],
    depth: Option<usize>,
) -> Result<serde_json::Value> {
    if !e.set_profiling(true) {
        println!(
            "(no per-kernel times: the adapter has no timestamp queries inside compute passes)"
        );
        return Ok(serde_json::Value::Null);
    }
    let mut out = serde_json::Map::new();
    let mut report = |name: String, e: &mut Engine| {
        let p = e.profiler().expect("profiling is on");
        let steps = p.steps.max(1) as f64;
        let total: f64 = p.totals.iter().map(|(_, t)| t).sum();
        println!("| {name}: kernel | ms per step | share |");
        println!("|---|---|---|");
        let mut rows = vec![];
        for (label, ns) in &p.totals {
            println!(
                "| {label} | {:.3} | {:.1}% |",
                ns / steps / 1e6,
                100.0 * ns / total
            );
            rows.push(json!({"kernel": label, "ms_per_step": ns / steps / 1e6}));
        }
        println!("| total (GPU) | {:.3} | |", total / steps / 1e6);
        out.insert(name, json!(rows));
        p.clear();
    };
    e.reset();
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    e.step(prompt, &pos, StepOutput::last(prompt.len()))?;
    report(format!("prefill {}", prompt.len()), e);
    if let Some(d) = depth {
        e.reset();
        e.n_cached = d;
        for s in 0..4u32 {
            e.step(&[1 + s], &[d as u32 + s], StepOutput::last(1))?;
        }
        report(format!("decode at depth {d}"), e);
    }
    e.set_profiling(false);
    Ok(serde_json::Value::Object(out))
}

/// One kernel timing for the JSON report: the op, its shape's fields, and
/// each candidate's time.
fn timing_json(t: &sieve::kernels::tune::Tuned) -> serde_json::Value {
    use sieve::kernels::tune::TuneKey;
    let mut v = match &t.key {
        TuneKey::Matrix {
            op,
            input,
            format,
            rows,
            cols,
            tokens,
        } => json!({
            "op": op, "input": input, "format": format.name(),
            "rows": rows, "cols": cols, "tokens": tokens,
        }),
        TuneKey::Attention {
            op,
            heads,
            queries,
            keys,
        } => json!({
            "op": op, "format": heads.kv_format.name(), "n_heads": heads.n_heads,
            "n_kv": heads.n_kv, "head_dim": heads.head_dim, "queries": queries, "keys": keys,
        }),
    };
    v["candidates"] = json!(t.labels);
    v["seconds"] = json!(t.seconds);
    v["errors"] = json!(t.errors);
    v["chosen"] = json!(t.labels[t.choice]);
    v["untimed"] = json!(t.untimed);
    v["wall_seconds"] = json!(t.wall_seconds);
    v
}
