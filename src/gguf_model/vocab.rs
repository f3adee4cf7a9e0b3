//! The GGUF vocabulary and the tokenizer files synthesized from it:
//! tokenizer.json for the `tokenizers` library and tokenizer_config.json,
//! as Hugging Face writes them. Two kinds of vocabulary
//! (`tokenizer.ggml.model`): `gpt2`, byte-level BPE with the file's merges;
//! and `llama`, SentencePiece BPE with byte fallback, whose merges the file
//! does not list: they are rebuilt from the vocabulary as transformers does
//! when it reads a GGUF (`generate_merges`), each pair ranked by the token it
//! makes.

use anyhow::{anyhow, bail, ensure};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::path::Path;

use crate::gguf::GgufFile;

const SUPPORTED_TOKENIZERS: &str = "gpt2, llama";

/// SentencePiece's word boundary, which stands for a space in its tokens.
const SPACE_MARK: char = '\u{2581}';

/// How the tokens become text, from `tokenizer.ggml.model`.
enum Kind<'a> {
    /// `gpt2`: byte-level BPE with the file's merges, its text split first
    /// by the pre-tokenizer `tokenizer.ggml.pre` names.
    ByteLevel { merges: Vec<&'a str>, pre: &'a str },
    /// `llama`: SentencePiece BPE with byte fallback (`<0x41>` tokens).
    SentencePiece(SentencePiece),
}

/// The SentencePiece flavours, by architecture, each as transformers builds
/// it from a GGUF (its `gguf_tokenizer_mapping`), which is how the reference
/// tokenizations were made.
enum SentencePiece {
    /// Gemma: spaces become `▁` by a normalizer, no prefix space; tokens of
    /// spaces are stored as real spaces and renamed to `▁`s; merges ranked by
    /// the position of the token they make (Gemma's scores do not follow its
    /// merge order).
    Gemma,
    /// Llama 2, Mistral and the other SentencePiece models: a `▁` prefix
    /// (unless `tokenizer.ggml.add_space_prefix` is false) and spaces
    /// replaced by a `Metaspace` pre-tokenizer, merges ranked by
    /// `tokenizer.ggml.scores`.
    Llama {
        scores: Vec<f32>,
        prefix_space: bool,
    },
    /// Phi-3: as Llama, but the prefix and the spaces come from a normalizer
    /// (text starting with spaces keeps one more `▁`).
    Phi3 { scores: Vec<f32> },
}

/// GGUF `tokenizer.ggml.token_type` values that become added tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The tokenizer metadata.
pub(crate) struct Vocab<'a> {
    pub tokens: Vec<&'a str>,
    /// One per token, or empty when the file has no token types.
    token_types: Vec<i64>,
    kind: Kind<'a>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<&'a str>,
}

