//! The server's lifecycle: bind (health NOT_SERVING), attach a loaded engine (warm-up step,
//! then SERVING), drain (NOT_SERVING, new work refused, in-flight work finished, listeners
//! closed).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kiln_engine::{EngineError, EngineHandle, Request, ShutdownMode};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::Status;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::config::ServerConfig;
use crate::edge::EdgeLayer;
use crate::generation::GenerationService;
use crate::info::{ModelsService, TokenizationService};
use crate::metrics::ServerMetrics;
use crate::pb;

/// Health is reported for the whole server ("") and for each kiln service.
const HEALTH_NAMES: [&str; 4] = [
    "",
    "kiln.v1.Generation",
    "kiln.v1.Tokenization",
    "kiln.v1.Models",
];

/// After the engine drained, how long open connections (say, health watchers) may take to
/// close before the listener task is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// What the services share.
#[derive(Debug)]
pub(crate) struct State {
    pub cfg: ServerConfig,
    /// Set once the model is loaded and warmed up.
    pub engine: OnceLock<EngineHandle>,
    pub draining: AtomicBool,
    pub metrics: ServerMetrics,
}

impl State {
    /// The engine, for new generation work: loaded and not draining.
    pub fn engine(&self) -> Result<&EngineHandle, Status> {
        if self.draining.load(Ordering::Acquire) {
            return Err(Status::unavailable(
                "the server is draining and takes no new requests",
            ));
        }
        self.loaded()
    }

    /// The engine, for reads (tokenizer, model info), also while draining.
    pub fn loaded(&self) -> Result<&EngineHandle, Status> {
        self.engine.get().ok_or_else(|| {
            Status::unavailable(
                "the model is still loading (grpc.health.v1.Health says when it serves)",
            )
        })
    }
}

