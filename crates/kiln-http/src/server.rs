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
use http::{HeaderValue, StatusCode, header};
use kiln_engine::{
    EngineError, EngineHandle, Health, Output, RequestStream, Serving, Usage, bearer_matches,
    new_request_id, usable_request_id,
};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

use crate::config::HttpConfig;
use crate::convert::{self, Plan};
use crate::error::{Api, ApiError};
use crate::openai::{ChatRequest, Common, CompletionRequest, ModelCard, ModelList};
use crate::respond::{self, Ctx, EventStream};

/// The header a request id travels in (taken from the client or made here; echoed back).
pub const REQUEST_ID: &str = "x-request-id";

/// The routes counted in metrics under their own name; anything else counts as `other`.
const ENDPOINTS: [&str; 7] = [
    "/v1/chat/completions",
    "/v1/completions",
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
struct App {
    serving: Arc<Serving>,
    cfg: HttpConfig,
    /// Unix seconds at bind (`created` of the model card).
    started: u64,
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
        cfg: HttpConfig,
    ) -> Result<Self, HttpError> {
        let bind = |source| HttpError::Bind {
            addr: listen,
            source,
        };
        let listener = TcpListener::bind(listen).await.map_err(bind)?;
        let addr = listener.local_addr().map_err(bind)?;
        let app = Arc::new(App {
            serving: serving.clone(),
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                message: format!("{} does not take {}", req.uri().path(), req.method()),
                kind: "invalid_request_error",
                param: None,
                code: None,
            }
        })
        .layer(middleware::from_fn_with_state(app.clone(), edge))
        .with_state(app)
}

/// What every call passes through: the request id, auth for `/v1/`, and the call count.
async fn edge(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let id = match req
        .headers()
        .get(REQUEST_ID)
        .filter(|v| usable_request_id(v.as_bytes()))
    {
        Some(v) => v.clone(),
        None => {
            // Hex digits are always a valid header value.
            let v = HeaderValue::from_str(&new_request_id())
                .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
            req.headers_mut().insert(REQUEST_ID, v.clone());
            v
        }
    };
    let path = req.uri().path().to_owned();
    let endpoint = endpoint(&path);
    let mut resp = match &app.cfg.api_key {
        Some(key)
            if path.starts_with("/v1/")
                && !bearer_matches(
                    req.headers()
                        .get(header::AUTHORIZATION)
                        .map(HeaderValue::as_bytes),
                    key,
                ) =>
        {
            ApiError::unauthorized().into_response()
        }
        _ => next.run(req).await,
    };
    resp.headers_mut().insert(REQUEST_ID, id);
    app.serving.record("http", endpoint, resp.status().as_str());
    resp
}

fn endpoint(path: &str) -> &'static str {
    if let Some(e) = ENDPOINTS.iter().find(|e| **e == path) {
        return e;
    }
    if path.starts_with("/v1/models/") {
        return "/v1/models/{id}";
    }
    "other"
}

/// Reads a JSON object body: 413 over the limit, 400 when it is not JSON or not an object.
async fn body(req: Request, limit: usize) -> Result<Value, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        // Read the body away first (up to a cap), so a client still writing it reads the 413
        // instead of a broken pipe.
        discard(req.into_body()).await;
        return Err(ApiError::too_large(limit));
    }
    let bytes = axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| {
            // A body without a length that runs over the limit, or one cut short.
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.to_string().contains("length limit"));
            if over {
                ApiError::too_large(limit)
            } else {
                ApiError::bad_body(format!("cannot read the request body: {e}"))
            }
        })?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::bad_body("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad_body(format!(
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
fn fields<T: DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(json_error)
}

fn json_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
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
        return ApiError::invalid(param, "missing");
    }
    if path == "." {
        return ApiError::bad_body(format!("the body must be a JSON object: {msg}"));
    }
    ApiError::invalid(path, msg)
}

async fn chat(State(app): State<Arc<App>>, req: Request) -> Result<Response, ApiError> {
    let v = body(req, app.cfg.max_body_bytes).await?;
    let (common, chat): (Common, ChatRequest) = (fields(&v)?, fields(&v)?);
    let engine = app
        .serving
        .for_work()
        .map_err(ApiError::not_serving)?
        .clone();
    let id = format!("chatcmpl-{:032x}", rand::random::<u128>());
    log_start(&id, common.user.as_deref());
    let submitted = off_the_workers(app.clone(), move |app| {
        let (tok, info) = (engine.tokenizer(), engine.info());
        let plan = convert::chat(&chat, &common, &id, tok, info, &app.cfg)?;
        submit(app, &engine, plan, id, Api::Chat)
    })
    .await?;
    respond(submitted).await
}