impl<'a> Vocab<'a> {
    pub fn read(g: &'a GgufFile) -> anyhow::Result<Self> {
        let file = g.path.display();
        let model = g.get_str("tokenizer.ggml.model")?;
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let n_tokens = tokens.len() as u64;
        crate::config::check_dimension(
            &file.to_string(),
            "tokenizer.ggml.tokens (its length)",
            "vocab_size",
            n_tokens,
        )?;
        let token_types = g
            .opt("tokenizer.ggml.token_type", GgufFile::get_i64_array)?
            .unwrap_or_default();
        ensure!(
            token_types.is_empty() || token_types.len() == tokens.len(),
            "{file}: {} token types for {} tokens",
            token_types.len(),
            tokens.len()
        );
        let id = |k: &str| -> anyhow::Result<Option<u32>> {
            let id = g.opt(k, GgufFile::get_u32)?;
            if let Some(id) = id {
                ensure!(
                    (id as usize) < tokens.len(),
                    "{file}: `{k}` is {id}, outside the vocabulary of {} tokens",
                    tokens.len()
                );
            }
            Ok(id)
        };
        let scores = || -> anyhow::Result<Vec<f32>> {
            let scores = g.get_f32_array("tokenizer.ggml.scores")?;
            ensure!(
                scores.len() == tokens.len(),
                "{file}: {} token scores (`tokenizer.ggml.scores`) for {} tokens",
                scores.len(),
                tokens.len()
            );
            Ok(scores)
        };
        let kind = match model {
            "gpt2" => Kind::ByteLevel {
                merges: g.get_str_array("tokenizer.ggml.merges")?,
                pre: g
                    .opt("tokenizer.ggml.pre", GgufFile::get_str)?
                    .unwrap_or("default"),
            },
            "llama" => Kind::SentencePiece(match g.get_str("general.architecture")? {
                "gemma" | "gemma2" | "gemma3" => SentencePiece::Gemma,
                "phi3" => SentencePiece::Phi3 { scores: scores()? },
                _ => SentencePiece::Llama {
                    scores: scores()?,
                    prefix_space: g
                        .opt("tokenizer.ggml.add_space_prefix", GgufFile::get_bool)?
                        .unwrap_or(true),
                },
            }),
            other => bail!(
                "{file}: tokenizer model `{other}` (`tokenizer.ggml.model`) is not supported (supported: {SUPPORTED_TOKENIZERS})"
            ),
        };
        let vocab = Self {
            kind,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: g
                .opt("tokenizer.ggml.add_bos_token", GgufFile::get_bool)?
                .unwrap_or(false),
            add_eos: g
                .opt("tokenizer.ggml.add_eos_token", GgufFile::get_bool)?
                .unwrap_or(false),
            chat_template: g.opt("tokenizer.chat_template", GgufFile::get_str)?,
            tokens,
            token_types,
        };
        ensure!(
            !vocab.add_bos || vocab.bos.is_some(),
            "{file}: `tokenizer.ggml.add_bos_token` is set but there is no BOS token id"
        );
        ensure!(
            !vocab.add_eos || vocab.eos.is_some(),
            "{file}: `tokenizer.ggml.add_eos_token` is set but there is no EOS token id"
        );
        Ok(vocab)
    }

