//! The `sieve` command line.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "sieve",
    version,
    about = "LLM inference on wgpu with a bounded KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text (chat template applied unless --raw).
    Run(cli::run::RunArgs),
    /// Print the token ids of a text.
    Tokenize(cli::tokenize::TokenizeArgs),
    /// Write the logits of the last position of a token sequence as .npy.
    Logits(cli::logits::LogitsArgs),
    /// Show the GPU adapter, driver, features and limits.
    Info(cli::info::InfoArgs),
    /// Measure prefill and decode speed, bandwidth and memory.
    Bench(cli::bench::BenchArgs),
    /// Convert a GGUF file into a Hugging Face model directory.
    ConvertGguf(cli::convert::ConvertArgs),
    /// Measure eviction quality: fidelity, generation, needle, tasks, explain.
    Eval(cli::eval::EvalArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => cli::run::main(a),
        Command::Tokenize(a) => cli::tokenize::main(a),
        Command::Logits(a) => cli::logits::main(a),
        Command::Info(a) => cli::info::main(a),
        Command::Bench(a) => cli::bench::main(a),
        Command::ConvertGguf(a) => cli::convert::main(a),
        Command::Eval(a) => cli::eval::main(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
