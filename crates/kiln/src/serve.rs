//! `kiln serve`: bind the gRPC server at once (health NOT_SERVING), load the model and start the
//! engine, warm up, serve; SIGTERM or Ctrl-C drains and exits 0.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use kiln_engine::{Engine, EngineConfig, EngineHandle};
use kiln_kv::{KvBudget, KvDtype, KvPlan, KvPlanConfig};
use kiln_model::Model;
use kiln_scheduler::SchedulerConfig;
use kiln_server::{Server, ServerConfig};

use crate::cli::Args;

pub const FLAGS: &[&str] = &[
    "model",
    "model-id",
    "listen",
    "metrics-listen",
    "backend",
    "kv-cache-memory",
    "kv-dtype",
    "block-size",
    "max-num-seqs",
    "max-num-batched-tokens",
    "max-waiting",
    "max-model-len",
    "max-new-tokens",
    "default-max-new-tokens",
    "api-key",
    "drain-timeout",
    "dtype",
    "quantize",
];

const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
const DEFAULT_METRICS: &str = "127.0.0.1:9464";
/// 512 MiB of K/V: ~22k tokens of the default model at f16.
const DEFAULT_KV_BYTES: u64 = 512 << 20;

fn addr(args: &Args, flag: &str, default: &str) -> Result<Option<SocketAddr>, String> {
    let v = args.get(flag).unwrap_or(default);
    if v == "off" {
        return Ok(None);
    }
    v.parse()
        .map(Some)
        .map_err(|e| format!("--{flag} {v}: {e} (expected HOST:PORT, e.g. {default})"))
}

/// Everything `serve` was told, checked before any work starts.
struct Plan {
    path: String,
    listen: SocketAddr,
    metrics: Option<SocketAddr>,
    server: ServerConfig,
    kv_bytes: u64,
    kv_dtype: KvDtype,
    block_size: u32,
    max_num_seqs: Option<usize>,
    max_num_batched_tokens: Option<usize>,
    max_waiting: Option<usize>,
    max_model_len: Option<usize>,
    speculative: Option<kiln_engine::SpeculativeConfig>,
}

fn plan(args: &Args) -> Result<Plan, String> {
    let path = args.required("model")?.to_owned();
    let model_id = match args.get("model-id") {
        Some(id) => id.to_owned(),
        None => Path::new(&path)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.clone()),
    };
    let mut server = ServerConfig::new(model_id);
    server.api_key = args
        .get("api-key")
        .map(str::to_owned)
        .or_else(|| std::env::var("KILN_API_KEY").ok())
        .filter(|k| !k.is_empty());
    if let Some(n) = args.parsed::<usize>("max-new-tokens")? {
        server.max_new_tokens = Some(n);
    }
    if let Some(n) = args.parsed::<usize>("default-max-new-tokens")? {
        server.default_max_new_tokens = n;
    }
    if let Some(s) = args.parsed::<f64>("drain-timeout")? {
        if !(s.is_finite() && s >= 0.0) {
            return Err(format!("--drain-timeout {s}: expected seconds >= 0"));
        }
        server.drain_timeout = Duration::from_secs_f64(s);
    }
    let kv_dtype = match args.get("kv-dtype").unwrap_or("f16") {
        "f16" => KvDtype::F16,
        "f32" => KvDtype::F32,
        "int8" => KvDtype::Int8,
        other => return Err(format!("--kv-dtype {other}: expected f16, f32 or int8")),
    };
    Ok(Plan {
        listen: addr(args, "listen", DEFAULT_LISTEN)?
            .ok_or("--listen off: the gRPC server needs an address")?,
        metrics: addr(args, "metrics-listen", DEFAULT_METRICS)?,
        server,
        kv_bytes: args
            .parsed::<u64>("kv-cache-memory")?
            .unwrap_or(DEFAULT_KV_BYTES),
        kv_dtype,
        block_size: args.parsed::<u32>("block-size")?.unwrap_or(16),
        max_num_seqs: args.parsed("max-num-seqs")?,
        max_num_batched_tokens: args.parsed("max-num-batched-tokens")?,
        max_waiting: args.parsed("max-waiting")?,
        max_model_len: args.parsed("max-model-len")?,
        speculative: crate::speculative::config(args)?,
        path,
    })
}

