//! Scheduler errors.

use kiln_kv::{KvError, SeqId};

/// Why the scheduler refused or failed an operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedulerError {
    /// The waiting queue is full: the caller should report "overloaded" and retry later.
    #[error("overloaded: {waiting} requests are already waiting (limit {limit})")]
    Overloaded { waiting: usize, limit: usize },
    /// The sequence can never run with this pool or budget.
    #[error("sequence {seq:?}: {reason}")]
    TooLarge { seq: SeqId, reason: String },
    #[error("sequence {0:?} is already known to the scheduler")]
    DuplicateSeq(SeqId),
    #[error("sequence {0:?} is not known to the scheduler")]
    UnknownSeq(SeqId),
    #[error("sequence {0:?} has an empty prompt")]
    EmptyPrompt(SeqId),
    /// An operation that needs a running, fully computed sequence got something else.
    #[error("sequence {seq:?}: {reason}")]
    WrongState { seq: SeqId, reason: &'static str },
    #[error("invalid scheduler config: {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error(transparent)]
    Kv(#[from] KvError),
}

pub type Result<T> = std::result::Result<T, SchedulerError>;
