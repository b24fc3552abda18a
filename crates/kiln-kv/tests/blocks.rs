//! Block manager behaviour: exhaustion, copy-on-write, admission, prefix reuse, LRU eviction,
//! sliding windows and slot mapping.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_kv::{
    Admission, BlockCopy, BlockId, BlockManager, BlockManagerConfig, CacheEvent, KvError,
    SeqConfig, SeqId,
};

fn manager(num_blocks: u32, block_size: u32) -> BlockManager {
    BlockManager::new(BlockManagerConfig {
        block_size,
        watermark: 0.0,
        ..BlockManagerConfig::new(num_blocks)
    })
    .unwrap()
}

fn tables(kv: &BlockManager) -> Vec<(SeqId, Vec<BlockId>, usize, usize)> {
    kv.seq_ids()
        .map(|s| {
            let t = kv.block_table(s).unwrap().to_vec();
            (s, t, kv.seq_len(s).unwrap(), kv.computed_len(s).unwrap())
        })
        .collect()
}

/// Allocates `prompt` and commits all of it, as after a prefill step.
fn prefill(kv: &mut BlockManager, seq: u64, prompt: &[u32]) -> usize {
    let a = kv
        .allocate(SeqId(seq), prompt, SeqConfig::default())
        .unwrap();
    kv.commit(SeqId(seq), &prompt[a.cached_tokens..]).unwrap();
    a.cached_tokens
}

