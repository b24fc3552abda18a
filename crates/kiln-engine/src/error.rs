//! Engine errors: what a caller did wrong, or what became of its request.

/// Why a request was refused or ended without finishing. Each maps to one gRPC status at the
/// server's edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The request is malformed; `field` names the offending field (INVALID_ARGUMENT).
    #[error("{field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    /// The waiting queue is full (RESOURCE_EXHAUSTED).
    #[error("overloaded: {waiting} requests waiting (limit {limit}); retry later")]
    Overloaded { waiting: usize, limit: usize },
    /// The request's deadline passed before it finished (DEADLINE_EXCEEDED).
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// Aborted by the caller or by an engine shutdown that cancels (CANCELLED).
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The engine is shutting down or has stopped (UNAVAILABLE).
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// Something failed inside the engine for this request (INTERNAL).
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("engine config: {field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error(transparent)]
    Scheduler(#[from] kiln_scheduler::SchedulerError),
    #[error(transparent)]
    Kv(#[from] kiln_kv::KvError),
    #[error("KV cache: {0}")]
    KvCache(#[from] kiln_kv::device::KvDeviceError),
    #[error("cannot start the engine thread: {0}")]
    Thread(String),
}
