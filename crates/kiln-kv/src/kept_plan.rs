//! Sizing two pools: a [`KeptPool`] beside the main one (DeepSeek-V4: the window's and the
//! compressors' rows in main blocks, held only while the window reads them; the compressed
//! entries and indexer keys in kept blocks, held for the whole sequence). The main pool is
//! sized by how many sequences run, not by how long they are; the kept pool takes the rest.

use std::fmt;

use crate::plan::human;
use crate::{BlockManagerConfig, KeptPool, KvError, Result};

/// What to fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptBudget {
    /// This many bytes, over both pools.
    Bytes(u64),
    /// This many kept blocks, and main blocks for every running sequence.
    KeptBlocks(u32),
    /// One sequence of this many tokens (a one-shot generation).
    Tokens(usize),
}

/// Inputs of [`KeptPlan::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptPlanConfig {
    pub block_size: u32,
    /// Bytes a main block holds, and a kept block.
    pub main_block_bytes: u64,
    pub kept_block_bytes: u64,
    /// Every sequence's window over the main pool ([`KeptPool::window`]).
    pub window: usize,
    /// Sequences running at once, and tokens one step computes.
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    pub budget: KeptBudget,
}

/// How two pools fill a budget. `Display` says it in words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptPlan {
    pub block_size: u32,
    pub main_block_bytes: u64,
    pub kept_block_bytes: u64,
    pub window: usize,
    pub main_blocks: u32,
    pub kept_blocks: u32,
    /// Sequences whose windows the main pool holds at once (the scheduler preempts past
    /// them).
    pub windows: usize,
}

impl KeptPlan {
    /// Main blocks for the windows of as many running sequences as the budget allows (at
    /// most `max_num_seqs`, at most half a byte budget, at least one) and one step's chunk;
    /// kept blocks for the rest.
    pub fn new(cfg: &KeptPlanConfig) -> Result<Self> {
        let invalid = |field, reason: String| Err(KvError::InvalidConfig { field, reason });
        let b = cfg.block_size as usize;
        if b == 0 || cfg.main_block_bytes == 0 || cfg.kept_block_bytes == 0 {
            return invalid("block_size", format!("{cfg:?}: blocks hold nothing"));
        }
        // A window may start inside a block, and a sequence's chunk may end inside one.
        let per_window = cfg.window.div_ceil(b) + 2;
        let chunk = cfg.max_batched_tokens.div_ceil(b);
        let main_for = |seqs: usize| seqs * per_window + chunk;
        let seqs = cfg.max_num_seqs.max(1);
        let (windows, kept) = match cfg.budget {
            KeptBudget::KeptBlocks(n) => (seqs, n as usize),
            KeptBudget::Tokens(t) => (1, t.div_ceil(b) + 1),
            KeptBudget::Bytes(bytes) => {
                let one = main_for(1) as u64 * cfg.main_block_bytes;
                if one.saturating_add(cfg.kept_block_bytes) > bytes {
                    return invalid(
                        "kv_cache_memory",
                        format!(
                            "{} holds not one sequence's window and a step's chunk ({} main \
                             blocks of {}) and a kept block ({})",
                            human(bytes),
                            main_for(1),
                            human(cfg.main_block_bytes),
                            human(cfg.kept_block_bytes)
                        ),
                    );
                }
                let half = (bytes / 2).saturating_sub(chunk as u64 * cfg.main_block_bytes);
                let fit = (half / (per_window as u64 * cfg.main_block_bytes)) as usize;
                let windows = fit.clamp(1, seqs);
                let left = bytes - main_for(windows) as u64 * cfg.main_block_bytes;
                (windows, (left / cfg.kept_block_bytes) as usize)
            }
        };
        let count = |n: usize, field| {
            u32::try_from(n).map_err(|_| KvError::InvalidConfig {
                field,
                reason: format!("{n} blocks do not fit a u32"),
            })
        };
        Ok(Self {
            block_size: cfg.block_size,
            main_block_bytes: cfg.main_block_bytes,
            kept_block_bytes: cfg.kept_block_bytes,
            window: cfg.window,
            main_blocks: count(main_for(windows), "main blocks")?,
            kept_blocks: count(kept, "kept blocks")?,
            windows,
        })
    }

