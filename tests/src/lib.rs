//! # kiln-tests
//!
//! The integration harness: [`TestServer::start`] loads the default model (SmolLM2-135M Q4_1,
//! fetched by `cargo xtask fetch-model`), starts the real [`kiln_server::Server`] on
//! `127.0.0.1:0` with a metrics endpoint and the OpenAI-compatible [`kiln_http::HttpServer`]
//! beside it on the same engine, and hands out real tonic clients over one channel and a small
//! real HTTP/1.1 client ([`http`]). The tests live in `tests/`; the benchmarks reuse the same
//! start-up.
//!
//! ```no_run
//! # async fn demo() {
//! let server = kiln_tests::TestServer::start(kiln_tests::Options::default()).await;
//! let info = server.models().get_model_info(kiln_server::pb::GetModelInfoRequest::default())
//!     .await.unwrap().into_inner();
//! assert_eq!(info.vocab_size, 49152);
//! server.shutdown().await;
//! # }
//! ```

#![allow(clippy::panic, clippy::expect_used, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

pub mod http;

use std::sync::Arc;

use kiln_api::{MetricsCompat, Serving, ServingConfig};
use kiln_engine::{Checkpoint, EngineHandle, EngineOptions, FaultPlan, KvSize, SpeculativeConfig};
use kiln_http::HttpServer;
use kiln_model::LoadOptions;
use kiln_server::pb::generation_client::GenerationClient;
use kiln_server::pb::models_client::ModelsClient;
use kiln_server::pb::tokenization_client::TokenizationClient;
use kiln_server::{Server, ServerConfig, pb};
use kiln_tensor::Device;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// How to start a test server.
#[derive(Debug, Clone)]
pub struct Options {
    /// The CPU reference by default (fast on CI's two cores); the product path (wgpu) is
    /// what `kiln_testkit::wgpu()` opens.
    pub device: Device,
    pub kv_blocks: u32,
    pub max_num_seqs: usize,
    pub max_waiting: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: Option<usize>,
    /// Speculative decoding (n-gram lookup only: the harness loads one model).
    pub speculative: Option<SpeculativeConfig>,
    /// Faults to inject into the engine.
    pub faults: FaultPlan,
    /// How long without progress, holding work, before health says stuck.
    pub stuck_after: Duration,
    /// Both front doors' settings (`server.api` is what they share).
    pub server: ServerConfig,
    /// How long a drain lets requests in flight finish.
    pub drain_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        let model_id = kiln_testkit::DEFAULT_GGUF.trim_end_matches(".gguf");
        let mut server = ServerConfig::new(model_id);
        server.architecture = "llama".into();
        Self {
            device: Device::Reference,
            kv_blocks: 512,
            max_num_seqs: 32,
            max_waiting: 256,
            max_num_batched_tokens: 256,
            max_model_len: Some(2048),
            speculative: None,
            faults: FaultPlan::default(),
            stuck_after: ServingConfig::default().stuck_after,
            server,
            drain_timeout: ServingConfig::default().drain_timeout,
        }
    }
}

/// The default model on `opts.device`, behind an engine sized by `opts` (built as `kiln serve`
/// builds its engine).
pub fn start_engine(opts: &Options) -> EngineHandle {
    let path = kiln_testkit::default_model();
    let checkpoint =
        Checkpoint::open(&path, LoadOptions::default()).expect("open the default model");
    let engine = EngineOptions {
        kv_size: KvSize::Blocks(opts.kv_blocks),
        max_num_seqs: Some(opts.max_num_seqs),
        max_waiting: Some(opts.max_waiting),
        max_num_batched_tokens: Some(opts.max_num_batched_tokens),
        max_model_len: opts.max_model_len,
        speculative: opts.speculative,
        faults: opts.faults.clone(),
        ..EngineOptions::new(opts.device.clone())
    };
    kiln_engine::build(checkpoint, &engine, &mut |_, _| {})
        .expect("start the engine")
        .engine
}

/// What `kiln serve` shares between its front doors by default: vLLM's metric names besides
/// kiln's.
pub fn serving_config(cfg: &ServerConfig) -> ServingConfig {
    ServingConfig {
        metrics_compat: MetricsCompat::Vllm {
            model_name: cfg.api.model_id().to_owned(),
        },
        ..ServingConfig::default()
    }
}

/// A real server on loopback (gRPC and HTTP over one engine), with a channel to it.
#[derive(Debug)]
pub struct TestServer {
    pub server: Server,
    pub http: HttpServer,
    pub channel: Channel,
}

impl TestServer {
    /// Binds, loads the default model, warms up and serves.
    pub async fn start(opts: Options) -> Self {
        let serving = ServingConfig {
            drain_timeout: opts.drain_timeout,
            stuck_after: opts.stuck_after,
            ..serving_config(&opts.server)
        };
        let t = Self::bind_serving(opts.server.clone(), serving).await;
        let engine = tokio::task::spawn_blocking(move || start_engine(&opts))
            .await
            .expect("engine start-up task");
        t.server.attach(engine).await.expect("attach the engine");
        t
    }

