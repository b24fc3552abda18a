//! The HTTP server: axum on the caller's tokio runtime, sharing a [`Serving`] (one engine, one
//! drain, one metrics text) with the other front doors of the process.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use http::{StatusCode, header};
use kiln_api::{ApiConfig, Health, Protocol, Serving, edge};
use kiln_engine::{EngineError, EngineHandle, Output, RequestStream, Usage};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

use crate::agents;
use crate::convert::{self, Plan};
use crate::error::{Door, ErrorReply, Shape};
use crate::openai::{ChatRequest, Common, CompletionRequest, ModelCard, ModelList};
use crate::respond::{self, Ctx, EventStream};
use crate::store::{ResponseStore, STORE_BYTES};

/// The header a request id travels in (taken from the client or made here; echoed back).
pub const REQUEST_ID: &str = edge::REQUEST_ID;

/// The routes counted in metrics under their own name; anything else counts as `other`.
const ENDPOINTS: [&str; 13] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/health",
    "/version",
    "/metrics",
    "/v1/models/{id}",
];

const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why the HTTP server could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

#[derive(Debug)]
pub(crate) struct App {
    pub serving: Arc<Serving>,
    pub cfg: ApiConfig,
    /// Unix seconds at bind (`created` of the model card).
    started: u64,
    /// Responses kept for `GET /v1/responses/{id}` and `previous_response_id`.
    pub store: Arc<ResponseStore>,
}

/// A running HTTP server. [`shutdown`](Self::shutdown) drains; dropping it stops listening.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    serving: Arc<Serving>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl HttpServer {
    /// Binds `listen` and answers at once: `/health` says 503 and generation is 503 until the
    /// [`Serving`] gets its engine. Must run inside a tokio runtime.
    pub async fn bind(
        listen: SocketAddr,
        serving: Arc<Serving>,
        cfg: ApiConfig,
    ) -> Result<Self, HttpError> {
        let bind = |source| HttpError::Bind {
            addr: listen,
            source,
        };
        let listener = TcpListener::bind(listen).await.map_err(bind)?;
        let addr = listener.local_addr().map_err(bind)?;
        let app = Arc::new(App {
            serving: serving.clone(),
            store: Arc::new(ResponseStore::new(cfg.responses_store, STORE_BYTES)),
            cfg,
            started: unix_now(),
        });
        let router = router(app);
        let (stop, mut stop_rx) = watch::channel(false);
        // Without TCP_NODELAY each small SSE chunk can wait for the client's delayed ACK.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY");
            }
        });
        let task = tokio::spawn(async move {
            let stopped = async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            };
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(stopped)
                .await
            {
                tracing::error!(error = %e, "HTTP server failed");
            }
        });
        tracing::info!(%addr, "HTTP listening (OpenAI-compatible)");
        Ok(Self {
            addr,
            serving,
            stop,
            task: Mutex::new(Some(task)),
        })
    }

    /// The address (with the port the OS picked for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the listener (and idle keep-alive connections), then drains (shared with every
    /// front door on the same [`Serving`]: new work still reaching it is refused with 503,
    /// requests in flight finish).
    pub async fn shutdown(&self) {
        // The listener closes first and idle keep-alive connections with it: a load balancer
        // sends new work to another replica while the requests in flight finish here.
        let _ = self.stop.send(true);
        self.serving.drain().await;
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = task {
            self.serving.close(t, "HTTP").await;
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(agents::create_response))
        .route(
            "/v1/responses/{id}",
            get(agents::get_response).delete(agents::delete_response),
        )
        .route("/v1/messages", post(agents::messages))
        .route("/v1/messages/count_tokens", post(agents::count_tokens))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/tokenizer_info", get(crate::tokenize::tokenizer_info))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(|req: Request| async move {
            let path = req.uri().path();
            ErrorReply::no_route(path).shaped(shape_of(path))
        })
        .method_not_allowed_fallback(|req: Request| async move {
            let path = req.uri().path();
            ErrorReply::method_not_allowed(path, req.method()).shaped(shape_of(path))
        })
        .layer(middleware::from_fn_with_state(app.clone(), edge))
        .with_state(app)
}

/// What every call passes through: the request id, auth for `/v1/`, and the call count.
async fn edge(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let id = edge::request_id(req.headers_mut());
    let path = req.uri().path().to_owned();
    let endpoint = endpoint(&path);
    let mut resp = if path.starts_with("/v1/")
        && !edge::authorized(req.headers(), app.cfg.api_key.as_deref())
    {
        ErrorReply::unauthorized()
            .shaped(shape_of(&path))
            .into_response()
    } else {
        next.run(req).await
    };
    resp.headers_mut().insert(REQUEST_ID, id);
    app.serving
        .record(Protocol::Http, endpoint, resp.status().as_str());
    resp
}