/// Why a server could not start or take its model.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("reflection service")]
    Reflection(#[source] tonic_reflection::server::Error),
    #[error("warm-up request failed")]
    Warmup(#[source] EngineError),
    #[error("a model is already attached to this server")]
    AlreadyAttached,
}

/// A running gRPC server (and its metrics endpoint); its listeners run on the tokio runtime
/// that bound them. [`shutdown`](Self::shutdown) drains; dropping it stops listening at once.
#[derive(Debug)]
pub struct Server {
    state: Arc<State>,
    health: HealthReporter,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

async fn listen(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), ServerError> {
    let bind = |source| ServerError::Bind { addr, source };
    let l = TcpListener::bind(addr).await.map_err(bind)?;
    let local = l.local_addr().map_err(bind)?;
    Ok((l, local))
}

impl Server {
    /// Binds `listen` (and `metrics_listen` for `/metrics`) and starts answering: health says
    /// NOT_SERVING and generation is UNAVAILABLE until [`attach`](Self::attach) succeeds.
    /// Must run inside a tokio runtime.
    pub async fn bind(
        listen: SocketAddr,
        metrics_listen: Option<SocketAddr>,
        cfg: ServerConfig,
    ) -> Result<Self, ServerError> {
        let (listener, addr) = self::listen(listen).await?;
        let metrics = match metrics_listen {
            Some(a) => Some(self::listen(a).await?),
            None => None,
        };
        let (health, health_service) = tonic_health::server::health_reporter();
        for name in HEALTH_NAMES {
            health
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = reflection().build_v1().map_err(ServerError::Reflection)?;
        // grpcurl and older tools still ask the v1alpha service.
        let reflection_v1alpha = reflection()
            .build_v1alpha()
            .map_err(ServerError::Reflection)?;

        let (max_in, max_out) = (cfg.max_request_bytes, cfg.max_response_bytes);
        let api_key = cfg.api_key.as_deref().map(Arc::from);
        let state = Arc::new(State {
            cfg,
            engine: OnceLock::new(),
            draining: AtomicBool::new(false),
            metrics: ServerMetrics::new(),
        });
        let generation = pb::generation_server::GenerationServer::new(GenerationService {
            state: state.clone(),
        })
        .max_decoding_message_size(max_in)
        .max_encoding_message_size(max_out);
        let tokenization = pb::tokenization_server::TokenizationServer::new(TokenizationService {
            state: state.clone(),
        })
        .max_decoding_message_size(max_in)
        .max_encoding_message_size(max_out);
        let models = pb::models_server::ModelsServer::new(ModelsService {
            state: state.clone(),
        })
        .max_decoding_message_size(max_in)
        .max_encoding_message_size(max_out);

        let (stop, stop_rx) = watch::channel(false);
        let mut grpc_stop = stop_rx.clone();
        let router = tonic::transport::Server::builder()
            .layer(EdgeLayer { api_key })
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(generation)
            .add_service(tokenization)
            .add_service(models);
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut tasks = vec![tokio::spawn(async move {
            let stopped = async move {
                let _ = grpc_stop.wait_for(|s| *s).await;
            };
            if let Err(e) = router.serve_with_incoming_shutdown(incoming, stopped).await {
                tracing::error!(error = %e, "gRPC server failed");
            }
        })];
        let metrics_addr = metrics.as_ref().map(|(_, a)| *a);
        if let Some((l, _)) = metrics {
            tasks.push(tokio::spawn(crate::metrics::serve(
                l,
                state.clone(),
                stop_rx,
            )));
        }
        tracing::info!(%addr, metrics = ?metrics_addr, "listening (not serving until the model is ready)");
        Ok(Self {
            state,
            health,
            addr,
            metrics_addr,
            stop,
            tasks: Mutex::new(tasks),
        })
    }

    /// The gRPC address (with the port the OS picked for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The `/metrics` address, when one was asked for.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The attached engine.
    pub fn engine(&self) -> Option<&EngineHandle> {
        self.state.engine.get()
    }

    /// The Prometheus text `/metrics` serves.
    pub fn metrics_text(&self) -> String {
        crate::metrics::render(&self.state)
    }

    /// Runs a warm-up request through `engine` (compiling every kernel the first real request
    /// would wait for), then serves with it: health turns SERVING.
    pub async fn attach(&self, engine: EngineHandle) -> Result<(), ServerError> {
        if self.state.engine.get().is_some() {
            return Err(ServerError::AlreadyAttached);
        }
        warm_up(&engine).await.map_err(ServerError::Warmup)?;
        self.state
            .engine
            .set(engine)
            .map_err(|_| ServerError::AlreadyAttached)?;
        if !self.state.draining.load(Ordering::Acquire) {
            for name in HEALTH_NAMES {
                self.health
                    .set_service_status(name, ServingStatus::Serving)
                    .await;
            }
            tracing::info!(addr = %self.addr, model = %self.state.cfg.model_id, "serving");
        }
        Ok(())
    }

    /// Drains: health turns NOT_SERVING, new generation is UNAVAILABLE, requests in flight
    /// finish (those still running after `drain_timeout` are cancelled), then the listeners
    /// close. Resolves when all of that is done.
    pub async fn shutdown(&self) {
        if self.state.draining.swap(true, Ordering::AcqRel) {
            tracing::debug!("shutdown already begun");
        }
        for name in HEALTH_NAMES {
            self.health
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
        if let Some(engine) = self.state.engine.get() {
            let start = Instant::now();
            let timeout = self.state.cfg.drain_timeout;
            tracing::info!(?timeout, "draining requests in flight");
            if tokio::time::timeout(timeout, engine.shutdown(ShutdownMode::Drain))
                .await
                .is_err()
            {
                tracing::warn!(?timeout, "drain timed out; cancelling what is left");
                engine.shutdown(ShutdownMode::Cancel).await;
            }
            tracing::info!(ms = start.elapsed().as_millis() as u64, "engine drained");
        }
        let _ = self.stop.send(true);
        let tasks: Vec<_> = self
            .tasks
            .lock()
            .map(|mut t| t.drain(..).collect())
            .unwrap_or_default();
        for t in tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout(CLOSE_GRACE, t).await.is_err() {
                tracing::warn!("connections still open after the drain; closing them");
                abort.abort();
            }
        }
        tracing::info!("server stopped");
    }
}

impl Drop for Server {
    /// A server dropped without [`shutdown`](Server::shutdown) stops listening at once; the
    /// engine then cancels whatever was in flight when its last handle goes.
    fn drop(&mut self) {
        let _ = self.stop.send(true);
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
