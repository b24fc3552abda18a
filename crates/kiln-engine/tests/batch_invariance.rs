//! Batch invariance: a greedy request and a seeded sampled request produce exactly the same
//! tokens alone and when they run with 15 other requests arriving at random moments, with
//! chunked prefill on and a KV pool small enough to force preemption (checked).
//!
//! The tiny llama runs on every backend; the default model runs on the CPU reference and the
//! native CPU backend (both compute each row independently of the batch; on wgpu the matmul
//! switches between the matvec and tiled kernels with the batch size, which sums in another
//! order).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use kiln_engine::{EngineConfig, EngineHandle, Request, SamplingParams};
use kiln_tensor::Device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Case {
    greedy: Request,
    sampled: Request,
    others: Vec<Request>,
}

fn case(vocab_hi: u32, prompt_len: usize, new_tokens: usize) -> Case {
    let mut rng = StdRng::seed_from_u64(5);
    let mut prompt =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(3..vocab_hi)).collect() };
    let mut greedy = Request::tokens(prompt(prompt_len)).max_new_tokens(new_tokens);
    greedy.stopping.ignore_eos = true;
    let sp = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        ..SamplingParams::default()
    };
    let mut sampled = Request::tokens(prompt(prompt_len)).sampling(sp.clone(), 77);
    sampled.stopping.max_new_tokens = Some(new_tokens);
    sampled.stopping.ignore_eos = true;
    let others = (0..14)
        .map(|i| {
            let mut r = Request::tokens(prompt(prompt_len / 2 + i * 3)).max_new_tokens(new_tokens);
            if i % 2 == 1 {
                r = r.sampling(sp.clone(), i as u64);
                r.stopping.max_new_tokens = Some(new_tokens);
            }
            r.stopping.ignore_eos = true;
            r
        })
        .collect();
    Case {
        greedy,
        sampled,
        others,
    }
}

fn alone(e: &EngineHandle, r: &Request) -> Vec<u32> {
    e.submit(r.clone())
        .unwrap()
        .blocking_collect()
        .unwrap()
        .outputs[0]
        .token_ids
        .clone()
}

/// Submits the 14 others and the two targets in a random order, at random moments up to
/// `spread_ms` apart (0: all at once, a crowd however fast the backend finishes requests).
fn crowded(e: &EngineHandle, c: &Case, seed: u64, spread_ms: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut all: Vec<(usize, Request)> = c.others.iter().cloned().map(|r| (2, r)).collect();
    all.insert(rng.random_range(0..all.len()), (0, c.greedy.clone()));
    all.insert(rng.random_range(0..all.len()), (1, c.sampled.clone()));
    let mut streams = Vec::new();
    for (tag, r) in all {
        std::thread::sleep(Duration::from_millis(rng.random_range(0..=spread_ms)));
        streams.push((tag, e.submit(r).unwrap()));
    }
    let mut got = (Vec::new(), Vec::new());
    for (tag, s) in streams {
        let out = s.blocking_collect().unwrap();
        match tag {
            0 => got.0 = out.outputs[0].token_ids.clone(),
            1 => got.1 = out.outputs[0].token_ids.clone(),
            _ => {}
        }
    }
    got
}

fn check(name: &str, make: impl Fn(EngineConfig) -> EngineHandle, c: &Case, small: EngineConfig) {
    let roomy = make(common::config(512, 16, 512, 16));
    let want = (alone(&roomy, &c.greedy), alone(&roomy, &c.sampled));
    drop(roomy);
    let e = make(small);
    // All at once (the pool must run short), then at random moments.
    for (seed, spread_ms) in [(0, 0), (1, 15)] {
        let got = crowded(&e, c, seed, spread_ms);
        assert_eq!(
            got.0, want.0,
            "{name}: greedy request changed in a crowd (seed {seed})"
        );
        assert_eq!(
            got.1, want.1,
            "{name}: seeded request changed in a crowd (seed {seed})"
        );
    }
    let stats = e.stats_blocking().unwrap();
    assert!(
        stats.preemptions > 0,
        "{name}: the pool never ran short: {stats:?}"
    );
    assert_eq!(stats.kv.used_blocks, 0);
    stats.invariants.unwrap();
}

#[test]
fn tiny_model_is_batch_invariant_on_every_backend() {
    let c = case(256, 20, 24);
    for (name, dev) in common::devices() {
        // 20 blocks of 4 tokens, 24-token steps: chunked prefill and preemption both happen.
        check(
            name,
            |cfg| common::tiny_engine(&dev, 2, cfg),
            &c,
            common::config(20, 4, 24, 16),
        );
    }
}

#[test]
fn default_model_is_batch_invariant_on_cpu() {
    let c = case(49152, 24, 12);
    check(
        "reference",
        |cfg| common::default_engine(&Device::reference(), cfg),
        &c,
        common::config(24, 4, 32, 16),
    );
}

/// The native CPU backend: its matmul computes a row of X the same way in a batch of any size
/// (in a tile of up to eight rows of X, the same operations in the same order).
#[test]
fn default_model_is_batch_invariant_on_the_native_cpu_backend() {
    let c = case(49152, 24, 12);
    check(
        "native cpu",
        |cfg| common::default_engine(&kiln_testkit::native_cpu(), cfg),
        &c,
        common::config(24, 4, 32, 16),
    );
}
