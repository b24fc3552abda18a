//! A kept pool beside the main one (DeepSeek-V4's entries beside its window's rows): random
//! interleavings of allocation (with prefix hits), chunk reservation, decode appends, commits,
//! frees and cache clears against simulated memories of both pools. The window's rows are
//! always there, no block leaks or is overwritten while shared or cached, prefix hits bring
//! back what both pools held, and both pools end fully free. Then the cases by hand.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use kiln_kv::{Admission, BlockManager, BlockManagerConfig, KeptPool, KvError, SeqConfig, SeqId};
use proptest::prelude::*;

const MAIN: u32 = 10;
const KEPT: u32 = 16;
const BLOCK: usize = 4;
const WINDOW: usize = 6;

fn manager(main: u32, kept: u32, window: usize) -> BlockManager {
    BlockManager::new(BlockManagerConfig {
        block_size: BLOCK as u32,
        watermark: 0.0,
        kept: Some(KeptPool {
            num_blocks: kept,
            window,
        }),
        ..BlockManagerConfig::new(main)
    })
    .unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Allocate {
        family: u32,
        shared: usize,
        len: usize,
    },
    Reserve {
        pick: usize,
        n: usize,
    },
    Append {
        pick: usize,
        n: usize,
        token: u32,
    },
    Commit {
        pick: usize,
        n: usize,
    },
    Free {
        pick: usize,
    },
    ClearCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3u32, 0..24usize, 1..30usize)
            .prop_map(|(family, shared, len)| Op::Allocate { family, shared, len }),
        4 => (any::<usize>(), 1..9usize).prop_map(|(pick, n)| Op::Reserve { pick, n }),
        3 => (any::<usize>(), 1..4usize, 0..50u32).prop_map(|(pick, n, token)| Op::Append { pick, n, token }),
        5 => (any::<usize>(), 1..9usize).prop_map(|(pick, n)| Op::Commit { pick, n }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => Just(Op::ClearCache),
    ]
}

/// The engine's side: each sequence's tokens; the main pool's memory (a token a slot, the
/// raw row of that position) and the kept pool's (a block's tokens, what its entries were
/// made of).
struct Harness {
    kv: BlockManager,
    tokens: BTreeMap<SeqId, Vec<u32>>,
    main: Vec<Option<u32>>,
    kept: Vec<[Option<u32>; BLOCK]>,
    next_seq: u64,
}

impl Harness {
    fn new() -> Self {
        Self {
            kv: manager(MAIN, KEPT, WINDOW),
            tokens: BTreeMap::new(),
            main: vec![None; MAIN as usize * BLOCK],
            kept: vec![[None; BLOCK]; KEPT as usize],
            next_seq: 0,
        }
    }

    fn pick(&self, i: usize) -> Option<SeqId> {
        let n = self.tokens.len();
        (n > 0).then(|| *self.tokens.keys().nth(i % n).unwrap())
    }

    fn snapshot(&self) -> String {
        let tables: Vec<_> = self
            .kv
            .seq_ids()
            .map(|s| {
                (
                    self.kv.block_table(s).unwrap().to_vec(),
                    self.kv.kept_table(s).unwrap().to_vec(),
                    self.kv.seq_len(s).unwrap(),
                )
            })
            .collect();
        format!(
            "{:?} {:?} {tables:?}",
            self.kv.metrics(),
            self.kv.kept_available_blocks()
        )
    }

