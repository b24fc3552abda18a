//! Sequences whose logical blocks hold a block of each pool ([`KeptPool`]): admission,
//! allocation, prefix hits, reservation of main blocks chunk by chunk, and appends.

use super::{
    Admission, Allocation, BlockManager, KeptPool, PrefixHit, Seq, SeqConfig, take_checked,
    trim_window,
};
use crate::hash::{ROOT_HASH, block_hash};
use crate::pool::BlockPool;
use crate::{BlockId, KvError, Result, SeqId};

impl BlockManager {
    /// The first logical block a sliding window of `window` still reads once positions
    /// `0 .. computed` are computed (what `trim_window` keeps from).
    fn window_start(&self, computed: usize, window: usize) -> usize {
        (computed + 1).saturating_sub(window) / self.block_size()
    }

    /// The kept pool's blocks of `seq`, one per logical block of its reserved slots (empty
    /// without a kept pool).
    pub fn kept_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.seq(seq)?.kept)
    }

    /// Blocks the kept pool can hand out now (free plus evictable); `None` without one.
    pub fn kept_available_blocks(&self) -> Option<usize> {
        self.kept.as_ref().map(BlockPool::available)
    }

    /// Main blocks [`reserve`](Self::reserve) would take for the next `n` positions of `seq`.
    pub fn reserve_cost(&self, seq: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        if s.computed + n > s.len {
            return Err(KvError::PositionOutOfRange {
                seq,
                pos: s.computed + n - 1,
                len: s.len,
            });
        }
        if self.kept.is_none() {
            return Ok(0);
        }
        Ok(self
            .blocks_for_tokens(s.computed + n)
            .saturating_sub(s.table.len()))
    }

    /// The most of the next `max` positions of `seq` whose main blocks [`reserve`](Self::reserve)
    /// could take now (all of them without a kept pool).
    pub fn reservable(&self, seq: SeqId, max: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        let max = max.min(s.len - s.computed);
        if self.kept.is_none() {
            return Ok(max);
        }
        let covered = (s.table.len() + self.pool.available()) * self.block_size();
        Ok(max.min(covered.saturating_sub(s.computed)))
    }

    /// Takes the main pool's blocks for the next `n` positions of `seq` to compute
    /// (`computed .. computed + n`, within its reserved slots), before a step computes them.
    /// Without a kept pool every reserved slot already has its block and this takes none.
    /// All-or-nothing.
    pub fn reserve(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let needed = self.reserve_cost(seq, n)?;
        if needed > self.pool.available() {
            return Err(KvError::OutOfBlocks {
                what: "reserve",
                needed,
                available: self.pool.available(),
            });
        }
        let fresh = take_checked(&mut self.pool, needed)?;
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        s.table.extend(fresh);
        Ok(())
    }

    /// [`can_allocate`](Self::can_allocate) with a kept pool: the kept blocks of the whole
    /// prompt, and main blocks for the window and the block being computed.
    pub(super) fn can_allocate_kept(&self, prompt: &[u32], opts: SeqConfig) -> Admission {
        let (Some(kept), Some(k)) = (&self.kept, self.cfg.kept) else {
            return Admission::Never;
        };
        let total = self.blocks_for_tokens(prompt.len());
        let kept_usable = kept.num_blocks().saturating_sub(self.kept_watermark);
        let usable = self.pool.num_blocks().saturating_sub(self.watermark_blocks);
        let window_blocks = self.blocks_for_tokens(k.window).saturating_add(1);
        if prompt.is_empty() || total > kept_usable || window_blocks > usable {
            return Admission::Never;
        }
        let hit = self.find_prefix(prompt, opts);
        let kept_needed = total - hit.kept.len() + self.kept_watermark;
        let needed = 1 + self.watermark_blocks;
        if kept_needed > kept.available() - hit.kept_evictable
            || needed > self.pool.available() - hit.evictable
        {
            Admission::Later
        } else {
            Admission::Ok
        }
    }

    /// [`allocate`](Self::allocate) with a kept pool: the kept blocks of every prompt
    /// position, and of the main pool only the cached blocks the window still reads
    /// ([`reserve`](Self::reserve) takes the rest, chunk by chunk).
    pub(super) fn allocate_kept(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        opts: SeqConfig,
        k: KeptPool,
    ) -> Result<Allocation> {
        if opts.sliding_window.is_some() {
            return Err(KvError::InvalidConfig {
                field: "sliding_window",
                reason: "with a kept pool every sequence has the pool's window".into(),
            });
        }
        let hit = self.find_prefix(prompt, opts);
        let total = self.blocks_for_tokens(prompt.len());
        let kept_new = total - hit.kept.len();
        let Some(kept) = self.kept.as_mut() else {
            return Err(KvError::InvariantBroken {
                block: None,
                detail: "a kept pool configured but not built".into(),
            });
        };
        let available = kept.available() - hit.kept_evictable;
        if kept_new > available {
            return Err(KvError::OutOfBlocks {
                what: "prompt (kept pool)",
                needed: kept_new,
                available,
            });
        }
        for &id in &hit.kept {
            kept.retain(id);
        }
        let mut kept_table = hit.kept;
        kept_table.extend(take_checked(kept, kept_new)?);
        for &id in &hit.blocks {
            self.pool.retain(id);
        }
        let mut table = vec![BlockId::TRIMMED; hit.lo];
        table.extend(hit.blocks);
        let cached_tokens = hit.len * self.block_size();
        self.query_tokens += prompt.len() as u64;
        self.hit_tokens += cached_tokens as u64;
        let mut state = Seq {
            table,
            kept: kept_table,
            len: prompt.len(),
            computed: cached_tokens,
            pending: Vec::with_capacity(self.block_size()),
            last_hash: hit.last_hash,
            window: Some(k.window),
            trimmed: hit.lo,
        };
        let b = self.block_size();
        trim_window(&mut self.pool, &mut state, b);
        self.seqs.insert(seq, state);
        Ok(Allocation {
            cached_tokens,
            new_blocks: kept_new,
        })
    }

    /// Reserves `n` more slots of `seq` in both pools (decode: the main pool's blocks too).
    pub(super) fn append_kept(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let s = self.seq(seq)?;
        // Appending reserves main blocks for the new slots only: the prompt's come chunk by
        // chunk from `reserve`, and may not be had all at once this way.
        let b = self.block_size();
        if s.table.len() < self.blocks_for_tokens(s.len) {
            return Err(KvError::NotReserved {
                seq,
                pos: s.table.len() * b,
            });
        }
        let total = self.blocks_for_tokens(s.len + n);
        let needed = total.saturating_sub(s.table.len());
        let kept_needed = total - s.kept.len();
        let kept_available = self.kept.as_ref().map_or(0, BlockPool::available);
        for (needed, available) in [
            (needed, self.pool.available()),
            (kept_needed, kept_available),
        ] {
            if needed > available {
                return Err(KvError::OutOfBlocks {
                    what: "append",
                    needed,
                    available,
                });
            }
        }
        let fresh = take_checked(&mut self.pool, needed)?;
        let kept_fresh = match self.kept.as_mut() {
            Some(kept) => take_checked(kept, kept_needed)?,
            None => Vec::new(),
        };
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        s.table.extend(fresh);
        s.kept.extend(kept_fresh);
        s.len += n;
        Ok(())
    }

    /// The longest cached prefix whose every block the kept pool holds and whose blocks the
    /// window still reads at its end the main pool holds.
    pub(super) fn find_prefix_kept(
        &self,
        prompt: &[u32],
        kept: &BlockPool,
        window: usize,
    ) -> PrefixHit {
        let b = self.block_size();
        let reusable = (prompt.len() - 1) / b;
        let mut parent = ROOT_HASH;
        let (mut kept_ids, mut mains, mut hashes) = (Vec::new(), Vec::new(), Vec::new());
        for chunk in prompt.chunks_exact(b).take(reusable) {
            let Some(id) = kept.cache.lookup(parent, chunk) else {
                break;
            };
            mains.push(self.pool.cache.lookup(parent, chunk));
            parent = block_hash(parent, chunk);
            kept_ids.push(id);
            hashes.push(parent);
        }
        let mut hit = PrefixHit::none();
        for len in (1..=kept_ids.len()).rev() {
            let lo = self.window_start(len * b, window).min(len);
            let Some(blocks) = mains[lo..len].iter().copied().collect::<Option<Vec<_>>>() else {
                continue;
            };
            let evictable = |pool: &BlockPool, ids: &[BlockId]| {
                ids.iter()
                    .filter(|&&id| pool.cache.is_evictable(id))
                    .count()
            };
            hit.evictable = evictable(&self.pool, &blocks);
            hit.kept_evictable = evictable(kept, &kept_ids[..len]);
            hit.blocks = blocks;
            hit.lo = lo;
            hit.len = len;
            hit.last_hash = hashes[len - 1];
            hit.kept = kept_ids[..len].to_vec();
            break;
        }
        hit
    }
}
