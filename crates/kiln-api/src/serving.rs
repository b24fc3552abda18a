//! What the front doors of one process (gRPC, HTTP) share: the engine once it is loaded and
//! warmed up, one drain, one health verdict, and one count of API calls by protocol, endpoint
//! and status code. Each front door maps [`NotServing`] and [`Health`] to its own statuses.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::OnceCell;

use kiln_engine::{EngineError, EngineHandle, Request, ShutdownMode};

/// Which names besides kiln's own the metrics exposition carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum MetricsCompat {
    /// kiln's names only.
    #[default]
    Off,
    /// Also vLLM's (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, ...), labelled
    /// with this `model_name`, for routers and dashboards built for vLLM.
    Vllm { model_name: String },
}

/// How the front doors drain and when they call the engine stuck.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingConfig {
    /// How long a drain lets requests in flight finish before cancelling them.
    pub drain_timeout: Duration,
    /// A step running longer than this makes health report [`Health::Stuck`].
    pub stuck_after: Duration,
    /// After the drain, how long open connections (a `Health.Watch` stream, an idle
    /// keep-alive) get to close before they are dropped: a shutdown takes at most
    /// `drain_timeout` plus this.
    pub close_grace: Duration,
    /// Metric names exported besides kiln's own.
    pub metrics_compat: MetricsCompat,
}

impl Default for ServingConfig {
    fn default() -> Self {
        Self {
            drain_timeout: Duration::from_secs(30),
            // A long prefill on a slow device takes seconds; a minute means a hung device.
            stuck_after: Duration::from_secs(60),
            close_grace: Duration::from_secs(1),
            metrics_compat: MetricsCompat::Off,
        }
    }
}

/// Where the process stands, for health endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// No engine attached yet (weights loading, warm-up running).
    Loading,
    Serving,
    /// A drain began: new work is refused.
    Draining,
    /// The step loop stopped on its own, or one step has run longer than
    /// [`ServingConfig::stuck_after`].
    Stuck,
}

impl Health {
    /// As health endpoints say it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Loading => "loading",
            Self::Serving => "serving",
            Self::Draining => "draining",
            Self::Stuck => "stuck",
        }
    }
}

/// Why new work is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotServing {
    #[error("the model is still loading")]
    Loading,
    #[error("the server is draining and takes no new requests")]
    Draining,
}

/// Why [`Serving::attach`] failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("warm-up request failed")]
    Warmup(#[source] EngineError),
    #[error("a model is already attached")]
    AlreadyAttached,
}

/// Which protocol a front door speaks, as the call counter labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    Http,
}

impl Protocol {
    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Grpc => "grpc",
            Self::Http => "http",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    /// `grpc` or `http`.
    protocol: &'static str,
    /// The request path (`/kiln.v1.Generation/Generate`, `/v1/chat/completions`).
    endpoint: String,
    /// The protocol's own status (a gRPC code name, an HTTP status number).
    code: String,
}

/// The state every front door of one process reads: cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct Serving {
    cfg: ServingConfig,
    engine: OnceLock<EngineHandle>,
    draining: AtomicBool,
    drained: OnceCell<()>,
    registry: Registry,
    /// The engine's metrics under other projects' names, made when the engine attaches.
    compat: OnceLock<Registry>,
    calls: Family<CallLabels, Counter>,
}

