//! `kiln`: serve a model over gRPC, generate text, tokenize, and describe a model from the
//! command line.

mod args;
mod cli;
mod export;
mod generate;
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
use kiln_engine::{BuildError, Checkpoint, EngineOptions, KvSize, StartError, error_chain};
use kiln_kv::KvDtype;
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
    let c = open(&args.model.model, LoadOptions::default())?;
    let ids = c
        .tokenizer()
        .encode(&args.text)
        .map_err(|e| error_chain(&e))?;
    println!("{}", serde_json::json!({ "ids": ids }));
    Ok(())
}

fn info(args: &InfoArgs) -> CmdResult {
    let path = &args.model.model;
    let c = open(path, LoadOptions::default())?;
    let cfg = c.config();
    let dev = device(&args.device)?;
    println!("model: {path}");
    println!("device: {}", dev.info());
    println!("config: {cfg:#?}");
    println!("attention: {}", cfg.attention_summary());
    if let Some(moe) = &cfg.moe {
        println!("experts: {}", moe.summary(cfg.layers));
    }
    let weights = c.files().stored_bytes();
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "weights: {weights} bytes ({:.1} MiB) as stored",
        mib(weights)
    );
    // `--cpu-moe` / `--n-cpu-moe`: which layers' experts stay in host memory, and the bytes
    // on each side.
    let placement = args.device.cpu_moe();
    if cfg.moe.is_some() && placement != kiln_model::CpuMoe::Off {
        let on_cpu = |l: usize| cfg.sparse_layer(l) && placement.covers(l);
        let layers = (0..cfg.layers).filter(|&l| on_cpu(l)).count();
        let host = c.files().stored_expert_bytes(on_cpu);
        if dev.is_cpu() {
            println!("experts: on the CPU with everything else (the device is the CPU)");
        } else {
            println!(
                "split: the experts of {layers} of {} layers on the CPU, {host} bytes ({:.1} MiB) \
                 in host memory; {} bytes ({:.1} MiB) on the device",
                cfg.layers,
                mib(host),
                weights - host,
                mib(weights - host)
            );
        }
    }
    // The pool `kiln serve --kv-cache-memory` would plan (its other defaults).
    let opts = EngineOptions {
        kv_size: KvSize::Bytes(args.kv_cache_memory),
        ..EngineOptions::new(dev)
    };
    let plan = opts.kv_plan(cfg).map_err(|e| build_error(&e, path, None))?;
    println!("kv cache: {}", plan.explain());
    // What `--kv-dtype` buys in the same memory.
    let capacity: Vec<String> = KvDtype::ALL
        .iter()
        .map(|&kv_dtype| {
            EngineOptions {
                kv_dtype,
                ..opts.clone()
            }
            .kv_plan(cfg)
            .map_or_else(
                |e| format!("{kv_dtype} {}", error_chain(&e)),
                |p| format!("{kv_dtype} {} tokens", p.num_tokens()),
            )
        })
        .collect();
    println!(
        "kv capacity in {} bytes by --kv-dtype: {}",
        args.kv_cache_memory,
        capacity.join(", ")
    );
    // What opening the model cost this process (its head and tokenizer, not the weights).
    match memory::peak_rss_bytes() {
        Some(b) => println!(
            "peak rss: {b} bytes ({:.1} MiB)",
            b as f64 / f64::from(1 << 20)
        ),
        None => println!("peak rss: not measured on this system"),
    }
    Ok(())
}

fn run(command: &Command) -> CmdResult {
    match command {
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Info(a) => info(a),
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
