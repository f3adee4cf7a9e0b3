//! sieve's kvpress policies against kvpress's own code
//! (tests/data/kvpress: the five presses run by
//! scripts/kvpress-reference.py on the tiny golden models, the 300-token
//! input): each (layer, KV head)'s scores of every position, and the kept
//! set per (layer, KV head) at compression ratios 0.25, 0.5 and 0.75
//! (the `head` granularity's selection, top n_kept of the head's scores):
//! equal wherever the cut is not inside float noise, and elsewhere (exact
//! ties, LagKV's tie at 1) kvpress's set is a top-n_kept set of sieve's
//! scores. SnapKVPress and ExpectedAttentionPress too, from the queries
//! kept by the engine.

mod common;
use common::*;
use serde_json::Value;
use sieve::engine::Signals;
use sieve::formats::{KvFormat, WeightFormat};
use sieve::kernels::key_scores::KeyScore;
use sieve::kernels::query_scores::{ExpectedAttention, QueryPolicy, QueryWindow, SnapKv};
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
        let lag = KeyScore::Lag { sinks: 4, lag: 128 };
        // kvpress's SnapKV window: the last 64 queries, scoring the entries
        // before them; Expected Attention's statistics: every query but the
        // 4 sinks', scoring every entry but theirs.
        let snapkv = QueryPolicy::SnapKv(SnapKv {
            window: 64,
            kernel: 5,
        });
        let sinks = 4;
        let expected = QueryPolicy::ExpectedAttention(ExpectedAttention {
            window: n - sinks,
            future: 512,
        });
        let window = |first: usize, end: usize, queries: usize| QueryWindow {
            n: n as u32,
            first: first as u32,
            end: end as u32,
            queries: queries as u32,
            last_pos: n as u32 - 1,
            _p: [0; 3],
        };
        for (press, kind, queries) in [
            ("KnormPress", Some(KeyScore::Norm), None),
            ("KeyDiffPress", Some(KeyScore::Diff), None),
            ("LagKVPress", Some(lag), None),
            ("SnapKVPress", None, Some((snapkv, window(0, n - 64, 64)))),
            (
                "ExpectedAttentionPress",
                None,
                Some((expected, window(sinks, n, n - sinks))),
            ),
        ] {
            let signals = Signals {
                key_scores: kind,
                queries: queries.map(|(policy, _)| policy),
                ..Default::default()
            };
            let (e, _) = fed_engine(&model, &ids, 64, signals, |_| {});
            let got = match queries {
                None => {
                    e.key_scores().unwrap();
                    e.read_key_scores_per_head(n).unwrap()
                }
                Some((_, w)) => {
                    e.query_scores(w).unwrap();
                    e.read_query_scores_per_head(n).unwrap()
                }
            };
            let p = &data["presses"][press];
            let protected: Vec<usize> = match p["protected"]["positions"].as_array() {
                Some(list) => list.iter().map(|v| v.as_u64().unwrap() as usize).collect(),
                None => vec![],
            };
            let (mut worst, mut equal, mut swaps) = (0.0f64, 0, 0);
            // Cuts inside an exact tie of kvpress's scores, and inside
            // sieve's error.
            let (mut exact_ties, mut near_ties) = (0, 0);
            let mut widest = 0.0f64;
            for l in 0..layers {
                for h in 0..n_kv {
                    let want = floats(&p["scores"][l][h]);
                    let row = &got[(l * n_kv + h) * n..(l * n_kv + h + 1) * n];
                    // How far apart two scores must be for their order to be
                    // certain: 4 times the error beyond the stored rounding.
                    let mut tie_tolerance = 1e-7f64;
                    if kind == Some(lag) {
                        swaps += check_ranks(row, &want, &p["pre_rank_scores"], l, h)
                            .unwrap_or_else(|e| panic!("{name} layer {l} head {h}: {e}"));
                    } else {
                        for (g, w) in row.iter().zip(&want) {
                            // Six significant digits stored; float32 forward
                            // passes that sum in another order: within 1e-4
                            // relative, or 2e-6 for scores near 0 (KeyDiff's
                            // float32 cosines).
                            let d = (*g as f64 - w).abs() / (1e-4 * w.abs() + 2e-6);
                            worst = worst.max(d);
                        }
                        // Beyond the stored rounding, on the scale of the
                        // scores at the cuts: the protected positions'
                        // constant (the layer's highest plus 1) left out.
                        for (j, (g, w)) in row.iter().zip(&want).enumerate() {
                            if !protected.contains(&j) {
                                let excess = (*g as f64 - w).abs() - 5e-6 * w.abs();
                                tie_tolerance = tie_tolerance.max(4.0 * excess);
                            }
                        }
                    }
                    widest = widest.max(tie_tolerance);
                    for (ratio, r) in p["ratios"].as_object().unwrap() {
                        let what = format!("{name} {press} ratio {ratio} layer {l} head {h}");
                        let n_kept = r["n_kept"].as_u64().unwrap() as usize;
                        let gap = r["boundary_gap"][l][h].as_f64().unwrap();
                        let want_kept: Vec<usize> = (r["kept"][l][h].as_array().unwrap().iter())
                            .map(|v| v.as_u64().unwrap() as usize)
                            .collect();
                        assert_eq!(want_kept.len(), n_kept, "{what}");
                        if gap > tie_tolerance {
                            let mut order: Vec<usize> = (0..n).collect();
                            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                            let mut kept = order[..n_kept].to_vec();
                            kept.sort_unstable();
                            assert_eq!(kept, want_kept, "{what}");
                            equal += 1;
                        } else {
                            // Inside a tie: kvpress's choice is one of sieve's
                            // top-n_kept sets, up to the scores' error.
                            let low = (want_kept.iter().map(|&i| row[i])).fold(f32::MAX, f32::min);
                            let high = ((0..n).filter(|i| !want_kept.contains(i)))
                                .map(|i| row[i])
                                .fold(f32::MIN, f32::max);
                            assert!(
                                low as f64 >= high as f64 - tie_tolerance,
                                "{what}: kept down to {low}, evicted up to {high}"
                            );
                            match gap > 0.0 {
                                true => near_ties += 1,
                                false => exact_ties += 1,
                            }
                        }
                    }
                }
            }
            eprintln!("{name} {press}: scores within {worst:.2} of the tolerance (1e-4 relative + 2e-6), {swaps} rank swaps within rounding; kept sets equal in {equal}; a top set in {exact_ties} exact ties and {near_ties} cuts closer than sieve's error (up to {widest:.1e})");
            assert!(
                worst <= 1.0,
                "{name} {press}: a score {worst} times the tolerance (1e-4 relative + 2e-6) from kvpress's"
            );
            // Only a few cuts may be excused by sieve's own error.
            assert!(
                near_ties * 3 <= equal,
                "{name} {press}: {near_ties} cuts within sieve's error, {equal} compared"
            );
            assert!(widest < 1e-4, "{name} {press}: ties up to {widest}");
        }
    }
}

