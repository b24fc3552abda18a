//! `kiln serve`: bind the gRPC server and the OpenAI-compatible HTTP one at once (health
//! NOT_SERVING / 503), load the model and start the engine, warm up, serve both from the same
//! engine; SIGTERM or Ctrl-C drains and exits 0 (a second one during the drain exits at once,
//! non-zero).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_api::{ApiConfig, MetricsCompat, ReasoningParser, Serving, ServingConfig};
use kiln_engine::{EngineOptions, error_chain};
use kiln_http::HttpServer;
use kiln_server::{KvEventPublisher, KvEventsConfig, Server, ServerConfig};
use kiln_tensor::Device;
use kiln_tokenizer::ChatTemplate;

use crate::args::{DeviceArgs, EngineArgs, LoadArgs, ModelArgs, SpeculativeArgs};

const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
const DEFAULT_METRICS: &str = "127.0.0.1:9464";
const DEFAULT_HTTP: &str = "127.0.0.1:8000";

/// `kiln serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    /// The model's name in requests and model info [default: the file name without extension];
    /// repeat it for aliases (listed by /v1/models; replies carry the first), so agents that
    /// send their own model names are served
    #[arg(long, value_name = "NAME")]
    pub model_id: Vec<String>,
    /// gRPC address
    #[arg(long, value_name = "HOST:PORT", default_value = DEFAULT_LISTEN, value_parser = listen_addr)]
    pub listen: SocketAddr,
    /// Prometheus address (/metrics), or off
    #[arg(
        long,
        value_name = "HOST:PORT|off",
        default_value = DEFAULT_METRICS,
        value_parser = metrics_addr
    )]
    pub metrics_listen: MaybeAddr,
    /// HTTP address (OpenAI's /v1/chat/completions, /v1/completions, /v1/responses and
    /// /v1/models; Anthropic's /v1/messages; /health, /version, /metrics), or off
    #[arg(
        long,
        value_name = "HOST:PORT|off",
        default_value = DEFAULT_HTTP,
        value_parser = http_addr
    )]
    pub http_listen: MaybeAddr,
    /// Metric names exported besides kiln's own: `vllm` adds vLLM's (`vllm:num_requests_waiting`,
    /// `vllm:kv_cache_usage_perc`, ...) for routers and dashboards built for vLLM
    #[arg(long, value_name = "vllm|off", default_value = "vllm", value_parser = metrics_compat)]
    pub metrics_compat: Compat,
    /// Publish prefix-cache events (vLLM's ZMQ format) for KV-aware routers: `tcp://*:PORT`
    /// binds, `tcp://HOST:PORT` connects (llm-d's scheduler binds; engine pods connect). The
    /// router's block size must equal `--block-size`
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub kv_events_endpoint: Option<String>,
    /// Answer replay requests for missed KV-event messages here (`tcp://*:PORT`, a ROUTER
    /// socket) [default: no replay]
    #[arg(long, value_name = "tcp://*:PORT", requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<String>,
    /// First frame of every KV-event message (llm-d reads `kv@POD_IP@MODEL`) [default: empty]
    #[arg(
        long,
        value_name = "TOPIC",
        default_value = "",
        requires = "kv_events_endpoint"
    )]
    pub kv_events_topic: String,
    /// Chat template for chat requests, over the model's own: a Jinja file, or a JSON file
    /// with a `chat_template` field (as transformers reads them)
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Read special-token spellings (`<|im_start|>`) inside chat message content as control
    /// tokens; by default they stay the plain text the user typed, so no one can forge a turn
    #[arg(long)]
    pub allow_special_tokens_in_content: bool,
    /// Every kiln.v1 and /v1/ call must carry `authorization: Bearer KEY` or `x-api-key: KEY`
    /// (empty: no key)
    #[arg(
        long,
        value_name = "KEY",
        env = "KILN_API_KEY",
        hide_env_values = true,
        allow_hyphen_values = true
    )]
    pub api_key: Option<String>,
    /// Most new tokens a request may ask for [default: up to the context]
    #[arg(long, value_name = "N")]
    pub max_new_tokens: Option<usize>,
    /// New tokens for a request that names no limit, on every door [default: each API's own:
    /// 256 on gRPC, 16 on /v1/completions, up to the context on chat, Responses and Messages]
    #[arg(long, value_name = "N")]
    pub default_max_new_tokens: Option<usize>,
    /// Split `<think>…</think>` from replies (vLLM's names): `reasoning_content` on chat
    /// completions, a `reasoning` item on Responses, a `thinking` block on Messages,
    /// `SequenceOutput.reasoning` on gRPC
    #[arg(long, value_name = "deepseek_r1|qwen3")]
    pub reasoning_parser: Option<ReasoningParser>,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (0: none kept)
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub responses_store: usize,
    /// On SIGTERM or Ctrl-C, how long running requests may finish [default: 30]
    #[arg(long, value_name = "SECONDS", value_parser = seconds)]
    pub drain_timeout: Option<Duration>,
    // The groups with a heading of their own come last: a heading holds for the flags after it.
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

