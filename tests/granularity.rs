//! Kept sets per layer and per (layer, KV head) (`--granularity`): a
//! bounded run on the tiny Llama (GQA, 3 layers of 2 KV heads) whose heads
//! keep different positions gives the logits of a plain-Rust Llama forward
//! pass that masks, for each query, every position its (layer, KV head)
//! had evicted by then, within the float32 bound of the golden tests
//! (1e-3). The reference is first checked against Hugging Face's float32
//! logits of the same model (golden_len300.npz).

mod common;
use common::*;
use sieve::cache::{BoundedCache, CacheOptions, FeedOutput, Granularity, RefreshRecord};
use sieve::eviction::Policy;
use sieve::formats::WeightFormat;
use sieve::model::{LoadOptions, Model};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

const MODEL: &str = "tiny-llama-gqa";

/// The tiny Llama's weights and sizes, read from its safetensors file.
struct Llama {
    hidden: usize,
    heads: usize,
    n_kv: usize,
    head_dim: usize,
    layers: usize,
    vocab: usize,
    eps: f64,
    theta: f64,
    w: HashMap<String, Vec<f64>>,
}

impl Llama {
    fn load(dir: &Path) -> Llama {
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let w = st
            .tensors()
            .into_iter()
            .map(|(name, t)| {
                let v: Vec<f64> = t
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
                    .collect();
                (name, v)
            })
            .collect();
        Llama {
            hidden: u("hidden_size"),
            heads: u("num_attention_heads"),
            n_kv: u("num_key_value_heads"),
            head_dim: u("head_dim"),
            layers: u("num_hidden_layers"),
            vocab: u("vocab_size"),
            eps: cfg["rms_norm_eps"].as_f64().unwrap(),
            theta: cfg["rope_theta"].as_f64().unwrap(),
            w,
        }
    }

    fn t(&self, name: &str) -> &[f64] {
        &self.w[name]
    }

    /// Logits `[n, vocab]` of every position of `ids`; query position i of
    /// layer l, KV head h sees key position j <= i where `sees(l, h, i, j)`.
    fn forward(&self, ids: &[u32], sees: impl Fn(usize, usize, usize, usize) -> bool) -> Vec<f64> {
        let (n, d, hd) = (ids.len(), self.hidden, self.head_dim);
        let emb = self.t("model.embed_tokens.weight");
        let mut x: Vec<f64> = ids
            .iter()
            .flat_map(|&t| emb[t as usize * d..(t as usize + 1) * d].to_vec())
            .collect();
        let group = self.heads / self.n_kv;
        for l in 0..self.layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let xn = rms_norm(&x, self.t(&p("input_layernorm.weight")), self.eps);
            let mut q = matmul(&xn, self.t(&p("self_attn.q_proj.weight")), d);
            let mut k = matmul(&xn, self.t(&p("self_attn.k_proj.weight")), d);
            let v = matmul(&xn, self.t(&p("self_attn.v_proj.weight")), d);
            rope(&mut q, self.heads, hd, self.theta);
            rope(&mut k, self.n_kv, hd, self.theta);
            let mut o = vec![0.0; n * self.heads * hd];
            let scale = 1.0 / (hd as f64).sqrt();
            for i in 0..n {
                for a in 0..self.heads {
                    let kvh = a / group;
                    let qi = &q[(i * self.heads + a) * hd..][..hd];
                    let keys: Vec<usize> = (0..=i).filter(|&j| sees(l, kvh, i, j)).collect();
                    let s: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            let kj = &k[(j * self.n_kv + kvh) * hd..][..hd];
                            qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (&j, w) in keys.iter().zip(&e) {
                        let vj = &v[(j * self.n_kv + kvh) * hd..][..hd];
                        let out = &mut o[(i * self.heads + a) * hd..][..hd];
                        for (o, v) in out.iter_mut().zip(vj) {
                            *o += w / z * v;
                        }
                    }
                }
            }
            add(
                &mut x,
                &matmul(&o, self.t(&p("self_attn.o_proj.weight")), self.heads * hd),
            );
            let xn = rms_norm(&x, self.t(&p("post_attention_layernorm.weight")), self.eps);
            let g = matmul(&xn, self.t(&p("mlp.gate_proj.weight")), d);
            let u = matmul(&xn, self.t(&p("mlp.up_proj.weight")), d);
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let inter = act.len() / n;
            add(
                &mut x,
                &matmul(&act, self.t(&p("mlp.down_proj.weight")), inter),
            );
        }
        let xn = rms_norm(&x, self.t("model.norm.weight"), self.eps);
        matmul(&xn, emb, d)
    }
}

