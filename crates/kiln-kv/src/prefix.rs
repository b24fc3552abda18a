//! The prefix cache: full, computed blocks indexed by their chained hash, and an LRU list of
//! the cached blocks no sequence references (evictable, yet still reusable until evicted).

use std::collections::{BTreeMap, HashMap};

use crate::BlockId;
use crate::events::EventLog;
use crate::hash::{ROOT_HASH, block_hash};

/// What the cache remembers about one registered block.
#[derive(Debug)]
struct CachedBlock {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
    /// `Some(tick)` while the block is unreferenced and sits in the LRU list.
    lru_tick: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct PrefixCache {
    by_hash: HashMap<u64, BlockId>,
    /// Indexed by block id; `Some` for registered blocks.
    blocks: Vec<Option<CachedBlock>>,
    /// Evictable blocks by the tick they became unreferenced: the first entry is evicted first.
    lru: BTreeMap<u64, BlockId>,
    tick: u64,
    pub(crate) events: EventLog,
}

impl PrefixCache {
    pub(crate) fn new(num_blocks: usize) -> Self {
        Self {
            by_hash: HashMap::new(),
            blocks: (0..num_blocks).map(|_| None).collect(),
            lru: BTreeMap::new(),
            tick: 0,
            events: EventLog::default(),
        }
    }

    /// The registered block holding `tokens` after the chain ending in `parent`, if any.
    /// A hash match alone is not trusted: the stored parent hash and token ids must match too.
    pub(crate) fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        let id = *self.by_hash.get(&block_hash(parent, tokens))?;
        let meta = self.meta(id)?;
        (meta.parent == parent && *meta.tokens == *tokens).then_some(id)
    }

    /// Registers a just-filled block and returns its chain hash. When another block already
    /// holds this hash (the same prefix computed twice, or a true collision) the block stays
    /// unregistered; the returned hash still continues the sequence's chain.
    pub(crate) fn register(&mut self, id: BlockId, parent: u64, tokens: &[u32]) -> u64 {
        let hash = block_hash(parent, tokens);
        let free_slot = self.blocks.get(id.index()).is_some_and(Option::is_none);
        if free_slot && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, id);
            if let Some(slot) = self.blocks.get_mut(id.index()) {
                *slot = Some(CachedBlock {
                    hash,
                    parent,
                    tokens: tokens.into(),
                    lru_tick: None,
                });
            }
            self.events
                .stored(hash, (parent != ROOT_HASH).then_some(parent), tokens);
        }
        hash
    }

    pub(crate) fn is_registered(&self, id: BlockId) -> bool {
        self.meta(id).is_some()
    }

    pub(crate) fn is_evictable(&self, id: BlockId) -> bool {
        self.meta(id).is_some_and(|m| m.lru_tick.is_some())
    }

    /// Puts a registered block that just lost its last reference at the young end of the LRU.
    pub(crate) fn push_evictable(&mut self, id: BlockId) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(Some(meta)) = self.blocks.get_mut(id.index()) {
            meta.lru_tick = Some(tick);
            self.lru.insert(tick, id);
        }
    }

    /// Takes a block out of the LRU because a sequence references it again.
    pub(crate) fn take_evictable(&mut self, id: BlockId) {
        if let Some(Some(meta)) = self.blocks.get_mut(id.index())
            && let Some(tick) = meta.lru_tick.take()
        {
            self.lru.remove(&tick);
        }
    }

    /// Evicts the least recently released block: forgets its hash and hands it out.
    pub(crate) fn evict_oldest(&mut self) -> Option<BlockId> {
        let (_, id) = self.lru.pop_first()?;
        self.unregister(id);
        Some(id)
    }

    pub(crate) fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    pub(crate) fn num_registered(&self) -> usize {
        self.by_hash.len()
    }

    /// Forgets every registered block; returns the evictable ones (oldest first), which the
    /// pool turns into free blocks. Blocks still referenced simply stop being shareable.
    pub(crate) fn clear(&mut self) -> Vec<BlockId> {
        let evictable: Vec<BlockId> = std::mem::take(&mut self.lru).into_values().collect();
        self.by_hash.clear();
        self.blocks.iter_mut().for_each(|b| *b = None);
        self.events.cleared();
        evictable
    }

    fn unregister(&mut self, id: BlockId) {
        if let Some(slot) = self.blocks.get_mut(id.index())
            && let Some(meta) = slot.take()
        {
            self.by_hash.remove(&meta.hash);
            self.events.removed(meta.hash);
        }
    }

    fn meta(&self, id: BlockId) -> Option<&CachedBlock> {
        self.blocks.get(id.index())?.as_ref()
    }

    /// Consistency of the index, the per-block records and the LRU list.
    pub(crate) fn check(&self) -> Result<(), (Option<BlockId>, String)> {
        for (&hash, &id) in &self.by_hash {
            match self.meta(id) {
                Some(m) if m.hash == hash => {}
                _ => {
                    return Err((
                        Some(id),
                        format!("hash {hash:#x} maps to a block not holding it"),
                    ));
                }
            }
        }
        let mut in_lru = 0;
        for (i, meta) in self.blocks.iter().enumerate() {
            let Some(meta) = meta else { continue };
            let id = BlockId(i as u32);
            if self.by_hash.get(&meta.hash) != Some(&id) {
                return Err((
                    Some(id),
                    "registered block missing from the hash index".into(),
                ));
            }
            if meta.hash != block_hash(meta.parent, &meta.tokens) {
                return Err((Some(id), "stored hash does not match stored tokens".into()));
            }
            if let Some(tick) = meta.lru_tick {
                in_lru += 1;
                if self.lru.get(&tick) != Some(&id) {
                    return Err((Some(id), format!("LRU tick {tick} does not point back")));
                }
            }
        }
        if in_lru != self.lru.len() {
            return Err((
                None,
                format!(
                    "LRU holds {} entries, blocks claim {in_lru}",
                    self.lru.len()
                ),
            ));
        }
        Ok(())
    }
}
