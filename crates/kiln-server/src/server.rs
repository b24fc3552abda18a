//! The server's lifecycle: bind (health NOT_SERVING), attach a loaded engine (warm-up step,
//! then SERVING), drain (NOT_SERVING, new work refused, in-flight work finished, listeners
//! closed).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_api::{AttachError, MetricsCompat, NotServing, Protocol, Serving, ServingConfig};
use kiln_engine::EngineHandle;
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
use crate::pb;

/// Health is reported for the whole server ("") and for each kiln service.
const HEALTH_NAMES: [&str; 4] = [
    "",
    "kiln.v1.Generation",
    "kiln.v1.Tokenization",
    "kiln.v1.Models",
];

/// What the services share.
#[derive(Debug)]
pub(crate) struct State {
    pub cfg: ServerConfig,
    /// The engine, drain and call counts, shared with any other front door of the process.
    pub serving: Arc<Serving>,
}

impl State {
    /// The engine, for new generation work: loaded and not draining.
    pub fn engine(&self) -> Result<&EngineHandle, Status> {
        self.serving.for_work().map_err(unavailable)
    }

    /// The engine, for reads (tokenizer, model info), also while draining.
    pub fn loaded(&self) -> Result<&EngineHandle, Status> {
        self.serving.loaded().map_err(unavailable)
    }

    /// Counts one call of `path` (`/kiln.v1.Generation/Generate`) that ended with `err`
    /// (`None`: OK).
    pub fn record(&self, path: &str, err: Option<&Status>) {
        let code = err.map_or(tonic::Code::Ok, Status::code);
        self.serving
            .record(Protocol::Grpc, path, &format!("{code:?}"));
    }
}

fn unavailable(e: NotServing) -> Status {
    match e {
        NotServing::Loading => Status::unavailable(
            "the model is still loading (grpc.health.v1.Health says when it serves)",
        ),
        NotServing::Draining => Status::unavailable(e.to_string()),
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
    #[error("cannot attach the model")]
    Attach(#[source] AttachError),
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
    /// The metrics listener stops after the drain (its figures are read while it runs).
    metrics_stop: watch::Sender<bool>,
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
        let serving = Arc::new(Serving::new(ServingConfig {
            metrics_compat: MetricsCompat::Vllm {
                model_name: cfg.api.model_id().to_owned(),
            },
            ..ServingConfig::default()
        }));
        Self::bind_with(listen, metrics_listen, cfg, serving).await
    }

    /// [`bind`](Self::bind) over a [`Serving`] that other front doors (kiln-http) share: one
    /// engine, one drain, one metrics text. `cfg.drain_timeout` is not used (the `Serving`'s
    /// own applies).
    pub async fn bind_with(
        listen: SocketAddr,
        metrics_listen: Option<SocketAddr>,
        cfg: ServerConfig,
        serving: Arc<Serving>,
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

        let (max_in, max_out) = (cfg.api.max_request_bytes, cfg.max_response_bytes);
        let api_key = cfg.api.api_key.as_deref().map(Arc::from);
        let state = Arc::new(State { cfg, serving });
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

        let (stop, mut grpc_stop) = watch::channel(false);
        let (metrics_stop, metrics_stop_rx) = watch::channel(false);
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
                metrics_stop_rx,
            )));
        }
        tracing::info!(%addr, metrics = ?metrics_addr, "listening (not serving until the model is ready)");
        Ok(Self {
            state,
            health,
            addr,
            metrics_addr,
            stop,
            metrics_stop,
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
        self.state.serving.engine()
    }

    /// What this server shares with other front doors.
    pub fn serving(&self) -> &Arc<Serving> {
        &self.state.serving
    }

    /// The Prometheus text `/metrics` serves.
    pub fn metrics_text(&self) -> String {
        self.state.serving.metrics_text()
    }

    /// Runs a warm-up request through `engine` (compiling every kernel the first real request
    /// would wait for), then serves with it: health turns SERVING.
    pub async fn attach(&self, engine: EngineHandle) -> Result<(), ServerError> {
        let serving = &self.state.serving;
        serving.attach(engine).await.map_err(ServerError::Attach)?;
        if !serving.is_draining() {
            set_health(&self.health, ServingStatus::Serving).await;
            tracing::info!(addr = %self.addr, model = %self.state.cfg.api.model_id(), "serving");
            let watchdog = tokio::spawn(watchdog(serving.clone(), self.health.clone()));
            if let Ok(mut tasks) = self.tasks.lock() {
                tasks.push(watchdog);
            }
        }
        Ok(())
    }

    /// Drains: health turns NOT_SERVING, the gRPC listener closes and every open connection
    /// gets an HTTP/2 GOAWAY (a load balancer sends new work to another replica: it cannot
    /// connect here, and a GOAWAY'd connection takes no new stream), new generation still
    /// reaching this server is UNAVAILABLE, requests in flight finish (those still running
    /// after the drain timeout are cancelled), then the metrics listener closes. Resolves
    /// when all of that is done. The drain is shared: every front door on the same
    /// [`Serving`] refuses new work from its start.
    pub async fn shutdown(&self) {
        set_health(&self.health, ServingStatus::NotServing).await;
        let _ = self.stop.send(true);
        self.state.serving.drain().await;
        let _ = self.metrics_stop.send(true);
        let tasks: Vec<_> = self
            .tasks
            .lock()
            .map(|mut t| t.drain(..).collect())
            .unwrap_or_default();
        for t in tasks {
            self.state.serving.close(t, "gRPC").await;
        }
        tracing::info!("server stopped");
    }
}

/// Every health name at once.
async fn set_health(health: &HealthReporter, status: ServingStatus) {
    for name in HEALTH_NAMES {
        health.set_service_status(name, status).await;
    }
}

/// How often the watchdog looks at the engine.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Keeps gRPC health truthful while serving: NOT_SERVING (with a log line saying why) while
/// the engine is stuck, SERVING again once it progresses; it ends with the drain, which sets
/// health itself.
async fn watchdog(serving: Arc<Serving>, health: HealthReporter) {
    let mut stuck = false;
    let mut tick = tokio::time::interval(WATCH_EVERY);
    loop {
        tick.tick().await;
        if serving.is_draining() {
            return;
        }
        match (serving.stuck_reason(), stuck) {
            (Some(why), false) => {
                tracing::error!(reason = %why, "engine stuck: health NOT_SERVING");
                set_health(&health, ServingStatus::NotServing).await;
                stuck = true;
            }
            (None, true) if !serving.is_draining() => {
                tracing::warn!("engine progressing again: health SERVING");
                set_health(&health, ServingStatus::Serving).await;
                stuck = false;
            }
            _ => {}
        }
    }
}

impl Drop for Server {
    /// A server dropped without [`shutdown`](Server::shutdown) stops listening at once; the
    /// engine then cancels whatever was in flight when its last handle goes.
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        let _ = self.metrics_stop.send(true);
    }
}
