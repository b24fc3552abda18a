//! `kiln`: serve a model over gRPC, generate text, tokenize, and describe a model from the
//! command line.

mod args;
mod cli;
mod export;
mod generate;
mod info;
mod memory;
mod perplexity;
mod serve;
mod speculative;

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use args::{DeviceArgs, LoadArgs, ModelArgs, Quantize, WeightDtype};
use cli::Command;
use kiln_engine::{BuildError, Checkpoint, KvSize, StartError, error_chain};
use kiln_model::LoadOptions;
use kiln_tensor::{DType, Device, DeviceOptions};

/// A failure worth one line on stderr.
type CmdResult = Result<(), String>;

/// `--dtype f16|f32` and `--quantize q8_0|q4_0|q4_1` (HF folders only).
pub(crate) fn load_options(args: &LoadArgs) -> LoadOptions {
    LoadOptions {
        dtype: args.dtype.map(|d| match d {
            WeightDtype::F16 => DType::F16,
            WeightDtype::F32 => DType::F32,
        }),
        quantize: args.quantize.map(|q| match q {
            Quantize::Q8_0 => DType::Q8_0,
            Quantize::Q4_0 => DType::Q4_0,
            Quantize::Q4_1 => DType::Q4_1,
        }),
    }
}

/// A `.gguf` file or a Hugging Face folder, opened: config and tokenizer read (quick), weights
/// not yet loaded. The error names the file and keeps its causes.
pub(crate) fn open(path: &str, options: LoadOptions) -> Result<Checkpoint, String> {
    Checkpoint::open(Path::new(path), options).map_err(|e| error_chain(&e))
}

/// A failed engine build in the words of the flags: the draft model's problems name
/// `--draft-model`, a pool that cannot exist names `--kv-cache-memory`, anything else the
/// target model's path. Every cause in the chain is kept.
pub(crate) fn build_error(e: &BuildError, target: &str, draft: Option<&str>) -> String {
    if let (BuildError::Start(start), Some(path)) = (e, draft) {
        match start.as_ref() {
            StartError::Draft(cause) => {
                return format!("--draft-model {path}: {}", error_chain(cause));
            }
            StartError::Config { field, reason } if *field == "draft_model" => {
                return format!("--draft-model {path}: {reason}");
            }
            _ => {}
        }
    }
    match (e, draft) {
        // The draft's file errors name the file themselves.
        (BuildError::Draft { source, .. }, Some(_)) => {
            format!("--draft-model: {}", error_chain(source.as_ref()))
        }
        (
            BuildError::KvPlan {
                size: KvSize::Bytes(bytes),
                source,
            },
            _,
        ) => format!("--kv-cache-memory {bytes}: {}", error_chain(source)),
        // These name their file themselves.
        (BuildError::Model(_) | BuildError::Tokenizer { .. } | BuildError::Weights { .. }, _) => {
            error_chain(e)
        }
        _ => format!("{target}: {}", error_chain(e)),
    }
}

pub(crate) fn device(args: &DeviceArgs) -> Result<Device, String> {
    Device::new(&DeviceOptions {
        backend: args.backend,
        threads: args.threads.map(|n| n as usize),
        kernels: args.kernels,
        ..DeviceOptions::default()
    })
    .map_err(|e| error_chain(&e))
}

/// `kiln tokenize`.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to tokenize
    #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
    pub text: String,
}

fn tokenize(args: &TokenizeArgs) -> CmdResult {
    let c = open(&args.model.model, LoadOptions::default())?;
    let ids = c
        .tokenizer()
        .encode(&args.text)
        .map_err(|e| error_chain(&e))?;
    println!("{}", serde_json::json!({ "ids": ids }));
    Ok(())
}

fn run(command: &Command) -> CmdResult {
    match command {
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Info(a) => info::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::ExportHf(a) => export::run(a),
    }
}

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let cli = match cli::parse(&argv) {
        Ok(cli) => cli,
        // `--help`, `--version`: stdout, exit 0.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("kiln: {}", cli::message(&e, &argv));
            return ExitCode::FAILURE;
        }
    };
    // A server logs what it does; the one-shot commands only warn.
    let default_level = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(&cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("kiln: {e}");
            ExitCode::FAILURE
        }
    }
}
