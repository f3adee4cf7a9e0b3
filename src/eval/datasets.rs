//! The evaluation data: documents for fidelity, prompts for generation and
//! tasks (MATH-500, GSM8K, AIME 2024), filler text for the needle test.
//! The files ship in the repository's `data/` folder (sources and licences in
//! data/README.md); `--data DIR` or $SIEVE_DATA points elsewhere.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

use super::answers::AnswerKind;
use crate::tokenizer::{Message, Tokenizer};

/// The data folder: `explicit`, else $SIEVE_DATA, else the repository's `data/`.
pub fn data_dir(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(d) = explicit {
        return Ok(d.to_path_buf());
    }
    if let Ok(d) = std::env::var("SIEVE_DATA") {
        return Ok(PathBuf::from(d));
    }
    for base in [
        PathBuf::from("."),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")),
    ] {
        let d = base.join("data");
        if d.join("math500.jsonl").exists() {
            return Ok(d);
        }
    }
    bail!("no evaluation data found: pass --data DIR (the folder with math500.jsonl, reasoning_traces.jsonl, prose/) or set SIEVE_DATA")
}

/// Every line of a JSON-lines file, parsed.
pub fn read_jsonl(path: &Path) -> Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{} line {}: not valid JSON", path.display(), i + 1))
        })
        .collect()
}

fn field<'a>(v: &'a Value, name: &str, path: &Path) -> Result<&'a str> {
    v[name]
        .as_str()
        .with_context(|| format!("{}: a record has no string field '{name}'", path.display()))
}

/// A token sequence to teacher-force.
#[derive(Clone, Debug)]
pub struct Document {
    pub id: String,
    pub tokens: Vec<u32>,
}

/// Where fidelity documents come from.
#[derive(Clone, Debug)]
pub enum DocumentSource {
    /// One text file, one document.
    Text(PathBuf),
    /// data/reasoning_traces.jsonl: the problem as the user's turn and the
    /// trace as the assistant's, in the model's chat template.
    ReasoningTraces,
    /// data/prose/*.txt: consecutive segments of `doc_tokens` tokens, taken
    /// from the three books in turn.
    Prose,
}

impl DocumentSource {
    pub fn parse(dataset: Option<&str>, text: Option<&Path>) -> Result<Self> {
        match (dataset, text) {
            (_, Some(t)) => Ok(DocumentSource::Text(t.to_path_buf())),
            (Some("reasoning_traces"), None) => Ok(DocumentSource::ReasoningTraces),
            (Some("prose"), None) => Ok(DocumentSource::Prose),
            (Some(other), None) => {
                bail!("--dataset {other}: unknown (known: reasoning_traces, prose)")
            }
            (None, None) => bail!("give --text FILE or --dataset reasoning_traces|prose"),
        }
    }

    pub fn name(&self) -> String {
        match self {
            DocumentSource::Text(p) => format!("text:{}", p.display()),
            DocumentSource::ReasoningTraces => "reasoning_traces".into(),
            DocumentSource::Prose => "prose".into(),
        }
    }

    /// Up to `max_docs` documents, each cut to `doc_tokens` tokens.
    pub fn documents(
        &self,
        tok: &Tokenizer,
        data: &Path,
        max_docs: usize,
        doc_tokens: usize,
    ) -> Result<Vec<Document>> {
        let mut docs = vec![];
        match self {
            DocumentSource::Text(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading --text {}", p.display()))?;
                let mut tokens = tok.encode(&text)?;
                tokens.truncate(doc_tokens);
                docs.push(Document {
                    id: p.display().to_string(),
                    tokens,
                });
            }
            DocumentSource::ReasoningTraces => {
                let path = data.join("reasoning_traces.jsonl");
                for r in read_jsonl(&path)? {
                    let chat = [
                        Message::new("user", field(&r, "problem", &path)?),
                        Message::new("assistant", field(&r, "trace", &path)?),
                    ];
                    let text = tok.apply_chat_template(&chat, false)?;
                    let mut tokens = tok.encode(&text)?;
                    tokens.truncate(doc_tokens);
                    docs.push(Document {
                        id: field(&r, "id", &path)?.to_string(),
                        tokens,
                    });
                }
            }
            DocumentSource::Prose => {
                let dir = data.join("prose");
                let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                    .with_context(|| format!("reading {}", dir.display()))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "txt"))
                    .collect();
                files.sort();
                let books: Vec<(String, Vec<u32>)> = files
                    .iter()
                    .map(|f| {
                        let text = std::fs::read_to_string(f)
                            .with_context(|| format!("reading {}", f.display()))?;
                        let stem = f
                            .file_stem()
                            .unwrap_or_default()
                            .to_string_lossy()
                            .to_string();
                        Ok((stem, tok.encode(&text)?))
                    })
                    .collect::<Result<_>>()?;
                let segments = books
                    .iter()
                    .map(|b| b.1.len() / doc_tokens.max(1))
                    .max()
                    .unwrap_or(0);
                for s in 0..segments {
                    for (name, ids) in &books {
                        if (s + 1) * doc_tokens <= ids.len() {
                            docs.push(Document {
                                id: format!("{name}#{s}"),
                                tokens: ids[s * doc_tokens..(s + 1) * doc_tokens].to_vec(),
                            });
                        }
                    }
                }
            }
        }
        docs.truncate(max_docs);
        Ok(docs)
    }
}

