//! `sieve run`: generate an answer, streaming text to stdout and statistics to stderr.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{Read, Write};

use super::{CacheArgs, ModelArgs};
use sieve::kernels::sample::SamplingParams;
use sieve::session::{GenerateOptions, Llm, SessionOptions, SubmitAhead};
use sieve::tokenizer::Message;

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// The prompt; read from stdin when absent.
    #[arg(long)]
    pub prompt: Option<String>,
    /// A system message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Use the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop before this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Longest context in tokens without --budget (0 = the model's, at most 8192).
    #[arg(long, default_value_t = 0)]
    pub max_context: usize,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
}

pub fn sampling(a: &RunArgs) -> Result<SamplingParams> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed,
    };
    params
        .validate()
        .context("in --temperature, --top-p or --repetition-penalty")?;
    Ok(params)
}

pub fn main(a: RunArgs) -> Result<()> {
    let sampling = sampling(&a)?;
    let cache = a.cache.options()?;
    let prompt = match &a.prompt {
        Some(p) => p.clone(),
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from stdin")?;
            s
        }
    };
    if prompt.trim().is_empty() {
        bail!("the prompt is empty (give --prompt TEXT or pipe text to stdin)");
    }
    if let Some(path) = &a.cache.trace {
        sieve::files::check_output(path, "--trace")?;
    }
    let dir = a.model.dir()?;
    let llm = Llm::load(&dir, &a.model.load_options()?)?;
    eprintln!("sieve: {} on {}", dir.display(), llm.model.gpu.describe());
    let ids = if a.raw {
        llm.tokenizer.encode(&prompt)?
    } else {
        let mut messages = vec![];
        if let Some(s) = &a.system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", &prompt));
        llm.chat_prompt(&messages)?
    };
    let mut session = llm.session(SessionOptions {
        max_context: a.max_context,
        prefill_chunk: a.prefill_chunk,
        cache,
    })?;
    session.cache().record = a.cache.trace.is_some();
    let opts = GenerateOptions {
        max_new_tokens: a.max_tokens,
        sampling,
        stop_strings: a.stop.clone(),
        stop_at_eos: !a.ignore_eos,
        on_prompt: None,
        submit_ahead: SubmitAhead::Auto,
    };
    let mut stdout = std::io::stdout().lock();
    let out = session.generate(&ids, &opts, |piece| {
        // A closed stdout (e.g. `| head`) ends the generation quietly.
        stdout.write_all(piece.as_bytes()).is_ok() && stdout.flush().is_ok()
    })?;
    let _ = writeln!(stdout);
    if let Some(path) = &a.cache.trace {
        session.cache().write_trace(path)?;
    }
    let s = &out.stats;
    let mem = session.memory();
    eprintln!(
        "sieve: prompt {} tokens in {:.2} s ({:.1} tok/s), generated {} tokens in {:.2} s ({:.2} tok/s), stop: {:?}, GPU memory {:.1} MiB weights + {:.1} MiB cache and buffers, peak process memory {}",
        s.prompt_tokens,
        s.prefill_seconds,
        s.prefill_tokens_per_second(),
        s.generated_tokens,
        s.decode_seconds,
        s.decode_tokens_per_second(),
        s.stop,
        mem.weights as f64 / 1048576.0,
        mem.buffers as f64 / 1048576.0,
        super::bench::peak_rss_bytes().map_or("n/a".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0))
    );
    Ok(())
}
