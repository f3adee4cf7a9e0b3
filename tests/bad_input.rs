//! Bad input gets a clear error naming the file, tensor, option or limit, never a panic.

mod common;
use common::golden_dir;
use sieve::gpu::{Gpu, GpuOptions};
use sieve::model::{LoadOptions, Model};
use sieve::session::{GenerateOptions, Session, SessionOptions};
use std::path::{Path, PathBuf};

/// A copy of tiny-qwen2 in a fresh temporary directory.
fn copy_tiny(tag: &str) -> PathBuf {
    let src = golden_dir().join("tiny-qwen2");
    let dst = std::env::temp_dir().join(format!("sieve-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    dst
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn truncated_safetensors() {
    let dir = copy_tiny("truncated");
    let f = dir.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    for cut in [4, 100, len / 2, len - 1] {
        let bytes = std::fs::read(golden_dir().join("tiny-qwen2/model.safetensors")).unwrap();
        std::fs::write(&f, &bytes[..cut as usize]).unwrap();
        let e = load_err(&dir);
        assert!(
            e.contains("model.safetensors") && e.contains("not a valid safetensors"),
            "cut {cut}: {e}"
        );
    }
}

#[test]
fn unknown_architecture() {
    let dir = copy_tiny("arch");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("Qwen2ForCausalLM", "FalconForCausalLM"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("FalconForCausalLM") && e.contains("LlamaForCausalLM, Qwen2ForCausalLM"),
        "{e}"
    );
}

#[test]
fn shape_mismatch() {
    // The config disagrees with the tensors: the message names tensor and shapes.
    let dir = copy_tiny("shape");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"intermediate_size\": 352", "\"intermediate_size\": 356"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("gate_proj") && e.contains("352") && e.contains("356"),
        "{e}"
    );
}

#[test]
fn int_weights_are_named() {
    let dir = copy_tiny("int");
    let bytes = std::fs::read(golden_dir().join("tiny-qwen2/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.norm.weight")
        .collect();
    let data = vec![0u8; 4 * 128];
    tensors.push((
        "model.norm.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![128], &data).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.norm.weight") && e.contains("I32") && e.contains("F32, F16, BF16"),
        "{e}"
    );
}

/// Issue #11: a NaN or infinity in any weight made every logit NaN with exit
/// 0; now loading refuses it, naming the tensor.
#[test]
fn non_finite_weights_are_named() {
    let bytes = std::fs::read(golden_dir().join("tiny-qwen2/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (target, bad) in [
        ("model.embed_tokens.weight", f32::NAN),
        ("model.layers.1.mlp.down_proj.weight", f32::INFINITY),
        ("model.norm.weight", f32::NEG_INFINITY),
    ] {
        let dir = copy_tiny("nonfinite");
        let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
            .collect();
        let t = owned.iter_mut().find(|t| t.0 == target).unwrap();
        assert_eq!(t.1, safetensors::Dtype::F32);
        t.3[20..24].copy_from_slice(&bad.to_le_bytes());
        let views: Vec<(String, safetensors::tensor::TensorView)> = owned
            .iter()
            .map(|(n, d, s, b)| {
                let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
                (n.clone(), v)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let e = load_err(&dir);
        assert!(
            e.contains(target) && e.contains(&format!("holds {bad} at flat index 5")),
            "{target}: {e}"
        );
    }
}

/// `name` from the golden folder with a final norm of 3e38: finite weights
/// whose logits overflow.
fn overflowing_model(name: &str) -> std::sync::Arc<Model> {
    use sieve::weights::{TensorStore, WeightSource};
    struct Overflowing(TensorStore);
    impl WeightSource for Overflowing {
        fn fill_rows(
            &self,
            gpu: &Gpu,
            m: &sieve::weights::GpuMatrix,
            row0: usize,
            rows: usize,
            name: &str,
        ) -> anyhow::Result<()> {
            self.0.fill_rows(gpu, m, row0, rows, name)
        }
        fn vector(&self, name: &str, len: usize) -> anyhow::Result<Vec<f32>> {
            match name {
                "model.norm.weight" => Ok(vec![3e38; len]),
                _ => self.0.vector(name, len),
            }
        }
        fn contains(&self, name: &str) -> bool {
            WeightSource::contains(&self.0, name)
        }
    }
    let dir = golden_dir().join(name);
    let config = sieve::config::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let store = Overflowing(TensorStore::open(&dir).unwrap());
    let opts = LoadOptions::default();
    let gpu = sieve::kernels::runtime::Runtime::open(&opts.gpu).unwrap();
    Model::upload(gpu, config, &store, &dir, &opts).unwrap()
}

/// Weights that are finite but overflow in the computation: the sampled
/// step and the logits read are errors naming what is non-finite, never a
/// token or a NaN row returned as an answer.
#[test]
fn non_finite_logits_are_errors() {
    use sieve::engine::{Engine, EngineOptions, StepOutput};
    let mut engine = Engine::new(
        overflowing_model("tiny-qwen2"),
        EngineOptions {
            max_slots: 8,
            max_tokens: 4,
            max_logit_rows: 4,
            ..Default::default()
        },
    )
    .unwrap();
    let sample = StepOutput {
        sample: Some((Default::default(), 0)),
        ..StepOutput::last(3)
    };
    let e = format!(
        "{:#}",
        engine.step(&[1, 2, 3], &[0, 1, 2], sample).unwrap_err()
    );
    assert!(
        e.contains("logits of the token in cache slot 2 hold NaN or infinity"),
        "{e}"
    );
    engine.reset();
    engine.step(&[1, 2], &[0, 1], StepOutput::last(2)).unwrap();
    let e = format!("{:#}", engine.read_logits(1).unwrap_err());
    assert!(
        e.contains("logit row 0 of 1") && e.contains("non-finite"),
        "{e}"
    );
}

/// A session whose step ran but failed (non-finite logits) holds that step
/// in its cache and not in its tokens: `generate` then refuses, naming the
/// error, until `reset`. An error before any step (a prompt too long, a
/// token id outside the vocabulary) leaves the session usable.
#[test]
fn a_session_out_of_step_after_an_error_asks_for_a_reset() {
    use sieve::tokenizer::Tokenizer;
    use sieve::ErrorKind;
    let tokenizer =
        std::sync::Arc::new(Tokenizer::load(&golden_dir().join("smollm2-135m"), &[]).unwrap());
    let bounded = sieve::CacheOptions {
        sinks: 2,
        recent: 4,
        ..sieve::CacheOptions::new(sieve::Policy::H2o, 10, 3)
    };
    for cache in [None, Some(bounded)] {
        let opts = SessionOptions {
            max_context: 32,
            prefill_chunk: 8,
            cache,
        };
        let what = format!("{:?}", cache.map(|c| c.policy));
        let mut s =
            Session::new(overflowing_model("tiny-llama-gqa"), tokenizer.clone(), opts).unwrap();
        let gen = GenerateOptions::default();
        let kind = |s: &mut Session, prompt: &[u32]| {
            s.generate(prompt, &gen, |_| true)
                .map(|_| ())
                .unwrap_err()
                .kind()
        };
        if cache.is_none() {
            assert_eq!(kind(&mut s, &[1; 40]), ErrorKind::PromptTooLong, "{what}");
        }
        // Its second chunk crosses the bounded cache's first refresh (two
        // steps), the bad id in the second.
        let mut bad = vec![1u32; 16];
        bad[14] = 1 << 20;
        assert_eq!(kind(&mut s, &bad), ErrorKind::InvalidOptions, "{what}");
        assert_eq!(
            kind(&mut s, &[1, 2, 3]),
            ErrorKind::NonFiniteLogits,
            "{what}"
        );
        let e = s.generate(&[4, 5], &gen, |_| true).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NeedsReset, "{what}");
        assert!(
            e.to_string().contains("reset the session")
                && e.to_string().contains("NaN or infinity"),
            "{what}: {e}"
        );
        s.reset();
        assert_eq!(
            kind(&mut s, &[1, 2, 3]),
            ErrorKind::NonFiniteLogits,
            "{what}"
        );
    }
}

/// Issue #11: a shard name in model.safetensors.index.json that leaves the
/// model folder is refused before any file is opened.
#[test]
fn index_shards_stay_in_the_model_folder() {
    let dir = copy_tiny("index");
    std::fs::rename(dir.join("model.safetensors"), dir.join("shard.safetensors")).unwrap();
    for (shard, ok) in [
        ("\"../../../../etc/passwd\"", false),
        ("\"/etc/passwd\"", false),
        ("\"sub/shard.safetensors\"", false),
        ("\"..\"", false),
        ("7", false),
        ("\"shard.safetensors\"", true),
    ] {
        let index = format!(r#"{{"weight_map": {{"model.norm.weight": {shard}}}}}"#);
        std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
        match sieve::weights::TensorStore::open(&dir) {
            Ok(_) => assert!(ok, "{shard} was accepted"),
            Err(e) => {
                let e = format!("{e:#}");
                assert!(!ok, "{shard}: {e}");
                assert!(
                    e.contains("model.norm.weight")
                        && e.contains("not a file name in the model folder"),
                    "{shard}: {e}"
                );
            }
        }
    }
}

/// Issue #11: a malformed generation_config.json was silently ignored (its
/// eos ids decide where generation stops), and token ids that are not
/// integers in u32 were skipped or truncated.
#[test]
fn malformed_token_settings_are_errors() {
    let dir = common::converted_tiny_llama("bad-tok");
    let gen = dir.join("generation_config.json");
    for (text, want) in [
        (
            "{\"eos_token_id\": ",
            "generation_config.json: not valid JSON",
        ),
        ("{\"eos_token_id\": \"2\"}", "eos_token_id holds \"2\""),
        ("{\"eos_token_id\": [2, -1]}", "eos_token_id holds -1"),
        (
            "{\"eos_token_id\": 4294967296}",
            "eos_token_id holds 4294967296",
        ),
    ] {
        std::fs::write(&gen, text).unwrap();
        let e = match sieve::tokenizer::Tokenizer::load(&dir, &[]) {
            Ok(_) => panic!("{text} was accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains(want), "{text}: {e}");
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["bos_token_id"] = serde_json::json!(1u64 << 40);
    let e = sieve::config::ModelConfig::from_json(&cfg, &dir.join("config.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("bos_token_id holds 1099511627776"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_tokenizer() {
    let e = match sieve::session::Llm::load(
        &golden_dir().join("tiny-qwen2"),
        &LoadOptions::default(),
    ) {
        Ok(_) => panic!("loaded without a tokenizer"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn prompt_longer_than_the_context() {
    let model = Model::load(
        &golden_dir().join("tiny-llama-gqa"),
        &LoadOptions::default(),
    )
    .unwrap();
    // The tiny model has no tokenizer; a byte-level one is enough to build a session.
    let tok = std::sync::Arc::new(
        sieve::tokenizer::Tokenizer::load(&golden_dir().join("smollm2-135m"), &[]).unwrap(),
    );
    let mut s = Session::new(
        model,
        tok,
        SessionOptions {
            max_context: 16,
            prefill_chunk: 8,
            cache: None,
        },
    )
    .unwrap();
    let prompt: Vec<u32> = (0..17).collect();
    let e = s
        .generate(&prompt, &GenerateOptions::default(), |_| true)
        .unwrap_err();
    // A kind an application can match, and a message for the library (no
    // command-line flags).
    assert_eq!(e.kind(), sieve::error::ErrorKind::PromptTooLong);
    let e = e.to_string();
    assert!(
        e.contains("17 tokens")
            && e.contains("16")
            && e.contains("max_context")
            && !e.contains("--"),
        "{e}"
    );
}

#[test]
fn no_matching_adapter() {
    let e = Gpu::new(&GpuOptions {
        adapter: Some("no-such-gpu".into()),
        ..Default::default()
    })
    .err()
    .expect("no adapter should match")
    .to_string();
    assert!(e.contains("no-such-gpu") && e.contains("available"), "{e}");
    let e = Gpu::new(&GpuOptions {
        backend: Some("glide".into()),
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("glide") && e.contains("vulkan"), "{e}");
}

/// Runs the sieve binary; returns (exit code, stderr).
fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sieve"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn cli_errors_are_one_line_and_exit_1() {
    let (code, err) = run(&["run", "--model", "/nonexistent-model", "--prompt", "hi"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("/nonexistent-model"), "{err}");
    let (code, err) = run(&["run", "--model", "x", "--prompt", "hi", "--top-p", "1.5"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--top-p"), "{err}");
    // A batch of no sequences, before any model is loaded or any work runs.
    let (code, err) = run(&[
        "eval",
        "task",
        "--dataset",
        "gsm8k",
        "--batch",
        "0",
        "--out",
        "x",
    ]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--batch"), "{err}");
    // Issue #11: settings with which sampling degenerates (one token repeated).
    for (flag, value, want) in [
        (
            "--temperature",
            "1e-38",
            "temperature 1e-38 is not 0 (greedy) or",
        ),
        ("--temperature", "inf", "temperature inf"),
        (
            "--repetition-penalty",
            "1e-45",
            "repetition penalty 1e-45 is not in [0.01, 100]",
        ),
        ("--repetition-penalty", "1000", "repetition penalty 1000.0"),
    ] {
        let (code, err) = run(&["run", "--model", "x", "--prompt", "hi", flag, value]);
        assert_eq!(code, Some(1), "{flag} {value}");
        assert!(
            err.contains(want) && err.contains(flag),
            "{flag} {value}: {err}"
        );
    }
    let (code, err) = run(&[
        "logits",
        "--model",
        "x",
        "--ids",
        "1,a",
        "--out",
        "/tmp/x.npy",
    ]);
    assert_eq!(code, Some(1));
    assert!(err.contains("'a'"), "{err}");
    let bad = std::env::temp_dir().join(format!("sieve-bad-{}.gguf", std::process::id()));
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00").unwrap();
    let out = std::env::temp_dir().join(format!("sieve-bad-out-{}", std::process::id()));
    let (code, err) = run(&["convert-gguf", bad.to_str().unwrap(), out.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains(bad.file_name().unwrap().to_str().unwrap()),
        "{err}"
    );
    assert!(!out.exists(), "a failed conversion left {}", out.display());
}

#[test]
fn cache_options_and_sizes_are_checked_before_loading() {
    let tiny = golden_dir().join("tiny-qwen2");
    let m = tiny.to_str().unwrap();
    let base = [
        "logits",
        "--model",
        m,
        "--ids",
        "1,2,3",
        "--out",
        "/tmp/sieve-never-written.npy",
    ];
    for (extra, want) in [
        (vec!["--budget", "10"], "cache budget 10 must exceed"),
        (vec!["--budget", "100", "--chunk", "0"], "--chunk"),
        (
            vec!["--budget", "100", "--policy", "lru"],
            "unknown policy 'lru'",
        ),
        (vec!["--policy", "window"], "needs a KV budget"),
        (vec!["--budget", "100", "--policy", "full"], "--policy full"),
        (vec!["--budget", "100", "--recent", "96"], "recent 96"),
        (
            vec!["--granularity", "head"],
            "--granularity head needs a bounded cache",
        ),
        (
            vec![
                "--budget",
                "100",
                "--policy",
                "snapkv",
                "--granularity",
                "layer",
                "--snapkv-window",
                "200",
            ],
            "snapkv_window 200 exceeds recent 64 + chunk 64",
        ),
        // Issue #11: sums that wrapped around.
        (
            vec!["--budget", "100", "--sinks", "18446744073709551615"],
            "sinks 18446744073709551615 + recent 64 overflows",
        ),
        (
            vec![
                "--budget",
                "100",
                "--recent",
                "18446744073709551614",
                "--sinks",
                "2",
            ],
            "overflows",
        ),
        (
            vec!["--budget", "18446744073709551615"],
            "budget 18446744073709551615 + chunk 64 overflows",
        ),
        // Sizes no device can hold, refused before anything is allocated (a
        // budget of 2^62 aborted in a host allocation).
        (
            vec!["--budget", "4611686018427388004"],
            "cache slots (context or KV budget + chunk) is more than the kernels index",
        ),
        (
            vec!["--budget", "1000000000000"],
            "more than the kernels index",
        ),
        (
            vec!["--budget", "2000000000"],
            "more than this device can hold",
        ),
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (code, err) = run(&args);
        assert_eq!(code, Some(1), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
    // A value clap parses itself: its usage error (exit 2) names it.
    let args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--granularity", "block"])
        .collect();
    let (code, err) = run(&args);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("unknown granularity 'block'; known: token, layer, head"),
        "{err}"
    );
    assert!(!Path::new("/tmp/sieve-never-written.npy").exists());
    // Issue #11: an output path that is not a regular file (or a new name)
    // is refused before the model runs; /dev/full was replaced by a file.
    let dir = std::env::temp_dir();
    let dir = dir.to_str().unwrap();
    for (flag, path) in [
        ("--out", "/dev/full"),
        ("--out", dir),
        ("--trace", "/dev/null"),
    ] {
        let mut args = base.to_vec();
        if flag == "--out" {
            args[6] = path;
        } else {
            args.extend(["--budget", "100", "--trace", path]);
        }
        let (code, err) = run(&args);
        assert_eq!(code, Some(1), "{flag} {path}: {err}");
        assert!(
            err.contains(flag) && err.contains(path) && err.contains("not a regular file"),
            "{flag} {path}: {err}"
        );
    }
    assert!(Path::new("/dev/full").exists());
}

/// The memory wall of attention-scored eviction with an eager weight matrix is
/// a clear error naming the matrix and the device limit, not a crash.
#[test]
fn materialized_matrix_too_large_for_the_device() {
    let tiny = golden_dir().join("tiny-llama-gqa");
    let args = [
        "logits",
        "--model",
        tiny.to_str().unwrap(),
        "--dtype",
        "f32",
        "--ids",
        "1,2,3",
        "--out",
        "/tmp/sieve-never-written-2.npy",
        "--budget",
        "4000",
        "--chunk",
        "96",
        "--policy",
        "h2o",
        "--materialize",
        "--prefill-chunk",
        "4096",
    ];
    let (code, err) = run(&args);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("materialized attention matrix") && err.contains("bytes per binding"),
        "{err}"
    );
    let (code, err) = run(&[&args[..13], &["--policy", "epikv", "--materialize"]].concat());
    assert_eq!(code, Some(1));
    assert!(err.contains("materialize applies"), "{err}");
}

/// Writes tiny-qwen2's config.json with `field` replaced by `value` (raw JSON)
/// and returns the load error.
fn config_error(tag: &str, field: &str, value: &str) -> String {
    let dir = copy_tiny(tag);
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg[field] = serde_json::from_str(value).unwrap();
    std::fs::write(&path, cfg.to_string()).unwrap();
    load_err(&dir)
}

/// Dimensions each within bounds that together need more weight memory than
/// the device can hold are refused before any buffer is created (naming the
/// size), not after allocating hundreds of GiB.
#[test]
fn weights_larger_than_the_device_are_refused() {
    let dir = copy_tiny("huge-weights");
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["vocab_size"] = 4194304.into();
    cfg["hidden_size"] = 65536.into();
    cfg["intermediate_size"] = 262144.into();
    cfg["head_dim"] = 32.into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("the weights need") && e.contains("more than this device can hold"),
        "{e}"
    );
}

/// Issue #11's configurations: each is refused before anything is allocated,
/// with the field, its value and the rule (they panicked, aborted, hung or
/// ran with NaN logits before).
#[test]
fn config_values_are_bounded_and_checked() {
    for (field, value, expect) in [
        ("hidden_size", "0", "hidden_size is 0; expected 1 to"),
        (
            "num_hidden_layers",
            "4294967296",
            "num_hidden_layers is 4294967296; expected 1 to",
        ),
        ("num_hidden_layers", "0", "num_hidden_layers is 0"),
        ("vocab_size", "1000000000000", "vocab_size is 1000000000000"),
        (
            "rms_norm_eps",
            "-1",
            "rms_norm_eps is -1; expected a finite number above 0",
        ),
        (
            "rms_norm_eps",
            "\"abc\"",
            "field 'rms_norm_eps' is \"abc\", expected a number",
        ),
        (
            "rope_theta",
            "0",
            "rope_theta is 0; expected a finite number above 0",
        ),
        ("rope_theta", "-5.0", "rope_theta is -5"),
        (
            "num_key_value_heads",
            "\"two\"",
            "field 'num_key_value_heads'",
        ),
    ] {
        let e = config_error(field, field, value);
        assert!(
            e.contains("config.json") && e.contains(expect),
            "{field} = {value}: {e}"
        );
    }
}

/// A config naming fewer layers than the checkpoint holds is refused (it ran
/// a truncated model silently before).
#[test]
fn layer_count_must_match_the_checkpoint() {
    // The tiny model's config lists its layers' types: the count disagrees
    // with that list first.
    let e = config_error("layers", "num_hidden_layers", "1");
    assert!(
        e.contains("layer_types has 4 entries; expected one per layer (1)"),
        "{e}"
    );
    // Without the list, with the weights.
    let dir = copy_tiny("layers-untyped");
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["num_hidden_layers"] = 1.into();
    cfg.as_object_mut().unwrap().remove("layer_types");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("num_hidden_layers is 1") && e.contains("more layers"),
        "{e}"
    );
}

#[test]
fn empty_token_ids_are_refused() {
    for ids in ["1,,2", "1,2,", ",1"] {
        let (code, err) = run(&[
            "logits",
            "--model",
            "x",
            "--ids",
            ids,
            "--out",
            "/tmp/x.npy",
        ]);
        assert_eq!(code, Some(1), "{ids}");
        assert!(
            err.contains("--ids") && err.contains("empty"),
            "{ids}: {err}"
        );
    }
}

/// `sieve tokenize ... | head -c 10` and `sieve info | head -c 5`: a closed
/// pipe ends the program quietly (it panicked before).
#[test]
fn closed_stdout_is_not_a_panic() {
    use std::process::{Command, Stdio};
    // The default model (scripts/setup.sh makes it; CI has it) has a tokenizer.
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct");
    let long = "many words ".repeat(8000);
    let mut cases = vec![vec!["info"]];
    if model.join("tokenizer.json").exists() {
        cases.push(vec![
            "tokenize",
            "--model",
            model.to_str().unwrap(),
            long.as_str(),
        ]);
    } else {
        eprintln!("note: no {}; the tokenize case is skipped", model.display());
    }
    for args in cases {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sieve"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Close the reading end at once.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{}: {err}", args[0]);
        assert_eq!(out.status.code(), Some(0), "{}: {err}", args[0]);
    }
}

/// Without XDG_RUNTIME_DIR the driver's complaint does not reach the user.
#[test]
fn no_runtime_dir_noise() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sieve"))
        .arg("info")
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("XDG_RUNTIME_DIR"), "{err}");
}

/// Issue #11: an interrupted `convert-gguf` left `OUT.partial-PID` folders of
/// 37 to 98 MB. Now SIGINT and SIGTERM remove the partial folder and exit 130.
#[cfg(unix)]
#[test]
fn interrupted_conversion_leaves_nothing() {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.exists() {
        eprintln!(
            "note: no {} (scripts/setup.sh makes it; CI has it); skipped",
            gguf.display()
        );
        return;
    }
    for signal in ["INT", "TERM"] {
        let parent =
            std::env::temp_dir().join(format!("sieve-interrupt-{signal}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        std::fs::create_dir_all(&parent).unwrap();
        let out = parent.join("converted");
        let child = Command::new(env!("CARGO_BIN_EXE_sieve"))
            .args([
                "convert-gguf",
                gguf.to_str().unwrap(),
                out.to_str().unwrap(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let partial = parent.join(format!("converted.partial-{}", child.id()));
        let t0 = Instant::now();
        while !partial.join("model.safetensors").exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no partial output appeared"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let killed = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let status = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&status.stderr);
        let left: Vec<_> = std::fs::read_dir(&parent)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        // The signal comes within milliseconds of the first bytes; writing
        // the 270 MB output takes about a second.
        assert_eq!(status.status.code(), Some(130), "{signal}: {err}");
        assert!(left.is_empty(), "{signal}: left {left:?}");
        let _ = std::fs::remove_dir_all(&parent);
    }
}

/// A GGUF block whose scale is not finite (a corrupt file) is refused when
/// the model loads, naming the tensor, rather than kept on the GPU to turn
/// every answer into NaN: for every quantized type, each of its scales.
#[test]
fn a_quantized_block_with_a_nan_scale_is_refused() {
    use sieve::formats::WeightFormat;
    use sieve::gguf::GgufFile;
    let dir = golden_dir().join("quant");
    let mut checked = std::collections::BTreeSet::new();
    for tag in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K_M", "Q5_K_M", "Q6_K"] {
        let file = dir.join(format!("tiny-llama-{tag}.gguf"));
        let g = GgufFile::open(&file).unwrap();
        let bytes = std::fs::read(&file).unwrap();
        // The first matrix of each block type the file holds.
        let mut seen = std::collections::BTreeSet::new();
        for t in &g.tensors {
            let Some(block) = WeightFormat::of_ggml(t.ggml_type).and_then(|f| f.block()) else {
                continue;
            };
            if t.dims.len() != 2 || !seen.insert(t.ggml_type.name()) {
                continue;
            }
            let data = g.tensor_data(t).unwrap();
            let start = bytes.windows(64).position(|w| w == &data[..64]).unwrap();
            for &at in block.scales {
                // The second block's scale.
                let at = start + block.ggml.block_bytes() as usize + at;
                let mut bad = bytes.clone();
                bad[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                let path = std::env::temp_dir()
                    .join(format!("sieve-nan-scale-{}-{tag}.gguf", std::process::id()));
                std::fs::write(&path, &bad).unwrap();
                let e = load_err(&path);
                assert!(
                    e.contains(&t.name) && e.contains("scale") && e.contains("finite"),
                    "{tag} {}: {e}",
                    t.name
                );
                std::fs::remove_file(&path).unwrap();
            }
            checked.insert(t.ggml_type.name());
        }
    }
    assert_eq!(checked.len(), 7, "{checked:?}");
}