    fn token(&self, id: Option<u32>) -> Option<&'a str> {
        id.map(|id| self.tokens[id as usize])
    }

    /// Token `id` as the tokenizer spells it: Gemma's tokens of spaces are
    /// stored as real spaces and looked up as `▁`s; every other token as
    /// the file has it.
    fn spelling(&self, id: usize) -> std::borrow::Cow<'a, str> {
        let token = self.tokens[id];
        let all_blank = token.contains(' ') && token.chars().all(python_isspace);
        match self.kind {
            Kind::SentencePiece(SentencePiece::Gemma) if all_blank => {
                SPACE_MARK.to_string().repeat(token.chars().count()).into()
            }
            _ => token.into(),
        }
    }

    /// Control tokens (special) and user-defined tokens (not special), which
    /// the tokenizer must match whole before BPE, as llama.cpp does. A
    /// user-defined token the tokenizer spells otherwise (Gemma's runs of
    /// spaces) is left to BPE, as transformers leaves it.
    fn added_tokens(&self) -> impl Iterator<Item = (usize, &'a str, bool)> + '_ {
        self.token_types.iter().enumerate().filter_map(|(id, &ty)| {
            let special = match ty {
                TOKEN_TYPE_CONTROL => true,
                TOKEN_TYPE_USER_DEFINED if self.spelling(id) == self.tokens[id] => false,
                _ => return None,
            };
            Some((id, self.tokens[id], special))
        })
    }

    /// `tokenizer.json` for the `tokenizers` library: BPE with the GGUF
    /// vocabulary (id = index) and its merges (rank = index), or for a
    /// SentencePiece vocabulary the merges it implies.
    pub fn tokenizer_json(&self, file: &Path) -> anyhow::Result<Value> {
        let file = file.display();
        let spellings: Vec<_> = (0..self.tokens.len()).map(|id| self.spelling(id)).collect();
        let mut ids: HashMap<&str, usize> = HashMap::with_capacity(spellings.len());
        for (id, token) in spellings.iter().enumerate() {
            if let Some(first) = ids.insert(token, id) {
                bail!("{file}: token {token:?} appears twice in the vocabulary (ids {first} and {id})");
            }
        }
        let vocab: Map<String, Value> = spellings
            .iter()
            .enumerate()
            .map(|(id, token)| (token.to_string(), json!(id)))
            .collect();

        let added_tokens: Vec<Value> = self
            .added_tokens()
            .map(|(id, content, special)| {
                json!({
                    "id": id,
                    "content": content,
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": special,
                })
            })
            .collect();

        // The BOS/EOS llama.cpp adds when encoding are added by a template,
        // as Hugging Face's Llama tokenizers do.
        let template = (self.add_bos || self.add_eos).then(|| self.bos_eos_template());
        let mut tokenizer = match &self.kind {
            Kind::ByteLevel { merges, pre } => {
                let merges = merges
                    .iter()
                    .map(|merge| {
                        let (left, right) = split_merge(merge).ok_or_else(|| {
                            anyhow!("{file}: merge {merge:?} is not two space-separated tokens")
                        })?;
                        // `tokenizers` refuses to load merges of unknown
                        // tokens; say which one here rather than leave a
                        // file that cannot load.
                        for part in [left, right, &format!("{left}{right}")] {
                            ensure!(
                                ids.contains_key(part),
                                "{file}: merge {merge:?} uses {part:?}, which is not in the vocabulary"
                            );
                        }
                        Ok(json!([left, right]))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                byte_level_json(pre, template, vocab, merges)
            }
            Kind::SentencePiece(style) => {
                let merges = implied_merges(&spellings, &ids, |id| match style {
                    SentencePiece::Gemma => -(id as f64),
                    SentencePiece::Llama { scores, .. } | SentencePiece::Phi3 { scores } => {
                        f64::from(scores[id])
                    }
                });
                let unk = self.token(self.unk);
                sentencepiece_json(style, unk, template, vocab, merges)
            }
        };
        tokenizer["added_tokens"] = json!(added_tokens);
        Ok(tokenizer)
    }

    /// A `TemplateProcessing` that wraps each sequence in the BOS/EOS tokens
    /// that `add_bos`/`add_eos` ask for.
    fn bos_eos_template(&self) -> Value {
        let bos = self.token(self.bos).filter(|_| self.add_bos);
        let eos = self.token(self.eos).filter(|_| self.add_eos);
        let special =
            |token: &str, type_id: u32| json!({"SpecialToken": {"id": token, "type_id": type_id}});
        let sequence = |type_id: u32| {
            let id = if type_id == 0 { "A" } else { "B" };
            let mut items: Vec<Value> = bos.map(|t| special(t, type_id)).into_iter().collect();
            items.push(json!({"Sequence": {"id": id, "type_id": type_id}}));
            items.extend(eos.map(|t| special(t, type_id)));
            items
        };
        let single = sequence(0);
        let pair: Vec<Value> = single.iter().cloned().chain(sequence(1)).collect();
        let special_tokens: Map<String, Value> = [(bos, self.bos), (eos, self.eos)]
            .into_iter()
            .filter_map(|(token, id)| Some((token?, id?)))
            .map(|(token, id)| {
                (
                    token.to_string(),
                    json!({"id": token, "ids": [id], "tokens": [token]}),
                )
            })
            .collect();
        json!({
            "type": "TemplateProcessing",
            "single": single,
            "pair": pair,
            "special_tokens": special_tokens,
        })
    }

    pub fn tokenizer_config_json(&self, model_max_length: usize) -> Value {
        let added_tokens_decoder: Map<String, Value> = self
            .added_tokens()
            .map(|(id, content, special)| {
                let entry = json!({
                    "content": content,
                    "lstrip": false,
                    "normalized": false,
                    "rstrip": false,
                    "single_word": false,
                    "special": special,
                });
                (id.to_string(), entry)
            })
            .collect();
        let mut config = json!({
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "add_prefix_space": false,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": self.token(self.bos),
            "eos_token": self.token(self.eos),
            "unk_token": self.token(self.unk),
            "pad_token": self.token(self.pad),
            "clean_up_tokenization_spaces": false,
            "model_max_length": model_max_length,
            // tokenizer.json describes the tokenizer completely; the generic
            // fast class uses it as is.
            "tokenizer_class": "PreTrainedTokenizerFast",
        });
        if let Some(template) = self.chat_template {
            config["chat_template"] = json!(template);
        }
        config
    }

    /// The special token ids that are present, for `config.json` and
    /// `generation_config.json`.
    pub fn special_ids(&self) -> Map<String, Value> {
        [
            ("bos_token_id", self.bos),
            ("eos_token_id", self.eos),
            ("pad_token_id", self.pad),
        ]
        .into_iter()
        .filter_map(|(key, id)| Some((key.to_string(), json!(id?))))
        .collect()
    }
}

/// Byte-level BPE's tokenizer.json (GPT-2's), less its added tokens.
fn byte_level_json(
    pre: &str,
    template: Option<Value>,
    vocab: Map<String, Value>,
    merges: Vec<Value>,
) -> Value {
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": true,
        "use_regex": true,
    });
    let pre_tokenizer = match pre {
        // SmolLM's HF tokenizer splits every digit off before the GPT-2
        // regex (llama.cpp's `smollm` pre-tokenizer does the same).
        "smollm" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level],
        }),
        // Every other pre-tokenizer gets GPT-2's regex. That is exact for
        // `gpt2`/`default` only: others (e.g. `llama-bpe`, `qwen2`) split
        // digits and whitespace differently, so their tokenization can
        // differ from llama.cpp's on such text.
        _ => byte_level,
    };
    // As in HF's GPT-2 tokenizer.json.
    let mut post_processor = json!({
        "type": "ByteLevel",
        "add_prefix_space": true,
        "trim_offsets": false,
        "use_regex": true,
    });
    if let Some(template) = template {
        post_processor = json!({
            "type": "Sequence",
            "processors": [post_processor, template],
        });
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": true,
            "use_regex": true,
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    })
}

