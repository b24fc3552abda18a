#![doc = include_str!("../README.md")]

mod batch;
mod builder;
mod constraint;
mod error;
mod field;
mod handle;
mod metrics;
mod output;
mod request;
mod sampling;
mod speculative;
mod start;
mod step_loop;

pub use builder::{BuildError, Built, Checkpoint, EngineOptions, KvSize, PoolPlan, build};
pub use constraint::{BadConstraint, Constraint, ConstraintCompiler, ConstraintError};
pub use error::{Cause, EngineError, InternalError, InvariantError, StartError, error_chain};
pub use field::{ConstraintKind, Field};
pub use handle::{
    EngineHandle, EngineInfo, EngineStats, KvEventBatch, PromptTooLong, RequestStream, ShutdownMode,
};
pub use kiln_kv::CacheEvent;
/// The structured-output engine kiln drives (its `Matcher` is what
/// [`ConstraintCompiler::compile`] returns).
pub use llguidance;
pub use metrics::EngineMetrics;
pub use request::{
    Delta, Event, FinishReason, Output, OutputOptions, Prompt, PromptLogprobs, Request, RequestId,
    SeqOutput, SpecStats, StoppingCriteria, Summary, Timing, TokenLogprobs, Usage,
};
pub use sampling::{ParamError, SamplingParams, TokenLogprob};
pub use speculative::{DraftModel, SpecMethod, SpeculativeConfig, TokenizerMismatch};
pub use start::{DeviceSampling, Engine, EngineConfig};
pub use step_loop::{FaultPlan, StepGate};
