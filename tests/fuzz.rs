//! Mutation tests (issue #11): thousands of damaged model files per run, on
//! stable Rust, in a few seconds. Valid GGUF files, safetensors files,
//! config.json, tokenizer_config.json, generation_config.json and
//! tokenizer.json are cut short, have bytes flipped, ranges inserted or
//! deleted, and their length, count and size fields set to extremes (the
//! mutator knows where those fields sit). Every case must end in `Ok` or a
//! clear `Err` naming the file: never a panic, never an abort, and never an
//! allocation sized by an unchecked length (the process's peak memory is
//! checked at the end of each test).
//!
//! The random stream is seeded (`SIEVE_FUZZ_SEED`, default 1; each failure
//! names its case), so a failure reproduces.

mod common;

use common::golden_dir;
use serde_json::Value;
use sieve::config::ModelConfig;
use sieve::gguf::GgufFile;
use sieve::tokenizer::{Message, Tokenizer};
use sieve::weights::TensorStore;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// splitmix64: small, fast, and the same everywhere.
struct Rng(u64);

impl Rng {
    fn new(stream: u64) -> Self {
        let seed = std::env::var("SIEVE_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1u64);
        Rng(seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Values that break length and size arithmetic.
const EXTREMES: [u64; 10] = [
    0,
    1,
    7,
    0x7f,
    0xff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 40,
    1 << 62,
    u64::MAX,
];

/// One random mutation of `base`. `fields` are offsets where a length, count,
/// type or size field starts: extremes go there most of the time.
fn mutate(rng: &mut Rng, base: &[u8], fields: &[usize]) -> Vec<u8> {
    let mut b = base.to_vec();
    let len = b.len();
    match rng.below(7) {
        0 => b.truncate(rng.below(len)),
        1 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(len);
                b[i] ^= 1 << rng.below(8);
            }
        }
        2 | 3 => {
            let at = if fields.is_empty() || rng.below(4) == 0 {
                rng.below(len)
            } else {
                *rng.pick(fields)
            };
            let v = *rng.pick(&EXTREMES);
            let bytes = if rng.below(2) == 0 {
                v.to_le_bytes().to_vec()
            } else {
                (v as u32).to_le_bytes().to_vec()
            };
            for (k, x) in bytes.into_iter().enumerate() {
                if let Some(slot) = b.get_mut(at + k) {
                    *slot = x;
                }
            }
        }
        4 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(64);
            let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            b.splice(at..at, junk);
        }
        5 => {
            let at = rng.below(len);
            let end = (at + 1 + rng.below(256)).min(len);
            b.drain(at..end);
        }
        _ => {
            // A byte set to a structural character of JSON or to 0/0xff.
            let i = rng.below(len);
            b[i] = *rng.pick(&[
                b'"', b'{', b'}', b'[', b']', b',', b':', b'-', b'9', 0, 0xff,
            ]);
        }
    }
    b
}

/// Runs one case: a panic fails the test naming the case; an error must
/// name `file` (a clear message).
fn case<T>(what: &str, n: usize, file: &str, f: impl FnOnce() -> anyhow::Result<T>) -> bool {
    match catch_unwind(AssertUnwindSafe(f)) {
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{what} case {n}: panicked: {msg} (rerun with the same SIEVE_FUZZ_SEED)");
        }
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            let e = format!("{e:#}");
            assert!(
                e.contains(file),
                "{what} case {n}: the error does not name {file}: {e}"
            );
            false
        }
    }
}

