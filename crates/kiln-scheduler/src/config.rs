//! What the scheduler is told: the limits of a step and of the queues, and each sequence's
//! options.

use kiln_kv::BlockManagerConfig;

/// Limits of one step and of the queues.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Sequences in one step (and running at once).
    pub max_num_seqs: usize,
    /// Tokens in one step: one per decode plus the prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Requests that may wait for admission; more are refused as overloaded.
    pub max_waiting: usize,
    /// Cut long prompts into chunks that fill the step's leftover budget. Off: a prompt runs
    /// whole in one step, so it must fit `max_num_batched_tokens`.
    pub chunked_prefill: bool,
    /// Sliding-window attention of the model, passed to the block manager.
    pub sliding_window: Option<usize>,
    /// The KV block pool.
    pub blocks: BlockManagerConfig,
}

impl SchedulerConfig {
    /// 64 sequences, 512 tokens a step, 256 waiting, chunked prefill, over `blocks`.
    pub fn new(blocks: BlockManagerConfig) -> Self {
        Self {
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            max_waiting: 256,
            chunked_prefill: true,
            sliding_window: None,
            blocks,
        }
    }
}

/// Per-sequence scheduling options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqParams {
    /// Lower runs first (vLLM's convention); ties go to the earlier arrival.
    pub priority: i32,
    /// Sequences this one will fork into after its prompt (`n - 1` for `n` outputs): admission
    /// reserves room for them under `max_num_seqs`.
    pub forks: usize,
    /// Compute the whole prompt, reusing no prefix-cache block, until it has been computed
    /// once (a request for the prompt's log-probabilities needs every position's logits; a
    /// later recompute after preemption reuses the cache as any sequence does).
    pub recompute_prefix: bool,
    /// The most tokens one of its prefill chunks may hold, with chunked prefill on (a request
    /// that scores its prompt reads back a vocabulary of logits a token, and this bounds that
    /// memory); `None`: the step's token budget alone.
    pub max_chunk: Option<usize>,
}
