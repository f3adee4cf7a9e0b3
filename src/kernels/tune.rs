//! Kernel autotuning: with `--kernels tuned` (what `auto` picks on a GPU),
//! each weight matrix's mat-vec and mat-mul variant, and the decode and
//! prefill attention, is the fastest of a few candidates, timed on the
//! device (with the matrix's own weights; on the engine's own cache) when
//! the engine is built, instead of a fixed rule.
//!
//! Why: the `gpu` kernels were written without a GPU at hand to tune them
//! on, and what is fastest differs between devices and shapes (rows per
//! mat-vec workgroup against the number of workgroups; the direct or the
//! staged cooperative GEMM). burn/CubeCL's autotune is the model: the
//! candidates are variants that all compute the same result (each is tested
//! against the CPU reference), the fixed rule's choice comes first and is
//! what runs when nothing can be timed, and a result is kept per shape, so
//! the 32 layers of a model with one shape cost one timing, and a second
//! engine on the same device (a session's counter-causal pass, a new
//! session) reuses it (mat-muls are keyed by the token count they are
//! timed at too: an engine with other prompt chunks times those again).
//!
//! How: after a few milliseconds of work that raise a GPU's clocks from
//! idle, the candidates run in rounds, each once per round (a warm-up round,
//! then three timed ones, so that a change of clocks touches all of them
//! alike), each run after a submission that reads a large scratch buffer
//! (so the weights are not in the GPU's cache, as in a real decode step
//! where every matrix is read once), timed by timestamp queries at the
//! start and end of its own compute pass; the median counts. A candidate
//! three times slower than the best after the first timed round is not run
//! again. Mat-vec and mat-mul
//! candidates run on scratch inputs (random values: matrix units run
//! faster on zeros) and outputs. Attention candidates read
//! the engine's own query and cache buffers (what they hold does not change
//! the work) and write only its partials, a scratch buffer every step
//! rewrites before reading; a step uniform of their own sets the depth. So
//! nothing the engine keeps is changed. A device without
//! timestamp queries, or without the memory for the timings, keeps the
//! rule's choice, and says so.
//!
//! Kept: the timings of one device are written to a file in the user's
//! cache folder (`SIEVE_TUNE_CACHE`; [`DiskCache`]) whose name hashes the
//! adapter, its driver, sieve's version, the compile options and every
//! kernel's source (cubecl's key), so a second process on the same device
//! times nothing it timed before, and a new driver or a changed kernel
//! times again.

use anyhow::{anyhow, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::dispatch;
use super::read_bandwidth::{Probe, Source};
use crate::formats::WeightFormat;
use crate::gpu::Gpu;

/// What a timing is kept for: one op on one shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TuneKey {
    /// A weight matrix's product.
    Matrix {
        /// "mat-vec" (one token) or "mat-mul" (`tokens` tokens).
        op: &'static str,
        /// What the kernel reads as x: "x", or the kernel it folds in
        /// ("rmsnorm", "swiglu"), which changes its cost.
        input: &'static str,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        tokens: usize,
    },
    /// The attention partials of `queries` queries over the first `keys`
    /// cache slots.
    Attention {
        /// "attention decode" or "attention prefill".
        op: &'static str,
        heads: super::rope_kv::Heads,
        queries: usize,
        keys: usize,
    },
}

impl TuneKey {
    /// "mat-vec", "mat-mul", "attention decode" or "attention prefill".
    pub fn op(&self) -> &'static str {
        match self {
            TuneKey::Matrix { op, .. } | TuneKey::Attention { op, .. } => op,
        }
    }

    /// The op and shape in one line: the key of a kept timing.
    pub fn id(&self) -> String {
        format!("{} {}", self.op(), self.shape())
    }

    /// The shape, as `sieve bench` prints it after the op.
    pub fn shape(&self) -> String {
        match self {
            TuneKey::Matrix {
                input,
                format,
                rows,
                cols,
                tokens,
                ..
            } => {
                let tokens = if *tokens > 1 {
                    format!(", {tokens} tokens")
                } else {
                    String::new()
                };
                let input = if *input == "x" {
                    String::new()
                } else {
                    format!(" ({input} folded in)")
                };
                format!("{} {rows}x{cols}{tokens}{input}", format.name())
            }
            TuneKey::Attention {
                heads,
                queries,
                keys,
                ..
            } => format!(
                "{} cache, {} heads over {} KV heads of {}, {queries} queries over {keys} slots",
                heads.kv_format.name(),
                heads.n_heads,
                heads.n_kv,
                heads.head_dim
            ),
        }
    }
}

