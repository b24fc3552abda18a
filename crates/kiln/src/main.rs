//! `kiln`: serve a model over gRPC, generate text, tokenize, and describe a model from the
//! command line.

mod args;
mod cli;
mod generate;
mod serve;
mod speculative;

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use args::{DeviceArgs, LoadArgs, ModelArgs, Quantize, WeightDtype};
use cli::Command;
use kiln_kv::{KvBudget, KvDtype, KvPlan, KvPlanConfig};
use kiln_model::{LoadOptions, ModelConfig, ModelFiles, ModelSource};
use kiln_tensor::{DType, Device, DeviceOptions};
use kiln_tokenizer::Tokenizer;

/// A failure worth one line on stderr.
type CmdResult = Result<(), String>;

/// The model's files, its config and its tokenizer.
pub(crate) struct Loaded {
    pub files: ModelFiles,
    pub cfg: ModelConfig,
    pub tokenizer: Tokenizer,
}

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

/// A `.gguf` file or a Hugging Face folder.
pub(crate) fn load(path: &str, options: LoadOptions) -> Result<Loaded, String> {
    let files = ModelFiles::open(Path::new(path), options).map_err(|e| e.to_string())?;
    let tokenizer = match files.source() {
        ModelSource::Gguf(g) => Tokenizer::from_gguf_metadata(g.file().metadata())
            .map_err(|e| format!("{path}: {e}"))?,
        ModelSource::Hf { dir, .. } => {
            Tokenizer::from_hf_dir(dir).map_err(|e| format!("{path}: {e}"))?
        }
    };
    Ok(Loaded {
        cfg: files.config().clone(),
        files,
        tokenizer,
    })
}

pub(crate) fn device(args: &DeviceArgs) -> Result<Device, String> {
    Device::new(&DeviceOptions {
        backend: args.backend,
        ..DeviceOptions::default()
    })
    .map_err(|e| e.to_string())
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

/// `kiln info`.
#[derive(Debug, Clone, clap::Args)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// K/V cache memory in bytes to plan for
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 30)]
    pub kv_cache_memory: u64,
}

fn tokenize(args: &TokenizeArgs) -> CmdResult {
    let l = load(&args.model.model, LoadOptions::default())?;
    let ids = l.tokenizer.encode(&args.text).map_err(|e| e.to_string())?;
    println!("{}", serde_json::json!({ "ids": ids }));
    Ok(())
}

fn info(args: &InfoArgs) -> CmdResult {
    let path = &args.model.model;
    let l = load(path, LoadOptions::default())?;
    let cfg = &l.cfg;
    let budget = args.kv_cache_memory;
    let dev = device(&args.device)?;
    println!("model: {path}");
    println!("device: {}", dev.info());
    println!("config: {cfg:#?}");
    let weights = l.files.stored_bytes();
    println!(
        "weights: {weights} bytes ({:.1} MiB) as stored",
        weights as f64 / (1 << 20) as f64
    );
    let plan = KvPlan::new(&KvPlanConfig {
        shape: cfg.kv_shape(KvDtype::F16),
        block_size: 16,
        max_seq_len: cfg.max_position,
        budget: KvBudget::Bytes(budget),
    })
    .map_err(|e| format!("--kv-cache-memory {budget}: {e}"))?;
    println!("kv cache: {}", plan.explain());
    Ok(())
}

fn run(command: &Command) -> CmdResult {
    match command {
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Info(a) => info(a),
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