    /// Binds both front doors over one `Serving`, without a model: health says NOT_SERVING
    /// until `server.attach`.
    pub async fn bind(cfg: ServerConfig) -> Self {
        let serving = serving_config(&cfg);
        Self::bind_serving(cfg, serving).await
    }

    /// [`bind`](Self::bind) with the shared serving settings given.
    pub async fn bind_serving(cfg: ServerConfig, serving: ServingConfig) -> Self {
        let http = cfg.api.clone();
        let localhost: SocketAddr = "127.0.0.1:0".parse().expect("address");
        let serving = Arc::new(Serving::new(serving));
        let server = Server::bind_with(localhost, Some(localhost), cfg, serving.clone())
            .await
            .expect("bind 127.0.0.1:0");
        let http = HttpServer::bind(localhost, serving, http)
            .await
            .expect("bind HTTP on 127.0.0.1:0");
        let channel = Channel::from_shared(format!("http://{}", server.local_addr()))
            .expect("uri")
            .connect()
            .await
            .expect("connect to the test server");
        Self {
            server,
            http,
            channel,
        }
    }

    /// The HTTP front door's address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.local_addr()
    }

    pub fn generation(&self) -> GenerationClient<Channel> {
        GenerationClient::new(self.channel.clone())
    }

    pub fn tokenization(&self) -> TokenizationClient<Channel> {
        TokenizationClient::new(self.channel.clone())
    }

    pub fn models(&self) -> ModelsClient<Channel> {
        ModelsClient::new(self.channel.clone())
    }

    pub fn health(&self) -> HealthClient<Channel> {
        HealthClient::new(self.channel.clone())
    }

    /// `GET /metrics` over a real HTTP connection.
    pub async fn metrics(&self) -> String {
        let addr = self.server.metrics_addr().expect("metrics endpoint");
        http_get(addr, "/metrics").await.1
    }

    /// Polls `GetModelInfo` until no request runs or waits and no KV block is referenced.
    pub async fn wait_until_idle(&self, within: Duration) -> pb::KvCacheInfo {
        let deadline = tokio::time::Instant::now() + within;
        let mut models = self.models();
        loop {
            let info = models
                .get_model_info(pb::GetModelInfoRequest::default())
                .await
                .expect("GetModelInfo")
                .into_inner();
            let kv = info.kv_cache.expect("kv_cache");
            let idle = kv.used_blocks == 0 && kv.running_requests == 0 && kv.waiting_requests == 0;
            if idle || tokio::time::Instant::now() > deadline {
                return kv;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One drain, then both listeners close.
    pub async fn shutdown(&self) {
        tokio::join!(self.server.shutdown(), self.http.shutdown());
    }
}

/// Polls gRPC health over `channel` until it reports `want`; panics after `within`.
pub async fn wait_for_health(channel: &Channel, want: ServingStatus, within: Duration) {
    let mut health = HealthClient::new(channel.clone());
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let h = health
            .check(HealthCheckRequest::default())
            .await
            .expect("health check")
            .into_inner();
        if h.status() == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "health never said {want:?} in {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The value of the sample of family `name` whose labels include every one of `labels`, in a
/// Prometheus text exposition (`name{a="x",b="y"} value` lines); `None` when there is none.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            let has_all = labels
                .iter()
                .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            (n == name && has_all).then(|| value.parse().ok())?
        })
}

/// A plain HTTP/1.1 GET: (status code, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.expect("read");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    (code, body.to_owned())
}

/// A text prompt with greedy decoding and `max_new_tokens`.
pub fn greedy(text: &str, max_new_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(text.into())),
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(pb::StoppingCriteria {
            max_new_tokens: Some(max_new_tokens),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A seeded sampled request.
pub fn sampled(text: &str, max_new_tokens: u32, seed: u64) -> pb::GenerateRequest {
    let mut r = greedy(text, max_new_tokens);
    r.sampling = Some(pb::SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.95),
        seed: Some(seed),
        ..Default::default()
    });
    r
}

/// Concatenated text of output `index` over a whole stream, the finish reason, and the last
/// message (usage, timing).
pub async fn collect_stream(
    mut stream: tonic::Streaming<pb::GenerateResponse>,
    index: u32,
) -> Result<(String, Option<pb::FinishInfo>, pb::GenerateResponse), tonic::Status> {
    let mut text = String::new();
    let mut finish = None;
    let mut last = pb::GenerateResponse::default();
    while let Some(msg) = stream.message().await? {
        for o in msg.outputs.iter().filter(|o| o.index == index) {
            text.push_str(&o.text);
            if o.finish.is_some() {
                finish = o.finish.clone();
            }
        }
        last = msg;
    }
    Ok((text, finish, last))
}
