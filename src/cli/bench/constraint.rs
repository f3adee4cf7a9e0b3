//! `sieve bench --schemas FILE`: decode speed with a JSON-schema constraint
//! against the same generation without one, and what the masks cost on the
//! host per token.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::sync::Arc;

use sieve::model::Model;
use sieve::session::{GenerateOptions, Llm, SessionOptions};
use sieve::tokenizer::{Message, Tokenizer};
use sieve::Constraint;

/// For each schema of `path` (a list of `{"name", "prompt", "schema"}`, as
/// tests/data/schemas.json): a greedy chat answer under the schema, then
/// the same number of tokens without it (end-of-sequence ignored), then
/// the constrained one again (A B A, so drift over the run falls on both
/// sides). Both submit steps ahead where the device's default does (not on
/// a CPU driver); the constrained decode time includes its masks, those
/// computed while the GPU runs a step's layers too.
pub fn sweep(model: &Arc<Model>, path: &std::path::Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--schemas {}: cannot read it", path.display()))?;
    let cases: Vec<Value> = serde_json::from_str(&text)
        .with_context(|| format!("--schemas {}: not a JSON list", path.display()))?;
    let tokenizer = Tokenizer::for_model(&model.dir).with_context(|| {
        format!(
            "--schemas needs the model's tokenizer ({}); not available with --synthetic",
            model.dir.display()
        )
    })?;
    let llm = Llm {
        model: model.clone(),
        tokenizer: Arc::new(tokenizer),
    };
    println!(
        "| schema | tokens | constrained tok/s | unconstrained tok/s | ratio | mask us/token |"
    );
    println!("|---|---|---|---|---|---|");
    let mut rows = vec![];
    let (mut tokens, mut generated) = (0usize, 0usize);
    let (mut constrained_s, mut free_s, mut mask_s) = (0.0, 0.0, 0.0);
    for (i, case) in cases.iter().enumerate() {
        let (Some(name), Some(prompt), Some(schema)) = (
            case["name"].as_str(),
            case["prompt"].as_str(),
            case.get("schema"),
        ) else {
            bail!(
                "--schemas {}: entry {i} lacks name, prompt or schema",
                path.display()
            );
        };
        let ids = llm.chat_prompt(&[Message::new("user", prompt)])?;
        let run = |constraint: Option<Constraint>, n: usize| {
            let mut session = llm.session(SessionOptions {
                max_context: ids.len() + n + 1,
                ..Default::default()
            })?;
            let opts = GenerateOptions {
                max_new_tokens: n,
                stop_at_eos: constraint.is_some(),
                constraint,
                ..Default::default()
            };
            session
                .generate(&ids, &opts, |_| true)
                .map_err(anyhow::Error::from)
        };
        let c = Some(Constraint::json_schema(schema));
        let first = run(c.clone(), 256)?;
        let n = first.stats.generated_tokens;
        if n < 2 {
            bail!("schema {name}: {n} tokens, too few to time a decode");
        }
        let free = run(None, n)?;
        let second = run(c, n)?;
        let decode = (first.stats.decode_seconds + second.stats.decode_seconds) / 2.0;
        let masks = (first.stats.mask_seconds + second.stats.mask_seconds) / 2.0;
        let steps = (n - 1) as f64;
        let (c_tps, f_tps) = (steps / decode, steps / free.stats.decode_seconds);
        let mask_us = masks * 1e6 / n as f64;
        println!(
            "| {name} | {n} | {c_tps:.2} | {f_tps:.2} | {:.3} | {mask_us:.0} |",
            c_tps / f_tps
        );
        rows.push(
            json!({"schema": name, "tokens": n, "constrained_tokens_per_second": c_tps,
            "unconstrained_tokens_per_second": f_tps, "mask_microseconds_per_token": mask_us,
            "stop": format!("{:?}", first.stats.stop)}),
        );
        tokens += n - 1;
        generated += n;
        constrained_s += decode;
        free_s += free.stats.decode_seconds;
        mask_s += masks;
    }
    let (c_tps, f_tps) = (tokens as f64 / constrained_s, tokens as f64 / free_s);
    println!(
        "| all {} | {tokens} | {c_tps:.2} | {f_tps:.2} | {:.3} | {:.0} |",
        rows.len(),
        c_tps / f_tps,
        mask_s * 1e6 / generated as f64
    );
    Ok(
        json!({"schemas": rows, "constrained_tokens_per_second": c_tps,
        "unconstrained_tokens_per_second": f_tps,
        "mask_microseconds_per_token": mask_s * 1e6 / generated as f64}),
    )
}
