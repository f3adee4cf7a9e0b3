//! The thread that owns the model's scheduler: it admits queued requests
//! while sequences are free, steps every running one together, sends each
//! its text as it comes and its generation at the end, and cancels a
//! sequence whose client has gone (its cache is then free for the next).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use tokio::sync::mpsc::UnboundedSender;

use crate::cache::CacheOptions;
use crate::error::Error;
use crate::scheduler::{Scheduler, SchedulerOptions, SequenceId};
use crate::session::{GenerateOptions, Generation, Llm};

/// One request for the worker.
pub struct Job {
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    pub cache: Option<CacheOptions>,
    pub events: UnboundedSender<Event>,
}

/// What the worker tells a request, in order: text pieces, then its end.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done(Generation),
    Failed(Error),
}

/// Counts the worker keeps for `/metrics` and for admission.
#[derive(Default)]
pub struct Counters {
    /// Requests sent to the worker and not yet admitted.
    pub waiting: AtomicUsize,
    /// Sequences running.
    pub busy: AtomicUsize,
    /// Finished sequences whose caches are kept for a next turn.
    pub parked: AtomicUsize,
    /// Cache entries held (running and parked sequences).
    pub kv_entries: AtomicUsize,
    /// Cache entries evicted, per policy.
    pub evicted: Mutex<BTreeMap<&'static str, u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub finished: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
}

/// Makes the scheduler (its KV pool), says on `ready` whether it could,
/// then runs until every sender of `jobs` is gone and no sequence is left.
pub fn run(
    llm: Llm,
    opts: SchedulerOptions,
    jobs: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
    ready: mpsc::Sender<anyhow::Result<()>>,
) {
    let mut scheduler = match Scheduler::new(&llm, opts) {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut running: HashMap<SequenceId, UnboundedSender<Event>> = HashMap::new();
    loop {
        if running.is_empty() && queue.is_empty() {
            match jobs.recv() {
                Ok(job) => queue.push_back(job),
                Err(_) => return,
            }
        }
        queue.extend(jobs.try_iter());
        while running.len() < opts.max_sequences {
            let Some(job) = queue.pop_front() else { break };
            counters.waiting.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                // Its client went while it waited: it never starts.
                counters.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let tx = job.events.clone();
            let on_text = move |piece: &str| tx.send(Event::Text(piece.to_string())).is_ok();
            match scheduler.add(&job.prompt, job.opts, job.cache, on_text) {
                Ok(id) => {
                    running.insert(id, job.events);
                }
                Err(e) => {
                    counters.failed.fetch_add(1, Ordering::Relaxed);
                    let _ = job.events.send(Event::Failed(e));
                }
            }
        }
        // A client that has gone ends its sequence within this step.
        for (id, events) in &running {
            if events.is_closed() {
                if let Some(token) = scheduler.cancel_token(*id) {
                    token.cancel();
                }
            }
        }
        counters.busy.store(running.len(), Ordering::Relaxed);
        // The step's last events go out after the counters say what the
        // step did, so a client that has its answer sees its sequence freed
        // in /metrics.
        let mut last_events = vec![];
        match scheduler.step() {
            Ok(finished) => {
                for (id, g) in finished {
                    let Some(events) = running.remove(&id) else {
                        continue;
                    };
                    let counter = match g.stats.stop {
                        crate::session::StopReason::Cancelled => &counters.cancelled,
                        _ => &counters.finished,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    counters
                        .prompt_tokens
                        .fetch_add(g.stats.prompt_tokens as u64, Ordering::Relaxed);
                    counters
                        .generated_tokens
                        .fetch_add(g.stats.generated_tokens as u64, Ordering::Relaxed);
                    last_events.push((events, Event::Done(g)));
                }
                // Non-finite logits, say: that request fails, the others go on.
                for (id, e) in scheduler.take_failed() {
                    if let Some(events) = running.remove(&id) {
                        counters.failed.fetch_add(1, Ordering::Relaxed);
                        last_events.push((events, Event::Failed(e)));
                    }
                }
            }
            Err(e) => {
                // The step's sequences were removed; they fail, the others
                // go on.
                let alive = scheduler.sequences();
                let gone: Vec<SequenceId> = running
                    .keys()
                    .filter(|id| !alive.contains(id))
                    .copied()
                    .collect();
                let message = e.to_string();
                for id in gone {
                    if let Some(events) = running.remove(&id) {
                        counters.failed.fetch_add(1, Ordering::Relaxed);
                        let err = Error::classify(anyhow::anyhow!("{message}"), e.kind());
                        last_events.push((events, Event::Failed(err)));
                    }
                }
            }
        }
        counters.busy.store(running.len(), Ordering::Relaxed);
        counters.parked.store(scheduler.parked(), Ordering::Relaxed);
        counters
            .kv_entries
            .store(scheduler.kv_entries(), Ordering::Relaxed);
        if let Ok(mut evicted) = counters.evicted.lock() {
            evicted.clone_from(scheduler.evicted());
        }
        for (events, event) in last_events {
            let _ = events.send(event);
        }
    }
}
