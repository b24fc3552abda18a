//! The Prometheus endpoint (`GET /metrics` on its own listener, plain HTTP/1.1): the text
//! [`Serving::metrics_text`](kiln_api::Serving::metrics_text) renders, the same an HTTP front
//! door on the same `Serving` serves.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::server::State;

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn respond(
    state: Arc<State>,
    req: http::Request<Incoming>,
) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let (status, ctype, body) = match (req.method(), req.uri().path()) {
        (&http::Method::GET, "/metrics") => (
            http::StatusCode::OK,
            CONTENT_TYPE,
            state.serving.metrics_text(),
        ),
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
