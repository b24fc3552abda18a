//! The block manager: per-sequence block tables over the block pool, with copy-on-write
//! forks, prefix-cache reuse, sliding-window trimming and slot mapping.

mod invariants;
mod kept;

use std::collections::BTreeMap;
use std::ops::Range;

use crate::hash::ROOT_HASH;
use crate::pool::BlockPool;
use crate::{BlockCopy, BlockId, KeptMetrics, KvError, KvMetrics, Result, SeqId};

/// How the pool is laid out and shared.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockManagerConfig {
    /// Blocks in the pool (see [`KvPlan`](crate::KvPlan) to derive it from a memory budget).
    pub num_blocks: u32,
    /// Tokens per block, `B`.
    pub block_size: u32,
    /// Fraction of the pool [`BlockManager::can_allocate`] keeps free for running decodes.
    pub watermark: f32,
    /// Register full computed blocks and reuse them for later prompts with the same prefix.
    pub enable_prefix_caching: bool,
    /// A second pool beside this one, for attention that keeps two caches of each block of
    /// tokens (see [`KeptPool`]); `None`: one pool.
    pub kept: Option<KeptPool>,
}

/// A second pool whose blocks no window gives back, for attention that keeps two caches of
/// each block of tokens at two rates: DeepSeek-V4's raw rows (and its compressors' rows) in
/// the main pool, given back as every sequence's window moves past them, and the entries
/// compressed from them in this one, kept for the sequence's life. Each logical block of a
/// sequence then holds one block of each pool (the main one only while the window needs it,
/// and only once [`BlockManager::reserve`] has reserved it: a long prompt never holds more
/// than its window and the chunk being computed of main blocks). Such sequences cannot be
/// forked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptPool {
    /// Blocks in the kept pool.
    pub num_blocks: u32,
    /// Every sequence's sliding window over the main pool: a query at `p` reads the main
    /// pool's rows from `p - window + 1`.
    pub window: usize,
}

impl BlockManagerConfig {
    /// `num_blocks` blocks of 16 tokens, a 1% watermark, prefix caching on.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            num_blocks,
            block_size: 16,
            watermark: 0.01,
            enable_prefix_caching: true,
            kept: None,
        }
    }
}

/// Per-sequence options given at allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqConfig {
    /// Sliding-window attention: a query at position `p` sees positions `p - W + 1 ..= p`.
    /// Blocks wholly before the window of every query still to come go back to the pool.
    pub sliding_window: Option<usize>,
    /// Compute every prompt token, reusing none of the prefix cache's blocks (a request for
    /// the prompt's log-probabilities needs every position's logits). The sequence's own
    /// blocks still enter the cache as they fill.
    pub recompute_prefix: bool,
}

/// Whether a prompt can be admitted now (see [`BlockManager::can_allocate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Enough blocks are free or evictable, above the watermark.
    Ok,
    /// Not now: wait for running sequences to finish (or preempt some).
    Later,
    /// Never: the prompt needs more blocks than the pool holds above the watermark.
    Never,
}

/// What [`BlockManager::allocate`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Leading prompt tokens whose K/V came from the prefix cache (whole blocks). The model
    /// computes positions `cached_tokens .. prompt.len()`, always at least one.
    pub cached_tokens: usize,
    /// Blocks taken from the free list or by eviction.
    pub new_blocks: usize,
}

#[derive(Debug, Clone)]
struct Seq {
    /// Logical block `i` holds positions `i * B .. (i + 1) * B`; [`BlockId::TRIMMED`] where a
    /// sliding window gave the block back (always a leading run). With a kept pool it may end
    /// before `len`'s last block: the rest is not reserved yet.
    table: Vec<BlockId>,
    /// The kept pool's block of each logical block (empty without a kept pool).
    kept: Vec<BlockId>,
    /// Reserved slots (positions `0 .. len`).
    len: usize,
    /// Positions `0 .. computed` hold K/V written by the model (or taken from the cache).
    computed: usize,
    /// Token ids of the computed part of the last, not yet full, block.
    pending: Vec<u32>,
    /// Chain hash of the last full computed block ([`ROOT_HASH`] before the first).
    last_hash: u64,
    window: Option<usize>,
    /// Number of leading [`BlockId::TRIMMED`] entries.
    trimmed: usize,
}

