//! What every call passes through before a service sees it: the `x-request-id` (taken from the
//! client or made here, and echoed on the response) and, when an API key is set, bearer-token
//! auth for the `kiln.v1` services. Also the `grpc-timeout` header, parsed into a deadline.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use kiln_api::edge;
use tonic::body::Body;
use tonic::{Code, Status};
use tower::{Layer, Service};

/// The metadata key of the request id.
pub const REQUEST_ID: &str = edge::REQUEST_ID;

/// Services under auth; health and reflection stay open for probes and tools.
const PROTECTED_PREFIX: &str = "/kiln.v1.";

#[derive(Debug, Clone)]
pub(crate) struct EdgeLayer {
    pub api_key: Option<Arc<str>>,
}

impl<S> Layer<S> for EdgeLayer {
    type Service = Edge<S>;

    fn layer(&self, inner: S) -> Edge<S> {
        Edge {
            inner,
            api_key: self.api_key.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Edge<S> {
    inner: S,
    api_key: Option<Arc<str>>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> Service<http::Request<B>> for Edge<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let id = edge::request_id(req.headers_mut());
        if req.uri().path().starts_with(PROTECTED_PREFIX)
            && !edge::authorized(req.headers(), self.api_key.as_deref())
        {
            let status = Status::unauthenticated(
                "this server needs an API key: send metadata `authorization: Bearer <key>` \
                 or `x-api-key: <key>`",
            );
            let mut resp = status.into_http::<Body>();
            resp.headers_mut().insert(REQUEST_ID, id);
            return Box::pin(async move { Ok(resp) });
        }
        // The ready service goes into the future; a clone takes its place (tower's idiom).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let mut resp = client_caused(inner.call(req).await?);
            resp.headers_mut().insert(REQUEST_ID, id);
            Ok(resp)
        })
    }
}

/// tonic refuses a request message before any service sees it with codes that blame the
/// server: INTERNAL for bytes that are not the method's protobuf message (invalid UTF-8 in a
/// string field included) and OUT_OF_RANGE for a message over the size limit. Both are the
/// client's doing: INVALID_ARGUMENT, and RESOURCE_EXHAUSTED as gRPC's status-code table has it
/// for a message larger than the configured limit. Such answers are trailers-only (the status
/// in the headers, no body), so the response is remade with the right code and the same text.
fn client_caused(resp: http::Response<Body>) -> http::Response<Body> {
    const UNDECODABLE: &str = "failed to decode Protobuf message";
    const TOO_LARGE: &str = "Error, decoded message length too large";
    let Some(status) = Status::from_header_map(resp.headers()) else {
        return resp;
    };
    let code = match status.code() {
        Code::Internal if status.message().starts_with(UNDECODABLE) => Code::InvalidArgument,
        Code::OutOfRange if status.message().starts_with(TOO_LARGE) => Code::ResourceExhausted,
        _ => return resp,
    };
    let message = format!("the request message: {}", status.message());
    Status::new(code, message).into_http::<Body>()
}

/// A malformed `grpc-timeout` header value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("grpc-timeout `{0}`: expected up to 8 digits and a unit (H, M, S, m, u, n)")]
pub(crate) struct BadTimeout(String);

/// The `grpc-timeout` header: at most 8 digits and a unit (`H M S m u n`), per the gRPC HTTP/2
/// protocol.
pub(crate) fn parse_grpc_timeout(v: &str) -> Result<Duration, BadTimeout> {
    let bad = || BadTimeout(v.to_owned());
    if v.len() < 2 || v.len() > 9 {
        return Err(bad());
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    Ok(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(bad()),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn grpc_timeout_units_and_errors() {
        assert_eq!(parse_grpc_timeout("5S").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_grpc_timeout("2M").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_grpc_timeout("1H").unwrap(), Duration::from_secs(3600));
        assert_eq!(
            parse_grpc_timeout("250m").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            parse_grpc_timeout("99999999u").unwrap(),
            Duration::from_micros(99_999_999)
        );
        assert_eq!(parse_grpc_timeout("7n").unwrap(), Duration::from_nanos(7));
        for bad in ["", "S", "5", "5s", "123456789S", "-1S", "1.5S"] {
            assert!(parse_grpc_timeout(bad).is_err(), "{bad:?} accepted");
        }
    }
}
