//! A snapshot of the pool and prefix-cache figures.

use std::fmt;

/// Pool occupancy and prefix-cache counters, taken by [`BlockManager::metrics`](crate::BlockManager::metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvMetrics {
    /// Blocks in the pool.
    pub total_blocks: usize,
    /// Blocks referenced by at least one block table.
    pub used_blocks: usize,
    /// Blocks on the free list.
    pub free_blocks: usize,
    /// Cached blocks no table references: reusable by a prefix hit, reclaimed LRU on demand.
    pub evictable_blocks: usize,
    /// Blocks registered in the prefix cache (in use or evictable).
    pub cached_blocks: usize,
    /// Sequences holding block tables.
    pub num_seqs: usize,
    /// Prompt tokens looked up in the prefix cache (cumulative).
    pub prefix_query_tokens: u64,
    /// Prompt tokens served from the prefix cache (cumulative).
    pub prefix_hit_tokens: u64,
    /// Cached blocks evicted to make room (cumulative).
    pub evictions: u64,
}

impl KvMetrics {
    /// Fraction of the pool referenced by sequences, in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.used_blocks as f64 / self.total_blocks as f64
        }
    }

    /// Fraction of looked-up prompt tokens served from the cache, in `[0, 1]`.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_query_tokens == 0 {
            0.0
        } else {
            self.prefix_hit_tokens as f64 / self.prefix_query_tokens as f64
        }
    }
}

impl fmt::Display for KvMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KV blocks: {} used / {} total ({:.1}%), {} free, {} evictable; prefix cache: {} of {} \
             prompt tokens hit ({:.1}%), {} evictions",
            self.used_blocks,
            self.total_blocks,
            100.0 * self.usage(),
            self.free_blocks,
            self.evictable_blocks,
            self.prefix_hit_tokens,
            self.prefix_query_tokens,
            100.0 * self.prefix_hit_rate(),
            self.evictions
        )
    }
}