/// Peak resident memory of this process (Linux), to catch allocations sized
/// by a damaged length field.
fn assert_bounded_memory(what: &str) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return;
    };
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        kib < 2 << 20,
        "{what}: peak memory {} MiB; a damaged length drove an allocation",
        kib >> 10
    );
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sieve-fuzz-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Offsets of every occurrence of `needle` in `hay`.
fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// Where a GGUF file's length, type, count and dimension fields sit: around
/// each metadata key and tensor name (the u64 length before the string, the
/// type or dimension count after it, the array length or first dimensions
/// after that).
fn gguf_fields(bytes: &[u8], g: &GgufFile) -> Vec<usize> {
    let mut out = vec![4, 8, 16]; // version, tensor count, metadata count
    let names = g
        .metadata
        .keys()
        .map(String::as_str)
        .chain(g.tensors.iter().map(|t| t.name.as_str()));
    for name in names {
        for at in find_all(bytes, name.as_bytes()) {
            let end = at + name.len();
            out.extend([
                at.saturating_sub(8),
                end,
                end + 4,
                end + 8,
                end + 12,
                end + 20,
            ]);
        }
    }
    out
}

#[test]
fn gguf_files() {
    let dir = golden_dir().join("quant");
    for (file, cases, stream) in [
        ("tiny-llama-Q8_0.gguf", 1500usize, 1u64),
        ("tiny-llama-Q4_K_M.gguf", 500, 2),
    ] {
        let base = std::fs::read(dir.join(file)).unwrap();
        let g = GgufFile::from_bytes(file, base.clone()).unwrap();
        if file.contains("Q8_0") {
            // The unmutated file converts, so a mutant's error is the mutation's.
            sieve::convert::check_convertible(&g).unwrap();
        }
        let fields = gguf_fields(&base, &g);
        let mut rng = Rng::new(stream);
        let mut ok = 0;
        for n in 0..cases {
            let bytes = mutate(&mut rng, &base, &fields);
            ok += case("gguf", n, file, || {
                let g = GgufFile::from_bytes(file, bytes)?;
                sieve::convert::check_convertible(&g)
            }) as usize;
        }
        eprintln!("{file}: {cases} mutants, {ok} still convert");
    }
    assert_bounded_memory("gguf");
}

#[test]
fn safetensors_files() {
    use safetensors::{tensor::TensorView, Dtype};
    let f32s: Vec<u8> = (0..15)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    let f16s: Vec<u8> = (0..7)
        .flat_map(|i| half::f16::from_f32(i as f32).to_le_bytes())
        .collect();
    let bf16s: Vec<u8> = (0..8)
        .flat_map(|i| half::bf16::from_f32(-(i as f32)).to_le_bytes())
        .collect();
    let tensors = vec![
        ("a", TensorView::new(Dtype::F32, vec![3, 5], &f32s).unwrap()),
        ("b", TensorView::new(Dtype::F16, vec![7], &f16s).unwrap()),
        (
            "c",
            TensorView::new(Dtype::BF16, vec![2, 2, 2], &bf16s).unwrap(),
        ),
    ];
    let base = safetensors::serialize(tensors, None).unwrap();
    let header_len = u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    // The header length, and every number in the JSON header (shapes, offsets).
    let mut fields = vec![0];
    fields.extend((8..8 + header_len).filter(|&i| base[i].is_ascii_digit()));
    let dir = scratch("safetensors");
    let file = dir.join("model.safetensors");
    let mut rng = Rng::new(3);
    let mut ok = 0;
    for n in 0..1500 {
        let mut bytes = mutate(&mut rng, &base, &fields);
        if rng.below(3) == 0 {
            // A number of the header replaced by a huge decimal one.
            if let Some(&at) = fields.get(1 + rng.below(fields.len() - 1)) {
                let huge = rng.pick(&["18446744073709551615", "99999999999", "4294967296"]);
                if at < bytes.len() {
                    bytes.splice(at..at + 1, huge.bytes());
                }
            }
        }
        std::fs::write(&file, &bytes).unwrap();
        ok += case("safetensors", n, "model.safetensors", || {
            let store = TensorStore::open(&dir)?;
            for name in ["a", "b", "c"] {
                if store.contains(name) {
                    store.read(name)?;
                }
            }
            Ok(())
        }) as usize;
    }
    eprintln!("safetensors: 1500 mutants, {ok} still read");
    let _ = std::fs::remove_dir_all(&dir);
    assert_bounded_memory("safetensors");
}