/// A `HOST:PORT` address, or none (`off`).
#[derive(Debug, Clone, Copy)]
pub struct MaybeAddr(pub Option<SocketAddr>);

fn addr(v: &str, default: &str) -> Result<SocketAddr, String> {
    v.parse()
        .map_err(|e| format!("{e} (expected HOST:PORT, e.g. {default})"))
}

fn listen_addr(v: &str) -> Result<SocketAddr, String> {
    if v == "off" {
        return Err("the gRPC server needs an address".into());
    }
    addr(v, DEFAULT_LISTEN)
}

fn metrics_addr(v: &str) -> Result<MaybeAddr, String> {
    if v == "off" {
        return Ok(MaybeAddr(None));
    }
    addr(v, DEFAULT_METRICS).map(|a| MaybeAddr(Some(a)))
}

fn http_addr(v: &str) -> Result<MaybeAddr, String> {
    if v == "off" {
        return Ok(MaybeAddr(None));
    }
    addr(v, DEFAULT_HTTP).map(|a| MaybeAddr(Some(a)))
}

/// `--metrics-compat`: whether vLLM's metric names are exported too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compat {
    Off,
    Vllm,
}

fn metrics_compat(v: &str) -> Result<Compat, String> {
    match v {
        "vllm" => Ok(Compat::Vllm),
        "off" => Ok(Compat::Off),
        _ => Err("expected vllm or off".into()),
    }
}

fn seconds(v: &str) -> Result<Duration, String> {
    let s = v.parse::<f64>().map_err(|e| e.to_string())?;
    Duration::try_from_secs_f64(s).map_err(|e| format!("expected seconds >= 0 ({e})"))
}

/// Everything `serve` was told, checked before any work starts.
struct Plan {
    path: String,
    listen: SocketAddr,
    metrics: Option<SocketAddr>,
    http: Option<SocketAddr>,
    server: ServerConfig,
    engine: EngineOptions,
    serving: ServingConfig,
    /// Where prefix-cache events go (`--kv-events-endpoint`), when anywhere.
    kv_events: Option<KvEventsConfig>,
}

fn plan(args: &ServeArgs) -> Result<Plan, String> {
    let path = args.model.model.clone();
    let model_ids = if args.model_id.is_empty() {
        vec![
            Path::new(&path)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| path.clone()),
        ]
    } else {
        args.model_id.clone()
    };
    let chat_template = match &args.chat_template {
        None => None,
        Some(path) => Some(Arc::new(ChatTemplate::from_file(path).map_err(|e| {
            format!("--chat-template {}: {}", path.display(), error_chain(&e))
        })?)),
    };
    let mut api = ApiConfig::new(String::new());
    api.model_ids = model_ids;
    api.api_key = args.api_key.clone().filter(|k| !k.is_empty());
    api.chat_template = chat_template;
    api.special_tokens_in_content = args.allow_special_tokens_in_content;
    api.max_tokens = args.max_new_tokens;
    api.default_max_tokens = args.default_max_new_tokens;
    api.reasoning = args.reasoning_parser;
    api.responses_store = args.responses_store;
    let metrics_compat = match args.metrics_compat {
        Compat::Off => MetricsCompat::Off,
        Compat::Vllm => MetricsCompat::Vllm {
            model_name: api.model_id().to_owned(),
        },
    };
    let server = ServerConfig::with(api);
    // The device is opened once the model's files check out (see `run`).
    let mut engine = EngineOptions::new(Device::Reference);
    args.engine.apply(&mut engine);
    crate::speculative::apply(&args.speculative, &mut engine)?;
    let kv_events = match &args.kv_events_endpoint {
        None => None,
        Some(endpoint) => {
            let cfg = KvEventsConfig {
                replay_endpoint: args.kv_events_replay_endpoint.clone(),
                topic: args.kv_events_topic.clone(),
                ..KvEventsConfig::new(endpoint.clone(), engine.block_size as usize)
            };
            // A malformed endpoint fails now, before the model loads.
            cfg.check().map_err(|e| error_chain(&e))?;
            Some(cfg)
        }
    };
    engine.kv_events = kv_events.is_some();
    let defaults = ServingConfig::default();
    let serving = ServingConfig {
        drain_timeout: args.drain_timeout.unwrap_or(defaults.drain_timeout),
        metrics_compat,
        ..defaults
    };
    Ok(Plan {
        serving,
        kv_events,
        listen: args.listen,
        metrics: args.metrics_listen.0,
        http: args.http_listen.0,
        server,
        engine,
        path,
    })
}

