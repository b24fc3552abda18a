//! # kiln-scheduler
//!
//! Continuous batching as pure logic: sequences wait, get admitted when the KV pool has room
//! above its watermark, run one chunk per step under a token budget and a sequence cap, and
//! are preempted (blocks freed, recomputed later) when a decode needs a block that is not
//! there. Each step runs every decode first, so inter-token latency stays flat while long
//! prompts are cut into chunks. The scheduler owns the [`BlockManager`](kiln_kv::BlockManager)
//! (block accounting only) and never touches a device: a caller runs the model on each
//! [`Schedule`] and reports back with [`Scheduler::complete`] and [`Scheduler::push_token`].
//!
//! ```
//! use kiln_kv::{BlockManagerConfig, SeqId};
//! use kiln_scheduler::{Scheduler, SchedulerConfig, SeqParams};
//!
//! # fn main() -> Result<(), kiln_scheduler::SchedulerError> {
//! let mut cfg = SchedulerConfig::new(BlockManagerConfig { block_size: 4, ..BlockManagerConfig::new(32) });
//! cfg.max_num_batched_tokens = 8;
//! cfg.max_num_seqs = 4;
//! let mut s = Scheduler::new(cfg)?;
//! s.add(SeqId(1), (0..12).collect(), SeqParams::default())?;
//!
//! // A 12-token prompt under an 8-token budget: two chunks.
//! let step = s.schedule();
//! assert_eq!((step.seqs[0].start, step.seqs[0].len, step.seqs[0].samples), (0, 8, false));
//! s.complete(&step)?;
//! let step = s.schedule();
//! assert_eq!((step.seqs[0].start, step.seqs[0].len, step.seqs[0].samples), (8, 4, true));
//! s.complete(&step)?;
//! s.push_token(SeqId(1), 42)?; // the model sampled token 42
//!
//! // Now a decode: one token a step.
//! let step = s.schedule();
//! assert_eq!((step.seqs[0].start, step.seqs[0].len), (12, 1));
//! s.complete(&step)?;
//! assert!(s.finish(SeqId(1)));
//! assert_eq!(s.stats().kv.used_blocks, 0);
//! # Ok(())
//! # }
//! ```

mod config;
mod error;
mod schedule;
mod scheduler;

pub use config::{SchedulerConfig, SeqParams};
pub use error::{Result, SchedulerError};
pub use schedule::{Schedule, ScheduledSeq, SchedulerStats, SeqStatus};
pub use scheduler::Scheduler;