/// Cached blocks a prompt can reuse, found without changing anything: its first `len`
/// logical blocks, of which the main pool supplies those from `lo` on (the ones before lie
/// behind the window) and the kept pool, if any, every one.
struct PrefixHit {
    blocks: Vec<BlockId>,
    lo: usize,
    len: usize,
    last_hash: u64,
    /// Hits on unreferenced blocks: they stop counting as available once taken.
    evictable: usize,
    kept: Vec<BlockId>,
    kept_evictable: usize,
}

impl PrefixHit {
    fn none() -> Self {
        Self {
            blocks: Vec::new(),
            lo: 0,
            len: 0,
            last_hash: ROOT_HASH,
            evictable: 0,
            kept: Vec::new(),
            kept_evictable: 0,
        }
    }
}

/// Paged KV bookkeeping: who holds which block. Never touches the device; every allocation
/// is all-or-nothing and returns [`KvError::OutOfBlocks`] instead of taking part of a request.
#[derive(Debug)]
pub struct BlockManager {
    cfg: BlockManagerConfig,
    pool: BlockPool,
    /// The kept pool, when `cfg.kept` asks for one.
    kept: Option<BlockPool>,
    kept_watermark: usize,
    seqs: BTreeMap<SeqId, Seq>,
    watermark_blocks: usize,
    query_tokens: u64,
    hit_tokens: u64,
}

