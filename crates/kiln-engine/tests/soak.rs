//! Soak: 200 requests with random prompt and output lengths, random `n`, aborts, dropped
//! streams and short deadlines, from several client threads, on a pool small enough to
//! preempt. Every request must end as asked (finished, cancelled or deadline exceeded), and
//! afterwards every KV block is free, the invariants hold and, after shutdown, the engine
//! thread is gone.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use kiln_engine::{
    EngineError, Event, FinishReason, Request, SamplingParams, ShutdownMode, SpecMethod,
    SpeculativeConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Default)]
struct Tally {
    finished: usize,
    aborted: usize,
    dropped: usize,
    deadline: usize,
}

fn client(e: &kiln_engine::EngineHandle, seed: u64, requests: usize) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = Tally::default();
    for _ in 0..requests {
        let len = rng.random_range(1..60);
        let ids = (0..len).map(|_| rng.random_range(0..256)).collect();
        let max_new = rng.random_range(1..40);
        let mut r = Request::tokens(ids).max_new_tokens(max_new);
        if rng.random_bool(0.5) {
            let sp = SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            };
            r = r.sampling(sp, rng.random());
            r.stopping.max_new_tokens = Some(max_new);
        }
        r.n = rng.random_range(1..=3);
        let fate = rng.random_range(0..10);
        if fate == 0 {
            r.deadline = Some(Instant::now() + Duration::from_millis(rng.random_range(0..20)));
        }
        let mut s = e.submit(r).unwrap();
        match fate {
            1 => {
                // Abort after a random number of events.
                let k = rng.random_range(0..4);
                let mut seen = 0;
                let mut ended = false;
                while seen < k {
                    match s.blocking_recv() {
                        Some(Event::Delta(_)) => seen += 1,
                        Some(_) | None => {
                            ended = true;
                            break;
                        }
                    }
                }
                if ended {
                    t.finished += 1;
                    continue;
                }
                e.abort(s.id());
                match std::iter::from_fn(|| s.blocking_recv()).last() {
                    Some(Event::Error(EngineError::Cancelled(_))) => t.aborted += 1,
                    Some(Event::Finished(_)) => t.finished += 1, // finished first
                    other => panic!("after abort: {other:?}"),
                }
            }
            2 => {
                let _ = s.blocking_recv();
                drop(s);
                t.dropped += 1;
            }
            _ => match s.blocking_collect() {
                Ok(out) => {
                    for o in &out.outputs {
                        let f = o.finish.clone().unwrap();
                        assert!(
                            matches!(f, FinishReason::Length | FinishReason::EosToken),
                            "{f:?}"
                        );
                        if f == FinishReason::Length {
                            assert_eq!(o.token_ids.len(), max_new);
                        }
                    }
                    t.finished += 1;
                }
                Err(EngineError::DeadlineExceeded) if fate == 0 => t.deadline += 1,
                Err(err) => panic!("request failed: {err}"),
            },
        }
    }
    t
}

#[test]
fn two_hundred_requests_end_as_asked_and_free_everything() {
    for (name, dev) in common::devices() {
        let e = common::tiny_engine(&dev, 2, common::config(48, 4, 48, 12));
        soak(name, &e);
    }
}

/// The same soak with speculative decoding: n-gram lookup on the CPU backend, a draft model
/// (the tiny mistral, with its own KV pool) on every backend. Afterwards every block of the
/// target's pool and of the draft's is free.
#[test]
fn speculative_soak_frees_every_block_of_target_and_draft() {
    for (name, dev) in common::devices() {
        let mut methods = vec![SpecMethod::Draft];
        if name == "cpu" {
            methods.push(SpecMethod::Ngram { min_n: 1, max_n: 3 });
        }
        for method in methods {
            let mut cfg = common::config(48, 4, 48, 12);
            cfg.speculative = Some(SpeculativeConfig {
                method,
                num_tokens: 4,
                disable_batch_size: 6,
            });
            let e = match method {
                SpecMethod::Draft => common::tiny_engine_with_draft(&dev, 2, cfg, "mistral"),
                SpecMethod::Ngram { .. } => common::tiny_engine(&dev, 2, cfg),
            };
            let m = e.metrics().encode();
            soak(&format!("{name}/{method:?}"), &e);
            let after = e.metrics().encode();
            assert_ne!(m, after);
            assert!(
                !after.contains("kiln_spec_decode_verify_steps_total 0\n"),
                "{name}/{method:?}: nothing was verified"
            );
        }
    }
}

fn soak(name: &str, e: &kiln_engine::EngineHandle) {
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let e = e.clone();
                s.spawn(move || client(&e, i, 25))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let total: usize = tallies
        .iter()
        .map(|t| t.finished + t.aborted + t.dropped + t.deadline)
        .sum();
    assert_eq!(total, 200, "{name}: {tallies:?}");
    assert!(tallies.iter().map(|t| t.finished).sum::<usize>() > 100);
    let stats = common::wait_idle(e);
    assert_eq!((stats.running, stats.waiting, stats.preempted), (0, 0, 0));
    assert_eq!(stats.kv.used_blocks, 0, "{name}: {stats:?}");
    assert!(stats.preemptions > 0, "{name}: never preempted: {stats:?}");
    if let Some(d) = stats.draft_kv {
        assert_eq!(d.used_blocks, 0, "{name}: draft pool: {stats:?}");
    }
    stats.invariants.unwrap();
    e.shutdown_blocking(ShutdownMode::Drain);
    assert!(e.is_stopped(), "{name}: engine thread still running");
    eprintln!("{name}: {tallies:?}, {} steps", stats.steps);
}
