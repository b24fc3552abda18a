//! Project automation, run as `cargo xtask <command>` (a cargo alias for this package).

mod bench;
mod fetch_model;
mod gpu_check;
mod hf_folder;
mod llama_cpp;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

/// A subcommand: its name, a one-line summary, and what runs it.
struct Command {
    name: &'static str,
    summary: &'static str,
    run: fn(&[String]) -> anyhow::Result<()>,
}

const COMMANDS: &[Command] = &[
    Command {
        name: "serve",
        summary: "serve the default model over gRPC (fetching it first when missing); extra flags go to `kiln serve`",
        run: serve::run,
    },
    Command {
        name: "bench",
        summary: "benchmarks on the default model: llama-bench style table, single stream, concurrency sweep, shared prefix, roofline, step profile and budget, vllm bench serve style serving over gRPC and HTTP; --compare llama-server|llama-cpp; --help lists the flags",
        run: bench::run,
    },
    Command {
        name: "gpu-check",
        summary: "bundle the GPU check (stripped kiln-bench, the Vulkan loader, run.sh) into target/gpu-check/ for a machine with a GPU; --run also runs it here",
        run: gpu_check::run_cmd,
    },
    Command {
        name: "llama-cpp",
        summary: "build llama.cpp's llama-server and llama-bench (CPU) into target/llama.cpp/bin from llama-cpp-python's sdist, for bench --compare llama-server",
        run: llama_cpp::run_cmd,
    },
    Command {
        name: "fetch-model",
        summary: "[NAME...|--all]: download known models into models/, size and SHA-256 checked: smollm2-135m (the default), gemma-3-270m; --hf also writes SmolLM2 as an HF folder; --help lists them",
        run: fetch_model::run,
    },
];

fn usage() -> String {
    let mut s = String::from("usage: cargo xtask <command> [args]\n\ncommands:\n");
    for c in COMMANDS {
        s.push_str(&format!("  {:<14} {}\n", c.name, c.summary));
    }
    s
}

/// The workspace root (the parent of this package's folder).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(name) = args.first() else {
        eprint!("{}", usage());
        return ExitCode::FAILURE;
    };
    if matches!(name.as_str(), "help" | "-h" | "--help") {
        print!("{}", usage());
        return ExitCode::SUCCESS;
    }
    let Some(command) = COMMANDS.iter().find(|c| c.name == name) else {
        eprint!("unknown command `{name}`\n\n{}", usage());
        return ExitCode::FAILURE;
    };
    match (command.run)(&args[1..]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
