//! The one error type of `kiln-kv`'s bookkeeping: every variant names what failed.

use crate::{BlockId, SeqId};

/// Everything that can go wrong in the block manager and capacity planning.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvError {
    /// Not enough free or evictable blocks; nothing was allocated. The scheduler decides what
    /// happens next (wait, preempt, reject).
    #[error("out of KV blocks: {what} needs {needed} blocks, {available} are free or evictable")]
    OutOfBlocks {
        what: &'static str,
        needed: usize,
        available: usize,
    },
    /// The sequence has no block table (never allocated, or already freed).
    #[error("{0} has no block table")]
    UnknownSeq(SeqId),
    /// `allocate` or `fork` named a sequence that already has a block table.
    #[error("{0} already has a block table")]
    DuplicateSeq(SeqId),
    /// A prompt of zero tokens cannot be allocated: the model needs a token to compute.
    #[error("{0}: cannot allocate an empty prompt")]
    EmptyPrompt(SeqId),
    /// `commit` was given more tokens than the sequence has reserved but not yet computed.
    #[error("{seq}: committing {got} tokens but only {reserved} reserved slots are uncomputed")]
    CommitOverrun {
        seq: SeqId,
        reserved: usize,
        got: usize,
    },
    /// Forking a sequence whose reserved slots are not all computed would let parent and child
    /// write the same shared slots.
    #[error("{parent}: cannot fork with {uncomputed} reserved slots not yet computed")]
    ForkUncomputed { parent: SeqId, uncomputed: usize },
    /// With a kept pool, a position's main block is taken only when [`reserve`] asks for it:
    /// this one was computed, committed or mapped to a slot first.
    ///
    /// [`reserve`]: crate::BlockManager::reserve
    #[error("{seq}: position {pos} has no block in the main pool yet (reserve it first)")]
    NotReserved { seq: SeqId, pos: usize },
    /// Sequences with a kept pool share no partial block, so they cannot be forked.
    #[error("{0}: a sequence with a kept pool cannot be forked")]
    ForkWithKeptPool(SeqId),
    /// `truncate` may only drop reserved slots that are not computed.
    #[error("{seq}: cannot truncate to {len} slots: {computed} are computed, {reserved} reserved")]
    TruncateOutOfRange {
        seq: SeqId,
        len: usize,
        computed: usize,
        reserved: usize,
    },
    /// A position past the sequence's reserved slots.
    #[error("{seq}: position {pos} is past its {len} reserved slots")]
    PositionOutOfRange { seq: SeqId, pos: usize, len: usize },
    /// A position whose block a sliding-window sequence already gave back to the pool.
    #[error("{seq}: position {pos} lies in a block trimmed by its sliding window")]
    TrimmedPosition { seq: SeqId, pos: usize },
    /// A configuration value is out of range.
    #[error("invalid KV configuration: {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    /// The memory budget cannot hold a single block.
    #[error(
        "KV memory budget of {budget_bytes} bytes cannot hold one block of {block_bytes} bytes"
    )]
    BudgetTooSmall { budget_bytes: u64, block_bytes: u64 },
    /// `check_invariants` found the bookkeeping inconsistent (a bug in `kiln-kv`).
    #[error("KV bookkeeping invariant broken at {block:?}: {detail}")]
    InvariantBroken {
        block: Option<BlockId>,
        detail: String,
    },
}

/// `Result` with [`KvError`].
pub type Result<T, E = KvError> = std::result::Result<T, E>;
