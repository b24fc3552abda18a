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
    /// The kept pool's occupancy, where there is one ([`KeptPool`](crate::KeptPool)); the
    /// figures above are then the main pool's.
    pub kept: Option<KeptMetrics>,
}

/// A kept pool's occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptMetrics {
    pub total_blocks: usize,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: usize,
    pub free_blocks: usize,
    /// Cached blocks no sequence references.
    pub evictable_blocks: usize,
}

impl KvMetrics {
    /// Fraction of the pool referenced by sequences, in `[0, 1]`; with a kept pool, of
    /// whichever pool is fuller.
    pub fn usage(&self) -> f64 {
        let share = |used: usize, total: usize| match total {
            0 => 0.0,
            t => used as f64 / t as f64,
        };
        let kept = self
            .kept
            .map_or(0.0, |k| share(k.used_blocks, k.total_blocks));
        share(self.used_blocks, self.total_blocks).max(kept)
    }

    /// `(used, total)` blocks of the pool that holds every token of a sequence: the kept
    /// pool where there is one, else the one pool.
    pub fn whole_sequences(&self) -> (usize, usize) {
        match self.kept {
            Some(k) => (k.used_blocks, k.total_blocks),
            None => (self.used_blocks, self.total_blocks),
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
        )?;
        match self.kept {
            Some(k) => write!(
                f,
                "; kept blocks: {} used / {} total, {} free, {} evictable",
                k.used_blocks, k.total_blocks, k.free_blocks, k.evictable_blocks
            ),
            None => Ok(()),
        }
    }
}