impl BlockManager {
    /// An empty pool of `cfg.num_blocks` free blocks.
    pub fn new(cfg: BlockManagerConfig) -> Result<Self> {
        let invalid = |field, reason: &str| KvError::InvalidConfig {
            field,
            reason: reason.to_owned(),
        };
        if cfg.num_blocks == 0 || cfg.num_blocks == u32::MAX {
            return Err(invalid("num_blocks", "must be in 1 ..= u32::MAX - 1"));
        }
        if cfg.block_size == 0 {
            return Err(invalid("block_size", "must be at least 1"));
        }
        if u64::from(cfg.num_blocks) * u64::from(cfg.block_size) > u64::from(u32::MAX) {
            return Err(invalid(
                "num_blocks",
                "num_blocks * block_size must fit a u32 slot",
            ));
        }
        if !(0.0..1.0).contains(&cfg.watermark) {
            return Err(invalid("watermark", "must be a fraction in [0, 1)"));
        }
        let watermark_blocks = (f64::from(cfg.watermark) * f64::from(cfg.num_blocks)) as usize;
        if let Some(k) = cfg.kept {
            if k.num_blocks == 0 || k.num_blocks == u32::MAX {
                return Err(invalid("kept.num_blocks", "must be in 1 ..= u32::MAX - 1"));
            }
            if u64::from(k.num_blocks) * u64::from(cfg.block_size) > u64::from(u32::MAX) {
                return Err(invalid(
                    "kept.num_blocks",
                    "kept.num_blocks * block_size must fit a u32 slot",
                ));
            }
            if k.window == 0 {
                return Err(invalid("kept.window", "must be at least 1"));
            }
        }
        let kept_watermark = cfg.kept.map_or(0, |k| {
            (f64::from(cfg.watermark) * f64::from(k.num_blocks)) as usize
        });
        Ok(Self {
            kept: cfg.kept.map(|k| BlockPool::new(k.num_blocks)),
            kept_watermark,
            pool: BlockPool::new(cfg.num_blocks),
            cfg,
            seqs: BTreeMap::new(),
            watermark_blocks,
            query_tokens: 0,
            hit_tokens: 0,
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &BlockManagerConfig {
        &self.cfg
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.cfg.block_size as usize
    }

    /// Blocks needed to hold `tokens` slots.
    pub fn blocks_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size())
    }

    /// Blocks an allocation may take right now (free plus evictable cached ones).
    pub fn available_blocks(&self) -> usize {
        self.pool.available()
    }

    /// Admission check for a prompt: `Ok` when it fits while leaving the watermark free for
    /// running decodes, counting blocks the prefix cache would supply.
    pub fn can_allocate(&self, prompt: &[u32], opts: SeqConfig) -> Admission {
        if self.kept.is_some() {
            return self.can_allocate_kept(prompt, opts);
        }
        let total = self.blocks_for_tokens(prompt.len());
        let usable = self.pool.num_blocks().saturating_sub(self.watermark_blocks);
        if prompt.is_empty() || total > usable {
            return Admission::Never;
        }
        let hit = self.find_prefix(prompt, opts);
        let needed = total - hit.blocks.len() + self.watermark_blocks;
        if needed > self.pool.available() - hit.evictable {
            Admission::Later
        } else {
            Admission::Ok
        }
    }

    /// Leading tokens of `prompt` the prefix cache would supply now to a sequence with
    /// `opts` (a query; changes nothing).
    pub fn cached_prefix_tokens(&self, prompt: &[u32], opts: SeqConfig) -> usize {
        self.find_prefix(prompt, opts).len * self.block_size()
    }

    /// Gives `seq` a block table with slots for every prompt position, reusing cached blocks
    /// for its longest cached prefix. All-or-nothing; ignores the watermark (that is
    /// [`can_allocate`](Self::can_allocate)'s business).
    pub fn allocate(&mut self, seq: SeqId, prompt: &[u32], opts: SeqConfig) -> Result<Allocation> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSeq(seq));
        }
        if prompt.is_empty() {
            return Err(KvError::EmptyPrompt(seq));
        }
        if opts.sliding_window == Some(0) {
            return Err(KvError::InvalidConfig {
                field: "sliding_window",
                reason: "must be at least 1".into(),
            });
        }
        if let Some(k) = self.cfg.kept {
            return self.allocate_kept(seq, prompt, opts, k);
        }
        let hit = self.find_prefix(prompt, opts);
        let total = self.blocks_for_tokens(prompt.len());
        let new_blocks = total - hit.blocks.len();
        let available = self.pool.available() - hit.evictable;
        if new_blocks > available {
            return Err(KvError::OutOfBlocks {
                what: "prompt",
                needed: new_blocks,
                available,
            });
        }
        let mut table = Vec::with_capacity(total);
        for &id in &hit.blocks {
            self.pool.retain(id);
            table.push(id);
        }
        for _ in 0..new_blocks {
            table.push(self.take_block()?);
        }
        let cached_tokens = hit.blocks.len() * self.block_size();
        self.query_tokens += prompt.len() as u64;
        self.hit_tokens += cached_tokens as u64;
        let mut state = Seq {
            table,
            kept: Vec::new(),
            len: prompt.len(),
            computed: cached_tokens,
            pending: Vec::with_capacity(self.block_size()),
            last_hash: hit.last_hash,
            window: opts.sliding_window,
            trimmed: 0,
        };
        trim_window(&mut self.pool, &mut state, self.cfg.block_size as usize);
        self.seqs.insert(seq, state);
        tracing::trace!(
            seq = seq.0,
            cached_tokens,
            new_blocks,
            "allocated KV blocks"
        );
        Ok(Allocation {
            cached_tokens,
            new_blocks,
        })
    }

    /// Blocks [`append_slots`](Self::append_slots) would take for `n` more slots, counting a
    /// copy-on-write of a shared last block.
    pub fn append_cost(&self, seq: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        Ok(self.blocks_for_tokens(s.len + n) - s.table.len() + usize::from(self.needs_cow(s, n)))
    }

    /// Reserves `n` more slots (positions `len .. len + n`) for decode. When the last block is
    /// partially filled and shared with another sequence, it is replaced by a fresh block and
    /// the returned [`BlockCopy`] must run on the device before this step's K/V are written.
    /// All-or-nothing.
    pub fn append_slots(&mut self, seq: SeqId, n: usize) -> Result<Option<BlockCopy>> {
        if self.kept.is_some() {
            return self.append_kept(seq, n).map(|()| None);
        }
        let needed = self.append_cost(seq, n)?;
        if needed > self.pool.available() {
            return Err(KvError::OutOfBlocks {
                what: "append",
                needed,
                available: self.pool.available(),
            });
        }
        let cow = match self.seqs.get(&seq) {
            Some(s) if self.needs_cow(s, n) => s.table.last().copied(),
            _ => None,
        };
        let copy = match cow {
            Some(src) => {
                let dst = self.take_block()?;
                self.pool.release(src);
                Some(BlockCopy { src, dst })
            }
            None => None,
        };
        let mut fresh = Vec::with_capacity(needed);
        for _ in 0..needed - usize::from(copy.is_some()) {
            fresh.push(self.take_block()?);
        }
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        if let (Some(copy), Some(last)) = (copy, s.table.last_mut()) {
            *last = copy.dst;
        }
        s.table.extend(fresh);
        s.len += n;
        Ok(copy)
    }

    /// Marks the next `tokens.len()` reserved slots as computed, holding `tokens`. Blocks that
    /// become full are registered in the prefix cache; a sliding window trims what fell out.
    pub fn commit(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let b = self.block_size();
        let caching = self.cfg.enable_prefix_caching;
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        if tokens.len() > s.len - s.computed {
            return Err(KvError::CommitOverrun {
                seq,
                reserved: s.len - s.computed,
                got: tokens.len(),
            });
        }
        let end = s.computed + tokens.len();
        if self.kept.is_some() && end > s.table.len() * b {
            return Err(KvError::NotReserved {
                seq,
                pos: s.table.len() * b,
            });
        }
        for &t in tokens {
            s.pending.push(t);
            s.computed += 1;
            if s.pending.len() == b {
                let i = s.computed / b - 1;
                if let (Some(kept), Some(&id), true) = (&mut self.kept, s.kept.get(i), caching) {
                    kept.cache.register(id, s.last_hash, &s.pending);
                }
                s.last_hash = match s.table.get(i) {
                    Some(&id) if caching => self.pool.cache.register(id, s.last_hash, &s.pending),
                    _ => crate::hash::block_hash(s.last_hash, &s.pending),
                };
                s.pending.clear();
            }
        }
        trim_window(&mut self.pool, s, b);
        Ok(())
    }

    /// Gives back reserved slots past `len` (speculative decoding: the slots of rejected draft
    /// tokens). Only uncomputed slots can go, so `len` must lie in `computed ..= reserved`.
    /// Blocks no longer covered return to the pool; they were never committed, so they never
    /// entered the prefix cache. Whatever K/V a step wrote into the dropped slots is garbage
    /// that the next write to those positions overwrites.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let b = self.block_size();
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        if len < s.computed || len > s.len {
            return Err(KvError::TruncateOutOfRange {
                seq,
                len,
                computed: s.computed,
                reserved: s.len,
            });
        }
        let keep = len.div_ceil(b).max(s.trimmed);
        for id in s.table.drain(keep.min(s.table.len())..).rev() {
            self.pool.release(id);
        }
        if let Some(kept) = &mut self.kept {
            for id in s.kept.drain(len.div_ceil(b)..).rev() {
                kept.release(id);
            }
        }
        s.len = len;
        Ok(())
    }

    /// Gives `child` the same block table as `parent`, sharing every block (for `n > 1` and
    /// beam-like branching). The parent's reserved slots must all be computed.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.seqs.contains_key(&child) {
            return Err(KvError::DuplicateSeq(child));
        }
        if self.kept.is_some() {
            return Err(KvError::ForkWithKeptPool(parent));
        }
        let p = self.seq(parent)?;
        if p.computed != p.len {
            return Err(KvError::ForkUncomputed {
                parent,
                uncomputed: p.len - p.computed,
            });
        }
        let state = p.clone();
        for &id in state.table.iter().filter(|id| !id.is_trimmed()) {
            self.pool.retain(id);
        }
        self.seqs.insert(child, state);
        Ok(())
    }

    /// Ends `seq`: its blocks lose a reference and, unless shared, become free or (if cached)
    /// evictable. Released last block first, so a cached chain is evicted from its tail.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seqs.remove(&seq).ok_or(KvError::UnknownSeq(seq))?;
        for &id in s.table.iter().rev().filter(|id| !id.is_trimmed()) {
            self.pool.release(id);
        }
        if let Some(kept) = &mut self.kept {
            for &id in s.kept.iter().rev() {
                kept.release(id);
            }
        }
        Ok(())
    }

    /// Starts (or stops) recording what changes in the prefix cache, for
    /// [`take_cache_events`](Self::take_cache_events). Off by default: nothing is kept.
    pub fn record_cache_events(&mut self, on: bool) {
        self.pool.cache.events.set_on(on);
    }

    /// The prefix-cache changes since the last call, in order (empty unless recording).
    pub fn take_cache_events(&mut self) -> Vec<crate::CacheEvent> {
        self.pool.cache.events.take()
    }

    /// Forgets the prefix cache; evictable blocks become free. Returns how many did.
    pub fn clear_prefix_cache(&mut self) -> usize {
        self.kept.as_mut().map_or(0, BlockPool::clear_cache) + self.pool.clear_cache()
    }

    /// Whether `seq` has a block table.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Sequences holding block tables, in id order.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Reserved slots of `seq`.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// Computed (committed) slots of `seq`.
    pub fn computed_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.computed)
    }

    /// The block table of `seq`, one entry per logical block (upload `id.0` per entry).
    /// For a sliding-window sequence, leading entries may be [`BlockId::TRIMMED`]
    /// (`u32::MAX`): their positions lie outside the window of every query still to come, so
    /// a windowed attention kernel never reads them; [`slot`](Self::slot) refuses them.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.seq(seq)?.table)
    }

    /// References to `id` from block tables (0 for free and evictable blocks).
    pub fn refcount(&self, id: BlockId) -> u32 {
        self.pool.refcount(id)
    }

    /// Physical slot of position `pos`: `block_id * B + pos % B`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<u32> {
        let s = self.seq(seq)?;
        self.slot_in(seq, s, pos)
    }

    /// Physical slots of `positions`, in order (the slot mapping the engine uploads).
    pub fn slots(&self, seq: SeqId, positions: Range<usize>) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(positions.len());
        self.extend_slots(seq, positions, &mut out)?;
        Ok(out)
    }

    /// Appends the physical slots of `positions` to `out` (for building a batch).
    pub fn extend_slots(
        &self,
        seq: SeqId,
        positions: Range<usize>,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let s = self.seq(seq)?;
        for pos in positions {
            out.push(self.slot_in(seq, s, pos)?);
        }
        Ok(())
    }

    /// Pool and prefix-cache figures.
    pub fn metrics(&self) -> KvMetrics {
        let total = self.pool.num_blocks();
        let free = self.pool.num_free();
        let evictable = self.pool.cache.num_evictable();
        KvMetrics {
            total_blocks: total,
            used_blocks: total - free - evictable,
            free_blocks: free,
            evictable_blocks: evictable,
            cached_blocks: self.pool.cache.num_registered(),
            num_seqs: self.seqs.len(),
            prefix_query_tokens: self.query_tokens,
            prefix_hit_tokens: self.hit_tokens,
            evictions: self.pool.evictions(),
            kept: self.kept.as_ref().map(|k| {
                let (total, free) = (k.num_blocks(), k.num_free());
                let evictable = k.cache.num_evictable();
                KeptMetrics {
                    total_blocks: total,
                    used_blocks: total - free - evictable,
                    free_blocks: free,
                    evictable_blocks: evictable,
                }
            }),
        }
    }

    fn seq(&self, seq: SeqId) -> Result<&Seq> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSeq(seq))
    }

    fn slot_in(&self, seq: SeqId, s: &Seq, pos: usize) -> Result<u32> {
        if pos >= s.len {
            return Err(KvError::PositionOutOfRange {
                seq,
                pos,
                len: s.len,
            });
        }
        let b = self.block_size();
        match s.table.get(pos / b) {
            Some(id) if !id.is_trimmed() => Ok(id.0 * self.cfg.block_size + (pos % b) as u32),
            Some(_) => Err(KvError::TrimmedPosition { seq, pos }),
            None => Err(KvError::NotReserved { seq, pos }),
        }
    }

    /// Appending `n > 0` slots writes into the last block when it is partially filled; if that
    /// block is shared it must be copied first.
    fn needs_cow(&self, s: &Seq, n: usize) -> bool {
        n > 0
            && !s.len.is_multiple_of(self.block_size())
            && s.table.last().is_some_and(|&id| self.pool.refcount(id) > 1)
    }

    fn take_block(&mut self) -> Result<BlockId> {
        self.pool.take().ok_or_else(ran_dry)
    }

    /// Longest run of cached full blocks heading `prompt`, leaving at least one token to
    /// compute; none when `opts` asks to recompute the prefix.
    fn find_prefix(&self, prompt: &[u32], opts: SeqConfig) -> PrefixHit {
        let mut hit = PrefixHit::none();
        if !self.cfg.enable_prefix_caching || opts.recompute_prefix || prompt.is_empty() {
            return hit;
        }
        if let (Some(kept), Some(k)) = (&self.kept, self.cfg.kept) {
            return self.find_prefix_kept(prompt, kept, k.window);
        }
        let b = self.block_size();
        let reusable = (prompt.len() - 1) / b;
        for chunk in prompt.chunks_exact(b).take(reusable) {
            let Some(id) = self.pool.cache.lookup(hit.last_hash, chunk) else {
                break;
            };
            hit.last_hash = crate::hash::block_hash(hit.last_hash, chunk);
            hit.evictable += usize::from(self.pool.cache.is_evictable(id));
            hit.blocks.push(id);
        }
        hit.len = hit.blocks.len();
        hit
    }
}

/// A pool handing out fewer blocks than its availability promised (a bug in `kiln-kv`).
fn ran_dry() -> KvError {
    KvError::InvariantBroken {
        block: None,
        detail: "pool ran dry after the availability check".into(),
    }
}

/// `n` fresh blocks of `pool`, whose availability was checked.
fn take_checked(pool: &mut BlockPool, n: usize) -> Result<Vec<BlockId>> {
    (0..n).map(|_| pool.take().ok_or_else(ran_dry)).collect()
}

/// Gives back the blocks wholly before the window of every query still to come. The earliest
/// such query is at position `computed`, which sees positions from `computed + 1 - W`.
fn trim_window(pool: &mut BlockPool, s: &mut Seq, block_size: usize) {
    let Some(window) = s.window else { return };
    let first_visible = (s.computed + 1).saturating_sub(window);
    let keep_from = (first_visible / block_size).min(s.table.len());
    for entry in s.table.iter_mut().take(keep_from).skip(s.trimmed) {
        pool.release(*entry);
        *entry = BlockId::TRIMMED;
    }
    s.trimmed = s.trimmed.max(keep_from);
}
