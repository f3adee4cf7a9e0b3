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
    /// Serve the OpenAI chat and completions API over HTTP.
    #[cfg(feature = "server")]
    Serve(cli::serve::ServeArgs),
    /// Write every kernel module sieve assembles, for other WGSL compilers.
    Shaders(cli::shaders::ShadersArgs),
}

/// Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid or not set in the
/// environment." while adapters are enumerated when the variable is missing
/// (a server, a container, CI), which reads like a failure. With no
/// XDG_RUNTIME_DIR, sieve points it at a private folder of its own
/// (`$TMPDIR/sieve-runtime-UID`, mode 0700) before any GPU call.
#[cfg(unix)]
fn private_runtime_dir() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| !d.is_empty()) {
        return;
    }
    let Ok(uid) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("sieve-runtime-{uid}"));
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    // Only a folder of ours that nobody else can enter.
    let ok = std::fs::symlink_metadata(&dir)
        .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0);
    if ok {
        // Single-threaded here: nothing else reads the environment yet.
        std::env::set_var("XDG_RUNTIME_DIR", &dir);
    }
}

#[cfg(not(unix))]
fn private_runtime_dir() {}

fn main() {
    private_runtime_dir();
    let cli = Cli::parse();
    // Ctrl-C or a kill: remove what is half written (temporary output files,
    // a partial converted model) before exiting with the shell's status for
    // an interrupt. The server handles both itself: it drains its requests.
    #[cfg(feature = "server")]
    let serving = matches!(cli.command, Command::Serve(_));
    #[cfg(not(feature = "server"))]
    let serving = false;
    if !serving {
        let _ = ctrlc::set_handler(|| {
            sieve::files::remove_unfinished();
            std::process::exit(130);
        });
    }
    let result = match cli.command {
        Command::Run(a) => cli::run::main(a),
        Command::Tokenize(a) => cli::tokenize::main(a),
        Command::Shaders(a) => cli::shaders::main(a),
        Command::Logits(a) => cli::logits::main(a),
        Command::Info(a) => cli::info::main(a),
        Command::Bench(a) => cli::bench::main(a),
        Command::ConvertGguf(a) => cli::convert::main(a),
        Command::Eval(a) => cli::eval::main(a),
        #[cfg(feature = "server")]
        Command::Serve(a) => cli::serve::main(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
