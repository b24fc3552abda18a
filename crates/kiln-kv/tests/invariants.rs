//! Property tests: random interleavings of every block-manager operation against a simulated
//! device memory. No block leaks or is freed twice, refcounts match the tables, cached and
//! shared blocks are never overwritten, and the pool returns to fully free at the end.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use kiln_kv::{Admission, BlockManager, BlockManagerConfig, KvError, SeqConfig, SeqId};
use proptest::prelude::*;

const NUM_BLOCKS: u32 = 12;
const BLOCK: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    /// A prompt: `len` tokens of one of three shared "system prompts", then a unique tail.
    Allocate {
        family: u32,
        shared: usize,
        len: usize,
        window: Option<usize>,
        /// Reuse no cached block (a request for prompt log-probabilities).
        recompute: bool,
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
    Fork {
        pick: usize,
    },
    Free {
        pick: usize,
    },
    ClearCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3u32, 0..20usize, 1..24usize, prop::option::weighted(0.3, 1..12usize), prop::bool::weighted(0.2))
            .prop_map(|(family, shared, len, window, recompute)| Op::Allocate { family, shared, len, window, recompute }),
        4 => (any::<usize>(), 1..6usize, 0..50u32).prop_map(|(pick, n, token)| Op::Append { pick, n, token }),
        4 => (any::<usize>(), 1..10usize).prop_map(|(pick, n)| Op::Commit { pick, n }),
        2 => any::<usize>().prop_map(|pick| Op::Fork { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => Just(Op::ClearCache),
    ]
}

/// The engine's side: each sequence's token ids and a simulated KV memory (one token id per slot).
struct Harness {
    kv: BlockManager,
    tokens: BTreeMap<SeqId, Vec<u32>>,
    memory: Vec<Option<u32>>,
    next_seq: u64,
}

impl Harness {
    fn new() -> Self {
        let cfg = BlockManagerConfig {
            block_size: BLOCK as u32,
            watermark: 0.1,
            ..BlockManagerConfig::new(NUM_BLOCKS)
        };
        Self {
            kv: BlockManager::new(cfg).unwrap(),
            tokens: BTreeMap::new(),
            memory: vec![None; NUM_BLOCKS as usize * BLOCK],
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
                    s,
                    self.kv.block_table(s).unwrap().to_vec(),
                    self.kv.seq_len(s).unwrap(),
                )
            })
            .collect();
        format!("{:?} {tables:?}", self.kv.metrics())
    }

    /// Every computed, untrimmed position of every sequence still holds its token.
    fn check_memory(&self) {
        for (&seq, toks) in &self.tokens {
            let computed = self.kv.computed_len(seq).unwrap();
            for (pos, &tok) in toks.iter().enumerate().take(computed) {
                match self.kv.slot(seq, pos) {
                    Ok(slot) => {
                        assert_eq!(self.memory[slot as usize], Some(tok), "{seq} pos {pos}")
                    }
                    Err(KvError::TrimmedPosition { .. }) => {}
                    Err(e) => panic!("{e}"),
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
                window,
                recompute,
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
                let opts = SeqConfig {
                    sliding_window: window,
                    recompute_prefix: recompute,
                };
                let admission = self.kv.can_allocate(&prompt, opts);
                let before = self.snapshot();
                let cached = self.kv.cached_prefix_tokens(&prompt, opts);
                match self.kv.allocate(seq, &prompt, opts) {
                    Ok(a) => {
                        assert!(a.cached_tokens < prompt.len() && a.cached_tokens % BLOCK == 0);
                        assert!(!recompute || a.cached_tokens == 0);
                        assert_eq!(a.cached_tokens, cached);
                        // Cached blocks really hold the prompt's tokens.
                        for (pos, &tok) in prompt.iter().enumerate().take(a.cached_tokens) {
                            if let Ok(slot) = self.kv.slot(seq, pos) {
                                assert_eq!(self.memory[slot as usize], Some(tok));
                            }
                        }
                        self.tokens.insert(seq, prompt);
                    }
                    Err(KvError::OutOfBlocks { .. }) => {
                        assert_ne!(admission, Admission::Ok, "admitted but allocation failed");
                        assert_eq!(self.snapshot(), before, "failed allocation changed state");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            Op::Append { pick, n, token } => {
                let Some(seq) = self.pick(pick) else { return };
                let before = self.snapshot();
                let cost = self.kv.append_cost(seq, n).unwrap();
                match self.kv.append_slots(seq, n) {
                    Ok(copy) => {
                        let taken = self.kv.metrics().used_blocks + self.kv.available_blocks();
                        assert_eq!(taken, NUM_BLOCKS as usize);
                        if let Some(c) = copy {
                            let (s, d) = (c.src.0 as usize * BLOCK, c.dst.0 as usize * BLOCK);
                            self.memory.copy_within(s..s + BLOCK, d);
                        }
                        let toks = self.tokens.get_mut(&seq).unwrap();
                        toks.extend((0..n as u32).map(|i| token + i));
                    }
                    Err(KvError::OutOfBlocks { needed, .. }) => {
                        assert_eq!(needed, cost);
                        assert_eq!(self.snapshot(), before, "failed append changed state");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            Op::Commit { pick, n } => {
                let Some(seq) = self.pick(pick) else { return };
                let computed = self.kv.computed_len(seq).unwrap();
                let len = self.kv.seq_len(seq).unwrap();
                let n = n.min(len - computed);
                // The forward pass writes K/V for the computed positions, then commits.
                let toks = self.tokens[&seq][computed..computed + n].to_vec();
                for (i, &t) in toks.iter().enumerate() {
                    let slot = self.kv.slot(seq, computed + i).unwrap();
                    self.memory[slot as usize] = Some(t);
                }
                self.kv.commit(seq, &toks).unwrap();
            }
            Op::Fork { pick } => {
                let Some(parent) = self.pick(pick) else {
                    return;
                };
                self.next_seq += 1;
                let child = SeqId(self.next_seq);
                match self.kv.fork(parent, child) {
                    Ok(()) => {
                        let toks = self.tokens[&parent].clone();
                        self.tokens.insert(child, toks);
                    }
                    Err(KvError::ForkUncomputed { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
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
    fn random_interleavings_keep_the_pool_consistent(ops in prop::collection::vec(op(), 1..80)) {
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
        let m = h.kv.metrics();
        prop_assert_eq!(m.used_blocks, 0);
        prop_assert_eq!(m.free_blocks + m.evictable_blocks, NUM_BLOCKS as usize);
        prop_assert_eq!(h.kv.clear_prefix_cache(), m.evictable_blocks);
        prop_assert_eq!(h.kv.metrics().free_blocks, NUM_BLOCKS as usize);
        h.kv.check_invariants().unwrap();
    }
}
