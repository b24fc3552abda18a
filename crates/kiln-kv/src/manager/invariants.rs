//! `check_invariants`: the bookkeeping's consistency rules, checked from scratch.

use crate::pool::BlockPool;
use crate::{BlockId, BlockManager, KvError, Result};

fn broken(block: Option<BlockId>, detail: impl Into<String>) -> KvError {
    KvError::InvariantBroken {
        block,
        detail: detail.into(),
    }
}

impl BlockManager {
    /// Recomputes every reference count from the block tables and checks the pool against it:
    /// each block is exactly one of free, evictable (cached, unreferenced) or in use; each
    /// in-use block's count equals the table entries naming it; the prefix cache's index and
    /// LRU agree; each table has one entry per logical block, sliding-window placeholders only
    /// as a leading run (with a kept pool: the main table at least to the computed slots, the
    /// kept pool checked as the main one). Costs O(blocks + table entries); meant for tests and debugging.
    pub fn check_invariants(&self) -> Result<()> {
        let n = self.pool.num_blocks();
        let b = self.block_size();
        let mut refs = vec![0u32; n];
        let mut kept_refs = vec![0u32; self.kept.as_ref().map_or(0, BlockPool::num_blocks)];
        for (&seq, s) in &self.seqs {
            let ctx = |what: String| broken(None, format!("{seq}: {what}"));
            let (slots, computed) = (
                self.blocks_for_tokens(s.len),
                self.blocks_for_tokens(s.computed),
            );
            // With a kept pool the main table reaches at least the computed slots (reserve
            // takes the rest chunk by chunk), and the kept table every reserved one.
            let main_ok = match self.kept {
                Some(_) => (computed..=slots).contains(&s.table.len()) && s.kept.len() == slots,
                None => s.table.len() == slots && s.kept.is_empty(),
            };
            if !main_ok {
                return Err(ctx(format!(
                    "{} main and {} kept table entries for {} slots, {} computed",
                    s.table.len(),
                    s.kept.len(),
                    s.len,
                    s.computed
                )));
            }
            if self.kept.is_some() {
                for &id in &s.kept {
                    match kept_refs.get_mut(id.index()) {
                        Some(r) => *r += 1,
                        None => return Err(ctx(format!("kept {id} is outside the kept pool"))),
                    }
                }
            }
            if s.computed > s.len || s.pending.len() != s.computed % b {
                return Err(ctx(format!(
                    "computed {} of {} slots with {} pending tokens",
                    s.computed,
                    s.len,
                    s.pending.len()
                )));
            }
            let expected_trim = match s.window {
                Some(w) => ((s.computed + 1).saturating_sub(w) / b).min(s.table.len()),
                None => 0,
            };
            let leading = s.table.iter().take_while(|id| id.is_trimmed()).count();
            let total = s.table.iter().filter(|id| id.is_trimmed()).count();
            if s.trimmed != expected_trim || leading != s.trimmed || total != s.trimmed {
                return Err(ctx(format!(
                    "{total} trimmed entries ({leading} leading), expected {expected_trim}"
                )));
            }
            for &id in s.table.iter().filter(|id| !id.is_trimmed()) {
                match refs.get_mut(id.index()) {
                    Some(r) => *r += 1,
                    None => return Err(ctx(format!("{id} is outside the pool of {n}"))),
                }
            }
        }
        let used = check_pool(&self.pool, &refs, "")?;
        let m = self.metrics();
        if m.used_blocks != used || m.free_blocks + m.evictable_blocks + used != n {
            return Err(broken(
                None,
                format!("metrics {m:?} disagree with {used} used blocks"),
            ));
        }
        if let Some(kept) = &self.kept {
            check_pool(kept, &kept_refs, "kept pool: ")?;
        }
        Ok(())
    }
}

/// Checks `pool` against the references its tables hold (`refs`, by block): each block is
/// exactly one of free, evictable or in use, with the count the tables give it; and the
/// prefix cache's index and LRU agree. Returns the blocks in use; errors start with `what`.
fn check_pool(pool: &BlockPool, refs: &[u32], what: &str) -> Result<usize> {
    let n = pool.num_blocks();
    let mut on_free_list = vec![false; n];
    for &id in pool.free_list() {
        match on_free_list.get_mut(id.index()) {
            Some(seen) if !*seen => *seen = true,
            Some(_) => {
                return Err(broken(
                    Some(id),
                    format!("{what}on the free list twice (double free)"),
                ));
            }
            None => {
                return Err(broken(
                    Some(id),
                    format!("{what}free list names a block outside the pool"),
                ));
            }
        }
    }
    let mut used = 0;
    for (i, (&expected, &free)) in refs.iter().zip(&on_free_list).enumerate() {
        let id = BlockId(i as u32);
        let actual = pool.refcount(id);
        if actual != expected {
            return Err(broken(
                Some(id),
                format!("{what}refcount {actual}, tables hold {expected}"),
            ));
        }
        let cached = pool.cache.is_registered(id);
        let evictable = pool.cache.is_evictable(id);
        let ok = match (actual, free, evictable) {
            (0, true, false) => !cached,
            (0, false, true) => true,
            (0, false, false) => false, // leaked: unreferenced yet nowhere to be allocated
            (_, false, false) => true,
            _ => false,
        };
        if !ok {
            return Err(broken(
                Some(id),
                format!(
                    "{what}refcount {actual}, free {free}, cached {cached}, evictable {evictable}"
                ),
            ));
        }
        used += usize::from(actual > 0);
    }
    pool.cache
        .check()
        .map_err(|(block, detail)| broken(block, format!("{what}prefix cache: {detail}")))?;
    Ok(used)
}
