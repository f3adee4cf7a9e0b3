//! Resumable results: every finished unit of an evaluation (one document or
//! prompt under one policy and budget) is appended as one JSON line to
//! `results.jsonl` in the output folder and flushed, so an interrupted eval
//! continues where it stopped. `settings.json` pins the settings that change
//! the numbers; resuming with different ones is an error that names them.
//! The lists of policies and budgets may change: a run with other ones
//! extends the folder (the new units are added, the old ones kept and
//! reported), and says so.
//!
//! The folder is guarded: one writer at a time (`lock`, an OS file lock,
//! released when the process ends, however it ends); every record is checked
//! on read (a line that is not a complete record of its kind, such as a line
//! cut off by an interruption or a record missing a field, is moved to
//! `results.damaged.jsonl`, reported, and its unit recomputed).

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub use crate::files::write_atomic;

/// Settings that are lists of what to run: a run with other values extends
/// the folder instead of being refused.
const EXTENDABLE: &[&str] = &["policies", "budgets"];

/// The fields every record of a kind has (besides "key", "kind", "policy"
/// and "budget"); a record without one of them is damaged. A fidelity unit
/// skipped for a short document has only "doc".
fn record_fields(kind: &str, skipped: bool) -> Option<&'static [&'static str]> {
    Some(match (kind, skipped) {
        ("fidelity", true) => &["doc"],
        ("fidelity", false) => &[
            "doc",
            "tokens",
            "positions",
            "mean_kl",
            "top1",
            "nll_positions",
            "nll_full",
            "nll_increase",
            "sums",
        ],
        ("generate", _) => &[
            "item",
            "generated",
            "ids",
            "text",
            "answer",
            "common_prefix",
            "answer_agree",
            "prompt_tokens",
        ],
        ("needle", _) => &["depth", "trial", "passkey", "context", "answer", "found"],
        ("task", _) => &[
            "dataset",
            "item",
            "predicted",
            "reference",
            "correct",
            "no_answer",
            "tokens",
            "seconds",
            "stop",
            "text",
        ],
        ("ruler", _) => &[
            "task",
            "index",
            "context",
            "answer",
            "answers",
            "string_match",
        ],
        _ => return None,
    })
}

/// Why a results line is not a record, or None when it is one.
fn damage(line: &str) -> Option<String> {
    let v: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return Some(format!("not a complete JSON line ({e})")),
    };
    let (Some(key), Some(kind)) = (v["key"].as_str(), v["kind"].as_str()) else {
        return Some("no \"key\" or \"kind\"".into());
    };
    if !key.starts_with(&format!("{kind}|")) {
        return Some(format!("key `{key}` is not of kind `{kind}`"));
    }
    let Some(fields) = record_fields(kind, v["skipped"] == true) else {
        return Some(format!("unknown kind `{kind}`"));
    };
    let missing: Vec<&str> = ["policy", "budget"]
        .iter()
        .chain(fields)
        .copied()
        .filter(|f| v.get(*f).is_none())
        .collect();
    (!missing.is_empty()).then(|| format!("`{key}` lacks {}", missing.join(", ")))
}

pub struct ResultStore {
    pub dir: PathBuf,
    records: Vec<Value>,
    index: HashMap<String, usize>,
    /// Held while the store is open: the OS releases it when the process
    /// ends, so a killed run never leaves the folder locked.
    _lock: std::fs::File,
}

