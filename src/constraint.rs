//! Constrained sampling: a generation may carry a [`Constraint`] (a JSON
//! schema, any JSON object, a regular expression or a Lark grammar). It is
//! compiled by Microsoft's `llguidance` into a matcher per sequence; before
//! each sampling step the matcher gives the set of tokens that keep the
//! output inside the constraint, and the sampler (sample.wgsl) chooses only
//! among them, on the GPU, in every sampling mode. The sampled token is
//! then fed to the matcher. When the constraint is complete (nothing can
//! follow) the generation stops; while it may end, the end-of-sequence
//! tokens are allowed, so the model can stop there too.
//!
//! The tokenizer bridge (each token's bytes, a token trie) is built here
//! from the `tokenizers` tokenizer sieve already holds, once per tokenizer:
//! llguidance's own bridge (`toktrie_hf_tokenizers`) is the same code for
//! another version of the `tokenizers` crate.

use std::sync::{Arc, OnceLock};

use anyhow::{bail, Context};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{tagged, ErrorKind};
use crate::tokenizer::Tokenizer;

/// What a generation's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// A JSON schema (draft 2020-12 as OpenAI's structured outputs use it:
    /// objects, arrays, strings with patterns and formats, numbers with
    /// bounds, enums, `anyOf`, `$defs` with `#/...` references; `oneOf` is
    /// read as `anyOf`). The output is one JSON value, written with ", "
    /// and ": " between items and no other white space. An integer the
    /// schema leaves unbounded stays within JSON's exact range, ±(2^53 - 1)
    /// (see [`bound_integers`]).
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `json_object` response format).
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect (`start: ...`, rules,
    /// terminals in regular-expression syntax, `%json {...}` for a schema
    /// inside a grammar).
    Grammar(String),
}

impl Constraint {
    pub fn json_schema(schema: &Value) -> Constraint {
        Constraint::JsonSchema(schema.clone())
    }
    pub fn json_object() -> Constraint {
        Constraint::JsonObject
    }
    pub fn regex(rx: &str) -> Constraint {
        Constraint::Regex(rx.to_string())
    }
    pub fn grammar(lark: &str) -> Constraint {
        Constraint::Grammar(lark.to_string())
    }

