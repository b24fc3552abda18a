//! The memory win of paging: under one KV budget, sequences of random lengths admitted by
//! the block manager versus caches that reserve the full context per sequence.
//! Run with `--nocapture` to see the figures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_kv::{
    BlockManager, BlockManagerConfig, KvBudget, KvDtype, KvError, KvPlan, KvPlanConfig, KvShape,
    SeqConfig, SeqId,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MAX_LEN: usize = 2048;

/// SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), f16 K/V, 1 GiB for the cache.
fn plan() -> KvPlan {
    KvPlan::new(&KvPlanConfig {
        shape: KvShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: KvDtype::F16,
        },
        block_size: 16,
        max_seq_len: MAX_LEN,
        budget: KvBudget::Bytes(1 << 30),
    })
    .unwrap()
}

/// Sequences of uniform random length in `1..=MAX_LEN` admitted until the pool runs out.
fn paged_admits(plan: &KvPlan, seed: u64) -> (usize, usize) {
    let mut kv = BlockManager::new(BlockManagerConfig {
        watermark: 0.0,
        enable_prefix_caching: false,
        ..plan.block_manager_config()
    })
    .unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tokens = 0;
    for id in 0.. {
        let len = rng.random_range(1..=MAX_LEN);
        match kv.allocate(SeqId(id), &vec![0; len], SeqConfig::default()) {
            Ok(_) => tokens += len,
            Err(KvError::OutOfBlocks { .. }) => return (id as usize, tokens),
            Err(e) => panic!("{e}"),
        }
    }
    unreachable!("the pool is finite")
}

#[test]
fn paging_admits_more_sequences_than_max_length_reservations() {
    let plan = plan();
    println!("{plan}");
    let contiguous = plan.max_len_sequences() as usize;
    assert_eq!(plan.num_blocks, 2912);
    assert_eq!(contiguous, 22);
    println!("seed | contiguous (max-length reservations) | paged | tokens held | pool use");
    let mut total = 0;
    for seed in 0..5 {
        let (paged, tokens) = paged_admits(&plan, seed);
        let use_pct = 100.0 * tokens as f64 / plan.num_tokens() as f64;
        println!("{seed:>4} | {contiguous:>36} | {paged:>5} | {tokens:>11} | {use_pct:.1}%");
        assert!(
            paged > contiguous,
            "seed {seed}: paged {paged} vs contiguous {contiguous}"
        );
        // Paging wastes less than one block per sequence, so the pool ends nearly full.
        assert!(plan.num_tokens() as usize - tokens < (paged + 1) * 16 + MAX_LEN);
        total += paged;
    }
    let mean = total as f64 / 5.0;
    println!(
        "mean: paged admits {mean:.1} sequences, {:.2}x contiguous",
        mean / contiguous as f64
    );
    assert!(mean > 1.5 * contiguous as f64);
}