/// Takes `dir/lock`, or names the process that holds it.
fn lock_folder(dir: &Path) -> Result<std::fs::File> {
    let path = dir.join("lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            bail!(
                "{} is in use by another sieve eval (process {}); wait for it to finish or use another --out folder",
                dir.display(),
                holder.trim()
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
    f.set_len(0)?;
    write!(f, "{}", std::process::id())?;
    Ok(f)
}

impl ResultStore {
    /// Opens (or creates) `dir`. `settings` must equal those of earlier runs in
    /// the same folder, except keys listed in `free` (e.g. a shard, a limit).
    pub fn open(dir: &Path, settings: &Value, free: &[&str]) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let lock = lock_folder(dir)?;
        let settings_path = dir.join("settings.json");
        if settings_path.exists() {
            let old: Value = serde_json::from_str(&std::fs::read_to_string(&settings_path)?)
                .with_context(|| format!("reading {}", settings_path.display()))?;
            let (Some(old_map), Some(new_map)) = (old.as_object(), settings.as_object()) else {
                bail!("{} is not a JSON object", settings_path.display());
            };
            let mut keys: Vec<&String> = old_map.keys().chain(new_map.keys()).collect();
            keys.sort();
            keys.dedup();
            let differ: Vec<String> = keys
                .iter()
                .copied()
                .filter(|k| {
                    !free.contains(&k.as_str())
                        && !EXTENDABLE.contains(&k.as_str())
                        && old_map.get(*k) != new_map.get(*k)
                })
                .map(|k| {
                    format!(
                        "{k}: {} before, {} now",
                        old_map.get(k).unwrap_or(&Value::Null),
                        new_map.get(k).unwrap_or(&Value::Null)
                    )
                })
                .collect();
            if !differ.is_empty() {
                bail!(
                    "{} holds results made with other settings ({}); use another --out folder, or the same settings to resume",
                    dir.display(),
                    differ.join("; ")
                );
            }
            // Other policies or budgets: the folder now covers the union.
            let mut merged = old_map.clone();
            for k in EXTENDABLE {
                let (before, now) = (list(old_map.get(*k)), list(new_map.get(*k)));
                let added: Vec<Value> = now.into_iter().filter(|v| !before.contains(v)).collect();
                if !added.is_empty() && old_map.contains_key(*k) {
                    eprintln!(
                        "note: extending {} with {k} {}; the {k} run before ({}) stay in its report",
                        dir.display(),
                        Value::Array(added.clone()),
                        Value::Array(before.clone())
                    );
                }
                merged.insert(k.to_string(), Value::Array([before, added].concat()));
            }
            let merged = Value::Object(merged);
            if merged != old {
                write_atomic(
                    &settings_path,
                    serde_json::to_string_pretty(&merged)?.as_bytes(),
                )?;
            }
        } else {
            write_atomic(
                &settings_path,
                serde_json::to_string_pretty(settings)?.as_bytes(),
            )?;
        }
        let mut store = ResultStore {
            dir: dir.to_path_buf(),
            records: vec![],
            index: HashMap::new(),
            _lock: lock,
        };
        let path = store.results_path();
        if path.exists() {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let (mut clean, mut damaged) = (String::new(), String::new());
            for (i, line) in text.lines().enumerate() {
                match damage(line) {
                    None => {
                        clean.push_str(line);
                        clean.push('\n');
                        store.insert(serde_json::from_str(line)?);
                    }
                    Some(why) => {
                        eprintln!(
                            "warning: {} line {}: {why}; moved to results.damaged.jsonl, its unit is run again",
                            path.display(),
                            i + 1
                        );
                        damaged.push_str(line);
                        damaged.push('\n');
                    }
                }
            }
            if !damaged.is_empty() {
                // Kept, not dropped: appended to what earlier runs moved there.
                let damaged_path = dir.join("results.damaged.jsonl");
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&damaged_path)
                    .with_context(|| format!("opening {}", damaged_path.display()))?;
                f.write_all(damaged.as_bytes())?;
                f.sync_data()?;
                write_atomic(&path, clean.as_bytes())?;
            }
        }
        Ok(store)
    }

    fn results_path(&self) -> PathBuf {
        self.dir.join("results.jsonl")
    }

    fn insert(&mut self, v: Value) {
        let key = v["key"].as_str().unwrap_or_default().to_string();
        match self.index.get(&key) {
            Some(&i) => self.records[i] = v,
            None => {
                self.index.insert(key, self.records.len());
                self.records.push(v);
            }
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.records[i])
    }

    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Appends one finished unit; `record` gets a "key" field.
    pub fn append(&mut self, key: &str, mut record: Value) -> Result<()> {
        record["key"] = Value::String(key.to_string());
        let path = self.results_path();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(f, "{}", serde_json::to_string(&record)?)?;
        f.sync_data()?;
        self.insert(record);
        Ok(())
    }

    pub fn records(&self) -> &[Value] {
        &self.records
    }

    /// Adds the records of another store (a shard) to this one.
    pub fn merge_from(&mut self, other: &ResultStore) -> Result<()> {
        for r in other.records() {
            let key = r["key"].as_str().unwrap_or_default().to_string();
            if !self.contains(&key) {
                self.append(&key, r.clone())?;
            }
        }
        Ok(())
    }
}