    /// What kind of constraint, for messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "JSON schema",
            Constraint::JsonObject => "JSON object",
            Constraint::Regex(_) => "regular expression",
            Constraint::Grammar(_) => "grammar",
        }
    }

    /// llguidance's grammar for this constraint. A schema without its own
    /// `x-guidance` options gets sieve's: compact separators (a small model
    /// left free to add white space can fill `max_tokens` with it) and
    /// `oneOf` read as `anyOf` (Pydantic writes `oneOf` for tagged unions).
    fn grammar_of(&self) -> anyhow::Result<TopLevelGrammar> {
        Ok(match self {
            Constraint::JsonSchema(schema) => {
                let mut schema = schema.clone();
                bound_integers(&mut schema);
                let Some(obj) = schema.as_object_mut() else {
                    bail!("a JSON schema is an object, not {schema}");
                };
                obj.entry("x-guidance").or_insert_with(json_options);
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::JsonObject => {
                Constraint::JsonSchema(serde_json::json!({"type": "object"})).grammar_of()?
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// sieve's llguidance options for a JSON schema (its `x-guidance`).
pub(crate) fn json_options() -> Value {
    serde_json::json!({
        "item_separator": ", ",
        "key_separator": ": ",
        "whitespace_flexible": false,
        "coerce_one_of": true,
    })
}

/// JavaScript's `Number.MAX_SAFE_INTEGER`: the largest integer every JSON
/// parser that reads numbers as doubles keeps exact.
const MAX_SAFE_INTEGER: i64 = (1 << 53) - 1;

/// Gives every `"type": "integer"` of a schema without a bound the bounds
/// ±(2^53 - 1), so at most 16 digits. Unbounded, a small model can write
/// digits until `max_tokens` (SmolLM2-135M answered a city's population
/// with "1111111111..." for 80 tokens), a number no parser would keep
/// exactly anyway; llama.cpp's schema converter caps integers at 16 digits
/// for the same reason. Values inside `enum`, `const`, `default` and
/// `examples` are data, not schemas, and are left alone.
pub fn bound_integers(schema: &mut Value) {
    match schema {
        Value::Object(obj) => {
            let integer = match obj.get("type") {
                Some(Value::String(t)) => t == "integer",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
                _ => false,
            };
            if integer {
                if !obj.contains_key("maximum") && !obj.contains_key("exclusiveMaximum") {
                    obj.insert("maximum".into(), MAX_SAFE_INTEGER.into());
                }
                if !obj.contains_key("minimum") && !obj.contains_key("exclusiveMinimum") {
                    obj.insert("minimum".into(), (-MAX_SAFE_INTEGER).into());
                }
            }
            for (key, v) in obj.iter_mut() {
                if !matches!(key.as_str(), "enum" | "const" | "default" | "examples") {
                    bound_integers(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(bound_integers),
        _ => {}
    }
}

/// A constraint compiled for one generation: the tokens each step may
/// take, and whether the output is complete.
pub struct ConstraintState {
    matcher: Matcher,
    /// The model's vocabulary (the sampler's mask has a bit per token).
    vocab: usize,
    /// Seconds spent computing masks so far.
    pub mask_seconds: f64,
}

impl ConstraintState {
    /// Compiles `constraint` for `tokenizer`'s tokens and a model of `vocab`
    /// tokens. Errors are [`ErrorKind::InvalidConstraint`], naming what
    /// does not compile.
    pub fn new(
        constraint: &Constraint,
        tokenizer: &Tokenizer,
        vocab: usize,
    ) -> anyhow::Result<ConstraintState> {
        let factory = tokenizer.constraint_factory()?;
        let parser = constraint
            .grammar_of()
            .and_then(|g| factory.create_parser(g))
            .map_err(|e| {
                tagged(
                    ErrorKind::InvalidConstraint,
                    format!("the {} does not compile: {e}", constraint.describe()),
                )
            })?;
        Ok(ConstraintState {
            matcher: Matcher::new(Ok(parser)),
            vocab,
            mask_seconds: 0.0,
        })
    }

    /// The tokens the next step may take, as the sampler's bitmask (bit
    /// `t % 32` of word `t / 32`). Never empty: a constraint that allows
    /// nothing more is complete ([`Self::is_complete`]) before it is asked.
    pub fn mask(&mut self) -> anyhow::Result<Vec<u32>> {
        let t0 = web_time::Instant::now();
        let vob = self.matcher.compute_mask().map_err(|e| {
            tagged(
                ErrorKind::InvalidConstraint,
                format!("the constraint failed: {e}"),
            )
        })?;
        let words = self.vocab.div_ceil(32);
        let mut mask = vec![0u32; words];
        let n = words.min(vob.as_slice().len());
        mask[..n].copy_from_slice(&vob.as_slice()[..n]);
        // Tokens of the tokenizer past the model's vocabulary cannot be sampled.
        let tail = (words * 32 - self.vocab) as u32;
        if let Some(last) = mask.last_mut().filter(|_| tail > 0) {
            *last &= u32::MAX >> tail;
        }
        self.mask_seconds += t0.elapsed().as_secs_f64();
        if mask.iter().all(|&w| w == 0) {
            return Err(tagged(
                ErrorKind::InvalidConstraint,
                "the constraint allows no token of the model's vocabulary next",
            ));
        }
        Ok(mask)
    }

    /// Feeds the sampled token; an error if the constraint did not allow it.
    pub fn accept(&mut self, token: u32) -> anyhow::Result<()> {
        self.matcher.consume_token(token).map_err(|e| {
            tagged(
                ErrorKind::InvalidConstraint,
                format!("the constraint refused token {token}: {e}"),
            )
        })
    }

    /// Whether the output is complete: nothing more can follow.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The mask of the next choice, or None (every token) once the output
    /// is complete: its generation ends after that step, whose choice is
    /// dropped.
    pub fn next_mask(&mut self) -> anyhow::Result<Option<Vec<u32>>> {
        match self.is_complete() {
            false => self.mask().map(Some),
            true => Ok(None),
        }
    }
}

/// llguidance's view of a tokenizer: each token's bytes in a trie, and
/// tokenization of bytes (used for its forced-token shortcuts).
struct TokenBytes {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for TokenBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let encoded = std::str::from_utf8(s)
            .ok()
            .and_then(|text| self.tokenizer.encode(text, false).ok());
        match encoded {
            Some(e) => e.get_ids().to_vec(),
            None => self.trie.greedy_tokenize(s),
        }
    }
}

/// The parser factory of a tokenizer, built on first use (a trie of the
/// whole vocabulary: a fraction of a second) and kept with it.
pub(crate) type FactoryCell = OnceLock<Result<Arc<ParserFactory>, String>>;

impl Tokenizer {
    /// The bytes of token `id` (a special token's text without
    /// llguidance's marker; empty for an id outside the vocabulary or when
    /// the tokenizer's bytes are unknown).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Ok(factory) = self.constraint_factory() else {
            return self.decode(&[id]).unwrap_or_default().into_bytes();
        };
        let trie = factory.tok_env().tok_trie();
        if id as usize >= trie.vocab_size() {
            return vec![];
        }
        let bytes = trie.token(id);
        bytes
            .strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
            .unwrap_or(bytes)
            .to_vec()
    }

    /// The parser factory every constraint of this tokenizer compiles with.
    pub(crate) fn constraint_factory(&self) -> anyhow::Result<Arc<ParserFactory>> {
        self.constraint_factory
            .get_or_init(|| {
                token_env(self.inner(), &self.eos_ids)
                    .and_then(|env| {
                        let mut f = ParserFactory::new_simple(&env)?;
                        f.quiet();
                        Ok(Arc::new(f))
                    })
                    .map_err(|e| format!("{e:#}"))
            })
            .clone()
            .map_err(|e| {
                tagged(
                    ErrorKind::InvalidConstraint,
                    format!("constraints cannot be used with this model's tokenizer: {e}"),
                )
            })
    }
}

/// The bytes of every token of `hf` and the trie of them, with `eos` as the
/// tokens that end a generation (llguidance allows them where the
/// constraint may end). As `toktrie_hf_tokenizers::ByteTokenizer`: a
/// byte-level vocabulary maps its characters back to bytes, a byte-fallback
/// one (SentencePiece) reads `<0xNN>` tokens as bytes and its space
/// character as a space; special tokens (and added ones written `<...>`)
/// get llguidance's marker byte, other added tokens are their text.
fn token_env(hf: &tokenizers::Tokenizer, eos: &[u32]) -> anyhow::Result<TokEnv> {
    use tokenizers::DecoderWrapper;
    fn decoder_kind(
        d: &DecoderWrapper,
        byte_level: &mut bool,
        fallback: &mut bool,
        space: &mut char,
    ) {
        match d {
            DecoderWrapper::ByteFallback(_) => *fallback = true,
            DecoderWrapper::ByteLevel(_) => *byte_level = true,
            DecoderWrapper::Replace(r) => {
                let v = serde_json::to_value(r).unwrap_or_default();
                if v["content"] == " " {
                    if let Some(s) = v["pattern"]["String"].as_str() {
                        let mut chars = s.chars();
                        if let (Some(c), None) = (chars.next(), chars.next()) {
                            *space = c;
                        }
                    }
                }
            }
            DecoderWrapper::Sequence(seq) => {
                for d in seq.get_decoders() {
                    decoder_kind(d, byte_level, fallback, space);
                }
            }
            _ => {}
        }
    }
    let (mut byte_level, mut fallback, mut space) = (false, false, ' ');
    if let Some(d) = hf.get_decoder() {
        decoder_kind(d, &mut byte_level, &mut fallback, &mut space);
    }
    if !byte_level && !fallback {
        bail!("its decoder is neither byte-level nor byte-fallback, so the bytes of its tokens are unknown");
    }
    let vocab = hf.get_vocab_size(true);
    let added = hf.get_added_tokens_decoder();
    let special = |t: &tokenizers::AddedToken| {
        t.special || (t.content.starts_with('<') && t.content.ends_with('>'))
    };
    // Byte-level vocabularies write byte b as the character GPT-2 maps it to.
    let mut char_to_byte = std::collections::HashMap::new();
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let c = b as char;
        if matches!(c, '!'..='~' | '\u{a1}'..='\u{ac}' | '\u{ae}'..='\u{ff}') {
            char_to_byte.insert(c, b);
        } else {
            char_to_byte.insert(char::from_u32(next).expect("below 0x200"), b);
            next += 1;
        }
    }
    let mut words: Vec<Vec<u8>> = vec![vec![]; vocab];
    for (id, word) in words.iter_mut().enumerate() {
        let id = id as u32;
        let Some(name) = hf.id_to_token(id) else {
            continue;
        };
        *word = if let Some(t) = added.get(&id).filter(|t| special(t)) {
            let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            bytes.extend_from_slice(t.content.as_bytes());
            bytes
        } else if let Some(t) = added.get(&id) {
            // An added token is its text as it is, not in the vocabulary's
            // byte spelling.
            t.content.as_bytes().to_vec()
        } else if let Some(hex) = name
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .filter(|h| fallback && h.len() == 2)
        {
            vec![u8::from_str_radix(hex, 16).with_context(|| format!("token {id} {name:?}"))?]
        } else if fallback {
            name.replace(space, " ").into_bytes()
        } else {
            // A token whose characters are not all mapped bytes (none in the
            // vocabularies seen) stays empty: it can never be allowed.
            name.chars()
                .map(|c| char_to_byte.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_default()
        };
    }
    let eos: Vec<u32> = eos
        .iter()
        .copied()
        .filter(|&t| (t as usize) < vocab)
        .collect();
    let Some(&first) = eos.first() else {
        bail!("it names no end-of-sequence token, which ends a constrained output");
    };
    let info = TokRxInfo::new(vocab as u32, first);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    Ok(Arc::new(TokenBytes {
        trie,
        tokenizer: without_prefix_space(hf),
    }))
}

/// `hf` without the space SentencePiece tokenizers put before the text
/// (a `Prepend` normalizer, a Metaspace pre-tokenizer's prepend scheme), as
/// llguidance's bridge has it: llguidance tokenizes pieces of the output
/// (a forced `{"`), which must come out as they do inside the text, not as
/// a text's first word.
fn without_prefix_space(hf: &tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    use tokenizers::normalizers::Sequence as Normalizers;
    use tokenizers::pre_tokenizers::metaspace::PrependScheme;
    use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizers;
    use tokenizers::{NormalizerWrapper, PreTokenizerWrapper};
    fn normalizer(n: NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(seq) => {
                let kept: Vec<_> = (seq.as_ref().iter().cloned())
                    .filter_map(normalizer)
                    .collect();
                (!kept.is_empty()).then(|| NormalizerWrapper::Sequence(Normalizers::new(kept)))
            }
            n => Some(n),
        }
    }
    fn pre_tokenizer(p: PreTokenizerWrapper) -> PreTokenizerWrapper {
        match p {
            PreTokenizerWrapper::Metaspace(mut m) => {
                m.set_prepend_scheme(PrependScheme::Never);
                PreTokenizerWrapper::Metaspace(m)
            }
            PreTokenizerWrapper::Sequence(seq) => PreTokenizerWrapper::Sequence(
                PreTokenizers::new(seq.as_ref().iter().cloned().map(pre_tokenizer).collect()),
            ),
            p => p,
        }
    }
    let mut t = hf.clone();
    if let Some(n) = hf.get_normalizer().cloned() {
        t.with_normalizer(normalizer(n));
    }
    if let Some(p) = hf.get_pre_tokenizer().cloned() {
        t.with_pre_tokenizer(Some(pre_tokenizer(p)));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unbounded integers get JSON's exact range, wherever they are; bounds
    /// given are kept, and data (enum, const) is not touched.
    #[test]
    fn unbounded_integers_get_the_exact_range() {
        let mut schema = serde_json::json!({"type": "object", "properties": {
            "a": {"type": "integer"},
            "b": {"type": ["integer", "null"], "minimum": 0},
            "c": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 10}},
            "type": {"enum": [{"type": "integer"}]},
            "d": {"anyOf": [{"$ref": "#/$defs/n"}]}},
            "$defs": {"n": {"type": "integer"}}});
        bound_integers(&mut schema);
        let max = MAX_SAFE_INTEGER;
        let p = &schema["properties"];
        assert_eq!(
            (&p["a"]["minimum"], &p["a"]["maximum"]),
            (&(-max).into(), &max.into())
        );
        assert_eq!(
            (&p["b"]["minimum"], &p["b"]["maximum"]),
            (&0.into(), &max.into())
        );
        assert_eq!(p["c"]["items"].get("maximum"), None);
        assert_eq!(p["c"]["items"]["minimum"], -max);
        assert_eq!(p["type"]["enum"][0], serde_json::json!({"type": "integer"}));
        assert_eq!(schema["$defs"]["n"]["maximum"], max);
    }

    /// A SentencePiece tokenizer that puts a space before its text (a
    /// Metaspace pre-tokenizer with prepend scheme "first", as sieve builds
    /// Llama 2's from a GGUF): the pieces llguidance tokenizes come out as
    /// they are inside a text ("{" alone, not "▁{"), so a JSON object may
    /// start with "{".
    #[test]
    fn sentencepiece_pieces_are_tokenized_without_the_prefix_space() {
        let mut vocab = serde_json::Map::new();
        let words = [
            "<unk>", "<s>", "</s>", "▁", "{", "▁{", "}", "\"", "a", ":", "1",
        ];
        for (i, w) in words.iter().enumerate() {
            vocab.insert(w.to_string(), i.into());
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), (words.len() as u32 + b).into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
            "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": [["▁", "{"]]}
        });
        let hf: tokenizers::Tokenizer = json.to_string().parse().unwrap();
        // As loaded, the tokenizer writes "{" as a text's first word.
        assert_eq!(hf.encode("{", false).unwrap().get_ids(), [5]);
        let env = token_env(&hf, &[2]).unwrap();
        assert_eq!(env.tokenize_bytes(b"{"), [4]);
        assert_eq!(env.tok_trie().token(5), " {".as_bytes());
        assert_eq!(env.tok_trie().token(11 + 0x41), b"A");
    }

    #[test]
    fn descriptions_name_the_kind() {
        assert_eq!(Constraint::json_object().describe(), "JSON object");
        assert_eq!(Constraint::regex("a+").describe(), "regular expression");
        assert!(Constraint::JsonSchema(serde_json::json!(true))
            .grammar_of()
            .is_err());
    }
}