/// A pipeline, its bind group (on scratch buffers) and its workgroup counts.
pub type Dispatch = (Arc<wgpu::ComputePipeline>, wgpu::BindGroup, (u32, u32, u32));

/// One candidate ready to run (or why it could not be built): its
/// dispatches, in order, timed together in one pass (an unfused mat-vec
/// runs the kernel that writes its input first).
pub struct Candidate {
    pub dispatches: Result<Vec<Dispatch>>,
}

/// The outcome for one key.
#[derive(Clone, Debug)]
pub struct Tuned {
    pub key: TuneKey,
    pub labels: Vec<String>,
    /// Median GPU seconds of each candidate; None where it was not timed
    /// (it failed to build or to run: `errors` says why).
    pub seconds: Vec<Option<f64>>,
    pub errors: Vec<Option<String>>,
    /// Index of the chosen candidate (0, the fixed rule's, when none was
    /// timed).
    pub choice: usize,
    /// Why nothing was timed, where that is so.
    pub untimed: Option<String>,
    /// Host seconds the timing took, pipeline builds included.
    pub wall_seconds: f64,
}

/// The timings of one device (a field of the kernels' runtime), in the
/// order they were made, and those kept from earlier processes.
#[derive(Default)]
pub struct Tuner {
    done: Mutex<Vec<Tuned>>,
    disk: Option<DiskCache>,
}

/// A timing as a file keeps it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Kept {
    labels: Vec<String>,
    /// Median seconds of each candidate (None: not timed).
    seconds: Vec<Option<f64>>,
    choice: usize,
}

/// The file of one device's timings.
#[derive(Debug, Default, Serialize, Deserialize)]
struct KeptFile {
    /// The adapter and driver, for a reader.
    device: String,
    /// By [`TuneKey::id`].
    timings: BTreeMap<String, Kept>,
}

/// Timings kept between processes: one JSON file per device and kernel
/// source (its name holds their hash), read when the runtime is made and
/// written after each new timing (atomically; a failure to write is a
/// warning, not an error: the timing still holds for this process).
pub struct DiskCache {
    path: PathBuf,
    file: Mutex<KeptFile>,
}

impl DiskCache {
    /// The cache of the device `device` (a description) whose key hashes to
    /// `key`, in folder `dir`; a file that cannot be read or parsed is
    /// started afresh (with a warning naming it).
    pub fn open(dir: &Path, key: u64, device: &str) -> Self {
        let path = dir.join(format!("tuning-{key:016x}.json"));
        let file = match crate::platform::read_kept(&path) {
            None => KeptFile::default(),
            Some(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                eprintln!(
                    "warning: the tuning cache {} is not readable ({e}); timing afresh",
                    path.display()
                );
                KeptFile::default()
            }),
        };
        DiskCache {
            path,
            file: Mutex::new(KeptFile {
                device: device.to_string(),
                ..file
            }),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The kept timing of `key`, if its candidates were the same.
    fn get(&self, key: &TuneKey, labels: &[String]) -> Option<Kept> {
        let file = self.file.lock().unwrap();
        let kept = file.timings.get(&key.id())?;
        (kept.labels == labels && kept.choice < labels.len()).then(|| kept.clone())
    }

    /// Keeps a timing and writes the file.
    fn put(&self, t: &Tuned) {
        let mut file = self.file.lock().unwrap();
        let kept = Kept {
            labels: t.labels.clone(),
            seconds: t.seconds.clone(),
            choice: t.choice,
        };
        file.timings.insert(t.key.id(), kept);
        let written = serde_json::to_vec_pretty(&*file)
            .map_err(anyhow::Error::from)
            .and_then(|json| crate::platform::write_kept(&self.path, &json));
        if let Err(e) = written {
            eprintln!(
                "warning: the tuning cache {} was not written ({e:#}); this process keeps its timings",
                self.path.display()
            );
        }
    }
}

/// Timed runs per candidate after the warm-up.
const RUNS: usize = 3;
/// A candidate this many times slower than the best so far is not run again.
const CUTOFF: f64 = 3.0;

impl Tuner {
    /// A tuner that keeps its timings in `disk` too (and takes those kept
    /// there by earlier processes).
    pub fn with_disk(disk: Option<DiskCache>) -> Self {
        Tuner {
            done: Mutex::new(vec![]),
            disk,
        }
    }

