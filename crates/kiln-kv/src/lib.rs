//! # kiln-kv
//!
//! The paged KV cache. The bookkeeping half is pure CPU: a pool of fixed-size blocks,
//! per-sequence block tables with reference counts and copy-on-write forks, a prefix cache
//! that reuses full computed blocks across prompts (evicted least recently used), sliding-window
//! trimming, slot mapping, admission with a watermark, and capacity planning from a memory
//! budget. Allocation is all-or-nothing and returns [`KvError::OutOfBlocks`] rather than
//! panicking, so a scheduler decides what happens when blocks run out. It links no device
//! stack: `kiln-attention` stores the blocks on a device and runs paged attention over them.
//!
//! ```
//! use kiln_kv::{BlockManager, BlockManagerConfig, SeqConfig, SeqId};
//!
//! # fn main() -> Result<(), kiln_kv::KvError> {
//! let cfg = BlockManagerConfig { block_size: 4, ..BlockManagerConfig::new(8) };
//! let mut kv = BlockManager::new(cfg)?;
//! let prompt = [10, 11, 12, 13, 14, 15];
//! let a = SeqId(1);
//! kv.allocate(a, &prompt, SeqConfig::default())?; // 6 slots: 2 blocks
//! kv.commit(a, &prompt)?; // the model wrote K/V for all 6 positions
//! assert_eq!(kv.append_slots(a, 1)?, None); // position 6 fits the last block
//! kv.commit(a, &[16])?;
//!
//! let b = SeqId(2);
//! kv.fork(a, b)?; // b shares both blocks
//! let copy = kv.append_slots(b, 1)?.expect("the shared last block is copied on write");
//! assert_eq!(kv.block_table(a)?[1], copy.src);
//! assert_eq!(kv.block_table(b)?[1], copy.dst);
//! assert_eq!(kv.slot(b, 7)?, copy.dst.0 * 4 + 3); // block * B + pos % B
//!
//! kv.free(a)?;
//! kv.free(b)?;
//! assert_eq!(kv.metrics().used_blocks, 0);
//! # Ok(())
//! # }
//! ```

mod error;
mod hash;
mod ids;
mod manager;
mod metrics;
mod plan;
mod pool;
mod prefix;

pub use error::{KvError, Result};
pub use ids::{BlockCopy, BlockId, SeqId};
pub use manager::{Admission, Allocation, BlockManager, BlockManagerConfig, SeqConfig};
pub use metrics::KvMetrics;
pub use plan::{KvBudget, KvDtype, KvPlan, KvPlanConfig, KvShape};
