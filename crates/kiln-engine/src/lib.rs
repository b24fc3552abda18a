//! # kiln-engine
//!
//! Serving without the server: a dedicated thread owns the model and the device, and runs the
//! step loop (continuous batching from `kiln-scheduler`, one forward pass per step over a
//! paged KV cache, sampling, stop rules, streaming detokenization). Callers hold an
//! [`EngineHandle`]: [`submit`](EngineHandle::submit) returns a [`RequestStream`] of
//! [`Event`]s (token deltas, then a summary with finish reasons, usage and timing), and
//! [`abort`](EngineHandle::abort) or dropping the stream frees the request's KV blocks before
//! the next step. Metrics come out in the Prometheus text format. Speculative decoding
//! ([`SpeculativeConfig`]: prompt lookup or a [`DraftModel`] via
//! [`Engine::start_with_draft`]) drafts tokens that the target verifies in the same forward
//! pass; it changes no greedy or seeded token. From a model path, [`build`] is the one way to
//! get an engine: [`Checkpoint::open`] reads the config and tokenizer, [`EngineOptions`] says
//! the device, the KV pool, the limits and the speculation. Errors keep their causes;
//! [`error_chain`] prints one with all of them.
//!
//! ```
//! use kiln_engine::{Engine, EngineConfig, Request};
//! use kiln_kv::BlockManagerConfig;
//! use kiln_model::{LoadOptions, Model, ModelFiles};
//! use kiln_scheduler::SchedulerConfig;
//! use kiln_tensor::Device;
//! use kiln_tokenizer::{SpecialTokens, Tokenizer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A tiny random-weight llama with a 256-token vocabulary, and a byte-level tokenizer.
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../kiln-model/tests/fixtures/tiny/llama3");
//! let files = ModelFiles::open(dir.as_ref(), LoadOptions::default())?;
//! let model = Model::load(&Device::Cpu, files.config().clone(), files.weights())?;
//! let tokenizer = Tokenizer::byte_level(SpecialTokens { eos: Some(2), ..Default::default() })?;
//! let cfg = EngineConfig::new(SchedulerConfig::new(BlockManagerConfig::new(64)));
//! let engine = Engine::start(model, tokenizer, cfg)?;
//!
//! let out = engine
//!     .submit(Request::text("Hello").max_new_tokens(8))?
//!     .blocking_collect()?;
//! assert_eq!(out.usage.prompt_tokens, 5);
//! assert!(out.outputs[0].token_ids.len() <= 8);
//! # Ok(())
//! # }
//! ```

mod batch;
mod builder;
mod error;
mod handle;
mod metrics;
mod output;
mod request;
mod sampling;
mod serving;
mod speculative;
mod start;
mod step_loop;

pub use builder::{BuildError, Built, Checkpoint, EngineOptions, KvSize, build};
pub use error::{Cause, EngineError, InternalError, InvariantError, StartError, error_chain};
pub use handle::{EngineHandle, EngineInfo, EngineStats, RequestStream, ShutdownMode};
pub use metrics::{EngineMetrics, FinishLabel};
pub use request::{
    Delta, Event, FinishReason, Output, OutputOptions, Prompt, Request, RequestId, SeqOutput,
    SpecStats, StoppingCriteria, Summary, Timing, TokenLogprobs, Usage,
};
pub use sampling::{
    LogprobRequest, ParamError, SampleError, Sampled, Sampler, SamplingParams, TokenHistory,
    TokenLogprob, raw_logprobs, rejection_sample,
};
pub use serving::{
    AttachError, Health, NotServing, Serving, ServingConfig, bearer_matches, new_request_id,
    usable_request_id,
};
pub use speculative::{
    DraftModel, DraftProposer, NgramProposer, ProposeError, ProposeInput, Proposer, SpecMethod,
    SpeculativeConfig, TokenizerMismatch, check_same_tokenizer,
};
pub use start::{Engine, EngineConfig};
