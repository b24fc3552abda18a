#![doc = include_str!("../README.md")]

mod error;
mod events;
mod hash;
mod ids;
mod kept_plan;
mod layout;
mod manager;
mod metrics;
mod plan;
mod pool;
mod prefix;

pub use error::{KvError, Result};
pub use events::CacheEvent;
pub use ids::{BlockCopy, BlockId, SeqId};
pub use kept_plan::{KeptBudget, KeptPlan, KeptPlanConfig};
pub use layout::{CacheKind, Growth, KvLayout, LayerCache};
pub use manager::{Admission, Allocation, BlockManager, BlockManagerConfig, KeptPool, SeqConfig};
pub use metrics::{KeptMetrics, KvMetrics};
pub use plan::{KvBudget, KvDtype, KvPlan, KvPlanConfig, KvShape};
