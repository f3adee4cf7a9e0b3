//! `sieve eval`: the fidelity metrics against ../shared/golden/eviction's
//! metrics.json (an independent implementation), and every eval command end
//! to end on a tiny random model that has the SmolLM2 tokenizer (seconds).

mod common;
use common::*;
use serde_json::Value;
use sieve::cache::CacheOptions;
use sieve::eval::fidelity::{fidelity_document, RunConfig};
use sieve::eviction::Policy;
use sieve::formats::WeightFormat;
use sieve::model::{LoadOptions, Model};
use std::path::Path;
use std::process::Command;

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// One tiny model of ../shared/golden/eviction: its settings, its input
/// ids, and the model (f32 weights).
fn golden_eviction_case(name: &str) -> (Value, Vec<u32>, std::sync::Arc<Model>) {
    let s = read_json(
        &golden_dir()
            .join("eviction")
            .join(name)
            .join("settings.json"),
    );
    let ids = s["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let opts = LoadOptions {
        dtype: Some(WeightFormat::F32),
        ..Default::default()
    };
    let model = Model::load(&golden_dir().join(name), &opts).unwrap();
    (s, ids, model)
}

/// Top-1 agreement may differ by one position (near-ties of the argmax under
/// a logit noise of ~1e-4 on other devices); KL and NLL increase are means
/// over 236 positions and agree within 1e-4 (measured on lavapipe: 4e-6 at
/// most, top-1 exact).
#[test]
fn fidelity_matches_the_reference_metrics() {
    let metrics = read_json(&golden_dir().join("eviction/metrics.json"));
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let (s, ids, model) = golden_eviction_case(name);
        let u = |k: &str| s[k].as_u64().unwrap() as usize;
        let base = CacheOptions {
            sinks: u("sinks"),
            recent: u("recent"),
            ..CacheOptions::new(Policy::Full, 0, u("h"))
        };
        let policies = ["window", "h2o", "tova", "epikv", "ccs", "ccs-full"];
        let configs: Vec<RunConfig> = policies
            .iter()
            .map(|p| RunConfig {
                policy: Policy::parse(p).unwrap(),
                budget: u("J"),
            })
            .collect();
        let mut fed = 0;
        let sums = fidelity_document(&model, &ids, &base, &configs, 1, |n| fed += n).unwrap();
        assert_eq!(fed, ids.len() * (1 + configs.len()));
        // Stepped together, four runs a step (the full one among them):
        // the same sums as one run at a time.
        let together = fidelity_document(&model, &ids, &base, &configs, 4, |_| {}).unwrap();
        assert_eq!(
            serde_json::to_value(&together).unwrap(),
            serde_json::to_value(&sums).unwrap(),
            "{name}"
        );
        // A document no longer than J + h: nothing to compare, no error.
        let short = &ids[..u("J")];
        let none = fidelity_document(&model, short, &base, &configs, 4, |_| {}).unwrap();
        assert!(none.iter().all(|m| m.positions == 0), "{name}");
        for (p, m) in policies.iter().zip(&sums) {
            let g = &metrics[name][p];
            let f = |k: &str| g[k].as_f64().unwrap();
            assert_eq!(m.positions, f("n_positions_after_first_refresh") as usize);
            assert_eq!(m.nll_positions, m.positions - 1);
            let top1 = f("top1_agree_after_first_refresh");
            assert!(
                (m.top1_agreement() - top1).abs() <= 1.0 / 236.0 + 1e-9,
                "{name} {p}: top-1 {} vs {top1}",
                m.top1_agreement()
            );
            eprintln!(
                "{name} {p}: KL {:+.2e}, NLL increase {:+.2e}, top-1 {:+.4} against the reference",
                m.mean_kl() - f("mean_kl_full_policy_after_first_refresh"),
                m.mean_nll_increase() - f("mean_nll_increase_after_first_refresh"),
                m.top1_agreement() - top1
            );
            for (got, key) in [
                (m.mean_kl(), "mean_kl_full_policy_after_first_refresh"),
                (
                    m.mean_nll_increase(),
                    "mean_nll_increase_after_first_refresh",
                ),
                (m.mean_nll_full(), "mean_nll_full_after_first_refresh"),
            ] {
                assert!(
                    (got - f(key)).abs() < 1e-4,
                    "{name} {p}: {key} {got} vs {}",
                    f(key)
                );
            }
        }
    }
}