/// The gRPC server and the HTTP one, over one `Serving`.
struct FrontDoors {
    server: Server,
    http: Option<HttpServer>,
}

impl FrontDoors {
    /// One drain (both refuse new work at once), then both listeners close.
    async fn shutdown(&self) {
        match &self.http {
            Some(http) => {
                tokio::join!(self.server.shutdown(), http.shutdown());
            }
            None => self.server.shutdown().await,
        }
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C), with the signal's name.
async fn stop_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = tokio::signal::ctrl_c() => "SIGINT",
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the server");
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

pub fn run(args: &ServeArgs) -> Result<(), String> {
    let mut p = plan(args)?;
    // The quick part first, so a bad path or flag fails before anything listens: the config and
    // tokenizer (the weights are read later, while health already answers NOT_SERVING).
    let checkpoint = crate::open(&p.path, crate::load_options(&args.load))?;
    p.server.architecture = checkpoint.config().arch_name().to_owned();
    p.engine.device = crate::device(&args.device)?;
    p.engine.cpu_experts = args.device.cpu_experts()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kiln-server")
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let kv_events = p.kv_events.take();
    let result = rt.block_on(async move {
        let serving = Arc::new(Serving::new(p.serving));
        let server = Server::bind_with(p.listen, p.metrics, p.server.clone(), serving.clone())
            .await
            .map_err(|e| error_chain(&e))?;
        let http = match p.http {
            None => None,
            Some(addr) => Some(
                HttpServer::bind(addr, serving, p.server.api.clone())
                    .await
                    .map_err(|e| error_chain(&e))?,
            ),
        };
        let front = FrontDoors { server, http };
        // One line on stdout that scripts (and tests binding port 0) can read.
        println!(
            "kiln: listening on {} (metrics: {}, http: {})",
            front.server.local_addr(),
            front
                .server
                .metrics_addr()
                .map_or("off".to_owned(), |a| format!("http://{a}/metrics")),
            front
                .http
                .as_ref()
                .map_or("off".to_owned(), |h| format!("http://{}", h.local_addr()))
        );
        let _ = std::io::Write::flush(&mut std::io::stdout());
        // Uploading the weights blocks: off the async workers.
        let draft = args.speculative.draft_model.clone();
        let load = tokio::task::spawn_blocking(move || {
            kiln_engine::build(checkpoint, &p.engine, &mut |_, _| {})
                .map(|b| b.engine)
                .map_err(|e| crate::build_error(&e, &p.path, draft.as_deref()))
        });
        let engine = tokio::select! {
            r = load => r.map_err(|e| format!("model loading stopped: {e}")).and_then(|r| r),
            signal = stop_signal() => {
                tracing::info!("{signal}: draining");
                front.shutdown().await;
                return Ok(());
            }
        };
        let engine = match engine {
            Ok(e) => e,
            Err(e) => {
                front.shutdown().await;
                return Err(e);
            }
        };
        // Before the warm-up, so a router hears of every block from the first.
        let kv_events = match (kv_events, engine.kv_events()) {
            (Some(cfg), Some(events)) => match KvEventPublisher::start(cfg, events).await {
                Ok(p) => Some(p),
                Err(e) => {
                    front.shutdown().await;
                    return Err(error_chain(&e));
                }
            },
            _ => None,
        };
        if let Err(e) = front.server.attach(engine).await {
            front.shutdown().await;
            return Err(error_chain(&e));
        }
        // An engine that stops on its own (its steps kept failing: a lost device) ends the
        // process non-zero, so an orchestrator restarts it.
        let engine_stopped = async {
            while front.server.engine().is_some_and(|e| !e.is_stopped()) {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        };
        let signal = tokio::select! {
            signal = stop_signal() => signal,
            () = engine_stopped => {
                tracing::error!("the engine stopped on its own: exiting");
                front.shutdown().await;
                return Err("the engine stopped (see the log): exiting for a restart".to_owned());
            }
        };
        tracing::info!("{signal}: draining");
        // A second signal during the drain means now: what is still running is dropped.
        let drained = tokio::select! {
            () = front.shutdown() => Ok(()),
            signal = stop_signal() => {
                tracing::warn!("{signal} again: stopping without finishing the drain");
                Err(format!("{signal} during the drain: stopped without finishing it"))
            }
        };
        // The engine has stopped: the publisher sends what it still holds, then ends.
        if let Some(p) = kv_events {
            let _ = tokio::time::timeout(Duration::from_secs(1), p.finished()).await;
        }
        drained
    });
    // A model still loading when a signal came is not waited for.
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}
