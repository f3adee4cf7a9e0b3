//! sieve's kvpress policies against kvpress's own code
//! (tests/data/kvpress: KnormPress and KeyDiffPress run by
//! scripts/kvpress-reference.py on the tiny golden models, the 300-token
//! input): each (layer, KV head)'s scores of every position, and the kept
//! set per (layer, KV head) at compression ratios 0.25, 0.5 and 0.75
//! (the `head` granularity's selection, top n_kept of the head's scores)
//! wherever the cut is not inside float noise. The other presses of the
//! data (LagKV, Expected Attention, SnapKV) are not in sieve yet.

mod common;
use common::*;
use serde_json::Value;
use sieve::engine::Signals;
use sieve::formats::{KvFormat, WeightFormat};
use sieve::kernels::key_scores::KeyScore;
use sieve::model::{LoadOptions, Model};

fn reference(model: &str) -> Value {
    let path = format!(
        "{}/tests/data/kvpress/{model}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn key_scores_match_kvpress() {
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let data = reference(name);
        let ids: Vec<u32> = (data["input"]["input_ids"].as_array().unwrap().iter())
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let n = ids.len();
        let opts = LoadOptions {
            dtype: Some(WeightFormat::F32),
            kv_dtype: Some(KvFormat::F32),
            ..Default::default()
        };
        let model = Model::load(&golden_dir().join(name), &opts).unwrap();
        let (layers, n_kv) = (model.config.num_layers, model.config.num_kv_heads);
        for (press, kind) in [
            ("KnormPress", KeyScore::Norm),
            ("KeyDiffPress", KeyScore::Diff),
        ] {
            let signals = Signals {
                key_scores: Some(kind),
                ..Default::default()
            };
            let (e, _) = fed_engine(&model, &ids, 64, signals, |_| {});
            e.key_scores().unwrap();
            let got = e.read_key_scores_per_head(n).unwrap();
            let p = &data["presses"][press];
            let (mut worst, mut compared, mut skipped) = (0.0f64, 0, 0);
            for l in 0..layers {
                for h in 0..n_kv {
                    let want = floats(&p["scores"][l][h]);
                    let row = &got[(l * n_kv + h) * n..(l * n_kv + h + 1) * n];
                    for (g, w) in row.iter().zip(&want) {
                        // Six significant digits stored; float32 forward passes
                        // that sum in another order.
                        let d = (*g as f64 - w).abs() / w.abs().max(1.0);
                        worst = worst.max(d);
                    }
                    for (ratio, r) in p["ratios"].as_object().unwrap() {
                        let n_kept = r["n_kept"].as_u64().unwrap() as usize;
                        let gap = r["boundary_gap"][l][h].as_f64().unwrap();
                        if gap < 1e-4 {
                            skipped += 1;
                            continue;
                        }
                        let mut order: Vec<usize> = (0..n).collect();
                        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                        let mut kept: Vec<u64> =
                            order[..n_kept].iter().map(|&i| i as u64).collect();
                        kept.sort_unstable();
                        let want_kept: Vec<u64> = (r["kept"][l][h].as_array().unwrap().iter())
                            .map(|v| v.as_u64().unwrap())
                            .collect();
                        assert_eq!(
                            kept, want_kept,
                            "{name} {press} ratio {ratio} layer {l} head {h}"
                        );
                        compared += 1;
                    }
                }
            }
            eprintln!("{name} {press}: scores max |d| (relative above 1) {worst:.2e}; kept sets equal in {compared}, {skipped} cut inside a tie");
            assert!(
                worst < 2e-5,
                "{name} {press}: scores max |d| (relative above 1) {worst}"
            );
            assert!(
                compared >= skipped * 4,
                "{name} {press}: {compared} compared, {skipped} skipped"
            );
        }
    }
}