/// Why generation or reads are refused (loading, draining), in `door`'s shape.
pub(crate) fn unavailable(door: Door) -> impl Fn(kiln_api::NotServing) -> ErrorReply {
    move |e| ErrorReply::from_api(&e.into(), door, None)
}

/// The error shape a path's clients read.
fn shape_of(path: &str) -> Shape {
    if path.starts_with("/v1/messages") {
        Shape::Anthropic
    } else {
        Shape::OpenAi
    }
}

fn endpoint(path: &str) -> &'static str {
    if let Some(e) = ENDPOINTS.iter().find(|e| **e == path) {
        return e;
    }
    if path.starts_with("/v1/models/") {
        return "/v1/models/{id}";
    }
    if path.starts_with("/v1/responses/") {
        return "/v1/responses/{id}";
    }
    "other"
}

/// Reads a JSON object body: 413 over the limit, 400 when it is not JSON or not an object.
pub(crate) async fn body(req: Request, limit: usize) -> Result<Value, ErrorReply> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        // Read the body away first (up to a cap), so a client still writing it reads the 413
        // instead of a broken pipe.
        discard(req.into_body()).await;
        return Err(ErrorReply::too_large(limit));
    }
    let bytes = axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| {
            // A body without a length that runs over the limit, or one cut short.
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.to_string().contains("length limit"));
            if over {
                ErrorReply::too_large(limit)
            } else {
                ErrorReply::bad_body(format!("cannot read the request body: {e}"))
            }
        })?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ErrorReply::bad_body("the body must be a JSON object")),
        Err(e) => Err(ErrorReply::bad_body(format!(
            "the body is not valid JSON: {e}"
        ))),
    }
}

/// Most of an oversized body read (and dropped) before answering 413; past it, or after
/// `DISCARD_TIME`, the connection closes under the client.
const DISCARD_BYTES: usize = 64 << 20;
const DISCARD_TIME: Duration = Duration::from_secs(10);

async fn discard(body: axum::body::Body) {
    let mut stream = body.into_data_stream();
    let drain = async {
        let mut seen = 0usize;
        while let Some(Ok(chunk)) = stream.next().await {
            seen += chunk.len();
            if seen > DISCARD_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DISCARD_TIME, drain).await;
}

/// Reads one view of the body, naming the field that has the wrong type.
pub(crate) fn fields<T: DeserializeOwned>(v: &Value) -> Result<T, ErrorReply> {
    serde_path_to_error::deserialize(v).map_err(json_error)
}

fn json_error(e: serde_path_to_error::Error<serde_json::Error>) -> ErrorReply {
    let path = e.path().to_string();
    let msg = e.into_inner().to_string();
    if let Some(field) = msg
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next())
    {
        let param = if path == "." {
            field.to_owned()
        } else {
            format!("{path}.{field}")
        };
        return ErrorReply::invalid(param, "missing");
    }
    if path == "." {
        return ErrorReply::bad_body(format!("the body must be a JSON object: {msg}"));
    }
    ErrorReply::invalid(path, msg)
}

async fn chat(State(app): State<Arc<App>>, req: Request) -> Result<Response, ErrorReply> {
    let v = body(req, app.cfg.max_request_bytes).await?;
    let (common, chat): (Common, ChatRequest) = (fields(&v)?, fields(&v)?);
    let engine = app
        .serving
        .for_work()
        .map_err(unavailable(Door::Chat))?
        .clone();
    let id = format!("chatcmpl-{:032x}", rand::random::<u128>());
    log_start(&id, common.user.as_deref());
    let submitted = off_the_workers(app.clone(), move |app| {
        let (tok, info) = (engine.tokenizer(), engine.info());
        let plan = convert::chat(&chat, &common, &id, tok, info, &app.cfg)?;
        submit(app, &engine, plan, id, Door::Chat)
    })
    .await?;
    respond(submitted).await
}

async fn completions(State(app): State<Arc<App>>, req: Request) -> Result<Response, ErrorReply> {
    let v = body(req, app.cfg.max_request_bytes).await?;
    let (common, completion): (Common, CompletionRequest) = (fields(&v)?, fields(&v)?);
    let engine = app
        .serving
        .for_work()
        .map_err(unavailable(Door::Completions))?
        .clone();
    let id = format!("cmpl-{:032x}", rand::random::<u128>());
    log_start(&id, common.user.as_deref());
    let submitted = off_the_workers(app.clone(), move |app| {
        let plan = convert::completion(
            &completion,
            &common,
            &id,
            engine.tokenizer(),
            engine.info(),
            &app.cfg,
        )?;
        submit(app, &engine, plan, id, Door::Completions)
    })
    .await?;
    respond(submitted).await
}

pub(crate) fn log_start(id: &str, user: Option<&str>) {
    let user = user.map(kiln_api::echo);
    tracing::debug!(request_id = id, user = user.as_deref(), "request accepted");
}

