//! Text side of a model: `tokenizer.json` through the `tokenizers` crate, the
//! chat template of `tokenizer_config.json` rendered with minijinja as Hugging
//! Face renders it with jinja2, and incremental detokenization for streaming.

use crate::error::{tagged, ErrorKind};
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// One chat message.
#[derive(Clone, Debug, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: bool,
    bos_id: Option<u32>,
    /// Ids that end a generation: the config's eos ids plus the tokenizer's eos token.
    pub eos_ids: Vec<u32>,
    /// What constraints compile with, built when the first one is used.
    pub(crate) constraint_factory: crate::constraint::FactoryCell,
}

/// A special token in tokenizer_config.json is a string or `{"content": ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and (if present) `tokenizer_config.json` from `dir`.
    /// `config_eos` are the eos ids of config.json / generation_config.json.
    /// A GGUF file in place of the folder gives the tokenizer its metadata
    /// describes (what `convert-gguf` would write).
    pub fn load(dir: &Path, config_eos: &[u32]) -> Result<Self> {
        if crate::gguf_model::is_gguf(dir) {
            return Self::from_gguf(&crate::gguf_model::GgufModel::open(dir)?);
        }
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            bail!(
                "{}: missing tokenizer.json (sieve needs a Hugging Face tokenizer file)",
                dir.display()
            );
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", cfg_path.display()))?
        } else {
            Value::Null
        };
        let mut eos_ids = config_eos.to_vec();
        // generation_config.json is optional, but when present it must be
        // valid: its eos ids decide where generation stops.
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path)
                .with_context(|| format!("reading {}", gen_path.display()))?;
            let v: Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", gen_path.display()))?;
            let ids = crate::config::token_ids(v.get("eos_token_id"), "eos_token_id", &gen_path)?;
            for id in ids {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        Self::build(&path, &text, &cfg, eos_ids)
    }

    /// The tokenizer of a model folder (with the eos ids of its config.json)
    /// or GGUF file.
    pub fn for_model(path: &Path) -> Result<Self> {
        if crate::gguf_model::is_gguf(path) {
            return Self::load(path, &[]);
        }
        let cfg = crate::config::ModelConfig::from_file(&path.join("config.json"))?;
        Self::load(path, &cfg.eos_token_ids)
    }

    /// The tokenizer of a GGUF file (its metadata's vocabulary, merges,
    /// special tokens and chat template).
    pub fn from_gguf(g: &crate::gguf_model::GgufModel) -> Result<Self> {
        let doc = |name: &str| g.document(name).cloned().unwrap_or(Value::Null);
        let text = serde_json::to_string(&doc("tokenizer.json"))?;
        let eos = crate::config::token_ids(
            doc("generation_config.json").get("eos_token_id"),
            "eos_token_id",
            &g.file.path,
        )?;
        let mut eos_ids = g.config.eos_token_ids.clone();
        for id in eos {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        Self::build(&g.file.path, &text, &doc("tokenizer_config.json"), eos_ids)
    }

    /// The tokenizer of `tokenizer.json`'s text (read from `path`) and the
    /// tokenizer config `cfg`; `eos_ids` are the eos ids known so far (the
    /// config's `eos_token` is added).
    fn build(path: &Path, text: &str, cfg: &Value, mut eos_ids: Vec<u32>) -> Result<Self> {
        // Invalid JSON is refused here with its position: the tokenizers
        // crate panics on some of it (found by tests/fuzz.rs).
        serde_json::from_str::<Value>(text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        // Valid JSON of the wrong shape can still panic inside the crate:
        // caught, it is an error like any other.
        let parsed =
            std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>()).map_err(|_| {
                anyhow!(
                    "{}: not a tokenizer the tokenizers crate can read (it panicked)",
                    path.display()
                )
            })?;
        let inner =
            parsed.map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", path.display()))?;
        let bos_token = token_string(cfg.get("bos_token"));
        let eos_token = token_string(cfg.get("eos_token"));
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        Ok(Tokenizer {
            inner,
            chat_template: cfg
                .get("chat_template")
                .and_then(Value::as_str)
                .map(String::from),
            add_bos: cfg
                .get("add_bos_token")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            bos_token,
            eos_token,
            bos_id,
            eos_ids,
            constraint_factory: Default::default(),
        })
    }

    /// Token ids of `text`. Special tokens written in the text are matched whole;
    /// a BOS token is prepended only when tokenizer_config.json asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode_continuation(text)?;
        if self.add_bos {
            if let Some(b) = self.bos_id {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
        }
        Ok(ids)
    }

    /// Token ids of `text` that continues a conversation already in the
    /// cache: as [`Tokenizer::encode`], without a BOS token.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included (so that `decode(encode(t)) == t`).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("detokenizing: {e}"))
    }

    /// The `tokenizers` tokenizer itself.
    pub(crate) fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template (as transformers' `apply_chat_template`).
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| {
                tagged(
                    ErrorKind::Template,
                    "this model's tokenizer_config.json has no chat_template (give the prompt as plain text)",
                )
            })?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", template).map_err(|e| {
            tagged(
                ErrorKind::Template,
                format!("chat template does not parse: {e}"),
            )
        })?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| {
                tagged(
                    ErrorKind::Template,
                    format!("rendering the chat template: {e}"),
                )
            })
    }
}

/// Turns a growing list of token ids into text pieces for streaming. Bytes of a
/// multi-byte character split over tokens are held back until complete. Each
/// token costs O(1): only the ids since the last emitted piece (plus the one
/// before, for byte-level context) are decoded, as Hugging Face's streamers do.
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Ids before `prefix` are done; `ids[prefix..read]` is decoded context.
    prefix: usize,
    read: usize,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamDecoder {
    pub fn new() -> Self {
        StreamDecoder {
            ids: vec![],
            prefix: 0,
            read: 0,
        }
    }

    /// Adds a token and returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() <= before.len()
            || now.ends_with('\u{FFFD}')
            || !now.is_char_boundary(before.len())
        {
            return Ok(String::new());
        }
        let piece = now[before.len()..].to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/golden/smollm2-135m");
        Tokenizer::load(&dir, &[]).unwrap()
    }

    #[test]
    fn streamed_pieces_add_up_to_the_text() {
        let tok = tokenizer();
        // Multi-byte characters split across byte-level tokens, spaces, digits.
        let text = "Caf\u{e9} \u{1F600}\u{1F600} na\u{ef}ve 2024 \u{4e2d}\u{6587} end";
        let ids = tok.encode(text).unwrap();
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(&tok, id).unwrap();
            assert!(
                !piece.contains('\u{FFFD}'),
                "a piece splits a character: {piece:?}"
            );
            out.push_str(&piece);
        }
        assert_eq!(out, text);
    }
}
