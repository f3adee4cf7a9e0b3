//! Measuring eviction quality (SPEC.md section 5): fidelity under teacher
//! forcing, greedy-generation agreement, needle retrieval and task accuracy,
//! with resumable results, reports and plots. The `sieve eval` commands drive
//! these; everything here is usable from the library as well.

pub mod answers;
pub mod datasets;
pub mod explain;
pub mod fidelity;
pub mod metrics;
pub mod needle;
pub mod report;
pub mod ruler;
pub mod store;

use anyhow::{Context, Result};
use std::collections::HashMap;
use std::time::Instant;

use crate::cache::CacheOptions;
use crate::scheduler::{Scheduler, SchedulerOptions};
use crate::session::{GenerateOptions, Generation, Llm, SessionOptions};

/// Greedy generation of up to `max_new` tokens after `prompt`, with a bounded
/// cache (`cache`) or the full one (None), stopping at end of sequence.
pub fn greedy(
    llm: &Llm,
    prompt: &[u32],
    cache: Option<CacheOptions>,
    max_new: usize,
) -> Result<Generation> {
    let mut session = llm.session(SessionOptions {
        max_context: prompt.len() + max_new + 1,
        prefill_chunk: PROMPT_CHUNK,
        cache,
    })?;
    let opts = GenerateOptions {
        max_new_tokens: max_new,
        ..Default::default()
    };
    Ok(session.generate(prompt, &opts, |_| true)?)
}

/// A greedy generation to run: its prompt and cache (None: the full one).
pub type GreedyJob = (Vec<u32>, Option<CacheOptions>);

/// Tokens of a prompt read in one step (as `greedy` reads it).
const PROMPT_CHUNK: usize = 256;

/// Most generations `greedy_jobs` steps together when not told: past a
/// few dozen, a step is bound by the mat-muls' arithmetic and by every
/// sequence's own attention dispatches, and more sequences add memory but
/// little speed.
pub const AUTO_BATCH_CAP: usize = 32;

/// Greedy generations of `jobs` (prompt, cache), up to `max_new` tokens
/// each, `batch` at a time stepped together (`Scheduler`: the weights read
/// once a step for all of them; None: as many as the jobs, the device's
/// memory and `AUTO_BATCH_CAP` allow); `done(job index, generation, seconds
/// from its start to its end)` is called as each finishes, in that order.
/// With a batch of 1 each runs alone, as `greedy`.
pub fn greedy_jobs(
    llm: &Llm,
    jobs: &[GreedyJob],
    max_new: usize,
    batch: Option<usize>,
    mut done: impl FnMut(usize, Generation, f64) -> Result<()>,
) -> Result<()> {
    let max_context = jobs.iter().map(|(p, _)| p.len() + max_new + 1).max();
    let max_context = max_context.unwrap_or(1);
    let batch = batch.unwrap_or_else(|| {
        SchedulerOptions::sequences_that_fit(&llm.model, max_context, AUTO_BATCH_CAP)
            .min(jobs.len())
    });
    if batch <= 1 {
        for (i, (prompt, cache)) in jobs.iter().enumerate() {
            let t = Instant::now();
            let g = greedy(llm, prompt, *cache, max_new)?;
            done(i, g, t.elapsed().as_secs_f64())?;
        }
        return Ok(());
    }
    let opts = SchedulerOptions {
        max_sequences: batch,
        step_tokens: PROMPT_CHUNK.max(batch),
        max_context,
        cache: None,
        // Each generation as if alone.
        reuse: false,
    };
    let mut scheduler = Scheduler::new(llm, opts)?;
    let generate = GenerateOptions {
        max_new_tokens: max_new,
        ..Default::default()
    };
    let mut running = HashMap::new();
    let mut next = 0;
    loop {
        while next < jobs.len() && scheduler.active() < batch {
            let (prompt, cache) = &jobs[next];
            let id = scheduler.add(prompt, generate.clone(), *cache, |_| true)?;
            running.insert(id, (next, Instant::now()));
            next += 1;
        }
        if scheduler.active() == 0 {
            return Ok(());
        }
        let finished = scheduler.step()?;
        if let Some((_, e)) = scheduler.take_failed().into_iter().next() {
            return Err(e.into());
        }
        for (id, g) in finished {
            let (i, t) = running
                .remove(&id)
                .context("a finished sequence was added")?;
            done(i, g, t.elapsed().as_secs_f64())?;
        }
    }
}

/// Length of the common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