/// Runs `work` (rendering, tokenizing, submitting: CPU work that grows with the prompt) on
/// tokio's blocking pool, so a long prompt never holds up the async workers that answer
/// health probes and stream other requests' tokens.
pub(crate) async fn off_the_workers<T: Send + 'static>(
    app: Arc<App>,
    work: impl FnOnce(&App) -> Result<T, ErrorReply> + Send + 'static,
) -> Result<T, ErrorReply> {
    tokio::task::spawn_blocking(move || work(&app))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "preparing a request failed");
            ErrorReply::internal("preparing the request failed")
        })?
}

/// A call's requests, submitted, and how to answer it.
struct Submitted {
    ctx: Ctx,
    streams: Vec<RequestStream>,
    stream: bool,
    include_usage: bool,
}

/// Submits every prompt's request, all checked before any is queued.
fn submit(
    app: &App,
    engine: &EngineHandle,
    mut plan: Plan,
    id: String,
    door: Door,
) -> Result<Submitted, ErrorReply> {
    let ctx = Ctx {
        id,
        created: unix_now(),
        model: app.cfg.model_id().to_owned(),
        door,
        n: plan.n,
        logprobs: plan.logprobs,
        tokenizer: engine.tokenizer().clone(),
        reply: plan.reply,
        echo: plan.echo.take(),
        prompt_logprobs: plan.prompt_logprobs,
    };
    let requests = std::mem::take(&mut plan.requests);
    let via = plan.constraint_via;
    let refused = |e: EngineError| ErrorReply::from_api(&e.into(), door, via);
    let streams = engine.submit_all(requests).map_err(|(_, e)| refused(e))?;
    Ok(Submitted {
        ctx,
        streams,
        stream: plan.stream,
        include_usage: plan.include_usage,
    })
}

/// Answers whole or as a stream.
async fn respond(s: Submitted) -> Result<Response, ErrorReply> {
    let Submitted {
        ctx,
        streams,
        stream,
        include_usage,
    } = s;
    let door = ctx.door;
    if stream {
        let log_id = ctx.id.clone();
        let on_finish = Box::new(move |u: &Usage| log_done(&log_id, u));
        let events = EventStream::new(ctx, streams, include_usage, on_finish);
        return Ok(Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    // Dropping this future (the client left) drops the streams: the engine aborts them.
    let mut outs: Vec<Output> = Vec::with_capacity(streams.len());
    for s in streams {
        outs.push(
            s.collect()
                .await
                .map_err(|e| ErrorReply::from_api(&e.into(), door, None))?,
        );
    }
    log_done(&ctx.id, &respond::total_usage(&outs));
    Ok(match door {
        Door::Completions => axum::Json(respond::completion(&ctx, &outs)).into_response(),
        _ => axum::Json(respond::chat_completion(&ctx, &outs)).into_response(),
    })
}

pub(crate) fn log_done(id: &str, u: &Usage) {
    tracing::info!(
        request_id = id,
        prompt_tokens = u.prompt_tokens,
        completion_tokens = u.completion_tokens,
        cached_prompt_tokens = u.cached_prompt_tokens,
        "request finished"
    );
}

fn card(app: &App, engine: &EngineHandle, id: &str) -> ModelCard {
    ModelCard {
        id: id.to_owned(),
        object: "model",
        created: app.started,
        owned_by: "kiln",
        max_model_len: engine.info().max_model_len,
    }
}

async fn models(State(app): State<Arc<App>>) -> Result<Response, ErrorReply> {
    let engine = app.serving.loaded().map_err(unavailable(Door::Chat))?;
    Ok(axum::Json(ModelList {
        object: "list",
        data: app
            .cfg
            .model_ids
            .iter()
            .map(|id| card(&app, engine, id))
            .collect(),
    })
    .into_response())
}

async fn model(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ErrorReply> {
    let engine = app.serving.loaded().map_err(unavailable(Door::Chat))?;
    app.cfg
        .check_model(Some(&id))
        .map_err(convert::core(Door::Chat, None))?;
    Ok(axum::Json(card(&app, engine, &id)).into_response())
}

/// 200 while serving; 503 while loading, draining or stuck (the body says which).
async fn health(State(app): State<Arc<App>>) -> Response {
    let h = app.serving.health();
    let code = if h == Health::Serving {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(serde_json::json!({"status": h.name()}))).into_response()
}

async fn version() -> Response {
    axum::Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// The same exposition as gRPC's `--metrics-listen`: routers scrape the inference port.
async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        app.serving.metrics_text(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_bounded() {
        assert_eq!(endpoint("/v1/completions"), "/v1/completions");
        assert_eq!(endpoint("/v1/models/abc"), "/v1/models/{id}");
        assert_eq!(endpoint("/etc/passwd"), "other");
    }
}
