//! The pair ratios behind the sink guards' threshold (docs/POLICIES.md,
//! `window-sinks`): every development trace through the full cache, EpiKV's
//! signal g(t) = ||h_A(t) - h_A(t-1)|| at layer A, and for each position t at
//! or after the sinks the ratio min(g(t), g(t+1)) / median(g over the last W
//! positions up to t + 1), as the guard computes it.
//!
//!   cargo run --release --example sink_ratios -- [MODEL_DIR] [DOCS]
//!
//! Prints, per trace, the positions whose ratio exceeds the guard's, with
//! their tokens, and the largest ratio below it.

use anyhow::Result;
use sieve::engine::{Engine, EngineOptions, Signals, StepOutput};
use sieve::eval::datasets::{data_dir, DocumentSource};
use sieve::eviction::epikv::{bands, median};
use sieve::eviction::sinks::RATIO;
use sieve::model::LoadOptions;
use sieve::session::Llm;
use std::path::PathBuf;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let model = PathBuf::from(args.next().unwrap_or("models/smollm2-135m-instruct".into()));
    let n_docs: usize = args.next().map_or(Ok(5), |s| s.parse())?;
    // As the development runs: f16 weights, chunk 32, 768 tokens, sinks 4, W 128.
    let (chunk, doc_tokens, sinks, window) = (32, 768, 4, 128);
    let opts = LoadOptions {
        dtype: sieve::WeightFormat::parse("f16"),
        ..Default::default()
    };
    let llm = Llm::load(&model, &opts)?;
    let layer = bands(llm.model.config.num_layers, false, None).0[0];
    let docs = DocumentSource::ReasoningTraces.documents(
        &llm.tokenizer,
        &data_dir(None)?,
        n_docs,
        doc_tokens,
    )?;
    println!("layer {layer}, ratio {RATIO}, sinks {sinks}, window {window}");
    for doc in docs {
        let mut engine = Engine::new(
            llm.model.clone(),
            EngineOptions {
                max_slots: doc.tokens.len(),
                max_tokens: chunk,
                max_logit_rows: 1,
                max_keep: None,
                signals: Signals {
                    track_layers: vec![layer],
                    ..Default::default()
                },
                ..Default::default()
            },
        )?;
        let mut g = vec![];
        for (k, piece) in doc.tokens.chunks(chunk).enumerate() {
            let positions: Vec<u32> = (0..piece.len()).map(|i| (k * chunk + i) as u32).collect();
            engine.step(piece, &positions, StepOutput::NONE)?;
            g.extend(
                engine
                    .read_layer_deltas(piece.len(), &[layer])?
                    .iter()
                    .map(|&v| v as f64),
            );
        }
        let ratio = |t: usize| {
            let mut w = g[sinks.max((t + 2).saturating_sub(window))..=t + 1].to_vec();
            g[t].min(g[t + 1]) / median(&mut w)
        };
        let ratios: Vec<(usize, f64)> = (sinks..g.len() - 1).map(|t| (t, ratio(t))).collect();
        let above: Vec<String> = ratios
            .iter()
            .filter(|r| r.1 > RATIO)
            .map(|&(t, r)| {
                let piece = llm.tokenizer.decode(&[doc.tokens[t]]).unwrap_or_default();
                format!("{t} {piece:?} {r:.2}")
            })
            .collect();
        let below = ratios
            .iter()
            .map(|r| r.1)
            .filter(|&r| r <= RATIO)
            .fold(0.0, f64::max);
        println!(
            "{}: {} detected [{}]; largest ratio below {RATIO}: {below:.2}",
            doc.id,
            above.len(),
            above.join(", ")
        );
    }
    Ok(())
}