/// LagKV's ranks against kvpress's: equal, except pairs of positions whose
/// pre-rank scores are equal to the six digits stored (float32 rounding
/// decides their order; sieve breaks ties by position, torch by neither).
/// Returns the number of such swapped positions.
fn check_ranks(
    got: &[f32],
    want: &[f64],
    pre_rank: &Value,
    l: usize,
    h: usize,
) -> Result<usize, String> {
    let first = pre_rank["positions"][0].as_u64().unwrap() as usize;
    let pre = floats(&pre_rank["scores"][l][h]);
    let mut swaps = 0;
    for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
        if (g as f64 - w).abs() < 1e-6 {
            continue;
        }
        let Some(pj) = j.checked_sub(first).and_then(|k| pre.get(k)) else {
            return Err(format!("position {j} scores {g}, kvpress {w}"));
        };
        // Another position of the same rounded pre-rank holding the rank
        // sieve gave j.
        let partner = (0..pre.len()).any(|t| {
            t + first != j
                && (pre[t] - pj).abs() <= 1e-6 * pj.abs()
                && (want[t + first] - g as f64).abs() < 1e-6
        });
        if !partner {
            return Err(format!(
                "position {j} ranks {g}, kvpress {w}, with no tied partner"
            ));
        }
        swaps += 1;
    }
    Ok(swaps)
}
