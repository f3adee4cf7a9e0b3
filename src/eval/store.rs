//! Resumable results: every finished unit of an evaluation (one document or
//! prompt under one policy and budget) is appended as one JSON line to
//! `results.jsonl` in the output folder and flushed, so an interrupted eval
//! continues where it stopped. `settings.json` pins the settings that change
//! the numbers; resuming with different ones is an error that names them.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub use crate::files::write_atomic;

pub struct ResultStore {
    pub dir: PathBuf,
    records: Vec<Value>,
    index: HashMap<String, usize>,
}

impl ResultStore {
    /// Opens (or creates) `dir`. `settings` must equal those of earlier runs in
    /// the same folder, except keys listed in `free` (e.g. a shard, a limit).
    pub fn open(dir: &Path, settings: &Value, free: &[&str]) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
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
                .into_iter()
                .filter(|k| !free.contains(&k.as_str()) && old_map.get(*k) != new_map.get(*k))
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
        };
        let path = store.results_path();
        if path.exists() {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            // A line cut off by an interruption is dropped (and rewritten clean).
            let mut clean = String::new();
            for line in text.lines() {
                if let Ok(v) = serde_json::from_str::<Value>(line) {
                    clean.push_str(line);
                    clean.push('\n');
                    store.insert(v);
                }
            }
            if clean.len() != text.len() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn resumes_and_refuses_other_settings() {
        let dir = std::env::temp_dir().join(format!("sieve-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let settings = json!({"chunk": 32, "shard": "0/2"});
        {
            let mut s = ResultStore::open(&dir, &settings, &["shard"]).unwrap();
            s.append("a", json!({"x": 1})).unwrap();
            s.append("b", json!({"x": 2})).unwrap();
        }
        // An interrupted write leaves half a line: it is dropped.
        let path = dir.join("results.jsonl");
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"key\": \"c\", \"x\"");
        std::fs::write(&path, text).unwrap();
        let s = ResultStore::open(&dir, &json!({"chunk": 32, "shard": "1/2"}), &["shard"]).unwrap();
        assert!(s.contains("a") && s.contains("b") && !s.contains("c"));
        assert_eq!(s.get("b").unwrap()["x"], 2);
        let err = ResultStore::open(&dir, &json!({"chunk": 64}), &["shard"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("chunk: 32 before, 64 now"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