    /// Every computed position's kept block holds its token; every computed position the
    /// window still reads has its main slot, holding its token.
    fn check_memory(&self) {
        for (&seq, toks) in &self.tokens {
            let computed = self.kv.computed_len(seq).unwrap();
            let kept = self.kv.kept_table(seq).unwrap();
            for (pos, &tok) in toks.iter().enumerate().take(computed) {
                let block = kept[pos / BLOCK].0 as usize;
                assert_eq!(
                    self.kept[block][pos % BLOCK],
                    Some(tok),
                    "{seq} kept pos {pos}"
                );
                let in_window = pos + WINDOW > computed;
                match self.kv.slot(seq, pos) {
                    Ok(slot) => assert_eq!(self.main[slot as usize], Some(tok), "{seq} pos {pos}"),
                    Err(KvError::TrimmedPosition { .. }) if !in_window => {}
                    Err(e) => panic!("{seq} pos {pos} (computed {computed}): {e}"),
                }
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Allocate {
                family,
                shared,
                len,
            } => {
                self.next_seq += 1;
                let seq = SeqId(self.next_seq);
                let prompt: Vec<u32> = (0..len)
                    .map(|i| {
                        if i < shared {
                            1000 * (family + 1) + i as u32
                        } else {
                            100_000 + self.next_seq as u32 * 100 + i as u32
                        }
                    })
                    .collect();
                let admission = self.kv.can_allocate(&prompt, SeqConfig::default());
                let cached = self.kv.cached_prefix_tokens(&prompt, SeqConfig::default());
                let before = self.snapshot();
                match self.kv.allocate(seq, &prompt, SeqConfig::default()) {
                    Ok(a) => {
                        assert!(a.cached_tokens < prompt.len() && a.cached_tokens % BLOCK == 0);
                        assert_eq!(a.cached_tokens, cached);
                        self.tokens.insert(seq, prompt);
                        // What the hit brought back is what both pools hold.
                        self.check_memory();
                    }
                    Err(KvError::OutOfBlocks { .. }) => {
                        assert_ne!(admission, Admission::Ok, "admitted but allocation failed");
                        assert_eq!(self.snapshot(), before, "failed allocation changed state");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            Op::Reserve { pick, n } => {
                let Some(seq) = self.pick(pick) else { return };
                let left = self.kv.seq_len(seq).unwrap() - self.kv.computed_len(seq).unwrap();
                let n = n.min(left);
                let before = self.snapshot();
                let cost = self.kv.reserve_cost(seq, n).unwrap();
                match self.kv.reserve(seq, n) {
                    Ok(()) => {}
                    Err(KvError::OutOfBlocks { needed, .. }) => {
                        assert_eq!(needed, cost);
                        assert_eq!(self.snapshot(), before, "failed reserve changed state");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            Op::Append { pick, n, token } => {
                let Some(seq) = self.pick(pick) else { return };
                let before = self.snapshot();
                match self.kv.append_slots(seq, n) {
                    Ok(copy) => {
                        assert_eq!(copy, None);
                        let toks = self.tokens.get_mut(&seq).unwrap();
                        toks.extend((0..n as u32).map(|i| token + i));
                    }
                    // Out of blocks, or the prompt not all reserved yet: nothing changes.
                    Err(KvError::OutOfBlocks { .. } | KvError::NotReserved { .. }) => {
                        assert_eq!(self.snapshot(), before, "failed append changed state");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            Op::Commit { pick, n } => {
                let Some(seq) = self.pick(pick) else { return };
                let computed = self.kv.computed_len(seq).unwrap();
                let reserved = self.kv.block_table(seq).unwrap().len() * BLOCK;
                let len = self.kv.seq_len(seq).unwrap();
                let n = n.min(len.min(reserved) - computed);
                let toks = self.tokens[&seq][computed..computed + n].to_vec();
                // The step writes each position's row and its block's entries, then commits.
                for (i, &t) in toks.iter().enumerate() {
                    let pos = computed + i;
                    let slot = self.kv.slot(seq, pos).unwrap();
                    self.main[slot as usize] = Some(t);
                    let block = self.kv.kept_table(seq).unwrap()[pos / BLOCK].0 as usize;
                    self.kept[block][pos % BLOCK] = Some(t);
                }
                self.kv.commit(seq, &toks).unwrap();
            }
            Op::Free { pick } => {
                let Some(seq) = self.pick(pick) else { return };
                self.kv.free(seq).unwrap();
                self.tokens.remove(&seq);
            }
            Op::ClearCache => {
                self.kv.clear_prefix_cache();
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_interleavings_keep_both_pools_consistent(ops in prop::collection::vec(op(), 1..90)) {
        let mut h = Harness::new();
        for op in &ops {
            h.apply(op);
            if let Err(e) = h.kv.check_invariants() {
                panic!("after {op:?}: {e}");
            }
            h.check_memory();
        }
        let seqs: Vec<SeqId> = h.kv.seq_ids().collect();
        for seq in seqs {
            h.kv.free(seq).unwrap();
        }
        h.kv.check_invariants().unwrap();
        prop_assert_eq!(h.kv.metrics().used_blocks, 0);
        h.kv.clear_prefix_cache();
        prop_assert_eq!(h.kv.metrics().free_blocks, MAIN as usize);
        prop_assert_eq!(h.kv.kept_available_blocks(), Some(KEPT as usize));
        h.kv.check_invariants().unwrap();
    }
}

/// Allocates `prompt`, then reserves and commits it in chunks of `chunk` tokens, as a
/// chunked prefill does.
fn prefill(kv: &mut BlockManager, seq: u64, prompt: &[u32], chunk: usize) -> usize {
    let seq = SeqId(seq);
    let cached = kv
        .allocate(seq, prompt, SeqConfig::default())
        .unwrap()
        .cached_tokens;
    let mut at = cached;
    while at < prompt.len() {
        let n = chunk.min(prompt.len() - at);
        kv.reserve(seq, n).unwrap();
        kv.commit(seq, &prompt[at..at + n]).unwrap();
        at += n;
    }
    kv.check_invariants().unwrap();
    cached
}

/// A long prompt holds the kept blocks of every position but main blocks only for its
/// window and the chunk being computed.
#[test]
fn a_long_prefill_holds_main_blocks_for_its_window_and_chunk_only() {
    let mut kv = manager(4, 40, WINDOW);
    let prompt: Vec<u32> = (0..100).collect();
    let seq = SeqId(1);
    kv.allocate(seq, &prompt, SeqConfig::default()).unwrap();
    assert_eq!(kv.kept_table(seq).unwrap().len(), 25);
    assert!(kv.block_table(seq).unwrap().is_empty());
    assert!(matches!(
        kv.commit(seq, &prompt[..1]),
        Err(KvError::NotReserved { pos: 0, .. })
    ));
    assert!(matches!(
        kv.slot(seq, 0),
        Err(KvError::NotReserved { pos: 0, .. })
    ));
    for (i, chunk) in prompt.chunks(8).enumerate() {
        kv.reserve(seq, chunk.len()).unwrap();
        kv.commit(seq, chunk).unwrap();
        // The window (6 tokens: 2 blocks) and nothing more stays: at most 2 main blocks.
        let held = kv.metrics().used_blocks;
        assert!(held <= 2, "chunk {i}: {held} main blocks held");
    }
    // Four main blocks would not have held the prompt whole.
    assert!(kv.blocks_for_tokens(100) > 4);
    kv.check_invariants().unwrap();
}

/// A prompt that repeats a computed one finds its blocks in both pools; when the main
/// pool's blocks of the window at the hit's end are evicted, the hit shrinks to where they
/// are still cached, and with nothing of the kept pool cached there is no hit.
#[test]
fn prefix_hits_need_every_kept_block_and_the_windows_main_blocks() {
    let mut kv = manager(6, 24, WINDOW);
    let prompt: Vec<u32> = (0..21).collect();
    prefill(&mut kv, 1, &prompt, 5);
    kv.free(SeqId(1)).unwrap();
    // 21 tokens: 5 full blocks cached in the kept pool; the last ones the window read also
    // in the main pool.
    assert_eq!(kv.cached_prefix_tokens(&prompt, SeqConfig::default()), 20);
    assert_eq!(prefill(&mut kv, 2, &prompt, 5), 20);
    let kept_hit = kv.kept_table(SeqId(2)).unwrap()[..5].to_vec();
    kv.free(SeqId(2)).unwrap();
    // Another prompt fills the main pool, evicting the cached main blocks.
    let other: Vec<u32> = (1000..1021).collect();
    prefill(&mut kv, 3, &other, 4);
    let a = kv.allocate(SeqId(4), &prompt, SeqConfig::default());
    match a {
        Ok(a) => {
            assert!(
                a.cached_tokens < 20,
                "hit {} with evicted main blocks",
                a.cached_tokens
            );
            assert_eq!(
                kv.kept_table(SeqId(4)).unwrap()[..a.cached_tokens / BLOCK],
                kept_hit[..a.cached_tokens / BLOCK]
            );
        }
        Err(e) => panic!("{e}"),
    }
    kv.check_invariants().unwrap();
    kv.free(SeqId(3)).unwrap();
    kv.free(SeqId(4)).unwrap();
    kv.clear_prefix_cache();
    assert_eq!(kv.cached_prefix_tokens(&prompt, SeqConfig::default()), 0);
    kv.check_invariants().unwrap();
}

/// Forking, a per-sequence window and a pool too small for one window are refused.
#[test]
fn what_a_kept_pool_cannot_do_is_refused() {
    let mut kv = manager(4, 8, WINDOW);
    prefill(&mut kv, 1, &[1, 2, 3], 3);
    assert_eq!(
        kv.fork(SeqId(1), SeqId(2)),
        Err(KvError::ForkWithKeptPool(SeqId(1)))
    );
    let err = kv
        .allocate(
            SeqId(3),
            &[1],
            SeqConfig {
                sliding_window: Some(4),
                ..SeqConfig::default()
            },
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            KvError::InvalidConfig {
                field: "sliding_window",
                ..
            }
        ),
        "{err}"
    );
    // A window of 6 needs 2 blocks and one more to compute in: a main pool of 2 never admits.
    let small = manager(2, 8, WINDOW);
    assert_eq!(
        small.can_allocate(&[1, 2, 3], SeqConfig::default()),
        Admission::Never
    );
    // More kept blocks than the kept pool has: never.
    assert_eq!(
        kv.can_allocate(&[7; 40], SeqConfig::default()),
        Admission::Never
    );
    let bad = BlockManager::new(BlockManagerConfig {
        kept: Some(KeptPool {
            num_blocks: 4,
            window: 0,
        }),
        ..BlockManagerConfig::new(4)
    });
    assert!(matches!(
        bad,
        Err(KvError::InvalidConfig {
            field: "kept.window",
            ..
        })
    ));
}

/// `reservable` says how much of a chunk the main pool can take now; an append on a sequence
/// whose prompt is not all reserved is refused (it would take the whole prompt's main blocks at
/// once).
#[test]
fn reservable_counts_what_fits_and_appends_wait_for_the_prompt() {
    let mut kv = manager(3, 16, WINDOW);
    let prompt: Vec<u32> = (0..30).collect();
    let seq = SeqId(1);
    kv.allocate(seq, &prompt, SeqConfig::default()).unwrap();
    // Three free blocks of 4: 12 positions.
    assert_eq!(kv.reservable(seq, 20).unwrap(), 12);
    assert_eq!(kv.reservable(seq, 5).unwrap(), 5);
    assert!(matches!(
        kv.append_slots(seq, 1),
        Err(KvError::NotReserved { pos: 0, .. })
    ));
    kv.reserve(seq, 12).unwrap();
    assert_eq!(kv.reservable(seq, 20).unwrap(), 12);
    kv.commit(seq, &prompt[..12]).unwrap();
    // The window (6) keeps 2 of the 3 blocks: one came back, room for 4 more positions.
    assert_eq!(kv.reservable(seq, 20).unwrap(), 4);
    kv.check_invariants().unwrap();
}