impl Serving {
    /// Loading: no engine yet.
    pub fn new(cfg: ServingConfig) -> Self {
        let mut registry = Registry::with_prefix("kiln");
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "api_requests",
            "API calls by protocol (grpc, http), endpoint (the request path) and status code",
            calls.clone(),
        );
        Self {
            cfg,
            engine: OnceLock::new(),
            draining: AtomicBool::new(false),
            drained: OnceCell::new(),
            registry,
            compat: OnceLock::new(),
            calls,
        }
    }

    /// Waits up to [`ServingConfig::close_grace`] for a listener `task` told to stop, then
    /// aborts it, dropping the connections still open (`what` names it in the log).
    pub async fn close(&self, task: tokio::task::JoinHandle<()>, what: &str) {
        let abort = task.abort_handle();
        if tokio::time::timeout(self.cfg.close_grace, task)
            .await
            .is_err()
        {
            tracing::warn!("{what} connections still open after the drain; closing them");
            abort.abort();
        }
    }

    /// How it drains and judges health.
    pub fn config(&self) -> &ServingConfig {
        &self.cfg
    }

    /// The engine, for new generation work: loaded and not draining.
    pub fn for_work(&self) -> Result<&EngineHandle, NotServing> {
        if self.is_draining() {
            return Err(NotServing::Draining);
        }
        self.loaded()
    }

    /// The engine, for reads (tokenizer, model info), also while draining.
    pub fn loaded(&self) -> Result<&EngineHandle, NotServing> {
        self.engine.get().ok_or(NotServing::Loading)
    }

    /// The engine, once attached.
    pub fn engine(&self) -> Option<&EngineHandle> {
        self.engine.get()
    }

    /// Whether a drain began.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Runs a warm-up request through `engine` (compiling every kernel the first real request
    /// would wait for), then serves with it.
    pub async fn attach(&self, engine: EngineHandle) -> Result<(), AttachError> {
        if self.engine.get().is_some() {
            return Err(AttachError::AlreadyAttached);
        }
        warm_up(&engine).await.map_err(AttachError::Warmup)?;
        if let MetricsCompat::Vllm { model_name } = &self.cfg.metrics_compat {
            let r = engine
                .metrics()
                .vllm_registry(model_name, engine.info().block_size);
            let _ = self.compat.set(r);
        }
        self.engine
            .set(engine)
            .map_err(|_| AttachError::AlreadyAttached)
    }

    /// Loading, serving, draining or stuck, read now.
    pub fn health(&self) -> Health {
        if self.is_draining() {
            return Health::Draining;
        }
        if self.engine.get().is_none() {
            return Health::Loading;
        }
        if self.stuck_reason().is_some() {
            Health::Stuck
        } else {
            Health::Serving
        }
    }

    /// Why the engine is stuck, when it is: its step loop has stopped (steps kept failing),
    /// or it has gone [`ServingConfig::stuck_after`] without progress while holding work (a
    /// hung step, or nothing schedulable).
    pub fn stuck_reason(&self) -> Option<String> {
        let engine = self.engine.get()?;
        if engine.is_stopped() {
            return Some("the engine's step loop has stopped".into());
        }
        match engine.stalled_for() {
            Some(t) if t > self.cfg.stuck_after => Some(format!(
                "no progress for {:.1} s with requests in flight",
                t.as_secs_f64()
            )),
            _ => None,
        }
    }

    /// Refuses new work, lets the requests in flight finish (cancelling those still running
    /// after the drain timeout) and stops the engine. Every caller waits for the same drain.
    pub async fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        self.drained
            .get_or_init(|| async {
                let Some(engine) = self.engine.get() else {
                    return;
                };
                let start = Instant::now();
                let timeout = self.cfg.drain_timeout;
                tracing::info!(?timeout, "draining requests in flight");
                if tokio::time::timeout(timeout, engine.shutdown(ShutdownMode::Drain))
                    .await
                    .is_err()
                {
                    tracing::warn!(?timeout, "drain timed out; cancelling what is left");
                    engine.shutdown(ShutdownMode::Cancel).await;
                }
                tracing::info!(ms = start.elapsed().as_millis() as u64, "engine drained");
            })
            .await;
    }

    /// Counts one API call.
    pub fn record(&self, protocol: Protocol, endpoint: &str, code: &str) {
        self.calls
            .get_or_create(&CallLabels {
                protocol: protocol.name(),
                endpoint: endpoint.to_owned(),
                code: code.to_owned(),
            })
            .inc();
    }

    /// The whole Prometheus exposition: the engine's metrics (once attached, and under vLLM's
    /// names too when [`ServingConfig::metrics_compat`] asks), then the calls.
    pub fn metrics_text(&self) -> String {
        let mut out = String::new();
        if let Some(engine) = self.engine.get() {
            engine.metrics().encode_metrics(&mut out);
        }
        if let Some(compat) = self.compat.get() {
            let _ = encode_registry(&mut out, compat);
        }
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_eof(&mut out);
        out
    }
}

/// One short prompt (a full block, so the batched matmul path runs too) and two generated
/// tokens.
async fn warm_up(engine: &EngineHandle) -> Result<(), EngineError> {
    let info = engine.info();
    let len = info
        .block_size
        .min(info.max_model_len.saturating_sub(2))
        .max(1);
    let mut req = Request::tokens(vec![info.bos.unwrap_or(0); len]).max_new_tokens(2);
    req.label = "warm-up".into();
    req.stopping.ignore_eos = true;
    let start = Instant::now();
    engine.submit(req)?.collect().await?;
    tracing::info!(ms = start.elapsed().as_millis() as u64, "warm-up step done");
    Ok(())
}