/// `x [n, k] . w^T` for `w [m, k]`.
fn matmul(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
    let m = w.len() / k;
    x.chunks(k)
        .flat_map(|row| {
            (0..m).map(move |r| {
                row.iter()
                    .zip(&w[r * k..(r + 1) * k])
                    .map(|(a, b)| a * b)
                    .sum()
            })
        })
        .collect()
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    x.chunks(w.len())
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
            let r = 1.0 / (ms + eps).sqrt();
            row.iter().zip(w).map(move |(v, w)| v * r * w)
        })
        .collect()
}

fn add(x: &mut [f64], y: &[f64]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// Hugging Face's rotate-half RoPE of `[n, heads, hd]` at positions 0..n.
fn rope(x: &mut [f64], heads: usize, hd: usize, theta: f64) {
    let half = hd / 2;
    for (row, chunk) in x.chunks_mut(heads * hd).enumerate() {
        for head in chunk.chunks_mut(hd) {
            for i in 0..half {
                let f = row as f64 / theta.powf(2.0 * i as f64 / hd as f64);
                let (c, s) = (f.cos(), f.sin());
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    }
}

/// Which key positions each keep list holds for a query at each position:
/// those kept by the latest refresh before it (all positions before the
/// first) and every position fed since.
struct Masks<'a> {
    trace: &'a [RefreshRecord],
}

impl Masks<'_> {
    fn sees(&self, list: usize, i: usize, j: usize) -> bool {
        let last = self
            .trace
            .iter()
            .rev()
            .find(|r| r.before_position as usize <= i);
        match last {
            None => true,
            Some(r) => {
                j >= r.before_position as usize
                    || r.kept_lists.as_ref().unwrap()[list].contains(&(j as u32))
            }
        }
    }
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max)
}

/// A bounded run's logits of every position and its refresh records.
fn bounded_run(
    model: &Arc<Model>,
    ids: &[u32],
    opts: CacheOptions,
) -> (Vec<f32>, Vec<RefreshRecord>) {
    let mut cache = BoundedCache::new(opts, model.config.num_layers).unwrap();
    cache.record = true;
    let mut engine =
        sieve::engine::Engine::new(model.clone(), cache.engine_options(ids.len(), 16, 16)).unwrap();
    let vocab = model.config.vocab_size;
    let mut logits = vec![0f32; ids.len() * vocab];
    cache
        .feed(&mut engine, ids, 0, FeedOutput::All, |first, l| {
            logits[first * vocab..first * vocab + l.len()].copy_from_slice(l);
            Ok(())
        })
        .unwrap();
    (logits, std::mem::take(&mut cache.trace))
}