    /// The file the timings are kept in, if any.
    pub fn disk_path(&self) -> Option<&Path> {
        self.disk.as_ref().map(DiskCache::path)
    }

    /// The index of the fastest of the candidates `build` makes for `key`,
    /// labelled `labels` (called only when `key` has not been timed on this
    /// device yet, in this process or, with the same candidates, in one
    /// before it; two threads asking at once may both time it, which is
    /// harmless). Timing never fails the caller: without timestamp
    /// queries, or when the candidates or their scratch buffers do not fit
    /// in memory, the rule's choice (index 0) is kept and the result says
    /// why (and nothing is kept on disk).
    pub fn choose(
        &self,
        gpu: &Gpu,
        key: TuneKey,
        labels: Vec<String>,
        build: impl FnOnce() -> Vec<Candidate>,
    ) -> usize {
        if let Some(t) = self.done.lock().unwrap().iter().find(|t| t.key == key) {
            return t.choice;
        }
        // SIEVE_TUNE_FORCE: the candidates its pattern keeps (`forced`);
        // one is taken untimed, several are timed among themselves.
        let only = gpu
            .settings
            .forced_label(key.op())
            .map(|p| forced(p, &labels));
        if let Some(only) = &only {
            let pattern = gpu.settings.forced_label(key.op()).unwrap_or_default();
            let kept: Vec<usize> = (0..labels.len()).filter(|&i| only[i]).collect();
            let why = match kept.len() {
                0 => Some(format!(
                    "SIEVE_TUNE_FORCE's {pattern} keeps no candidate of this shape: the rule's"
                )),
                1 => Some(format!("forced by SIEVE_TUNE_FORCE ({pattern})")),
                _ => None,
            };
            if let Some(why) = why {
                let choice = kept.first().copied().unwrap_or(0);
                self.record_untimed(key, labels, choice, why);
                return choice;
            }
        }
        let disk = self.disk.as_ref().filter(|_| only.is_none());
        if let Some(kept) = disk.and_then(|d| d.get(&key, &labels)) {
            let n = labels.len();
            self.done.lock().unwrap().push(Tuned {
                key,
                labels,
                seconds: kept.seconds,
                errors: vec![None; n],
                choice: kept.choice,
                untimed: Some("kept from an earlier process (the tuning cache)".into()),
                wall_seconds: 0.0,
            });
            return kept.choice;
        }
        let start = web_time::Instant::now();
        let mut tuned = if gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            // The scratch buffers and the flush are not the engine's: a
            // device too full for them skips the timings instead of failing
            // the engine's build (whose own error scope would catch them).
            let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let candidates = build();
            let tuned = time_all(
                gpu,
                key.clone(),
                labels.clone(),
                &candidates,
                only.as_deref(),
            );
            drop(candidates);
            match crate::platform::block_on(scope.pop()) {
                None => tuned,
                Some(e) => Tuned {
                    untimed: Some(format!(
                        "not timed: out of GPU memory for the timings ({e})"
                    )),
                    choice: 0,
                    ..tuned
                },
            }
        } else {
            Tuned {
                key,
                seconds: vec![None; labels.len()],
                errors: vec![None; labels.len()],
                labels: labels.clone(),
                choice: 0,
                untimed: Some(
                    "not timed: the device has no timestamp queries; the fixed rule's choice is kept"
                        .into(),
                ),
                wall_seconds: 0.0,
            }
        };
        tuned.wall_seconds = start.elapsed().as_secs_f64();
        // (A choice among the candidates SIEVE_TUNE_FORCE kept is not kept.)
        if let (Some(disk), None) = (disk, &tuned.untimed) {
            disk.put(&tuned);
        }
        let choice = tuned.choice;
        self.done.lock().unwrap().push(tuned);
        choice
    }

    /// Records that `key` keeps the fixed rule's choice (index 0) untimed,
    /// and why, where its candidates cannot be timed on the engine's
    /// buffers (unless it was timed already).
    pub fn keep_rule(&self, key: TuneKey, labels: Vec<String>, why: String) {
        let mut done = self.done.lock().unwrap();
        if done.iter().any(|t| t.key == key) {
            return;
        }
        let n = labels.len();
        done.push(Tuned {
            key,
            labels,
            seconds: vec![None; n],
            errors: vec![None; n],
            choice: 0,
            untimed: Some(why),
            wall_seconds: 0.0,
        });
    }

