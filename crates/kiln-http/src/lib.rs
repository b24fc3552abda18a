//! # kiln-http
//!
//! kiln over the OpenAI HTTP API, beside (or instead of) gRPC, on the same engine:
//! `POST /v1/chat/completions` (messages rendered with the model's chat template, or one given
//! in [`HttpConfig::chat_template`]), `POST /v1/completions` (a string, strings, or token ids),
//! `GET /v1/models`, `/health` (200 serving; 503 loading, draining or stuck), `/version` and
//! `/metrics` (the same Prometheus text as the gRPC server's endpoint). Streaming is
//! Server-Sent Events ending with `data: [DONE]`; errors are OpenAI error objects with the
//! status a client expects. The front doors share a [`kiln_engine::Serving`]: one engine, one
//! drain, one count of calls by protocol and endpoint. It holds no engine logic: bodies become
//! engine requests and events become JSON.
//!
//! ```
//! use std::sync::Arc;
//! use kiln_engine::{Engine, EngineConfig, Serving, ServingConfig};
//! use kiln_http::{HttpConfig, HttpServer};
//! use kiln_kv::BlockManagerConfig;
//! use kiln_model::{LoadOptions, Model, ModelFiles};
//! use kiln_scheduler::SchedulerConfig;
//! use kiln_tensor::Device;
//! use kiln_tokenizer::{SpecialTokens, Tokenizer};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A tiny random-weight llama with a byte-level tokenizer.
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../kiln-model/tests/fixtures/tiny/llama3");
//! let files = ModelFiles::open(dir.as_ref(), LoadOptions::default())?;
//! let model = Model::load(&Device::Cpu, files.config().clone(), files.weights())?;
//! let tokenizer = Tokenizer::byte_level(SpecialTokens { eos: Some(2), ..Default::default() })?;
//! let cfg = EngineConfig::new(SchedulerConfig::new(BlockManagerConfig::new(64)));
//!
//! // Listen first (/health says 503), then attach the engine (warm-up, 200).
//! let serving = Arc::new(Serving::new(ServingConfig::default()));
//! let http = HttpServer::bind("127.0.0.1:0".parse()?, serving.clone(), HttpConfig::new("tiny")).await?;
//! serving.attach(Engine::start(model, tokenizer, cfg)?).await?;
//!
//! let body = r#"{"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}"#;
//! let mut s = tokio::net::TcpStream::connect(http.local_addr()).await?;
//! s.write_all(format!(
//!     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
//!      Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).as_bytes()).await?;
//! let mut reply = String::new();
//! s.read_to_string(&mut reply).await?;
//! assert!(reply.starts_with("HTTP/1.1 200"));
//! assert!(reply.contains(r#""object":"text_completion""#));
//!
//! http.shutdown().await; // drains, then closes the listener
//! # Ok(())
//! # }
//! ```

mod config;
mod convert;
mod error;
mod openai;
mod respond;
mod server;

pub use config::HttpConfig;
pub use error::ApiError;
pub use server::{HttpError, HttpServer, REQUEST_ID};