/// SentencePiece BPE's tokenizer.json as transformers' `GemmaTokenizer`
/// and `LlamaTokenizer` build it, less its added tokens.
fn sentencepiece_json(
    style: &SentencePiece,
    unk: Option<&str>,
    template: Option<Value>,
    vocab: Map<String, Value>,
    merges: Vec<Value>,
) -> Value {
    let mark = SPACE_MARK.to_string();
    let spaces_to_marks = json!({"type": "Replace", "pattern": {"String": " "}, "content": mark});
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": mark}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    let strip_prefix = json!({"type": "Strip", "content": " ", "start": 1, "stop": 0});
    let (normalizer, pre_tokenizer, unk) = match style {
        // The split on spaces never fires once the normalizer has replaced
        // them; it is kept so that the file is the one transformers makes.
        SentencePiece::Gemma => (
            spaces_to_marks,
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
            unk,
        ),
        SentencePiece::Llama { prefix_space, .. } => {
            if *prefix_space {
                decoders.push(strip_prefix);
            }
            let scheme = if *prefix_space { "first" } else { "never" };
            (
                Value::Null,
                json!({"type": "Metaspace", "replacement": mark, "prepend_scheme": scheme, "split": false}),
                None,
            )
        }
        SentencePiece::Phi3 { .. } => {
            decoders.push(strip_prefix);
            (
                json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": mark}, spaces_to_marks]}),
                Value::Null,
                None,
            )
        }
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": template,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    })
}

/// The merges a SentencePiece vocabulary implies, as transformers'
/// `generate_merges` rebuilds them: every split of a token into two tokens,
/// best first by the `priority` of the token they make, then by the longer
/// left piece and the longer right piece (in characters); the splits of one
/// token with equal keys keep the order of their pieces' ids.
fn implied_merges(
    spellings: &[std::borrow::Cow<'_, str>],
    ids: &HashMap<&str, usize>,
    priority: impl Fn(usize) -> f64,
) -> Vec<Value> {
    struct Merge<'s> {
        priority: f64,
        left_chars: usize,
        right_chars: usize,
        left: &'s str,
        right: &'s str,
    }
    let mut merges = Vec::new();
    for (id, token) in spellings.iter().enumerate() {
        let mut splits: Vec<(usize, usize, &str, &str)> = token
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (left, right) = token.split_at(at);
                Some((*ids.get(left)?, *ids.get(right)?, left, right))
            })
            .collect();
        splits.sort_by_key(|&(left_id, right_id, ..)| (left_id, right_id));
        let p = priority(id);
        merges.extend(splits.into_iter().map(|(_, _, left, right)| Merge {
            priority: p,
            left_chars: left.chars().count(),
            right_chars: right.chars().count(),
            left,
            right,
        }));
    }
    // Stable, as Python's sort is.
    merges.sort_by(|a, b| {
        (b.priority.total_cmp(&a.priority))
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    merges
        .into_iter()
        .map(|m| json!([m.left, m.right]))
        .collect()
}

/// Python's `str.isspace` (which `str.strip()` strips) for one character:
/// Unicode white space and the four ASCII separators U+001C..U+001F.
fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Splits a GGUF merge `"left right"`. Byte-level BPE tokens never contain a
/// plain space, but like llama.cpp the split ignores the first character so
/// that a token that is a space itself still splits correctly.
fn split_merge(merge: &str) -> Option<(&str, &str)> {
    let first = merge.chars().next()?.len_utf8();
    let at = first + merge[first..].find(' ')?;
    Some((&merge[..at], &merge[at + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::GgufBuilder;

    /// The tokenizer of a SentencePiece vocabulary of `tokens` (with
    /// `scores`) in a GGUF of architecture `arch`.
    fn sentencepiece(arch: &str, tokens: &[&str], scores: &[f32]) -> tokenizers::Tokenizer {
        let bytes = GgufBuilder::default()
            .str("general.architecture", arch)
            .str("tokenizer.ggml.model", "llama")
            .str_array("tokenizer.ggml.tokens", tokens)
            .f32_array("tokenizer.ggml.scores", scores)
            .build();
        let g = GgufFile::from_bytes("spm.gguf", bytes).unwrap();
        let json = Vocab::read(&g).unwrap().tokenizer_json(&g.path).unwrap();
        serde_json::to_string(&json).unwrap().parse().unwrap()
    }

    fn ids(t: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
        t.encode(text, false).unwrap().get_ids().to_vec()
    }

    /// transformers' `generate_merges` on this vocabulary gives
    /// [(a, b), (b, c), (ab, c), (a, bc)]: by the made token's score, then
    /// the longer left piece.
    #[test]
    fn implied_merges_rank_by_score_then_the_longer_left_piece() {
        let spellings: Vec<std::borrow::Cow<str>> =
            ["a", "b", "c", "abc", "bc", "ab"].map(Into::into).to_vec();
        let ids = spellings
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_ref(), i))
            .collect();
        let scores = [0.0, 0.0, 0.0, -3.0, -2.0, -1.0];
        let merges = implied_merges(&spellings, &ids, |id| scores[id]);
        assert_eq!(
            merges,
            [
                json!(["a", "b"]),
                json!(["b", "c"]),
                json!(["ab", "c"]),
                json!(["a", "bc"])
            ]
        );
    }

    /// Llama 2's flavour: a `▁` before the text, spaces as `▁`, merges by
    /// score (`▁ab` beats `bc`), bytes outside the vocabulary as `<0x..>`
    /// tokens, and back to the same text.
    #[test]
    fn llama_sentencepiece_prefixes_merges_and_falls_back_to_bytes() {
        let mut tokens = vec![
            "<unk>",
            "\u{2581}",
            "a",
            "b",
            "c",
            "\u{2581}a",
            "\u{2581}ab",
            "bc",
        ];
        let mut scores = vec![0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0];
        let bytes: Vec<String> = (0..=255).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.extend(bytes.iter().map(String::as_str));
        scores.extend([0.0; 256]);
        let t = sentencepiece("llama", &tokens, &scores);
        // "▁abc": ▁a (-5) first, then ▁ab (-6) before bc (-7).
        assert_eq!(ids(&t, "abc"), [6, 4]);
        // "é" is two bytes (0xC3 0xA9), neither a token.
        assert_eq!(ids(&t, "a é"), [5, 1, 8 + 0xC3, 8 + 0xA9]);
        assert_eq!(t.decode(&ids(&t, "a é"), false).unwrap(), "a é");
    }

    /// Gemma's flavour: no prefix, a token of real spaces looked up as
    /// `▁`s, merges by position in the file whatever the scores say.
    #[test]
    fn gemma_sentencepiece_respells_spaces_and_ranks_by_position() {
        let tokens = ["<unk>", "\u{2581}", "a", "b", "c", "  ", "bc", "ab"];
        // Scores that would make `ab` win; Gemma's rank is the position.
        let scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -9.0, -1.0];
        let t = sentencepiece("gemma3", &tokens, &scores);
        assert_eq!(ids(&t, "abc"), [2, 6]);
        assert_eq!(ids(&t, "a  b"), [2, 5, 3]);
        assert_eq!(t.decode(&[2, 5, 3], false).unwrap(), "a  b");
    }

    #[test]
    fn merges_split_like_llama_cpp() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("  x"), Some((" ", "x")));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
    }
}