/// The items of a JSON list setting (none when absent).
fn list(v: Option<&Value>) -> Vec<Value> {
    v.and_then(Value::as_array).cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A record read back and written again keeps its numbers to the last
    /// digit (serde_json's `float_roundtrip`; without it this value came
    /// back as 0.1511669942204125 and a merge rewrote old results).
    #[test]
    fn numbers_survive_a_read_and_a_write() {
        let line = r#"{"mean_kl":0.15116699422041247,"nll":1865.0678069998119}"#;
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), line);
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sieve-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A complete needle record.
    fn needle(found: bool) -> Value {
        json!({"kind": "needle", "policy": "window", "budget": 128, "depth": 0.5,
               "trial": 0, "passkey": "12345", "context": 900, "answer": "12345",
               "found": found})
    }

    #[test]
    fn resumes_and_refuses_other_settings() {
        let dir = scratch("resume");
        let settings = json!({"chunk": 32, "shard": "0/2"});
        {
            let mut s = ResultStore::open(&dir, &settings, &["shard"]).unwrap();
            s.append("needle|a|window|128", needle(true)).unwrap();
            s.append("needle|b|window|128", needle(false)).unwrap();
        }
        let s = ResultStore::open(&dir, &json!({"chunk": 32, "shard": "1/2"}), &["shard"]).unwrap();
        assert!(s.contains("needle|a|window|128") && s.contains("needle|b|window|128"));
        assert_eq!(s.get("needle|b|window|128").unwrap()["found"], false);
        drop(s);
        let err = ResultStore::open(&dir, &json!({"chunk": 64}), &["shard"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("chunk: 32 before, 64 now"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue #11: a half-written line, a record missing a field, one whose key
    /// is of another kind and one of an unknown kind are not finished work:
    /// their units are recomputed and the lines kept in results.damaged.jsonl.
    #[test]
    fn every_kind_a_sweep_writes_is_kept_on_reopening() {
        // As src/cli/eval/ruler.rs writes its records: a kind the store did
        // not know was moved aside as damaged on every resume.
        let dir = scratch("kinds");
        let settings = json!({"chunk": 32});
        let ruler = json!({
            "kind": "ruler", "task": "vt", "index": 0, "policy": "window", "budget": null,
            "context": 900, "answer": " X", "answers": ["X"], "string_match": 100.0,
            "seconds": 1.0,
        });
        {
            let mut s = ResultStore::open(&dir, &settings, &[]).unwrap();
            s.append("ruler|vt/0|window|null", ruler).unwrap();
        }
        let s = ResultStore::open(&dir, &settings, &[]).unwrap();
        assert!(s.contains("ruler|vt/0|window|null"));
        assert!(!dir.join("results.damaged.jsonl").exists());
    }

    #[test]
    fn damaged_records_are_reported_and_recomputed() {
        let dir = scratch("damaged");
        let settings = json!({"chunk": 32});
        {
            let mut s = ResultStore::open(&dir, &settings, &[]).unwrap();
            s.append("needle|good|window|128", needle(true)).unwrap();
        }
        let mut missing = needle(true);
        missing.as_object_mut().unwrap().remove("found");
        missing["key"] = json!("needle|missing|window|128");
        let mut other_kind = needle(true);
        other_kind["key"] = json!("task|x|window|128");
        let mut unknown = needle(true);
        unknown["kind"] = json!("poll");
        unknown["key"] = json!("poll|y|window|128");
        let bad = [
            "{\"key\": \"needle|cut|window|128\", \"kind\"".to_string(),
            missing.to_string(),
            other_kind.to_string(),
            unknown.to_string(),
        ];
        let path = dir.join("results.jsonl");
        let mut text = std::fs::read_to_string(&path).unwrap();
        for line in &bad {
            text.push_str(line);
            text.push('\n');
        }
        std::fs::write(&path, text).unwrap();
        let s = ResultStore::open(&dir, &settings, &[]).unwrap();
        assert_eq!(s.records().len(), 1);
        assert!(s.contains("needle|good|window|128"));
        assert!(!s.contains("needle|missing|window|128"));
        let kept = std::fs::read_to_string(dir.join("results.damaged.jsonl")).unwrap();
        assert_eq!(kept.lines().collect::<Vec<_>>(), bad);
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue #11: two writers on one folder produced duplicates; the second
    /// is refused, naming the first, and the folder is free once it closes.
    #[test]
    fn one_writer_at_a_time() {
        let dir = scratch("lock");
        let settings = json!({"chunk": 32});
        let first = ResultStore::open(&dir, &settings, &[]).unwrap();
        let err = ResultStore::open(&dir, &settings, &[])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("in use by another sieve eval")
                && err.contains(&format!("process {}", std::process::id())),
            "{err}"
        );
        drop(first);
        ResultStore::open(&dir, &settings, &[]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Other budgets or policies extend the folder (settings.json keeps the
    /// union); every other setting is still pinned.
    #[test]
    fn budgets_and_policies_extend_the_folder() {
        let dir = scratch("extend");
        let one = json!({"chunk": 32, "budgets": [128], "policies": ["window"]});
        drop(ResultStore::open(&dir, &one, &[]).unwrap());
        let more = json!({"chunk": 32, "budgets": [256, 128], "policies": ["tova"]});
        drop(ResultStore::open(&dir, &more, &[]).unwrap());
        let saved: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("settings.json")).unwrap())
                .unwrap();
        assert_eq!(saved["budgets"], json!([128, 256]));
        assert_eq!(saved["policies"], json!(["window", "tova"]));
        let err = ResultStore::open(&dir, &json!({"chunk": 16, "budgets": [128]}), &[])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("chunk: 32 before, 16 now"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
