//! # kiln-server
//!
//! kiln over gRPC (package `kiln.v1`, protos in `proto/kiln/v1/`): `Generation.Generate`
//! (unary) and `GenerateStream` (server streaming), `Tokenization`, `Models.GetModelInfo`,
//! the standard `grpc.health.v1.Health` and server reflection, in front of a running
//! [`kiln_engine::EngineHandle`]. The server validates at its edge and maps every engine error
//! to a gRPC status; it honours `grpc-timeout`, echoes `x-request-id`, checks an optional
//! bearer token, drains on shutdown, and serves Prometheus text at `/metrics`. It holds no
//! engine logic: requests become engine requests and events become messages.
//!
//! ```
//! use kiln_engine::{Engine, EngineConfig};
//! use kiln_kv::BlockManagerConfig;
//! use kiln_model::{LoadOptions, Model, ModelFiles};
//! use kiln_scheduler::SchedulerConfig;
//! use kiln_server::{Server, ServerConfig, pb};
//! use kiln_tensor::Device;
//! use kiln_tokenizer::{SpecialTokens, Tokenizer};
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
//! // Listen first (health says NOT_SERVING), then attach the engine (warm-up, SERVING).
//! let server = Server::bind("127.0.0.1:0".parse()?, None, ServerConfig::new("tiny")).await?;
//! server.attach(Engine::start(model, tokenizer, cfg)?).await?;
//!
//! let mut client =
//!     pb::generation_client::GenerationClient::connect(format!("http://{}", server.local_addr()))
//!         .await?;
//! let reply = client
//!     .generate(pb::GenerateRequest {
//!         prompt: Some(pb::generate_request::Prompt::Text("Hello".into())),
//!         stopping: Some(pb::StoppingCriteria { max_new_tokens: Some(4), ..Default::default() }),
//!         ..Default::default()
//!     })
//!     .await?
//!     .into_inner();
//! assert_eq!(reply.usage.map(|u| u.prompt_tokens), Some(5));
//!
//! server.shutdown().await; // drains, then closes the listeners
//! # Ok(())
//! # }
//! ```

mod config;
mod convert;
mod edge;
mod generation;
mod info;
mod metrics;
pub mod pb;
mod server;
mod status;

pub use config::ServerConfig;
pub use edge::REQUEST_ID;
pub use server::{Server, ServerError};
