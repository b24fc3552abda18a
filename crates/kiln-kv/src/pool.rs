//! The block pool: reference counts, the free list, and the prefix cache's evictable blocks.
//!
//! Every block is in exactly one state: free (on the free list), evictable (unreferenced but
//! registered in the prefix cache, on its LRU list) or in use (referenced by block tables).

use crate::BlockId;
use crate::prefix::PrefixCache;

#[derive(Debug)]
pub(crate) struct BlockPool {
    /// Number of block-table entries (over all sequences) naming each block.
    refs: Vec<u32>,
    /// Free blocks; popped from the end, so block 0 is handed out first.
    free: Vec<BlockId>,
    pub(crate) cache: PrefixCache,
    evictions: u64,
}

impl BlockPool {
    pub(crate) fn new(num_blocks: u32) -> Self {
        Self {
            refs: vec![0; num_blocks as usize],
            free: (0..num_blocks).rev().map(BlockId).collect(),
            cache: PrefixCache::new(num_blocks as usize),
            evictions: 0,
        }
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks an allocation may take: free ones, then evictable cached ones.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.cache.num_evictable()
    }

    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }

    pub(crate) fn refcount(&self, id: BlockId) -> u32 {
        self.refs.get(id.index()).copied().unwrap_or(0)
    }

    pub(crate) fn free_list(&self) -> &[BlockId] {
        &self.free
    }

    /// A fresh block with one reference: a free one if any, else the LRU-oldest cached one.
    pub(crate) fn take(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.cache.evict_oldest()?;
                self.evictions += 1;
                tracing::trace!(block = id.0, "evicted cached KV block");
                id
            }
        };
        self.set_ref(id, 1);
        Some(id)
    }

    /// One more reference to a block already in use or cached (fork, prefix hit).
    pub(crate) fn retain(&mut self, id: BlockId) {
        if self.refcount(id) == 0 {
            self.cache.take_evictable(id);
        }
        self.set_ref(id, self.refcount(id) + 1);
    }

    /// Drops one reference; at zero the block becomes evictable if cached, else free.
    pub(crate) fn release(&mut self, id: BlockId) {
        let left = self.refcount(id).saturating_sub(1);
        self.set_ref(id, left);
        if left == 0 {
            if self.cache.is_registered(id) {
                self.cache.push_evictable(id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// Forgets the prefix cache; evictable blocks become free. Returns how many did.
    pub(crate) fn clear_cache(&mut self) -> usize {
        let freed = self.cache.clear();
        let n = freed.len();
        self.free.extend(freed);
        n
    }

    fn set_ref(&mut self, id: BlockId, n: u32) {
        if let Some(r) = self.refs.get_mut(id.index()) {
            *r = n;
        }
    }
}
