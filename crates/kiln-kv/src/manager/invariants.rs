//! `check_invariants`: the bookkeeping's consistency rules, checked from scratch.

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
    /// as a leading run. Costs O(blocks + table entries); meant for tests and debugging.
    pub fn check_invariants(&self) -> Result<()> {
        let n = self.pool.num_blocks();
        let b = self.block_size();
        let mut refs = vec![0u32; n];
        for (&seq, s) in &self.seqs {
            let ctx = |what: String| broken(None, format!("{seq}: {what}"));
            if s.table.len() != self.blocks_for_tokens(s.len) {
                return Err(ctx(format!(
                    "{} table entries for {} slots",
                    s.table.len(),
                    s.len
                )));
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
        let mut on_free_list = vec![false; n];
        for &id in self.pool.free_list() {
            match on_free_list.get_mut(id.index()) {
                Some(seen) if !*seen => *seen = true,
                Some(_) => return Err(broken(Some(id), "on the free list twice (double free)")),
                None => return Err(broken(Some(id), "free list names a block outside the pool")),
            }
        }
        let mut used = 0;
        for (i, (&expected, &free)) in refs.iter().zip(&on_free_list).enumerate() {
            let id = BlockId(i as u32);
            let actual = self.pool.refcount(id);
            if actual != expected {
                return Err(broken(
                    Some(id),
                    format!("refcount {actual}, tables hold {expected}"),
                ));
            }
            let cached = self.pool.cache.is_registered(id);
            let evictable = self.pool.cache.is_evictable(id);
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
                        "refcount {actual}, free {free}, cached {cached}, evictable {evictable}"
                    ),
                ));
            }
            used += usize::from(actual > 0);
        }
        let m = self.metrics();
        if m.used_blocks != used || m.free_blocks + m.evictable_blocks + used != n {
            return Err(broken(
                None,
                format!("metrics {m:?} disagree with {used} used blocks"),
            ));
        }
        self.pool
            .cache
            .check()
            .map_err(|(block, detail)| broken(block, format!("prefix cache: {detail}")))
    }
}