    /// Records `choice` for `key` as if timed (tests: to make a product
    /// take a given candidate).
    #[cfg(any(test, feature = "kernel-checks"))]
    pub fn force(&self, key: TuneKey, labels: Vec<String>, choice: usize) {
        self.record_untimed(key, labels, choice, "forced by a test".into());
    }

    /// Records `choice` for `key` without timing, and why.
    fn record_untimed(&self, key: TuneKey, labels: Vec<String>, choice: usize, why: String) {
        let n = labels.len();
        self.done.lock().unwrap().push(Tuned {
            key,
            labels,
            seconds: vec![None; n],
            errors: vec![None; n],
            choice,
            untimed: Some(why),
            wall_seconds: 0.0,
        });
    }

    /// Every timing made so far, oldest first.
    pub fn results(&self) -> Vec<Tuned> {
        self.done.lock().unwrap().clone()
    }
}

/// Which of `labels` a `SIEVE_TUNE_FORCE` pattern keeps: the one equal to
/// it if there is one, else those it begins (`q8` keeps every `q8 ...`),
/// or with `!` first those it does not begin (`!q8`).
pub fn forced(pattern: &str, labels: &[String]) -> Vec<bool> {
    if labels.iter().any(|l| l == pattern) {
        return labels.iter().map(|l| l == pattern).collect();
    }
    match pattern.strip_prefix('!') {
        Some(p) => labels.iter().map(|l| !l.starts_with(p)).collect(),
        None => labels.iter().map(|l| l.starts_with(pattern)).collect(),
    }
}

/// Times `candidates` (labelled `labels`, one each) for `key`: those `only`
/// keeps where it is given.
fn time_all(
    gpu: &Gpu,
    key: TuneKey,
    labels: Vec<String>,
    candidates: &[Candidate],
    only: Option<&[bool]>,
) -> Tuned {
    let n = candidates.len();
    assert_eq!(labels.len(), n, "one label per candidate");
    let mut tuned = Tuned {
        key,
        labels,
        seconds: vec![None; n],
        errors: vec![None; n],
        // Where nothing is timed, the first candidate `only` keeps.
        choice: only.and_then(|o| o.iter().position(|&k| k)).unwrap_or(0),
        untimed: None,
        wall_seconds: 0.0,
    };
    let timer = match Timer::new(gpu) {
        Ok(t) => t,
        Err(e) => {
            tuned.untimed = Some(format!("not timed: {e:#}"));
            return tuned;
        }
    };
    let runs: Vec<Option<&[Dispatch]>> = candidates
        .iter()
        .enumerate()
        .map(|(i, c)| match &c.dispatches {
            _ if only.is_some_and(|o| !o[i]) => None,
            Ok(d) => Some(&d[..]),
            Err(e) => {
                tuned.errors[i] = Some(format!("{e:#}"));
                None
            }
        })
        .collect();
    if let Err(e) = timer.warm_up(gpu) {
        tuned.untimed = Some(format!("not timed: {e:#}"));
        return tuned;
    }
    // Round by round, every candidate once per round (a warm-up round
    // first), so that a change of the GPU's clocks during the timings
    // touches every candidate alike; a candidate CUTOFF times slower than
    // the best after the first timed round is not run again.
    let mut times: Vec<Vec<f64>> = vec![vec![]; n];
    for round in 0..=RUNS {
        let best = times
            .iter()
            .filter_map(|t| t.first().copied())
            .fold(f64::INFINITY, f64::min);
        for (i, run) in runs.iter().enumerate() {
            let Some(run) = run else { continue };
            if tuned.errors[i].is_some() || times[i].first().is_some_and(|&t| t > CUTOFF * best) {
                continue;
            }
            match timer.once(gpu, run) {
                Ok(t) if round > 0 => times[i].push(t),
                Ok(_) => {}
                Err(e) => tuned.errors[i] = Some(format!("{e:#}")),
            }
        }
    }
    let mut best = f64::INFINITY;
    for (i, t) in times.iter_mut().enumerate() {
        if tuned.errors[i].is_some() || t.is_empty() {
            continue;
        }
        t.sort_by(f64::total_cmp);
        let s = t[t.len() / 2];
        tuned.seconds[i] = Some(s);
        if s < best {
            best = s;
            tuned.choice = i;
        }
    }
    tuned
}

