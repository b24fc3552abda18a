//! Newtype ids: a physical block of the KV pool and a sequence that owns a block table.

use std::fmt;

/// A physical block of the KV pool: block `i` holds token slots `i * B .. (i + 1) * B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

impl BlockId {
    /// Placeholder a block table keeps where a sliding-window sequence gave a block back to the
    /// pool. Logical block indices stay stable; the attention kernel never reads these entries
    /// because every position they held lies outside the window of every query still to come.
    pub const TRIMMED: BlockId = BlockId(u32::MAX);

    /// Whether this entry is the [`BlockId::TRIMMED`] placeholder rather than a real block.
    pub fn is_trimmed(self) -> bool {
        self == Self::TRIMMED
    }

    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_trimmed() {
            f.write_str("block(trimmed)")
        } else {
            write!(f, "block {}", self.0)
        }
    }
}

/// A sequence (one completion of one request) that owns a block table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq {}", self.0)
    }
}

/// A whole-block copy the device must perform before the step that writes into `dst`
/// (copy-on-write of a shared, partially filled last block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockCopy {
    /// The shared block whose contents are copied.
    pub src: BlockId,
    /// The freshly allocated block that replaces `src` in the appending sequence's table.
    pub dst: BlockId,
}
