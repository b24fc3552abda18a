//! A small real HTTP/1.1 client (hyper) for the OpenAI front door: JSON calls, and
//! Server-Sent Events read event by event as they arrive. Dropping an [`SseStream`] closes its
//! connection, as a client that goes away does.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// A whole response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Reply {
    /// The body as JSON (panics when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> http::Response<Incoming> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("HTTP handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body))).expect("request");
    sender.send_request(req).await.expect("send the request")
}

async fn whole(resp: http::Response<Incoming>) -> Reply {
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.expect("read the body").to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// `POST path` with a JSON body.
pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    post_with(addr, path, body.to_string().into_bytes(), &[]).await
}

/// `POST path` with raw bytes and extra headers.
pub async fn post_with(
    addr: SocketAddr,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> Reply {
    whole(send(addr, "POST", path, body, headers).await).await
}

/// `GET path`.
pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    whole(send(addr, "GET", path, Vec::new(), &[]).await).await
}

/// `DELETE path`.
pub async fn delete(addr: SocketAddr, path: &str) -> Reply {
    whole(send(addr, "DELETE", path, Vec::new(), &[]).await).await
}

/// An open SSE response.
#[derive(Debug)]
pub struct SseStream {
    pub status: u16,
    pub headers: http::HeaderMap,
    body: Incoming,
    buf: String,
}

impl SseStream {
    /// `POST path` and wait for the response head.
    pub async fn open(addr: SocketAddr, path: &str, body: &Value) -> Self {
        Self::open_with(addr, path, body.to_string().into_bytes(), &[]).await
    }

    /// [`open`](Self::open) with raw bytes and extra headers.
    pub async fn open_with(
        addr: SocketAddr,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Self {
        let resp = send(addr, "POST", path, body, headers).await;
        let (parts, body) = resp.into_parts();
        Self {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
            buf: String::new(),
        }
    }

    /// The `data:` of the next event (comments such as keep-alives skipped); `None` at the end.
    pub async fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            let frame = self.body.frame().await?.expect("read an SSE frame");
            if let Ok(data) = frame.into_data() {
                self.buf.push_str(&String::from_utf8_lossy(&data));
            }
        }
    }

    /// Every remaining event's data, up to and including `[DONE]`.
    pub async fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(d) = self.next_data().await {
            out.push(d);
        }
        out
    }
}
