//! The Prometheus endpoint (`GET /metrics` on its own listener, plain HTTP/1.1) and the
//! server's own counters, exposed after the engine's histograms and gauges.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::Status;

use crate::server::State;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: String,
    code: String,
}

/// Calls by method and gRPC status code.
#[derive(Debug)]
pub(crate) struct ServerMetrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
}

impl ServerMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kiln");
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "grpc_requests",
            "gRPC calls by method and status code",
            calls.clone(),
        );
        Self { registry, calls }
    }

    /// Counts one call of `method` that ended with `err` (`None`: OK).
    pub fn record(&self, method: &str, err: Option<&Status>) {
        let code = err.map_or(tonic::Code::Ok, Status::code);
        self.calls
            .get_or_create(&CallLabels {
                method: method.to_owned(),
                code: format!("{code:?}"),
            })
            .inc();
    }
}

/// The whole exposition: the engine's metrics (once a model is attached), then the server's.
pub(crate) fn render(state: &State) -> String {
    let mut out = String::new();
    if let Some(engine) = state.engine.get() {
        engine.metrics().encode_metrics(&mut out);
    }
    // Writing into a String cannot fail.
    let _ = encode_registry(&mut out, &state.metrics.registry);
    let _ = encode_eof(&mut out);
    out
}

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn respond(
    state: Arc<State>,
    req: http::Request<Incoming>,
) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let (status, ctype, body) = match (req.method(), req.uri().path()) {
        (&http::Method::GET, "/metrics") => (http::StatusCode::OK, CONTENT_TYPE, render(&state)),
        (_, "/metrics") => (
            http::StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use GET\n".to_owned(),
        ),
        _ => (
            http::StatusCode::NOT_FOUND,
            "text/plain",
            "kiln serves metrics at /metrics\n".to_owned(),
        ),
    };
    let mut resp = http::Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(ctype),
    );
    Ok(resp)
}

/// Serves `/metrics` on `listener` until `stop` turns true.
pub(crate) async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stop.wait_for(|s| *s) => return,
        };
        let stream = match conn {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics listener: accept failed");
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| respond(state.clone(), req));
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "metrics connection ended with an error");
            }
        });
    }
}
