#![doc = include_str!("../README.md")]

mod config;
mod error;
mod schedule;
mod scheduler;

pub use config::{SchedulerConfig, SeqParams};
pub use error::{Result, SchedulerError};
pub use schedule::{Schedule, ScheduledSeq, SchedulerStats, SeqStatus};
pub use scheduler::Scheduler;
