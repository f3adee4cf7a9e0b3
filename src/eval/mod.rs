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
pub mod store;

use anyhow::Result;

use crate::cache::CacheOptions;
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
        prefill_chunk: 256,
        cache,
    })?;
    let opts = GenerateOptions {
        max_new_tokens: max_new,
        ..Default::default()
    };
    Ok(session.generate(prompt, &opts, |_| true)?)
}

/// Length of the common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
