//! The GGUF vocabulary (GPT-2 style byte-level BPE) and the tokenizer
//! files synthesized from it: tokenizer.json for the `tokenizers` library
//! and tokenizer_config.json, as Hugging Face writes them.

use anyhow::{anyhow, bail, ensure};
use serde_json::{json, Map, Value};
use std::path::Path;

use crate::gguf::GgufFile;

const SUPPORTED_TOKENIZERS: &str = "gpt2";

/// GGUF `tokenizer.ggml.token_type` values that become added tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The tokenizer metadata.
pub(crate) struct Vocab<'a> {
    pub tokens: Vec<&'a str>,
    /// One per token, or empty when the file has no token types.
    token_types: Vec<i64>,
    merges: Vec<&'a str>,
    pre: &'a str,
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
        ensure!(
            model == "gpt2",
            "{file}: tokenizer model `{model}` is not supported (supported: {SUPPORTED_TOKENIZERS})"
        );
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
        let vocab = Self {
            merges: g.get_str_array("tokenizer.ggml.merges")?,
            pre: g
                .opt("tokenizer.ggml.pre", GgufFile::get_str)?
                .unwrap_or("default"),
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

    /// Control tokens (special) and user-defined tokens (not special), which
    /// the tokenizer must match whole before BPE, as llama.cpp does.
    fn added_tokens(&self) -> impl Iterator<Item = (usize, &'a str, bool)> + '_ {
        self.token_types.iter().enumerate().filter_map(|(id, &ty)| {
            let special = match ty {
                TOKEN_TYPE_CONTROL => true,
                TOKEN_TYPE_USER_DEFINED => false,
                _ => return None,
            };
            Some((id, self.tokens[id], special))
        })
    }

    /// `tokenizer.json` for the `tokenizers` library: byte-level BPE with the
    /// GGUF vocabulary (id = index) and merges (rank = index).
    pub fn tokenizer_json(&self, file: &Path) -> anyhow::Result<Value> {
        let file = file.display();
        let mut vocab = Map::new();
        for (id, &token) in self.tokens.iter().enumerate() {
            if let Some(first) = vocab.insert(token.to_string(), json!(id)) {
                bail!("{file}: token {token:?} appears twice in the vocabulary (ids {first} and {id})");
            }
        }
        let merges = self
            .merges
            .iter()
            .map(|merge| {
                let (left, right) = split_merge(merge).ok_or_else(|| {
                    anyhow!("{file}: merge {merge:?} is not two space-separated tokens")
                })?;
                // `tokenizers` refuses to load merges of unknown tokens; say
                // which one here rather than leave a file that cannot load.
                for part in [left, right, &format!("{left}{right}")] {
                    ensure!(
                        vocab.contains_key(part),
                        "{file}: merge {merge:?} uses {part:?}, which is not in the vocabulary"
                    );
                }
                Ok(json!([left, right]))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;

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

        let byte_level = json!({
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": true,
            "use_regex": true,
        });
        let pre_tokenizer = match self.pre {
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

        // As in HF's GPT-2 tokenizer.json. The BOS/EOS llama.cpp adds when
        // encoding are added by a template, as HF's Llama tokenizers do.
        let mut post_processor = json!({
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": false,
            "use_regex": true,
        });
        if self.add_bos || self.add_eos {
            post_processor = json!({
                "type": "Sequence",
                "processors": [post_processor, self.bos_eos_template()],
            });
        }

        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added_tokens,
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
        }))
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

    #[test]
    fn merges_split_like_llama_cpp() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("  x"), Some((" ", "x")));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
    }
}
