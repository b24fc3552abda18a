//! Engine errors: what a caller did wrong, what became of its request, and what failed inside.
//! Each keeps its cause as [`std::error::Error::source`]; [`error_chain`] renders the whole
//! chain on one line for a status message or a log.

use std::error::Error;
use std::sync::Arc;

use kiln_kv::{KvError, SeqId};
use kiln_model::ModelError;
use kiln_scheduler::SchedulerError;
use kiln_tokenizer::TokenizerError;

use crate::field::Field;
use crate::sampling::SampleError;

/// A cause shared by everything it ended (one failed step ends every request in it).
pub type Cause = Arc<dyn Error + Send + Sync + 'static>;

/// Why a request was refused or ended without finishing. Each front door maps every kind to
/// one status of its own, in one place.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The request is malformed; `field` names the offending field (INVALID_ARGUMENT).
    #[error("{field}: {reason}")]
    InvalidArgument {
        field: Field,
        reason: String,
        /// What refused it, when something did (the tokenizer, the scheduler).
        #[source]
        source: Option<Cause>,
    },
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
    /// Something failed inside the engine for this request (INTERNAL); the source says what.
    #[error("internal error")]
    Internal(#[source] Arc<InternalError>),
}

/// Equal kinds with equal fields; two internal errors are equal when they are the same failure.
impl PartialEq for EngineError {
    fn eq(&self, other: &Self) -> bool {
        use EngineError::*;
        match (self, other) {
            (
                InvalidArgument {
                    field: f1,
                    reason: r1,
                    ..
                },
                InvalidArgument {
                    field: f2,
                    reason: r2,
                    ..
                },
            ) => f1 == f2 && r1 == r2,
            (
                Overloaded {
                    waiting: w1,
                    limit: l1,
                },
                Overloaded {
                    waiting: w2,
                    limit: l2,
                },
            ) => w1 == w2 && l1 == l2,
            (DeadlineExceeded, DeadlineExceeded) | (ShuttingDown, ShuttingDown) => true,
            (Cancelled(a), Cancelled(b)) => a == b,
            (Internal(a), Internal(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl EngineError {
    pub(crate) fn invalid(field: Field, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            reason: reason.into(),
            source: None,
        }
    }

    /// `field` refused by `source` (kept as the cause).
    pub(crate) fn invalid_because(
        field: Field,
        reason: impl Into<String>,
        source: impl Error + Send + Sync + 'static,
    ) -> Self {
        Self::InvalidArgument {
            field,
            reason: reason.into(),
            source: Some(Arc::new(source)),
        }
    }
}

impl From<InternalError> for EngineError {
    fn from(e: InternalError) -> Self {
        Self::Internal(Arc::new(e))
    }
}

/// What failed inside the engine. A failed forward step ends every request in its batch with
/// the same error; the step loop goes on.
#[derive(Debug, thiserror::Error)]
pub enum InternalError {
    /// Recording, submitting or reading back the forward pass (a kernel, the device, a batch
    /// the model refused).
    #[error("model step")]
    Forward(#[source] ModelError),
    /// The scheduler's or block manager's bookkeeping refused an update.
    #[error("KV bookkeeping")]
    Scheduler(#[source] SchedulerError),
    /// Forking a finished prompt into the other outputs of `n > 1` failed.
    #[error("forking the prompt for n > 1")]
    Fork(#[source] SchedulerError),
    /// The sequence was dropped by the scheduler: it can never fit the KV pool again.
    #[error("no longer fits the KV pool")]
    NoLongerFits(#[source] SchedulerError),
    /// A scheduled sequence's tokens were not where the schedule said.
    #[error("{0} lost its tokens")]
    LostTokens(SeqId),
    #[error("sampling")]
    Sampling(#[source] SampleError),
    /// The structured-output matcher failed.
    #[error("structured output")]
    Constraint(#[source] crate::constraint::ConstraintError),
    #[error("detokenizing")]
    Detokenize(#[source] TokenizerError),
    /// Step-loop state that cannot disagree did (a bug in kiln-engine).
    #[error("engine state: {0}")]
    State(&'static str),
    /// A fault a test asked for ([`FaultPlan`](crate::FaultPlan)), standing for a lost device.
    #[error("injected fault at step {0}")]
    Injected(u64),
    /// The step loop dropped a request's stream without its final event.
    #[error("the engine closed the stream without a final event")]
    StreamClosed,
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("engine config: {field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The target model's KV cache could not be allocated.
    #[error("allocating the model's KV pool")]
    KvCache(#[source] ModelError),
    /// The draft model's KV cache or pool could not be set up.
    #[error("setting up speculative decoding")]
    Draft(#[source] crate::speculative::ProposeError),
    #[error("cannot start the engine thread")]
    Thread(#[source] std::io::Error),
}

/// A broken invariant of the step loop's bookkeeping (a bug, reported by
/// [`EngineStats::invariants`](crate::EngineStats::invariants)).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvariantError {
    #[error("scheduler")]
    Scheduler(#[source] SchedulerError),
    #[error("{owners} sequences have owners, the scheduler holds {held}")]
    Owners { owners: usize, held: usize },
    #[error("draft KV pool")]
    DraftKv(#[source] KvError),
    #[error("the draft cache still holds finished {0}")]
    DraftLeak(SeqId),
    #[error("{seqs} draft sequences but {tables} draft block tables")]
    DraftTables { seqs: usize, tables: usize },
}

/// `e` and its sources on one line, outermost first, joined by `": "` (a source whose text
/// the line already ends with is not repeated).
pub fn error_chain(e: &(dyn Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !text.is_empty() && !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        next = s.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_names_every_cause_once() {
        let kv = KvError::UnknownSeq(SeqId(3));
        let e = EngineError::from(InternalError::Scheduler(SchedulerError::Kv(kv)));
        // SchedulerError::Kv is transparent: its text is the KvError's, said once.
        assert_eq!(
            error_chain(&e),
            "internal error: KV bookkeeping: seq 3 has no block table"
        );
        let e = EngineError::invalid_because(
            Field::Prompt,
            "cannot be scheduled",
            SchedulerError::EmptyPrompt(SeqId(1)),
        );
        assert_eq!(
            error_chain(&e),
            "prompt: cannot be scheduled: sequence SeqId(1) has an empty prompt"
        );
        assert_eq!(
            e,
            EngineError::invalid(Field::Prompt, "cannot be scheduled")
        );
        let a = EngineError::from(InternalError::StreamClosed);
        assert_eq!(a, a.clone());
        assert_ne!(a, EngineError::from(InternalError::StreamClosed));
    }
}