/// Uploads the weights and starts the engine (blocking: runs off the async workers).
fn start_engine(
    l: crate::Loaded,
    dev: kiln_tensor::Device,
    p: &Plan,
    args: &Args,
) -> Result<EngineHandle, String> {
    let start = Instant::now();
    let crate::Loaded {
        files,
        cfg,
        tokenizer,
    } = l;
    let model = Model::load(&dev, cfg.clone(), files.weights()).map_err(|e| e.to_string())?;
    drop(files);
    let kv = KvPlan::new(&KvPlanConfig {
        shape: cfg.kv_shape(p.kv_dtype),
        block_size: p.block_size,
        max_seq_len: p.max_model_len.unwrap_or(cfg.max_position),
        budget: KvBudget::Bytes(p.kv_bytes),
    })
    .map_err(|e| format!("--kv-cache-memory {}: {e}", p.kv_bytes))?;
    tracing::info!(
        weights_mib = model.weight_bytes() as f64 / f64::from(1 << 20),
        device = %dev.info(),
        kv = %kv.explain(),
        ms = start.elapsed().as_millis() as u64,
        "model loaded"
    );
    let mut sched = SchedulerConfig::new(kv.block_manager_config());
    if let Some(n) = p.max_num_seqs {
        sched.max_num_seqs = n;
    }
    if let Some(n) = p.max_num_batched_tokens {
        sched.max_num_batched_tokens = n;
    }
    if let Some(n) = p.max_waiting {
        sched.max_waiting = n;
    }
    let mut ecfg = EngineConfig::new(sched);
    ecfg.kv_dtype = p.kv_dtype;
    ecfg.max_model_len = p.max_model_len;
    ecfg.speculative = p.speculative;
    let draft = crate::speculative::draft(args, &dev)?;
    if let Some(s) = &p.speculative {
        tracing::info!(method = ?s.method, k = s.num_tokens, off_above = s.disable_batch_size, "speculative decoding");
    }
    Engine::start_with_draft(model, tokenizer, ecfg, draft)
        .map_err(|e| crate::speculative::start_error(args, &p.path, &e))
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: draining"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the server");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("Ctrl-C: draining");
    }
}

pub fn run(args: &Args) -> Result<(), String> {
    let mut p = plan(args)?;
    // The quick part first, so a bad path or flag fails before anything listens: the config and
    // tokenizer (the weights are read later, while health already answers NOT_SERVING).
    let loaded = crate::load(&p.path, crate::load_options(args)?)?;
    p.server.architecture = loaded.cfg.arch.name().to_owned();
    let dev = crate::device(args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kiln-server")
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let result = rt.block_on(async move {
        let server = Server::bind(p.listen, p.metrics, p.server.clone())
            .await
            .map_err(|e| e.to_string())?;
        // One line on stdout that scripts (and tests binding port 0) can read.
        println!(
            "kiln: listening on {} (metrics: {})",
            server.local_addr(),
            server
                .metrics_addr()
                .map_or("off".to_owned(), |a| format!("http://{a}/metrics"))
        );
        let _ = std::io::Write::flush(&mut std::io::stdout());
        let args = args.clone();
        let load = tokio::task::spawn_blocking(move || start_engine(loaded, dev, &p, &args));
        let engine = tokio::select! {
            r = load => r.map_err(|e| format!("model loading stopped: {e}")).and_then(|r| r),
            () = stop_signal() => {
                server.shutdown().await;
                return Ok(());
            }
        };
        let engine = match engine {
            Ok(e) => e,
            Err(e) => {
                server.shutdown().await;
                return Err(e);
            }
        };
        if let Err(e) = server.attach(engine).await {
            server.shutdown().await;
            return Err(e.to_string());
        }
        stop_signal().await;
        server.shutdown().await;
        Ok(())
    });
    // A model still loading when a signal came is not waited for.
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}