#[test]
fn heads_and_layers_that_keep_their_own_entries_match_a_masked_reference() {
    let dir = golden_dir().join(MODEL);
    let reference = Llama::load(&dir);
    let g = Npz::open(&dir.join("golden_len300.npz"));
    let ids = g.ids("input_ids");
    let vocab = reference.vocab;

    // The reference (float64) against transformers' float32 logits, full
    // attention: within the golden README's bound for a float32 engine
    // (transformers' own float32 RoPE angles at position 299 are off by
    // about 2e-5).
    let full = reference.forward(&ids, |_, _, _, _| true);
    let (_, want) = g.f32("logits");
    let mut worst = 0f64;
    for (i, &p) in g.ids("logits_positions").iter().enumerate() {
        let d = max_diff(
            &want[i * vocab..][..vocab],
            &full[p as usize * vocab..][..vocab],
        );
        assert!(
            d <= 1e-3,
            "the CPU reference at position {p}: max |d| {d} against transformers"
        );
        worst = worst.max(d);
    }
    eprintln!("the CPU reference against transformers: logits max |d| {worst}");

    let load = LoadOptions {
        dtype: Some(WeightFormat::F32),
        ..Default::default()
    };
    let model = Model::load(&dir, &load).unwrap();
    let n_kv = reference.n_kv;
    // The engine's own float32 error: its full-cache run against the reference.
    let (engine_full, _) = bounded_run(&model, &ids, CacheOptions::new(Policy::Full, 0, 16));
    let noise = max_diff(&engine_full, &full);
    eprintln!("the full cache against the reference: logits max |d| {noise}");
    // KeyDiff scores each (layer, KV head) on its own; SnapKV too, from the
    // window's queries and each list's key positions.
    for (policy, granularity) in [
        (Policy::Keydiff, Granularity::Head),
        (Policy::Keydiff, Granularity::Layer),
        (Policy::Snapkv, Granularity::Head),
    ] {
        let opts = CacheOptions {
            sinks: 4,
            recent: 8,
            snapkv_window: 8,
            granularity,
            ..CacheOptions::new(policy, 40, 16)
        };
        let (got, trace) = bounded_run(&model, &ids, opts);
        let what = format!("{} at {} granularity", policy.name(), granularity.name());
        assert!(trace.len() >= 10, "{what}: {} refreshes", trace.len());
        let masks = Masks { trace: &trace };
        let list = |l: usize, h: usize| granularity.list_of(l, h, n_kv);
        // The lists keep different entries (else this tests nothing).
        let kept = trace.last().unwrap().kept_lists.as_ref().unwrap();
        assert_eq!(
            kept.len(),
            granularity.lists(reference.layers, n_kv),
            "{what}"
        );
        let distinct: std::collections::HashSet<&Vec<u32>> = kept.iter().collect();
        assert!(
            distinct.len() == kept.len(),
            "{what}: lists kept the same entries"
        );
        let want = reference.forward(&ids, |l, h, i, j| masks.sees(list(l, h), i, j));
        let d = max_diff(&got, &want);
        eprintln!("{what}: logits max |d| {d} over {} positions", ids.len());
        // The golden bound of a float32 engine: the full cache's own error
        // against this float64 reference is about 5e-4 (RoPE angles in
        // float32 at positions near 300).
        assert!(
            d <= 1e-3,
            "{what}: logits max |d| {d} against the masked reference"
        );
        // Every head masked by list 0's entries instead is far off.
        let wrong = reference.forward(&ids, |_, _, i, j| masks.sees(0, i, j));
        let d = max_diff(&got, &wrong);
        assert!(
            d > 1e-2,
            "{what}: list 0's mask for every head is as close ({d})"
        );
    }
}

/// At layer or head granularity, a policy that scores tokens keeps the same
/// entries in every list, so its run equals the token-granularity run.
#[test]
fn policies_that_score_tokens_keep_one_set_at_every_granularity() {
    let dir = golden_dir().join(MODEL);
    let load = LoadOptions {
        dtype: Some(WeightFormat::F32),
        ..Default::default()
    };
    let model = Model::load(&dir, &load).unwrap();
    let ids: Vec<u32> = (0..120u32).map(|i| (i * 37 + 11) % 512).collect();
    let run = |granularity| {
        let opts = CacheOptions {
            sinks: 4,
            recent: 8,
            granularity,
            ..CacheOptions::new(Policy::Tova, 40, 16)
        };
        bounded_run(&model, &ids, opts)
    };
    let (token, token_trace) = run(Granularity::Token);
    let (head, head_trace) = run(Granularity::Head);
    assert_eq!(token, head, "logits");
    for (t, h) in token_trace.iter().zip(&head_trace) {
        assert!(h.kept_lists.as_ref().unwrap().iter().all(|k| *k == t.kept));
    }
}

/// Options a granularity cannot take are refused, naming them.
#[test]
fn snapkv_windows_beyond_the_shared_entries_are_refused_per_head() {
    let opts = CacheOptions {
        snapkv_window: 200,
        granularity: Granularity::Head,
        ..CacheOptions::new(Policy::Snapkv, 256, 32)
    };
    let e = opts.validate().unwrap_err().to_string();
    assert!(
        e.contains("snapkv_window 200") && e.contains("granularity head"),
        "{e}"
    );
    assert!(CacheOptions {
        granularity: Granularity::Token,
        ..opts
    }
    .validate()
    .is_ok());
    let e = Granularity::parse("block").unwrap_err().to_string();
    assert!(
        e.contains("'block'") && e.contains("token, layer, head"),
        "{e}"
    );
}
