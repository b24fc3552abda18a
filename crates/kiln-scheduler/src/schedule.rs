//! What the scheduler answers: each step's [`Schedule`], where a sequence is, and the queue
//! figures.

use kiln_kv::{BlockCopy, KvMetrics, SeqId};

use crate::SchedulerError;

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    /// Queued for admission; no KV blocks.
    Waiting,
    /// Holds KV blocks and is scheduled every step it can be.
    Running,
    /// Was running, lost its blocks under memory pressure; recomputes when readmitted.
    Preempted,
}

/// One sequence's part of a step: compute positions `start .. start + len` of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    /// Tokens already in the KV cache (the chunk's first position).
    pub start: usize,
    /// Tokens computed this step, draft tokens included.
    pub len: usize,
    /// Whether this chunk reaches the end of the sequence's tokens, so its logits pick the
    /// next token (false for a prefill chunk that is not the last).
    pub samples: bool,
    /// Draft tokens (speculative decoding) that end this chunk, after its last real token:
    /// the step verifies them and [`Scheduler::accept_draft`](crate::Scheduler::accept_draft) keeps the accepted ones.
    pub draft: usize,
}

impl ScheduledSeq {
    /// The context length after this step (draft slots included).
    pub fn end(&self) -> usize {
        self.start + self.len
    }

    /// Real (non-draft) tokens of the chunk end here.
    pub fn real_end(&self) -> usize {
        self.end() - self.draft
    }
}

/// What [`Scheduler::schedule`](crate::Scheduler::schedule) decided for one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Schedule {
    /// Decodes first, then prefill chunks, each in (priority, arrival) order.
    pub seqs: Vec<ScheduledSeq>,
    /// How many of `seqs` (the leading ones) are decodes.
    pub decodes: usize,
    /// Copy-on-write block copies that must run on the device before this step's K/V writes.
    pub copies: Vec<BlockCopy>,
    /// Sequences preempted this step (their blocks are free; they wait to recompute).
    pub preempted: Vec<SeqId>,
    /// Sequences admitted this step with the prompt tokens the prefix cache supplied.
    pub admitted: Vec<(SeqId, usize)>,
    /// Sequences dropped because they can never fit the pool (the caller reports an error).
    pub rejected: Vec<(SeqId, SchedulerError)>,
}

impl Schedule {
    /// Tokens computed this step.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }

    /// Sequences computing the token they sampled last step.
    pub fn num_decodes(&self) -> usize {
        self.decodes
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// Queue lengths and pool figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerStats {
    pub running: usize,
    pub waiting: usize,
    pub preempted: usize,
    /// Preemptions so far.
    pub preemptions: u64,
    pub kv: KvMetrics,
}