/// Timestamps around one compute pass, after a pass that evicts the cache.
/// Made per timed shape, so that its 256 MiB flush buffer is not held for
/// the engine's life (allocating it again costs a fraction of a
/// millisecond on a GPU).
struct Timer {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    period_ns: f64,
    flush: Probe,
    _flush_src: wgpu::Buffer,
}

impl Timer {
    fn new(gpu: &Gpu) -> Result<Self> {
        let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("tune-timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("tune-resolve"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        // Larger than the caches of today's GPUs (tens of MiB of L2, up to
        // 256 MiB of AMD's Infinity Cache), as far as one binding allows;
        // on a CPU implementation, whose "GPU memory" is host memory,
        // larger than most CPUs' last-level cache (64 MiB), which keeps
        // its timings, slow there, short.
        let cache = if gpu.profile.cpu_implementation {
            64 << 20
        } else {
            256 << 20
        };
        let flush_bytes = gpu.max_binding.min(cache) / 16 * 16;
        let flush_src = gpu.storage("tune-flush", flush_bytes);
        Ok(Timer {
            set,
            resolve,
            readback: gpu.readback("tune-readback", 16),
            period_ns: gpu.queue.get_timestamp_period() as f64,
            flush: Probe::new(gpu, Source::Buffer(&flush_src, flush_bytes))?,
            _flush_src: flush_src,
        })
    }

    /// GPU seconds of one run of `run`. The flush is its own submission,
    /// waited for, so that the candidate starts on an idle device (a GPU
    /// may overlap independent passes, and the pass's start timestamp
    /// would then fall after the candidate had begun).
    fn once(&self, gpu: &Gpu, run: &[Dispatch]) -> Result<f64> {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            self.flush.encode(&mut pass);
        }
        gpu.queue.submit([enc.finish()]);
        crate::platform::wait_for_gpu(&gpu.device, &gpu.queue, None)?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("tune-candidate"),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &self.set,
                    beginning_of_pass_write_index: Some(0),
                    end_of_pass_write_index: Some(1),
                }),
            });
            for (pipeline, group, groups) in run {
                dispatch(&mut pass, pipeline, group, *groups);
            }
        }
        enc.resolve_query_set(&self.set, 0..2, &self.resolve, 0);
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, 16);
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        gpu.queue.submit([enc.finish()]);
        if let Some(e) = crate::platform::block_on(scope.pop()) {
            return Err(anyhow!("running the candidate: {e}"));
        }
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&gpu.map_and_read(&self.readback, 16)?);
        let ns = ticks[1]
            .checked_sub(ticks[0])
            .ok_or_else(|| anyhow!("timestamps went backwards"))? as f64
            * self.period_ns;
        Ok(ns * 1e-9)
    }

    /// Keeps a GPU busy for a few milliseconds before the timings (16
    /// flushes in one submission), so that its clocks have risen from
    /// idle; a CPU implementation has no such clocks and skips it.
    fn warm_up(&self, gpu: &Gpu) -> Result<()> {
        if gpu.profile.cpu_implementation {
            return Ok(());
        }
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for _ in 0..16 {
                self.flush.encode(&mut pass);
            }
        }
        gpu.queue.submit([enc.finish()]);
        crate::platform::wait_for_gpu(&gpu.device, &gpu.queue, None)?;
        Ok(())
    }
}

/// One line per timing, for `sieve bench`: the shape, each candidate's time
/// in microseconds, and the choice.
pub fn describe(t: &Tuned) -> String {
    let cands: Vec<String> = (0..t.labels.len())
        .map(|i| {
            let mark = if i == t.choice { "*" } else { "" };
            match (&t.seconds[i], &t.errors[i]) {
                (Some(s), _) => format!("{}{mark} {:.1} us", t.labels[i], s * 1e6),
                (None, Some(e)) => format!("{}{mark} failed: {e}", t.labels[i]),
                (None, None) => format!("{}{mark} not timed", t.labels[i]),
            }
        })
        .collect();
    let untimed = t
        .untimed
        .as_ref()
        .map_or(String::new(), |u| format!(" [{u}]"));
    format!(
        "{} {}: {}{untimed}",
        t.key.op(),
        t.key.shape(),
        cands.join(", ")
    )
}
