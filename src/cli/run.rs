//! `sieve run`: generate an answer, streaming text to stdout and statistics to stderr.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{Read, Write};

use super::{CacheArgs, ModelArgs};
use sieve::kernels::sample::SamplingParams;
use sieve::session::{GenerateOptions, Llm, SessionOptions, SubmitAhead};
use sieve::tokenizer::Message;
use sieve::Constraint;

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
    /// OpenAI's presence penalty, in [-2, 2] (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty, in [-2, 2] (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub constraint: ConstraintArgs,
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

/// What the output must match (at most one of them).
#[derive(Args, Debug, Default)]
#[group(multiple = false)]
pub struct ConstraintArgs {
    /// The answer is JSON valid under the JSON schema in this file.
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<std::path::PathBuf>,
    /// The answer is a JSON object.
    #[arg(long)]
    pub json: bool,
    /// The whole answer matches this regular expression.
    #[arg(long, value_name = "REGEX")]
    pub regex: Option<String>,
    /// The answer follows the Lark grammar in this file (llguidance's dialect).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
}

impl ConstraintArgs {
    /// The constraint asked for, its file read and parsed.
    pub fn constraint(&self) -> Result<Option<Constraint>> {
        let read = |path: &std::path::Path, option: &str| {
            std::fs::read_to_string(path)
                .with_context(|| format!("{option} {}: cannot read it", path.display()))
        };
        Ok(if let Some(path) = &self.json_schema {
            let text = read(path, "--json-schema")?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("--json-schema {}: not valid JSON", path.display()))?;
            Some(Constraint::json_schema(&schema))
        } else if self.json {
            Some(Constraint::json_object())
        } else if let Some(rx) = &self.regex {
            Some(Constraint::regex(rx))
        } else if let Some(path) = &self.grammar {
            Some(Constraint::grammar(&read(path, "--grammar")?))
        } else {
            None
        })
    }
}

pub fn sampling(a: &RunArgs) -> Result<SamplingParams> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        seed: a.seed,
    };
    params.validate().context(
        "in --temperature, --top-p, --repetition-penalty, --presence-penalty or --frequency-penalty",
    )?;
    Ok(params)
}

pub fn main(a: RunArgs) -> Result<()> {
    let sampling = sampling(&a)?;
    let constraint = a.constraint.constraint()?;
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
        constraint,
        logprobs: None,
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
    if opts.constraint.is_some() {
        eprintln!(
            "sieve: constraint masks {:.1} ms in all, {:.0} us per generated token",
            s.mask_seconds * 1e3,
            s.mask_seconds * 1e6 / s.generated_tokens.max(1) as f64
        );
    }
    Ok(())
}
