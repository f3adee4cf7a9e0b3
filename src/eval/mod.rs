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

use anyhow::Result;
use std::time::Instant;

use crate::cache::CacheOptions;
use crate::scheduler::{jobs_that_fit, run_jobs, Job};
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
pub type GreedyJob = Job;

/// Tokens of a prompt read in one step (as `greedy` reads it).
const PROMPT_CHUNK: usize = 256;

pub use crate::scheduler::AUTO_BATCH_CAP;

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
    let batch = batch.unwrap_or_else(|| jobs_that_fit(&llm.model, jobs, max_new));
    if batch <= 1 {
        for (i, (prompt, cache)) in jobs.iter().enumerate() {
            let t = Instant::now();
            let g = greedy(llm, prompt, *cache, max_new)?;
            done(i, g, t.elapsed().as_secs_f64())?;
        }
        return Ok(());
    }
    let generate = GenerateOptions {
        max_new_tokens: max_new,
        ..Default::default()
    };
    run_jobs(llm, jobs, &generate, batch, done)
}

/// Length of the common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