async fn completions(State(app): State<Arc<App>>, req: Request) -> Result<Response, ApiError> {
    let v = body(req, app.cfg.max_body_bytes).await?;
    let (common, completion): (Common, CompletionRequest) = (fields(&v)?, fields(&v)?);
    let engine = app
        .serving
        .for_work()
        .map_err(ApiError::not_serving)?
        .clone();
    let id = format!("cmpl-{:032x}", rand::random::<u128>());
    log_start(&id, common.user.as_deref());
    let submitted = off_the_workers(app.clone(), move |app| {
        let plan = convert::completion(&completion, &common, &id, engine.info(), &app.cfg)?;
        submit(app, &engine, plan, id, Api::Completions)
    })
    .await?;
    respond(submitted).await
}

fn log_start(id: &str, user: Option<&str>) {
    let user = user.map(kiln_engine::echo);
    tracing::debug!(request_id = id, user = user.as_deref(), "request accepted");
}

/// Runs `work` (rendering, tokenizing, submitting: CPU work that grows with the prompt) on
/// tokio's blocking pool, so a long prompt never holds up the async workers that answer
/// health probes and stream other requests' tokens.
async fn off_the_workers<T: Send + 'static>(
    app: Arc<App>,
    work: impl FnOnce(&App) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || work(&app))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "preparing a request failed");
            ApiError::internal("preparing the request failed")
        })?
}

/// A call's requests, submitted, and how to answer it.
struct Submitted {
    ctx: Ctx,
    streams: Vec<RequestStream>,
    stream: bool,
    include_usage: bool,
}

/// Submits every prompt's request (if a later one is refused, dropping the earlier streams
/// aborts their requests).
fn submit(
    app: &App,
    engine: &EngineHandle,
    mut plan: Plan,
    id: String,
    api: Api,
) -> Result<Submitted, ApiError> {
    let ctx = Ctx {
        id,
        created: unix_now(),
        model: app.cfg.model_id.clone(),
        api,
        n: plan.n,
        logprobs: plan.logprobs.is_some(),
        tokenizer: engine.tokenizer().clone(),
        tools: plan.tools,
    };
    let requests = std::mem::take(&mut plan.requests);
    let refused = |e: EngineError| {
        let mut err = ApiError::from_engine(&e, api);
        if let EngineError::InvalidArgument { field, .. } = &e
            && let Some(param) = plan.constraint_param(field)
        {
            err.rename_param(field, param);
        }
        err
    };
    let mut streams = Vec::with_capacity(requests.len());
    for r in requests {
        streams.push(engine.submit(r).map_err(refused)?);
    }
    Ok(Submitted {
        ctx,
        streams,
        stream: plan.stream,
        include_usage: plan.include_usage,
    })
}

/// Answers whole or as a stream.
async fn respond(s: Submitted) -> Result<Response, ApiError> {
    let Submitted {
        ctx,
        streams,
        stream,
        include_usage,
    } = s;
    let api = ctx.api;
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
                .map_err(|e| ApiError::from_engine(&e, api))?,
        );
    }
    log_done(&ctx.id, &respond::total_usage(&outs));
    Ok(match api {
        Api::Chat => axum::Json(respond::chat_completion(&ctx, &outs)).into_response(),
        Api::Completions => axum::Json(respond::completion(&ctx, &outs)).into_response(),
    })
}

fn log_done(id: &str, u: &Usage) {
    tracing::info!(
        request_id = id,
        prompt_tokens = u.prompt_tokens,
        completion_tokens = u.completion_tokens,
        cached_prompt_tokens = u.cached_prompt_tokens,
        "request finished"
    );
}

fn card(app: &App, engine: &EngineHandle) -> ModelCard {
    ModelCard {
        id: app.cfg.model_id.clone(),
        object: "model",
        created: app.started,
        owned_by: "kiln",
        max_model_len: engine.info().max_model_len,
    }
}

async fn models(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    let engine = app.serving.loaded().map_err(ApiError::not_serving)?;
    Ok(axum::Json(ModelList {
        object: "list",
        data: vec![card(&app, engine)],
    })
    .into_response())
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let engine = app.serving.loaded().map_err(ApiError::not_serving)?;
    if id != app.cfg.model_id {
        return Err(ApiError::model_not_found(&id, &app.cfg.model_id));
    }
    Ok(axum::Json(card(&app, engine)).into_response())
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