fn sieve(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sieve"))
        .args(args)
        .env("NODEVICE_SELECT", "1")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn ok(args: &[&str]) -> String {
    let (success, stdout, stderr) = sieve(args);
    assert!(success, "sieve {}: {stderr}", args.join(" "));
    stdout
}

fn lines(p: &Path) -> usize {
    std::fs::read_to_string(p).unwrap().lines().count()
}

#[test]
fn eval_commands_end_to_end_on_a_tiny_model() {
    let model = tiny_text_model();
    let m = model.to_str().unwrap();
    let work = std::env::temp_dir().join(format!("sieve-eval-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let w = |p: &str| work.join(p).to_str().unwrap().to_string();
    let sweep = [
        "--model",
        m,
        "--dtype",
        "f32",
        "--policies",
        "full,window,epikv,ccs",
        "--budgets",
        "72,96",
        "--chunk",
        "16",
        "--sinks",
        "4",
        "--recent",
        "8",
    ];
    let with = |cmd: &[&str], extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
        v.extend(sweep.iter().map(|s| s.to_string()));
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run = |args: &[String]| ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());

    // Fidelity on prose: 2 documents x (window, epikv, ccs) x 2 budgets.
    let fid = w("fidelity");
    let args = with(
        &["eval", "fidelity", "--dataset", "prose"],
        &["--docs", "2", "--doc-tokens", "160", "--out", &fid],
    );
    let table = run(&args);
    assert!(table.contains("| window | 72 | 2 |"), "{table}");
    assert_eq!(lines(&work.join("fidelity/results.jsonl")), 12);
    let report: Value = read_json(&work.join("fidelity/report.json"));
    assert_eq!(report["rows"].as_array().unwrap().len(), 6);
    // epikv and ccs paired with the window at both budgets, on both documents.
    let paired = report["paired"].as_array().unwrap();
    assert_eq!(paired.len(), 4);
    assert!(
        paired.iter().all(|p| p["difference"]["n"] == 2),
        "{paired:?}"
    );
    assert!(
        table.contains("### fidelity, paired with window"),
        "{table}"
    );
    for r in report["rows"].as_array().unwrap() {
        let kl = r["metrics"]["mean KL(full ‖ policy)"]["mean"]
            .as_f64()
            .unwrap();
        let top1 = r["metrics"]["top-1 agreement"]["mean"].as_f64().unwrap();
        assert!(
            kl >= 0.0 && kl.is_finite() && (0.0..=1.0).contains(&top1),
            "{r}"
        );
        assert!(r["metrics"]["mean KL(full ‖ policy)"]["ci95"].is_number());
    }
    let svg = std::fs::read_to_string(work.join("fidelity/fidelity.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("epikv"));
    assert!(
        std::fs::read_to_string(work.join("fidelity/report.csv"))
            .unwrap()
            .lines()
            .count()
            > 6
    );
    // Resuming does no work and adds nothing; other settings are refused.
    run(&args);
    assert_eq!(lines(&work.join("fidelity/results.jsonl")), 12);
    let mut other = args.clone();
    let i = other.iter().position(|a| a == "--chunk").unwrap();
    other[i + 1] = "8".into();
    let (success, _, err) = sieve(&other.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(!success && err.contains("chunk: 16 before, 8 now"), "{err}");
    // Results made with an f32 KV cache are not mixed with f16 ones.
    let mut f16_kv = args.clone();
    f16_kv.extend(["--kv-dtype".to_string(), "f16".to_string()]);
    let (success, _, err) = sieve(&f16_kv.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(!success && err.contains("kv_dtype: null before"), "{err}");

    // Needle: 2 depths x 1 trial x (full + 3 policies x 2 budgets).
    let args = with(
        &["eval", "needle"],
        &[
            "--context",
            "200",
            "--depths",
            "0.2,0.8",
            "--trials",
            "1",
            "--out",
            &w("needle"),
        ],
    );
    let table = run(&args);
    assert!(table.contains("| full | full | all |"), "{table}");
    assert_eq!(lines(&work.join("needle/results.jsonl")), 14);

    // RULER: 2 tasks x 1 sample x (full + 3 policies at one compression
    // ratio), kvpress's layout beside the report.
    let args = with(
        &["eval", "ruler"],
        &[
            "--context",
            "900",
            "--tasks",
            "niah_single_1,niah_multikey_1",
            "--samples",
            "1",
            "--compression-ratios",
            "0.5",
            "--out",
            &w("ruler"),
        ],
    );
    let table = run(&args);
    assert!(
        table.contains("| window ratio=0.5 | - | niah_single_1 | 1 |"),
        "{table}"
    );
    assert_eq!(lines(&work.join("ruler/results.jsonl")), 8);
    let metrics: Value = serde_json::from_str(
        &std::fs::read_to_string(work.join("ruler/ruler_metrics.json")).unwrap(),
    )
    .unwrap();
    let niah = metrics["epikv ratio=0.5"]["niah_single_1"]["string_match"].as_f64();
    assert!(
        niah.is_some_and(|a| (0.0..=100.0).contains(&a)),
        "{metrics}"
    );
    // A ratio leaving too little room for the question and answer after the
    // cut is refused (kvpress never compresses while answering).
    let mut small = args.clone();
    let i = small.iter().position(|a| a == "0.5").unwrap();
    small[i] = "0.05".into();
    let i = small.iter().position(|a| a == "--out").unwrap();
    small[i + 1] = w("ruler-small");
    let (success, _, err) = sieve(&small.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(
        !success && err.contains("--compression-ratios 0.05"),
        "{err}"
    );

    // Task in two shards, then merged.
    for shard in ["0/2", "1/2"] {
        let dir = w(&format!("task{}", &shard[..1]));
        let args = with(
            &["eval", "task", "--dataset", "gsm8k"],
            &[
                "--limit",
                "3",
                "--shard",
                shard,
                "--max-new-tokens",
                "8",
                "--batch",
                "1",
                "--out",
                &dir,
            ],
        );
        run(&args);
    }
    assert_eq!(lines(&work.join("task0/results.jsonl")), 2 * 7);
    assert_eq!(lines(&work.join("task1/results.jsonl")), 7);
    let merged = ok(&[
        "eval",
        "merge",
        "--out",
        &w("task"),
        &w("task0"),
        &w("task1"),
    ]);
    assert!(merged.contains("| full | full | all | 3 |"), "{merged}");
    assert_eq!(lines(&work.join("task/results.jsonl")), 21);

    // Generate: the full cache is the reference of every other run.
    let args = with(
        &["eval", "generate", "--dataset", "math500"],
        &[
            "--limit",
            "1",
            "--max-new-tokens",
            "40",
            "--batch",
            "1",
            "--out",
            &w("generate"),
        ],
    );
    run(&args);
    let recs: Vec<Value> = std::fs::read_to_string(work.join("generate/results.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 7);
    let full = recs.iter().find(|r| r["policy"] == "full").unwrap();
    for r in &recs {
        let prefix = r["common_prefix"].as_u64().unwrap();
        assert!(prefix <= full["generated"].as_u64().unwrap());
    }

    // Stepped together (generate: as many as fit, all 7; task: --batch 4),
    // generate and task give the records they give one at a time (in the
    // order they finish).
    let records = |dir: &str| -> std::collections::BTreeMap<String, Value> {
        std::fs::read_to_string(work.join(dir).join("results.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .map(|mut r| {
                let key = format!("{} {} {}", r["item"], r["policy"], r["budget"]);
                r.as_object_mut().unwrap().remove("seconds");
                (key, r)
            })
            .collect()
    };
    let args = with(
        &["eval", "generate", "--dataset", "math500"],
        &[
            "--limit",
            "1",
            "--max-new-tokens",
            "40",
            "--out",
            &w("generate-batched"),
        ],
    );
    run(&args);
    assert_eq!(records("generate-batched"), records("generate"));
    let args = with(
        &["eval", "task", "--dataset", "gsm8k"],
        &[
            "--limit",
            "3",
            "--shard",
            "0/2",
            "--max-new-tokens",
            "8",
            "--batch",
            "4",
            "--out",
            &w("task-batched"),
        ],
    );
    run(&args);
    assert_eq!(records("task-batched"), records("task0"));

    // Explain: an HTML page with one span per token.
    let text = work.join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(12),
    )
    .unwrap();
    let page = w("page.html");
    ok(&[
        "eval",
        "explain",
        "--model",
        m,
        "--dtype",
        "f32",
        "--policy",
        "epikv",
        "--budget",
        "48",
        "--chunk",
        "16",
        "--recent",
        "8",
        "--text",
        text.to_str().unwrap(),
        "--out",
        &page,
        "--diagnostics",
        &w("diagnosis.json"),
        "--also-diagnose",
        "window,tova",
        "--trace",
        &w("explain-trace.json"),
    ]);
    let html = std::fs::read_to_string(&page).unwrap();
    let n_tokens = html.matches("title=\"position ").count();
    assert!(n_tokens > 100, "{n_tokens}");
    assert!(html.contains("evicted at refresh 0") && html.contains("kept to the end"));
    assert!(html.contains("attention later"));
    // The diagnosis: per refresh, an overlap with the oracle in [0, 1] and
    // never less evicted future attention than the oracle's choice.
    let d = read_json(Path::new(&w("diagnosis.json")));
    for policy in ["epikv", "window", "tova"] {
        let p = &d["policies"][policy];
        let refreshes = p["refreshes"].as_array().unwrap();
        assert!(!refreshes.is_empty(), "{policy}");
        for r in refreshes {
            let f = |k: &str| r[k].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&f("overlap_next")), "{policy} {r}");
            assert!(
                f("lost_rest") >= f("oracle_lost_rest") - 1e-6,
                "{policy} {r}"
            );
        }
        assert!(p["categories"]["class: word"]["evicted"].as_u64().unwrap() > 0);
    }
    // Different policies evict differently (not EpiKV and the window here:
    // on this 2-layer model both EpiKV layers are layer 1, every score is 0,
    // and ties keep the later position).
    assert_ne!(
        d["policies"]["window"]["summary"],
        d["policies"]["tova"]["summary"]
    );
    let trace = read_json(Path::new(&w("explain-trace.json")));
    assert_eq!(trace[0]["diagnosis"]["refresh"], 0);
    // A kept set per (layer, KV head): the page says how many lists hold
    // each token, the trace has every list's kept positions, and each
    // refresh's diagnosis (the mean over the lists) stays in range.
    ok(&[
        "eval",
        "explain",
        "--model",
        m,
        "--dtype",
        "f32",
        "--policy",
        "keydiff",
        "--granularity",
        "head",
        "--budget",
        "48",
        "--chunk",
        "16",
        "--recent",
        "8",
        "--text",
        text.to_str().unwrap(),
        "--out",
        &page,
        "--trace",
        &w("explain-trace.json"),
    ]);
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains("keep lists"),
        "no token held by some lists only"
    );
    let trace = read_json(Path::new(&w("explain-trace.json")));
    let lists = trace[0]["kept_lists"].as_array().unwrap();
    assert!(lists.len() > 1 && lists.iter().all(|k| k.as_array().unwrap().len() == 48));
    for r in trace.as_array().unwrap() {
        let overlap = r["diagnosis"]["overlap_rest"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&overlap), "{r}");
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// The oracles' first pass against ../shared/golden/eviction: before the
/// first refresh no entry was evicted, so the attention each position has
/// received from the queries 0..C in the full run is exactly the reference's
/// H2O score at refresh 0 (an independent implementation). Every step's
/// queries give out one unit of attention each (averaged over layers and
/// heads), so each step's row grows by its number of queries. Then the
/// oracles run through fidelity: one extra pass, finite metrics.
#[test]
fn oracle_records_the_full_runs_attention() {
    for name in ["tiny-llama-gqa", "tiny-qwen2"] {
        let (s, ids, model) = golden_eviction_case(name);
        let dir = golden_dir().join("eviction").join(name);
        let u = |k: &str| s[k].as_u64().unwrap() as usize;
        let (j, h) = (u("J"), u("h"));
        let future = sieve::eval::fidelity::record_future_attention(&model, &ids, h).unwrap();
        assert_eq!(future.cumulative.len(), ids.len().div_ceil(h) + 1);
        for (k, pair) in future.cumulative.windows(2).enumerate() {
            let queries = (ids.len() - k * h).min(h) as f64;
            let grown: f64 = pair[1]
                .iter()
                .zip(&pair[0])
                .map(|(b, a)| (b - a) as f64)
                .sum();
            assert!(
                (grown - queries).abs() < 1e-3,
                "{name} step {k}: {grown} vs {queries}"
            );
        }
        let h2o = read_json(&dir.join("h2o.scores.json"));
        let first = &h2o[0];
        assert_eq!(first["before_position"].as_u64(), Some((j + h) as u64));
        let positions: Vec<u32> = first["unprotected"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = future.received(&positions, 0, j + h).unwrap();
        for (p, (g, want)) in positions
            .iter()
            .zip(got.iter().zip(first["scores"].as_array().unwrap()))
        {
            let want = want.as_f64().unwrap();
            assert!(
                (g - want).abs() < 1e-4 * want.abs().max(1.0),
                "{name} position {p}: {g} vs {want}"
            );
        }
        let base = CacheOptions {
            sinks: u("sinks"),
            recent: u("recent"),
            ..CacheOptions::new(Policy::Full, 0, h)
        };
        let configs: Vec<RunConfig> = ["oracle", "oracle-rest", "window"]
            .iter()
            .map(|p| RunConfig {
                policy: Policy::parse(p).unwrap(),
                budget: j,
            })
            .collect();
        let mut fed = 0;
        let sums = fidelity_document(&model, &ids, &base, &configs, 8, |n| fed += n).unwrap();
        assert_eq!(fed, ids.len() * (2 + configs.len()));
        for (c, m) in configs.iter().zip(&sums) {
            assert!(m.positions > 0 && m.mean_kl().is_finite(), "{name} {c:?}");
        }
        // Only fidelity knows the future: a generator refuses the oracle.
        let err = sieve::cache::BoundedCache::new(configs[0].cache_options(&base), 2)
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("only `sieve eval fidelity`"),
            "{err}"
        );
    }
}