/// A problem with a checkable answer.
#[derive(Clone, Debug)]
pub struct TaskItem {
    pub id: String,
    pub problem: String,
    pub reference: String,
}

/// The instruction appended to every task prompt (the usual one for
/// MATH-style evaluation of chat models).
pub const TASK_INSTRUCTION: &str =
    "Please reason step by step, and put your final answer within \\boxed{}.";

/// A task dataset: its items and how its answers are extracted.
pub fn task_items(data: &Path, dataset: &str) -> Result<(Vec<TaskItem>, AnswerKind)> {
    let (file, kind) = match dataset {
        "math500" => ("math500.jsonl", AnswerKind::Boxed),
        "gsm8k" => ("gsm8k_test.jsonl", AnswerKind::Number),
        "aime2024" => ("aime2024.jsonl", AnswerKind::BoxedOrNumber),
        other => bail!("--dataset {other}: unknown (known: math500, gsm8k, aime2024)"),
    };
    let path = data.join(file);
    let mut items = vec![];
    for (i, r) in read_jsonl(&path)?.iter().enumerate() {
        let item = match dataset {
            "gsm8k" => {
                let answer = field(r, "answer", &path)?;
                TaskItem {
                    id: format!("gsm8k-{i}"),
                    problem: field(r, "question", &path)?.to_string(),
                    reference: super::answers::extract(answer, AnswerKind::Number).with_context(
                        || format!("{} line {}: no #### answer", path.display(), i + 1),
                    )?,
                }
            }
            _ => TaskItem {
                id: r["unique_id"]
                    .as_str()
                    .or(r["id"].as_str())
                    .map_or(format!("{dataset}-{i}"), str::to_string),
                problem: field(r, "problem", &path)?.to_string(),
                reference: field(r, "answer", &path)?.to_string(),
            },
        };
        items.push(item);
    }
    Ok((items, kind))
}

/// The prompt of a task item, rendered with the model's chat template.
pub fn task_prompt(tok: &Tokenizer, item: &TaskItem) -> Result<Vec<u32>> {
    let user = format!("{}\n{}", item.problem, TASK_INSTRUCTION);
    let text = tok.apply_chat_template(&[Message::new("user", &user)], true)?;
    tok.encode(&text)
}

/// Items `i` with `i % n == shard` ("i/n", 0-based), after the first `limit`.
pub fn shard_of<T: Clone>(
    items: &[T],
    limit: Option<usize>,
    shard: Option<(usize, usize)>,
) -> Vec<(usize, T)> {
    let limit = limit.unwrap_or(items.len()).min(items.len());
    items[..limit]
        .iter()
        .cloned()
        .enumerate()
        .filter(|(i, _)| shard.is_none_or(|(k, n)| i % n == k))
        .collect()
}

/// Parses `--shard i/n`.
pub fn parse_shard(s: &str) -> Result<(usize, usize)> {
    let parsed = s
        .split_once('/')
        .and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)));
    match parsed {
        Some((i, n)) if n > 0 && i < n => Ok((i, n)),
        _ => bail!("--shard {s}: expected i/n with 0 <= i < n, e.g. 0/4"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_partition_the_items() {
        let items: Vec<u32> = (0..10).collect();
        let mut seen: Vec<usize> = (0..3)
            .flat_map(|k| {
                shard_of(&items, Some(8), Some((k, 3)))
                    .into_iter()
                    .map(|(i, _)| i)
            })
            .collect();
        seen.sort();
        assert_eq!(seen, (0..8).collect::<Vec<_>>());
        assert!(parse_shard("3/3").is_err() && parse_shard("x").is_err());
        assert_eq!(parse_shard("1/4").unwrap(), (1, 4));
    }

    #[test]
    fn every_dataset_has_references() {
        let data = data_dir(None).unwrap();
        for (name, n) in [("math500", 500), ("gsm8k", 1319), ("aime2024", 30)] {
            let (items, _) = task_items(&data, name).unwrap();
            assert_eq!(items.len(), n, "{name}");
            assert!(items.iter().all(|i| !i.reference.is_empty()), "{name}");
        }
        let (gsm, _) = task_items(&data, "gsm8k").unwrap();
        assert_eq!(gsm[0].reference, "18");
    }
}