#[test]
fn exhaustion_is_an_error_and_changes_nothing() {
    let mut kv = manager(4, 4);
    kv.allocate(SeqId(1), &[1; 12], SeqConfig::default())
        .unwrap();
    let before = (kv.metrics(), tables(&kv));

    let err = kv
        .allocate(SeqId(2), &[2; 8], SeqConfig::default())
        .unwrap_err();
    assert_eq!(
        err,
        KvError::OutOfBlocks {
            what: "prompt",
            needed: 2,
            available: 1
        }
    );
    assert!(!kv.contains(SeqId(2)));
    assert_eq!((kv.metrics(), tables(&kv)), before);

    // Appending 5 slots needs 2 more blocks; only 1 is free.
    let err = kv.append_slots(SeqId(1), 5).unwrap_err();
    assert!(
        matches!(
            err,
            KvError::OutOfBlocks {
                needed: 2,
                available: 1,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!((kv.metrics(), tables(&kv)), before);
    kv.check_invariants().unwrap();

    // The last free block is enough for 4 more slots.
    assert_eq!(kv.append_slots(SeqId(1), 4).unwrap(), None);
    assert_eq!(kv.metrics().free_blocks, 0);
    assert!(matches!(
        kv.append_slots(SeqId(1), 1),
        Err(KvError::OutOfBlocks { .. })
    ));
    kv.check_invariants().unwrap();
}

#[test]
fn copy_on_write_when_appending_into_a_shared_partial_block() {
    let mut kv = manager(8, 4);
    prefill(&mut kv, 1, &[1, 2, 3, 4, 5, 6]);
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.fork(SeqId(1), SeqId(3)).unwrap();
    let shared = kv.block_table(SeqId(1)).unwrap().to_vec();
    assert_eq!(kv.block_table(SeqId(2)).unwrap(), shared);
    assert!(shared.iter().all(|&b| kv.refcount(b) == 3));

    // First appender copies the shared last block; the full first block stays shared.
    let copy = kv.append_slots(SeqId(2), 1).unwrap().unwrap();
    assert_eq!(copy.src, shared[1]);
    assert_eq!(kv.block_table(SeqId(2)).unwrap(), [shared[0], copy.dst]);
    assert_eq!(kv.refcount(shared[0]), 3);
    assert_eq!(kv.refcount(shared[1]), 2);
    assert_eq!(kv.refcount(copy.dst), 1);

    let copy3 = kv.append_slots(SeqId(3), 1).unwrap().unwrap();
    assert_eq!(copy3.src, shared[1]);
    assert_ne!(copy3.dst, copy.dst);
    // The last holder writes in place.
    assert_eq!(kv.append_slots(SeqId(1), 1).unwrap(), None);
    assert_eq!(kv.block_table(SeqId(1)).unwrap(), shared);
    assert_eq!(kv.refcount(shared[1]), 1);
    kv.check_invariants().unwrap();

    // A full shared last block needs no copy: the new slot opens a new block.
    let mut kv = manager(8, 4);
    prefill(&mut kv, 1, &[1, 2, 3, 4]);
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    assert_eq!(kv.append_slots(SeqId(2), 1).unwrap(), None);
    assert_eq!(kv.block_table(SeqId(2)).unwrap().len(), 2);
    assert_eq!(kv.refcount(kv.block_table(SeqId(1)).unwrap()[0]), 2);
    kv.check_invariants().unwrap();
}

#[test]
fn copy_on_write_that_cannot_get_a_block_changes_nothing() {
    let mut kv = manager(2, 4);
    prefill(&mut kv, 1, &[1, 2, 3, 4, 5]);
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    let before = (kv.metrics(), tables(&kv));
    assert_eq!(kv.append_cost(SeqId(2), 1).unwrap(), 1);
    assert!(matches!(
        kv.append_slots(SeqId(2), 1),
        Err(KvError::OutOfBlocks { needed: 1, .. })
    ));
    assert_eq!((kv.metrics(), tables(&kv)), before);
    kv.check_invariants().unwrap();
}

#[test]
fn fork_requires_computed_slots_and_a_new_child() {
    let mut kv = manager(8, 4);
    kv.allocate(SeqId(1), &[1, 2, 3], SeqConfig::default())
        .unwrap();
    kv.commit(SeqId(1), &[1, 2]).unwrap();
    assert_eq!(
        kv.fork(SeqId(1), SeqId(2)),
        Err(KvError::ForkUncomputed {
            parent: SeqId(1),
            uncomputed: 1
        })
    );
    kv.commit(SeqId(1), &[3]).unwrap();
    assert_eq!(
        kv.fork(SeqId(1), SeqId(1)),
        Err(KvError::DuplicateSeq(SeqId(1)))
    );
    assert_eq!(
        kv.fork(SeqId(9), SeqId(2)),
        Err(KvError::UnknownSeq(SeqId(9)))
    );
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn misuse_is_reported_not_panicked() {
    let mut kv = manager(8, 4);
    assert_eq!(
        kv.allocate(SeqId(1), &[], SeqConfig::default()),
        Err(KvError::EmptyPrompt(SeqId(1)))
    );
    kv.allocate(SeqId(1), &[1, 2], SeqConfig::default())
        .unwrap();
    assert_eq!(
        kv.allocate(SeqId(1), &[1], SeqConfig::default()),
        Err(KvError::DuplicateSeq(SeqId(1)))
    );
    assert_eq!(
        kv.commit(SeqId(1), &[1, 2, 3]),
        Err(KvError::CommitOverrun {
            seq: SeqId(1),
            reserved: 2,
            got: 3
        })
    );
    assert_eq!(kv.free(SeqId(5)), Err(KvError::UnknownSeq(SeqId(5))));
    assert_eq!(
        kv.slot(SeqId(1), 2),
        Err(KvError::PositionOutOfRange {
            seq: SeqId(1),
            pos: 2,
            len: 2
        })
    );
    assert!(matches!(
        kv.allocate(
            SeqId(2),
            &[1],
            SeqConfig {
                sliding_window: Some(0),
                ..SeqConfig::default()
            }
        ),
        Err(KvError::InvalidConfig {
            field: "sliding_window",
            ..
        })
    ));
    for bad in [
        BlockManagerConfig {
            block_size: 0,
            ..BlockManagerConfig::new(8)
        },
        BlockManagerConfig::new(0),
        BlockManagerConfig {
            watermark: 1.0,
            ..BlockManagerConfig::new(8)
        },
        BlockManagerConfig {
            block_size: 1 << 16,
            ..BlockManagerConfig::new(1 << 16)
        },
    ] {
        assert!(matches!(
            BlockManager::new(bad),
            Err(KvError::InvalidConfig { .. })
        ));
    }
    kv.check_invariants().unwrap();
}

#[test]
fn watermark_keeps_blocks_for_running_decodes() {
    let mut kv = BlockManager::new(BlockManagerConfig {
        block_size: 4,
        watermark: 0.1,
        enable_prefix_caching: false,
        ..BlockManagerConfig::new(100)
    })
    .unwrap();
    assert_eq!(
        kv.can_allocate(&[7; 4 * 91], SeqConfig::default()),
        Admission::Never
    );
    assert_eq!(
        kv.can_allocate(&[7; 4 * 90], SeqConfig::default()),
        Admission::Ok
    );
    assert_eq!(kv.can_allocate(&[], SeqConfig::default()), Admission::Never);
    kv.allocate(SeqId(1), &[7; 4 * 85], SeqConfig::default())
        .unwrap();
    // 15 blocks left, 10 of them kept back.
    assert_eq!(
        kv.can_allocate(&[7; 4 * 5], SeqConfig::default()),
        Admission::Ok
    );
    assert_eq!(
        kv.can_allocate(&[7; 4 * 5 + 1], SeqConfig::default()),
        Admission::Later
    );
    // The watermark is for admission only: a running sequence may still grow into it.
    kv.commit(SeqId(1), &[7; 4 * 85]).unwrap();
    kv.append_slots(SeqId(1), 4 * 15).unwrap();
    assert_eq!(kv.metrics().free_blocks, 0);
    assert_eq!(
        kv.can_allocate(&[7], SeqConfig::default()),
        Admission::Later
    );
    kv.free(SeqId(1)).unwrap();
    assert_eq!(
        kv.can_allocate(&[7; 4 * 90], SeqConfig::default()),
        Admission::Ok
    );
}

#[test]
fn prefix_hits_reduce_the_tokens_to_compute() {
    let mut kv = manager(16, 4);
    let system: Vec<u32> = (100..110).collect(); // 10 tokens: 2 full blocks + 2
    assert_eq!(prefill(&mut kv, 1, &system), 0);

    // A running sequence's full blocks are shared at once.
    let mut prompt = system.clone();
    prompt.extend([1, 2, 3]);
    assert_eq!(kv.cached_prefix_tokens(&prompt, SeqConfig::default()), 8);
    let a = kv
        .allocate(SeqId(2), &prompt, SeqConfig::default())
        .unwrap();
    assert_eq!((a.cached_tokens, a.new_blocks), (8, 2));
    assert_eq!(kv.computed_len(SeqId(2)).unwrap(), 8);
    let (t1, t2) = (
        kv.block_table(SeqId(1)).unwrap(),
        kv.block_table(SeqId(2)).unwrap(),
    );
    assert_eq!(t1[..2], t2[..2]);
    assert_eq!(kv.refcount(t1[0]), 2);
    kv.commit(SeqId(2), &prompt[8..]).unwrap();

    // A finished sequence's blocks stay reusable.
    kv.free(SeqId(1)).unwrap();
    kv.free(SeqId(2)).unwrap();
    assert_eq!(kv.metrics().used_blocks, 0);
    assert_eq!(kv.metrics().evictable_blocks, 3);
    assert_eq!(prefill(&mut kv, 3, &prompt), 12);

    // A prompt that is exactly cached still computes its last block.
    let exact: Vec<u32> = system[..8].to_vec();
    assert_eq!(kv.cached_prefix_tokens(&exact, SeqConfig::default()), 4);
    // A different token in the first block shares nothing.
    let mut other = system.clone();
    other[0] = 999;
    assert_eq!(kv.cached_prefix_tokens(&other, SeqConfig::default()), 0);

    let m = kv.metrics();
    assert_eq!(m.prefix_query_tokens, 10 + 13 + 13);
    assert_eq!(m.prefix_hit_tokens, 8 + 12);
    kv.check_invariants().unwrap();
}

/// A sequence that must compute its whole prompt (prompt log-probabilities) reuses no cached
/// block, yet its own full blocks still serve later sequences, the cache keeping one block
/// per content.
#[test]
fn a_sequence_may_recompute_a_cached_prefix() {
    let mut kv = manager(16, 4);
    let prompt: Vec<u32> = (100..110).collect();
    prefill(&mut kv, 1, &prompt);
    let again = SeqConfig {
        recompute_prefix: true,
        ..SeqConfig::default()
    };
    assert_eq!(kv.cached_prefix_tokens(&prompt, again), 0);
    assert_eq!(kv.can_allocate(&prompt, again), Admission::Ok);
    let a = kv.allocate(SeqId(2), &prompt, again).unwrap();
    assert_eq!((a.cached_tokens, a.new_blocks), (0, 3));
    let (t1, t2) = (
        kv.block_table(SeqId(1)).unwrap().to_vec(),
        kv.block_table(SeqId(2)).unwrap().to_vec(),
    );
    assert!(t1.iter().all(|b| !t2.contains(b)), "{t1:?} {t2:?}");
    kv.commit(SeqId(2), &prompt).unwrap();
    kv.free(SeqId(1)).unwrap();
    kv.free(SeqId(2)).unwrap();
    // The first sequence's blocks answer the next lookup; the duplicates are plain free
    // blocks.
    assert_eq!(kv.cached_prefix_tokens(&prompt, SeqConfig::default()), 8);
    assert_eq!(kv.metrics().cached_blocks, 2);
    kv.check_invariants().unwrap();
}

#[test]
fn prefix_caching_can_be_disabled() {
    let mut kv = BlockManager::new(BlockManagerConfig {
        block_size: 4,
        enable_prefix_caching: false,
        ..BlockManagerConfig::new(8)
    })
    .unwrap();
    prefill(&mut kv, 1, &[1, 2, 3, 4, 5]);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(prefill(&mut kv, 2, &[1, 2, 3, 4, 5]), 0);
    assert_eq!(kv.metrics().cached_blocks, 0);
    kv.check_invariants().unwrap();
}

#[test]
fn evicts_the_least_recently_released_cached_block() {
    let mut kv = manager(3, 2);
    for (seq, prompt) in [(1, [1, 2]), (2, [3, 4]), (3, [5, 6])] {
        // A one-block prompt, committed: the full block is registered in the cache.
        kv.allocate(SeqId(seq), &prompt, SeqConfig::default())
            .unwrap();
        kv.commit(SeqId(seq), &prompt).unwrap();
    }
    for seq in [1, 2, 3] {
        kv.free(SeqId(seq)).unwrap();
    }
    assert_eq!(kv.metrics().evictable_blocks, 3);

    // Reusing [3, 4] takes its block out of the LRU; the new block evicts [1, 2] (oldest).
    let a = kv
        .allocate(SeqId(4), &[3, 4, 9], SeqConfig::default())
        .unwrap();
    assert_eq!((a.cached_tokens, a.new_blocks), (2, 1));
    assert_eq!(kv.metrics().evictions, 1);
    assert_eq!(kv.cached_prefix_tokens(&[1, 2, 0], SeqConfig::default()), 0);
    assert_eq!(kv.cached_prefix_tokens(&[5, 6, 0], SeqConfig::default()), 2);
    assert_eq!(kv.cached_prefix_tokens(&[3, 4, 0], SeqConfig::default()), 2);

    // Next eviction takes [5, 6]; [3, 4] is in use and never evicted.
    kv.allocate(SeqId(5), &[7], SeqConfig::default()).unwrap();
    assert_eq!(kv.metrics().evictions, 2);
    assert_eq!(kv.cached_prefix_tokens(&[5, 6, 0], SeqConfig::default()), 0);
    assert_eq!(kv.cached_prefix_tokens(&[3, 4, 0], SeqConfig::default()), 2);
    assert!(matches!(
        kv.allocate(SeqId(6), &[8], SeqConfig::default()),
        Err(KvError::OutOfBlocks {
            needed: 1,
            available: 0,
            ..
        })
    ));
    kv.check_invariants().unwrap();
}

#[test]
fn clearing_the_cache_frees_evictable_blocks() {
    let mut kv = manager(8, 2);
    prefill(&mut kv, 1, &[1, 2, 3, 4, 5]);
    prefill(&mut kv, 2, &[9, 9, 9]);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.metrics().evictable_blocks, 2);
    assert_eq!(kv.clear_prefix_cache(), 2);
    let m = kv.metrics();
    assert_eq!(
        (
            m.free_blocks,
            m.evictable_blocks,
            m.cached_blocks,
            m.used_blocks
        ),
        (6, 0, 0, 2)
    );
    assert_eq!(kv.cached_prefix_tokens(&[9, 9, 0], SeqConfig::default()), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn sliding_window_gives_back_blocks_outside_the_window() {
    let mut kv = manager(16, 4);
    let seq = SeqId(1);
    let window = SeqConfig {
        sliding_window: Some(6),
        ..SeqConfig::default()
    };
    kv.allocate(seq, &[1; 8], window).unwrap();
    kv.commit(seq, &[1; 8]).unwrap();
    // The next query (position 8) sees 3..=8: block 0 (positions 0..4) is still needed.
    assert!(kv.block_table(seq).unwrap().iter().all(|b| !b.is_trimmed()));
    assert_eq!(kv.metrics().used_blocks, 2);

    kv.append_slots(seq, 4).unwrap();
    kv.commit(seq, &[2; 4]).unwrap();
    // Position 12 sees 7..=12: block 0 is out, block 1 (4..8) still holds position 7.
    let table = kv.block_table(seq).unwrap().to_vec();
    assert_eq!(table.len(), 3);
    assert!(table[0].is_trimmed() && !table[1].is_trimmed());
    assert_eq!(kv.metrics().used_blocks, 2);
    assert_eq!(
        kv.slot(seq, 3),
        Err(KvError::TrimmedPosition { seq, pos: 3 })
    );
    assert_eq!(kv.slot(seq, 7).unwrap(), table[1].0 * 4 + 3);

    kv.append_slots(seq, 8).unwrap();
    kv.commit(seq, &[3; 8]).unwrap();
    // Position 20 sees 15..=20: blocks 0..3 are gone, indices stay stable.
    let table = kv.block_table(seq).unwrap();
    assert_eq!(table.len(), 5);
    assert_eq!(table.iter().filter(|b| b.is_trimmed()).count(), 3);
    assert_eq!(kv.metrics().used_blocks, 2);
    kv.check_invariants().unwrap();

    // A fork keeps the placeholders; freeing both returns everything.
    kv.fork(seq, SeqId(2)).unwrap();
    kv.check_invariants().unwrap();
    kv.free(seq).unwrap();
    kv.free(SeqId(2)).unwrap();
    kv.clear_prefix_cache();
    assert_eq!(kv.metrics().free_blocks, 16);
    kv.check_invariants().unwrap();
}

#[test]
fn slot_mapping_is_block_times_size_plus_offset() {
    let mut kv = manager(8, 4);
    kv.allocate(SeqId(1), &[1, 2, 3], SeqConfig::default())
        .unwrap(); // block 0
    kv.allocate(SeqId(2), &[1; 8], SeqConfig::default())
        .unwrap(); // blocks 1, 2
    kv.commit(SeqId(1), &[1, 2, 3]).unwrap();
    kv.append_slots(SeqId(1), 3).unwrap(); // fills block 0, opens block 3
    assert_eq!(kv.block_table(SeqId(1)).unwrap(), [BlockId(0), BlockId(3)]);
    assert_eq!(kv.slots(SeqId(1), 0..6).unwrap(), [0, 1, 2, 3, 12, 13]);
    assert_eq!(kv.slots(SeqId(2), 2..8).unwrap(), [6, 7, 8, 9, 10, 11]);
    let mut batch = Vec::new();
    kv.extend_slots(SeqId(2), 7..8, &mut batch).unwrap();
    kv.extend_slots(SeqId(1), 5..6, &mut batch).unwrap();
    assert_eq!(batch, [11, 13]);
    assert!(matches!(
        kv.slots(SeqId(1), 5..7),
        Err(KvError::PositionOutOfRange { pos: 6, .. })
    ));
    assert_eq!(
        BlockCopy {
            src: BlockId(0),
            dst: BlockId(3)
        }
        .dst
        .to_string(),
        "block 3"
    );
}

#[test]
fn metrics_report_usage() {
    let mut kv = manager(10, 4);
    prefill(&mut kv, 1, &[1; 10]);
    let m = kv.metrics();
    assert_eq!((m.total_blocks, m.used_blocks, m.free_blocks), (10, 3, 7));
    assert!((m.usage() - 0.3).abs() < 1e-12);
    assert_eq!(m.cached_blocks, 2);
    assert_eq!(m.num_seqs, 1);
    assert!(m.to_string().contains("3 used / 10 total (30.0%)"), "{m}");
}

#[test]
fn truncating_gives_back_rejected_draft_slots_without_caching_them() {
    let mut kv = manager(8, 4);
    let prompt: Vec<u32> = (10..16).collect(); // 6 tokens: a full block and 2
    prefill(&mut kv, 1, &prompt);
    assert_eq!(kv.metrics().used_blocks, 2);

    // A verification step: the sampled token plus 5 draft tokens, slots 6..12.
    kv.append_slots(SeqId(1), 6).unwrap();
    assert_eq!(kv.block_table(SeqId(1)).unwrap().len(), 3);
    // Two tokens turn out right (the sampled one and one draft): commit them, drop the rest.
    kv.commit(SeqId(1), &[16, 17]).unwrap();
    kv.truncate(SeqId(1), 8).unwrap();
    assert_eq!(
        (
            kv.seq_len(SeqId(1)).unwrap(),
            kv.computed_len(SeqId(1)).unwrap()
        ),
        (8, 8)
    );
    assert_eq!(kv.block_table(SeqId(1)).unwrap().len(), 2);
    assert_eq!(kv.metrics().used_blocks, 2);
    kv.check_invariants().unwrap();

    // Only committed tokens enter the prefix cache: the rejected drafts 18.. never do.
    let mut again: Vec<u32> = (10..18).collect();
    again.push(1);
    assert_eq!(kv.cached_prefix_tokens(&again, SeqConfig::default()), 8);
    let mut rejected: Vec<u32> = (10..18).collect();
    rejected.extend([18, 19, 20, 21, 1]);
    assert_eq!(kv.cached_prefix_tokens(&rejected, SeqConfig::default()), 8);

    // Truncating into computed slots, or past the reserved ones, is refused and changes nothing.
    kv.append_slots(SeqId(1), 3).unwrap();
    for bad in [7, 12] {
        assert!(matches!(
            kv.truncate(SeqId(1), bad),
            Err(KvError::TruncateOutOfRange { .. })
        ));
    }
    assert_eq!(kv.seq_len(SeqId(1)).unwrap(), 11);
    kv.truncate(SeqId(1), 8).unwrap();
    assert!(matches!(
        kv.truncate(SeqId(9), 0),
        Err(KvError::UnknownSeq(_))
    ));
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.metrics().used_blocks, 0);
    kv.check_invariants().unwrap();
}

/// A router's view of one replica, built from the cache events alone as llm-d's indexer builds
/// it: each stored block keyed by its parent and its own tokens (the consumer's keys, not the
/// cache's hash function).
#[derive(Default)]
struct EventIndex {
    /// (parent hash, the block's tokens) → the block's hash.
    blocks: std::collections::HashMap<(Option<u64>, Vec<u32>), u64>,
}

impl EventIndex {
    fn apply(&mut self, events: Vec<CacheEvent>, block_size: usize) {
        for e in events {
            match e {
                CacheEvent::Stored {
                    hashes,
                    parent,
                    token_ids,
                } => {
                    assert_eq!(token_ids.len(), hashes.len() * block_size);
                    let mut parent = parent;
                    for (h, chunk) in hashes.iter().zip(token_ids.chunks(block_size)) {
                        self.blocks.insert((parent, chunk.to_vec()), *h);
                        parent = Some(*h);
                    }
                }
                CacheEvent::Removed { hashes } => {
                    let before = self.blocks.len();
                    self.blocks.retain(|_, h| !hashes.contains(h));
                    assert_eq!(before - self.blocks.len(), hashes.len(), "removed unknown");
                }
                CacheEvent::AllCleared => self.blocks.clear(),
            }
        }
    }

    /// Leading tokens of `prompt` the replica holds, as the router predicts it.
    fn cached_tokens(&self, prompt: &[u32], block_size: usize) -> usize {
        let mut parent = None;
        let mut n = 0;
        for chunk in prompt.chunks_exact(block_size) {
            match self.blocks.get(&(parent, chunk.to_vec())) {
                Some(h) => {
                    parent = Some(*h);
                    n += block_size;
                }
                None => break,
            }
        }
        n
    }
}

/// Random prefills, frees, evictions and clears over a small vocabulary (so prefixes are
/// shared): after every operation, the index rebuilt from the events alone predicts exactly
/// the cached prefix the block manager finds for any prompt.
#[test]
fn cache_events_rebuild_the_prefix_index() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let bs = 2;
    let mut kv = manager(12, bs as u32);
    kv.record_cache_events(true);
    let mut index = EventIndex::default();
    let mut rng = StdRng::seed_from_u64(7);
    let prompt = |rng: &mut StdRng| -> Vec<u32> {
        let len = rng.random_range(1..=9);
        (0..len).map(|_| rng.random_range(1..=2)).collect()
    };
    let mut live: Vec<u64> = Vec::new();
    let (mut stored, mut cleared) = (0, 0);
    for step in 0..400u64 {
        match rng.random_range(0..10) {
            0..=4 => {
                let p = prompt(&mut rng);
                if kv.can_allocate(&p, SeqConfig::default()) == Admission::Ok {
                    prefill(&mut kv, step, &p);
                    live.push(step);
                }
            }
            5..=8 if !live.is_empty() => {
                let seq = live.swap_remove(rng.random_range(0..live.len()));
                kv.free(SeqId(seq)).unwrap();
            }
            _ => {}
        }
        if step % 97 == 96 {
            kv.clear_prefix_cache();
        }
        let events = kv.take_cache_events();
        cleared += events
            .iter()
            .filter(|e| matches!(e, CacheEvent::AllCleared))
            .count();
        stored += events
            .iter()
            .filter(|e| matches!(e, CacheEvent::Stored { .. }))
            .count();
        index.apply(events, bs);
        for _ in 0..8 {
            let mut probe = prompt(&mut rng);
            probe.push(9);
            assert_eq!(
                index.cached_tokens(&probe, bs),
                kv.cached_prefix_tokens(&probe, SeqConfig::default()),
                "step {step}, probe {probe:?}"
            );
        }
        kv.check_invariants().unwrap();
    }
    assert!(stored > 20, "{stored} stored events");
    assert_eq!(cleared, 4);
    assert!(kv.metrics().evictions > 0, "no eviction exercised");
    // Off: nothing is kept.
    kv.record_cache_events(false);
    prefill(&mut kv, 1000, &[2, 1, 2, 1, 2]);
    assert!(kv.take_cache_events().is_empty());
}
