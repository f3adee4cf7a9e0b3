//! `sieve tokenize`: prints the token ids of a text, comma-separated.

use anyhow::Result;
use clap::Args;

use super::ModelArgs;
use sieve::tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text (used as is: no chat template).
    pub text: String,
}

pub fn main(a: TokenizeArgs) -> Result<()> {
    let tok = Tokenizer::for_model(&a.model.dir()?)?;
    let ids = tok.encode(&a.text)?;
    let s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    super::print_line(&s.join(","))
}