/// A JSON value set somewhere in a document: the structure-aware mutation.
fn extreme_json(rng: &mut Rng) -> Value {
    let s = rng.pick(&[
        "0",
        "-1",
        "1",
        "3",
        "4294967296",
        "18446744073709551615",
        "1e308",
        "-1e308",
        "1e-320",
        "0.5",
        "\"abc\"",
        "null",
        "[]",
        "{}",
        "true",
        "[1, -2, 1e40]",
        "{\"rope_type\": \"llama3\", \"factor\": 0, \"low_freq_factor\": 4, \"high_freq_factor\": 1, \"original_max_position_embeddings\": 8192}",
    ]);
    serde_json::from_str(s).unwrap()
}

/// `base` (a JSON object) with one field set to an extreme value (or removed),
/// or its text mutated byte-wise.
fn mutate_json(rng: &mut Rng, base: &str) -> String {
    if rng.below(2) == 0 {
        let mut v: Value = serde_json::from_str(base).unwrap();
        let obj = v.as_object_mut().unwrap();
        let keys: Vec<String> = obj.keys().cloned().collect();
        for _ in 0..1 + rng.below(3) {
            let k = rng.pick(&keys).clone();
            if rng.below(6) == 0 {
                obj.remove(&k);
            } else {
                obj.insert(k, extreme_json(rng));
            }
        }
        v.to_string()
    } else {
        let digits: Vec<usize> = base
            .bytes()
            .enumerate()
            .filter(|(_, c)| c.is_ascii_digit())
            .map(|(i, _)| i)
            .collect();
        String::from_utf8_lossy(&mutate(rng, base.as_bytes(), &digits)).into_owned()
    }
}

#[test]
fn config_json() {
    let qwen = std::fs::read_to_string(golden_dir().join("tiny-qwen2/config.json")).unwrap();
    let mut llama3: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir().join("tiny-llama-gqa/config.json")).unwrap(),
    )
    .unwrap();
    llama3["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192});
    let llama3 = llama3.to_string();
    let path = Path::new("config.json");
    let mut rng = Rng::new(4);
    let mut ok = 0;
    for n in 0..4000 {
        let text = mutate_json(&mut rng, if n % 2 == 0 { &qwen } else { &llama3 });
        ok += case("config.json", n, "config.json", || {
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("config.json: not valid JSON ({e})"))?;
            let c = ModelConfig::from_json(&v, path)?;
            // What loading sizes from it stays finite and in range.
            assert!(
                c.qkv_dim() <= 1 << 24,
                "case {n}: qkv width {}",
                c.qkv_dim()
            );
            assert!(c.rope().inv_freq.iter().all(|f| f.is_finite()), "case {n}");
            Ok(())
        }) as usize;
    }
    eprintln!("config.json: 4000 mutants, {ok} still load");
    assert_bounded_memory("config.json");
}

#[test]
fn tokenizer_files() {
    // A small real tokenizer folder: the tiny GGUF converted (512 tokens).
    let model = common::converted_tiny_llama("fuzz-tokenizer");
    let messages = [Message::new("user", "What is 2 + 2?")];
    for (file, cases, stream) in [
        ("tokenizer_config.json", 1500usize, 5u64),
        ("generation_config.json", 500, 6),
        ("tokenizer.json", 300, 7),
    ] {
        let path = model.join(file);
        let base = std::fs::read_to_string(&path).unwrap();
        let mut rng = Rng::new(stream);
        let mut ok = 0;
        for n in 0..cases {
            std::fs::write(&path, mutate_json(&mut rng, &base)).unwrap();
            ok += case(file, n, file, || {
                let t = Tokenizer::load(&model, &[])?;
                let ids = t.encode("Hello world, 2 + 2 = 4.")?;
                t.decode(&ids)?;
                if t.has_chat_template() {
                    // A template that no longer parses or renders is an error.
                    let _ = t.apply_chat_template(&messages, true);
                }
                Ok(())
            }) as usize;
        }
        std::fs::write(&path, base).unwrap();
        eprintln!("{file}: {cases} mutants, {ok} still load");
    }
    let _ = std::fs::remove_dir_all(&model);
    assert_bounded_memory("tokenizer");
}
