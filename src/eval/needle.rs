//! Needle retrieval: a pass key hidden at a given depth of filler text, asked
//! for at the end (the passkey test of Mohtashami and Jaggi, 2023), as plain
//! text so that it works the same for base and chat models.

use anyhow::{bail, Result};

use crate::tokenizer::Tokenizer;

pub const INTRO: &str =
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n";
pub const QUESTION: &str = "\n\nWhat is the pass key? The pass key is";

pub fn needle_sentence(passkey: u32) -> String {
    format!(" The pass key is {passkey}. Remember it. {passkey} is the pass key. ")
}

/// A five-digit pass key from a seed and trial number (SplitMix64).
pub fn passkey(seed: u64, trial: u64) -> u32 {
    let mut z = seed
        .wrapping_add(trial.wrapping_mul(0x9E3779B97F4A7C15))
        .wrapping_add(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^= z >> 31;
    10_000 + (z % 90_000) as u32
}

/// The prompt: intro, filler with the needle after `depth` (0..1) of the
/// filler tokens, and the question; `context` tokens in all.
pub fn needle_prompt(
    tok: &Tokenizer,
    filler: &[u32],
    context: usize,
    depth: f64,
    passkey: u32,
) -> Result<Vec<u32>> {
    let intro = tok.encode(INTRO)?;
    let needle = tok.encode(&needle_sentence(passkey))?;
    let question = tok.encode(QUESTION)?;
    let fixed = intro.len() + needle.len() + question.len();
    if context <= fixed {
        bail!("--context {context} is too short: the intro, needle and question alone take {fixed} tokens");
    }
    let n_filler = context - fixed;
    if filler.len() < n_filler {
        bail!(
            "--context {context} needs {n_filler} filler tokens; the filler text has {}",
            filler.len()
        );
    }
    let at = ((n_filler as f64) * depth.clamp(0.0, 1.0)).round() as usize;
    let mut ids = intro;
    ids.extend_from_slice(&filler[..at]);
    ids.extend_from_slice(&needle);
    ids.extend_from_slice(&filler[at..n_filler]);
    ids.extend_from_slice(&question);
    Ok(ids)
}

/// Whether the answer retrieves the key: its first number is the pass key.
pub fn retrieved(answer: &str, passkey: u32) -> bool {
    let digits: String = answer
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits == passkey.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_keys_and_grading() {
        let a = passkey(0, 0);
        assert!((10_000..100_000).contains(&a));
        assert_ne!(a, passkey(0, 1));
        assert_eq!(a, passkey(0, 0));
        assert!(retrieved(" 48213. Remember", 48213));
        assert!(!retrieved(" 4821", 48213));
        assert!(!retrieved(" 482135", 48213));
        assert!(!retrieved(" unknown", 48213));
    }
}