    /// Tokens of context the kept pool holds, over every sequence.
    pub fn num_tokens(&self) -> u64 {
        u64::from(self.kept_blocks) * u64::from(self.block_size)
    }

    /// Bytes both pools occupy.
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.main_blocks) * self.main_block_bytes
            + u64::from(self.kept_blocks) * self.kept_block_bytes
    }

    /// A [`BlockManagerConfig`] for these pools, with the defaults for everything else.
    pub fn block_manager_config(&self) -> BlockManagerConfig {
        BlockManagerConfig {
            block_size: self.block_size,
            kept: Some(KeptPool {
                num_blocks: self.kept_blocks,
                window: self.window,
            }),
            ..BlockManagerConfig::new(self.main_blocks)
        }
    }
}

impl fmt::Display for KeptPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "KV state in two pools of {}-token blocks, {} in all:",
            self.block_size,
            human(self.total_bytes())
        )?;
        writeln!(
            f,
            "  main: {} blocks of {} (the last {} tokens of {} running sequences, and a step's \
             chunk)",
            self.main_blocks,
            human(self.main_block_bytes),
            self.window,
            self.windows
        )?;
        write!(
            f,
            "  kept: {} blocks of {}: {} tokens of context over every sequence",
            self.kept_blocks,
            human(self.kept_block_bytes),
            self.num_tokens()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(budget: KeptBudget) -> KeptPlanConfig {
        KeptPlanConfig {
            block_size: 128,
            main_block_bytes: 1000,
            kept_block_bytes: 10,
            window: 128,
            max_num_seqs: 8,
            max_batched_tokens: 512,
            budget,
        }
    }

    #[test]
    fn a_byte_budget_gives_at_most_half_to_windows_and_the_rest_to_kept_blocks() {
        // 3 main blocks a window, 4 for a step's chunk.
        let p = KeptPlan::new(&cfg(KeptBudget::Bytes(1_000_000))).unwrap();
        assert_eq!((p.windows, p.main_blocks), (8, 8 * 3 + 4));
        assert_eq!(p.kept_blocks, (1_000_000 - 28_000) / 10);
        let p = KeptPlan::new(&cfg(KeptBudget::Bytes(20_000))).unwrap();
        assert_eq!((p.windows, p.main_blocks, p.kept_blocks), (2, 10, 1000));
        assert!(p.total_bytes() <= 20_000);
        let tight = KeptPlan::new(&cfg(KeptBudget::Bytes(7_010))).unwrap();
        assert_eq!(
            (tight.windows, tight.main_blocks, tight.kept_blocks),
            (1, 7, 1)
        );
        let err = KeptPlan::new(&cfg(KeptBudget::Bytes(7_009))).unwrap_err();
        assert!(err.to_string().contains("kv_cache_memory"), "{err}");
    }

    #[test]
    fn blocks_and_one_sequence_budgets() {
        let p = KeptPlan::new(&cfg(KeptBudget::KeptBlocks(50))).unwrap();
        assert_eq!((p.main_blocks, p.kept_blocks), (28, 50));
        let p = KeptPlan::new(&cfg(KeptBudget::Tokens(1000))).unwrap();
        assert_eq!((p.main_blocks, p.kept_blocks), (7, 9));
        let m = p.block_manager_config();
        assert_eq!(
            m.kept,
            Some(KeptPool {
                num_blocks: 9,
                window: 128
            })
        );
        assert_eq!((m.num_blocks, m.block_size), (7, 128));
        assert!(p.to_string().contains("1152 tokens of context"), "{p}");
    }
}
