//! A warm decode step on the native CPU backend allocates nothing: every op's output reuses
//! a dropped tensor's storage, the matmul and attention keep their scratch between calls, the
//! model its step's lists (token ids, positions, the attention batch). Counted with an
//! instrumented global allocator, every thread's allocations (this file is its own test
//! binary, with one test, so nothing else runs while it counts).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::System;

use kiln_attention::KvCache;
use kiln_kv::{BlockId, KvDtype};
use kiln_model::{KvPoolConfig, LogitsAt, Model, ModelConfig, SeqInput, SyntheticSource};
use kiln_tensor::{DType, Device, Recorder};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const BLOCK: usize = 16;

/// A llama of `layers` layers with grouped heads, random Q4_1 weights.
fn model(dev: &Device, layers: usize) -> Model {
    let json = format!(
        r#"{{"model_type": "llama", "hidden_size": 128, "num_hidden_layers": {layers},
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
            "vocab_size": 256, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
            "tie_word_embeddings": true}}"#
    );
    let cfg = ModelConfig::from_hf_json("config.json", &json).unwrap();
    let src = SyntheticSource::new(cfg.clone(), DType::Q4_1, 3).unwrap();
    Model::load(dev, cfg, &src).unwrap()
}

/// Allocations of each of `steps` decode steps that take two sequences on from `context`
/// tokens, after a prefill and the steps up to `context` (the spares and the kept scratch
/// have seen the step's shapes). Each step runs as the model runner runs it
/// ([`Device::run`]: on one of the pool's threads).
fn decode_allocations(dev: &Device, layers: usize, kv: KvDtype, context: usize) -> Vec<u64> {
    const STEPS: usize = 8;
    let m = model(dev, layers);
    let pool = KvPoolConfig {
        block_size: BLOCK as u32,
        num_blocks: 8,
        dtype: kv,
    };
    let mut cache = KvCache::new(dev, m.config().kv_cache_config(pool)).unwrap();
    let tables = [[0, 1, 2].map(BlockId), [4, 5, 6].map(BlockId)];
    let tokens: Vec<u32> = (0..(context + STEPS) as u32).map(|t| t * 7 % 256).collect();
    assert!(tokens.len() <= 3 * BLOCK);
    let mut rec = Recorder::new(dev);
    let mut step = |from: usize, to: usize| {
        let seqs = tables.each_ref().map(|t| SeqInput {
            tokens: &tokens[from..to],
            block_table: t,
            context_len: to,
        });
        dev.run(|| {
            let logits = m
                .forward(&mut rec, &mut cache, &seqs, LogitsAt::Last)
                .unwrap();
            assert_eq!(logits.shape(), [2, 256]);
        });
    };
    let prompt = 3;
    step(0, prompt);
    for c in prompt..context {
        step(c, c + 1);
    }
    (context..context + STEPS)
        .map(|c| {
            let region = Region::new(GLOBAL);
            step(c, c + 1);
            let change = region.change();
            (change.allocations + change.reallocations) as u64
        })
        .collect()
}

/// The median allocations of the steps counted: what a warm step makes. A step now and then
/// makes a few more, once: the first task of a kind that lands on a pool thread fills that
/// thread's kept scratch, and INT4's table of the centres' turns grows as the context does
/// (by doubling). An allocation made in most steps, by any layer, shows here.
fn per_step(counts: &[u64]) -> u64 {
    let mut c = counts.to_vec();
    c.sort_unstable();
    c.get(c.len() / 2).copied().unwrap_or(0)
}

#[test]
fn a_native_decode_step_allocates_nothing() {
    let dev = Device::cpu().unwrap();
    for kv in [KvDtype::F16, KvDtype::Int8, KvDtype::Int4] {
        for layers in [2, 6] {
            // Past a block boundary, so that the steps read several blocks.
            let counts = decode_allocations(&dev, layers, kv, 20);
            assert_eq!(
                per_step(&counts),
                0,
                "{kv:?}, {layers} layers: allocations a step {counts:?}"
            );
        }
    }
}
