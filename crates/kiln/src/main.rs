//! `kiln`: serve a model over gRPC, generate text, tokenize, and describe a model from the
//! command line.

mod cli;
mod generate;
mod serve;
mod speculative;

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use cli::{Args, USAGE};
use kiln_kv::{KvBudget, KvDtype, KvPlan, KvPlanConfig};
use kiln_model::{LoadOptions, ModelConfig, ModelFiles, ModelSource};
use kiln_tensor::{BackendChoice, DType, Device, DeviceOptions};
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
pub(crate) fn load_options(args: &Args) -> Result<LoadOptions, String> {
    let dtype = match args.get("dtype") {
        None => None,
        Some("f16") => Some(DType::F16),
        Some("f32") => Some(DType::F32),
        Some(other) => return Err(format!("--dtype {other}: expected f16 or f32")),
    };
    let quantize = match args.get("quantize") {
        None => None,
        Some("q8_0") => Some(DType::Q8_0),
        Some("q4_0") => Some(DType::Q4_0),
        Some("q4_1") => Some(DType::Q4_1),
        Some(other) => return Err(format!("--quantize {other}: expected q8_0, q4_0 or q4_1")),
    };
    Ok(LoadOptions { dtype, quantize })
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

pub(crate) fn device(args: &Args) -> Result<Device, String> {
    let backend = match args.get("backend") {
        Some(b) => b
            .parse::<BackendChoice>()
            .map_err(|e| format!("--backend: {e}"))?,
        None => BackendChoice::from_env().map_err(|e| format!("KILN_BACKEND: {e}"))?,
    };
    Device::new(&DeviceOptions {
        backend,
        ..DeviceOptions::default()
    })
    .map_err(|e| e.to_string())
}

fn tokenize(args: &Args) -> CmdResult {
    let path = args.required("model")?;
    let text = args.required("text")?;
    let l = load(path, LoadOptions::default())?;
    let ids = l.tokenizer.encode(text).map_err(|e| e.to_string())?;
    println!("{}", serde_json::json!({ "ids": ids }));
    Ok(())
}

fn info(args: &Args) -> CmdResult {
    let path = args.required("model")?;
    let l = load(path, LoadOptions::default())?;
    let cfg = &l.cfg;
    let budget = args.parsed::<u64>("kv-cache-memory")?.unwrap_or(1 << 30);
    let dev = device(args)?;
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

fn run(argv: &[String]) -> CmdResult {
    let Some(cmd) = argv.first() else {
        return Err(USAGE.to_string());
    };
    let rest = &argv[1..];
    match cmd.as_str() {
        "generate" => {
            let allowed = [
                "model",
                "prompt",
                "max-tokens",
                "temperature",
                "top-k",
                "top-p",
                "min-p",
                "repetition-penalty",
                "stop",
                "seed",
                "backend",
                "json",
                "chat",
                "dtype",
                "quantize",
            ];
            let allowed: Vec<&str> = allowed.iter().chain(speculative::FLAGS).copied().collect();
            generate::run(&Args::parse(cmd, rest, &allowed)?)
        }
        "serve" => {
            let allowed: Vec<&str> = serve::FLAGS
                .iter()
                .chain(speculative::FLAGS)
                .copied()
                .collect();
            serve::run(&Args::parse(cmd, rest, &allowed)?)
        }
        "tokenize" => tokenize(&Args::parse(cmd, rest, &["model", "text"])?),
        "info" => info(&Args::parse(
            cmd,
            rest,
            &["model", "backend", "kv-cache-memory"],
        )?),
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n{USAGE}")),
    }
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    // A server logs what it does; the one-shot commands only warn.
    let default_level = if argv.first().is_some_and(|c| c == "serve") {
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
    match run(&argv) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("kiln: {e}");
            ExitCode::FAILURE
        }
    }
}
