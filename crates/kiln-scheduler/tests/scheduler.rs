//! Scheduling policy: budgets, ordering, admission, preemption, prefix hits, forks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use kiln_kv::{BlockManagerConfig, SeqId};
use kiln_scheduler::{Schedule, Scheduler, SchedulerConfig, SchedulerError, SeqParams, SeqStatus};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn config(blocks: u32, block_size: u32, budget: usize, max_seqs: usize) -> SchedulerConfig {
    let mut cfg = SchedulerConfig::new(BlockManagerConfig {
        block_size,
        watermark: 0.0,
        ..BlockManagerConfig::new(blocks)
    });
    cfg.max_num_batched_tokens = budget;
    cfg.max_num_seqs = max_seqs;
    cfg
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

/// Plays the model: completes the step and samples a token for every sequence that samples.
fn run_step(s: &mut Scheduler, step: &Schedule, next: &mut u32) {
    s.complete(step).unwrap();
    for x in &step.seqs {
        if x.samples {
            *next += 1;
            s.push_token(x.seq, *next).unwrap();
        }
    }
    s.check_invariants().unwrap();
}

fn generated(s: &Scheduler, seq: SeqId, prompt_len: usize) -> usize {
    s.tokens(seq).map_or(0, |t| t.len() - prompt_len)
}

#[test]
fn decodes_come_first_and_long_prompts_are_chunked() {
    let mut s = Scheduler::new(config(64, 4, 16, 8)).unwrap();
    let mut next = 0;
    for i in 0..3 {
        s.add(SeqId(i), prompt(i as u32, 5), SeqParams::default())
            .unwrap();
    }
    let step = s.schedule();
    assert_eq!(step.num_tokens(), 15);
    run_step(&mut s, &step, &mut next);
    // A long prompt arrives while three sequences decode.
    s.add(SeqId(9), prompt(9, 40), SeqParams::default())
        .unwrap();
    let mut chunks = Vec::new();
    for _ in 0..4 {
        let step = s.schedule();
        assert!(step.num_tokens() <= 16);
        // Every decode runs in every step, before any prefill.
        let decodes: Vec<u64> = step.seqs[..3].iter().map(|x| x.seq.0).collect();
        assert_eq!(decodes, vec![0, 1, 2]);
        assert!(step.seqs[..3].iter().all(|x| x.len == 1 && x.samples));
        // The prompt's last 1-token chunk samples too, but it is not a decode.
        assert_eq!(step.num_decodes(), 3);
        chunks.push((step.seqs[3].start, step.seqs[3].len, step.seqs[3].samples));
        run_step(&mut s, &step, &mut next);
    }
    assert_eq!(
        chunks,
        vec![
            (0, 13, false),
            (13, 13, false),
            (26, 13, false),
            (39, 1, true)
        ]
    );
    // All four decode together afterwards.
    let step = s.schedule();
    assert_eq!(step.seqs.len(), 4);
    assert_eq!(step.num_decodes(), 4);
}

#[test]
fn budget_and_seq_cap_hold_every_step_under_random_load() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut s = Scheduler::new(config(40, 4, 24, 6)).unwrap();
    let mut next = 0;
    let mut want: HashMap<SeqId, (usize, usize)> = HashMap::new();
    let mut id = 0;
    for _ in 0..400 {
        if rng.random_bool(0.3) {
            let len = rng.random_range(1..60);
            match s.add(SeqId(id), prompt(id as u32, len), SeqParams::default()) {
                Ok(()) => {
                    want.insert(SeqId(id), (len, rng.random_range(1..12)));
                }
                Err(SchedulerError::Overloaded { .. }) => {}
                Err(e) => panic!("{e}"),
            }
            id += 1;
        }
        let step = s.schedule();
        assert!(step.num_tokens() <= 24, "budget: {}", step.num_tokens());
        assert!(step.seqs.len() <= 6);
        assert!(s.stats().running <= 6);
        assert!(step.rejected.is_empty());
        run_step(&mut s, &step, &mut next);
        let done: Vec<SeqId> = want
            .iter()
            .filter(|(q, (p, n))| generated(&s, **q, *p) >= *n)
            .map(|(q, _)| *q)
            .collect();
        for q in done {
            assert!(s.finish(q));
            want.remove(&q);
        }
    }
    for q in want.keys() {
        s.finish(*q);
    }
    assert!(s.is_empty());
    assert_eq!(s.stats().kv.used_blocks, 0);
}

#[test]
fn a_long_prompt_at_the_head_is_not_starved() {
    // 12 blocks of 4: the long prompt needs 10, so it only fits once the pool drains.
    let mut s = Scheduler::new(config(12, 4, 64, 8)).unwrap();
    let mut next = 0;
    s.add(SeqId(100), prompt(100, 20), SeqParams::default())
        .unwrap();
    s.add(SeqId(101), prompt(101, 40), SeqParams::default())
        .unwrap();
    let mut long_admitted_at = None;
    let mut lens: HashMap<SeqId, usize> = HashMap::from([(SeqId(100), 20), (SeqId(101), 40)]);
    for step_no in 0..200u64 {
        // A steady stream of short requests behind it (ids 0, 1, ...).
        let id = step_no;
        s.add(SeqId(id), prompt(id as u32, 3), SeqParams::default())
            .ok();
        lens.insert(SeqId(id), 3);
        let step = s.schedule();
        if step.admitted.iter().any(|(q, _)| *q == SeqId(101)) {
            long_admitted_at = Some(step_no);
            break;
        }
        // Short ones (ids below 100) behind the long one never overtake it.
        assert!(step.admitted.iter().all(|(q, _)| q.0 >= 100), "{step:?}");
        run_step(&mut s, &step, &mut next);
        for (q, p) in lens.clone() {
            if generated(&s, q, p) >= 3 {
                s.finish(q);
                lens.remove(&q);
            }
        }
    }
    assert!(long_admitted_at.is_some(), "the long prompt never ran");
}

#[test]
fn preemption_takes_the_lowest_priority_latest_arrival_and_it_recomputes() {
    // 6 blocks of 2 tokens; three sequences of 3 tokens take 2 blocks each.
    let mut s = Scheduler::new(config(6, 2, 64, 8)).unwrap();
    let mut next = 0;
    s.add(
        SeqId(1),
        prompt(1, 3),
        SeqParams {
            priority: 0,
            forks: 0,
            ..SeqParams::default()
        },
    )
    .unwrap();
    s.add(
        SeqId(2),
        prompt(2, 3),
        SeqParams {
            priority: 5,
            forks: 0,
            ..SeqParams::default()
        },
    )
    .unwrap();
    s.add(
        SeqId(3),
        prompt(3, 3),
        SeqParams {
            priority: 0,
            forks: 0,
            ..SeqParams::default()
        },
    )
    .unwrap();
    let step = s.schedule();
    // Priority orders admission: 1 and 3 (priority 0) before 2.
    let order: Vec<u64> = step.seqs.iter().map(|x| x.seq.0).collect();
    assert_eq!(order, vec![1, 3, 2]);
    run_step(&mut s, &step, &mut next);
    // Position 3 fits the second block of each; position 4 needs a third block each.
    let step = s.schedule();
    assert!(step.preempted.is_empty());
    run_step(&mut s, &step, &mut next);
    let step = s.schedule();
    // Seq 2 (priority 5) is the victim even though it arrived before seq 3.
    assert_eq!(step.preempted, vec![SeqId(2)]);
    assert_eq!(s.status(SeqId(2)), Some(SeqStatus::Preempted));
    let ran: Vec<u64> = step.seqs.iter().map(|x| x.seq.0).collect();
    assert_eq!(ran, vec![1, 3]);
    run_step(&mut s, &step, &mut next);
    // With equal priority the later arrival (3) goes next, when the blocks run out again.
    let step = loop {
        let step = s.schedule();
        run_step(&mut s, &step, &mut next);
        if !step.preempted.is_empty() {
            break step;
        }
    };
    assert_eq!(step.preempted, vec![SeqId(3)]);
    let tokens_before = s.tokens(SeqId(3)).unwrap().to_vec();
    s.finish(SeqId(1));
    // Preempted sequences come back first, recomputing prompt and generated tokens.
    let step = s.schedule();
    let back: Vec<(u64, usize, usize)> = step
        .seqs
        .iter()
        .map(|x| (x.seq.0, x.start, x.len))
        .collect();
    assert_eq!(back[0].0, 3);
    assert_eq!(back[0].1 + back[0].2, tokens_before.len());
    assert!(step.seqs[0].samples);
    assert!(s.stats().preemptions >= 2);
    run_step(&mut s, &step, &mut next);
    assert_eq!(
        &s.tokens(SeqId(3)).unwrap()[..tokens_before.len()],
        &tokens_before[..]
    );
}

#[test]
fn admission_respects_the_watermark() {
    let mut cfg = config(10, 4, 64, 8);
    cfg.blocks.watermark = 0.2; // keep 2 blocks free for running decodes
    let mut s = Scheduler::new(cfg).unwrap();
    let mut next = 0;
    s.add(SeqId(1), prompt(1, 24), SeqParams::default())
        .unwrap(); // 6 blocks
    // 3 blocks: with 4 left, taking them would eat into the 2 kept free.
    s.add(SeqId(2), prompt(2, 12), SeqParams::default())
        .unwrap();
    let step = s.schedule();
    assert_eq!(step.admitted, vec![(SeqId(1), 0)]);
    run_step(&mut s, &step, &mut next);
    let step = s.schedule();
    assert!(step.admitted.is_empty());
    assert_eq!(s.status(SeqId(2)), Some(SeqStatus::Waiting));
    run_step(&mut s, &step, &mut next);
    s.finish(SeqId(1));
    let step = s.schedule();
    assert_eq!(step.admitted, vec![(SeqId(2), 0)]);
    // A prompt that can never fit above the watermark is refused at once.
    let err = s
        .add(SeqId(3), prompt(3, 40), SeqParams::default())
        .unwrap_err();
    assert!(matches!(err, SchedulerError::TooLarge { .. }), "{err}");
}

/// The waiting queue holds `max_waiting` plus the running slots no sequence holds: an idle
/// scheduler takes a burst of `max_waiting + max_num_seqs`, a full one `max_waiting` more.
#[test]
fn a_full_waiting_queue_reports_overload() {
    let mut cfg = config(16, 4, 64, 8);
    cfg.max_waiting = 3;
    let mut s = Scheduler::new(cfg).unwrap();
    assert_eq!(s.waiting_capacity(), 3 + 8);
    for i in 0..11 {
        s.add(SeqId(i), prompt(i as u32, 4), SeqParams::default())
            .unwrap();
    }
    let err = s
        .add(SeqId(11), prompt(11, 4), SeqParams::default())
        .unwrap_err();
    assert_eq!(
        err,
        SchedulerError::Overloaded {
            waiting: 11,
            limit: 11
        }
    );
    assert!(s.status(SeqId(11)).is_none());
    // Admission fills the eight slots; the three left waiting are the limit now.
    let step = s.schedule();
    assert_eq!(step.admitted.len(), 8);
    assert_eq!(s.waiting_capacity(), 3);
    let err = s
        .add(SeqId(11), prompt(11, 4), SeqParams::default())
        .unwrap_err();
    assert_eq!(
        err,
        SchedulerError::Overloaded {
            waiting: 3,
            limit: 3
        }
    );
}

#[test]
fn prefix_cache_hits_shorten_prefill() {
    let mut s = Scheduler::new(config(32, 4, 64, 8)).unwrap();
    let mut next = 0;
    let shared = prompt(1, 16);
    s.add(SeqId(1), shared.clone(), SeqParams::default())
        .unwrap();
    let step = s.schedule();
    assert_eq!(step.num_tokens(), 16);
    run_step(&mut s, &step, &mut next);
    // Same 16-token prefix plus 3 new tokens: the 4 full blocks come from the cache.
    let mut p2 = shared.clone();
    p2.extend([7, 8, 9]);
    s.add(SeqId(2), p2, SeqParams::default()).unwrap();
    let step = s.schedule();
    assert_eq!(step.admitted, vec![(SeqId(2), 16)]);
    let x = step.seqs.iter().find(|x| x.seq == SeqId(2)).unwrap();
    assert_eq!((x.start, x.len), (16, 3));
    run_step(&mut s, &step, &mut next);
    // An identical prompt still computes its last token (for logits).
    s.add(SeqId(3), shared, SeqParams::default()).unwrap();
    let step = s.schedule();
    let x = step.seqs.iter().find(|x| x.seq == SeqId(3)).unwrap();
    assert_eq!((x.start, x.len), (12, 4));
    assert!(s.stats().kv.prefix_hit_tokens >= 28);
}

/// A sequence that asks for its prompt's log-probabilities computes the whole prompt though
/// the cache holds it.
#[test]
fn a_sequence_may_recompute_its_cached_prefix_once() {
    let mut s = Scheduler::new(config(32, 4, 64, 8)).unwrap();
    let mut next = 0;
    let shared = prompt(1, 16);
    s.add(SeqId(1), shared.clone(), SeqParams::default())
        .unwrap();
    let step = s.schedule();
    run_step(&mut s, &step, &mut next);
    let mut p2 = shared.clone();
    p2.extend([7, 8, 9]);
    let params = SeqParams {
        recompute_prefix: true,
        ..SeqParams::default()
    };
    s.add(SeqId(2), p2, params).unwrap();
    let step = s.schedule();
    assert_eq!(step.admitted, vec![(SeqId(2), 0)]);
    let x = step.seqs.iter().find(|x| x.seq == SeqId(2)).unwrap();
    assert_eq!((x.start, x.len, x.samples), (0, 19, true));
    run_step(&mut s, &step, &mut next);
    // Its blocks entered the cache as any sequence's do.
    s.finish(SeqId(2));
    let mut p3 = shared.clone();
    p3.extend([7, 8, 9, 10]);
    s.add(SeqId(3), p3, SeqParams::default()).unwrap();
    assert_eq!(s.schedule().admitted, vec![(SeqId(3), 16)]);
}

/// A sequence's own chunk cap holds under a larger budget; others still fill the step.
#[test]
fn a_sequence_may_cap_its_prefill_chunks() {
    let mut s = Scheduler::new(config(64, 4, 32, 8)).unwrap();
    let mut next = 0;
    let capped = SeqParams {
        max_chunk: Some(5),
        ..SeqParams::default()
    };
    s.add(SeqId(1), prompt(1, 12), capped).unwrap();
    s.add(SeqId(2), prompt(2, 10), SeqParams::default())
        .unwrap();
    let mut chunks = Vec::new();
    while generated(&s, SeqId(1), 12) == 0 {
        let step = s.schedule();
        for x in step.seqs.iter().filter(|x| x.seq == SeqId(1)) {
            chunks.push((x.start, x.len, x.samples));
        }
        // The uncapped prompt runs whole beside it.
        if let Some(x) = step.seqs.iter().find(|x| x.seq == SeqId(2) && x.start == 0) {
            assert_eq!(x.len, 10);
        }
        run_step(&mut s, &step, &mut next);
    }
    assert_eq!(chunks, [(0, 5, false), (5, 5, false), (10, 2, true)]);
}

#[test]
fn forks_share_the_prompt_and_count_against_the_seq_cap() {
    let mut s = Scheduler::new(config(32, 4, 64, 4)).unwrap();
    let mut next = 0;
    s.add(
        SeqId(1),
        prompt(1, 6),
        SeqParams {
            priority: 0,
            forks: 2,
            ..SeqParams::default()
        },
    )
    .unwrap();
    s.add(
        SeqId(2),
        prompt(2, 6),
        SeqParams {
            priority: 0,
            forks: 1,
            ..SeqParams::default()
        },
    )
    .unwrap();
    let step = s.schedule();
    // 1 + 2 forks + 2 would exceed 4 sequences: seq 2 waits.
    assert_eq!(step.admitted.len(), 1);
    s.complete(&step).unwrap();
    s.fork(SeqId(1), SeqId(10)).unwrap();
    s.fork(SeqId(1), SeqId(11)).unwrap();
    let used = s.stats().kv.used_blocks;
    assert_eq!(used, 2); // the children share both prompt blocks
    for (q, t) in [(1, 100), (10, 101), (11, 102)] {
        s.push_token(SeqId(q), t).unwrap();
    }
    let step = s.schedule();
    // The shared, partly filled last block is copied on write for two of the three.
    assert_eq!(step.copies.len(), 2);
    assert_eq!(step.num_decodes(), 3);
    run_step(&mut s, &step, &mut next);
    assert!(s.fork(SeqId(2), SeqId(12)).is_err()); // not running yet
    for q in [1, 10, 11] {
        s.finish(SeqId(q));
    }
    let step = s.schedule();
    assert_eq!(step.admitted.len(), 1);
}

#[test]
fn config_is_validated() {
    let mut cfg = config(8, 4, 4, 8);
    assert!(matches!(
        Scheduler::new(cfg.clone()),
        Err(SchedulerError::InvalidConfig {
            field: "max_num_batched_tokens",
            ..
        })
    ));
    cfg.max_num_seqs = 0;
    assert!(Scheduler::new(cfg).is_err());
}

#[test]
fn without_chunked_prefill_a_prompt_runs_whole() {
    let mut cfg = config(32, 4, 16, 8);
    cfg.chunked_prefill = false;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut next = 0;
    assert!(
        s.add(SeqId(1), prompt(1, 17), SeqParams::default())
            .is_err()
    );
    s.add(SeqId(1), prompt(1, 10), SeqParams::default())
        .unwrap();
    s.add(SeqId(2), prompt(2, 10), SeqParams::default())
        .unwrap();
    let step = s.schedule();
    assert_eq!(step.seqs.len(), 1); // the second does not fit the 6 tokens left
    run_step(&mut s, &step, &mut next);
    let step = s.schedule();
    assert_eq!(step.seqs.len(), 2);
    assert_eq!(step.seqs[1].len, 10);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random arrivals, lengths, priorities and aborts on a small pool: invariants hold after
    /// every step, the budget is never exceeded, everything finishes, and the pool ends free.
    #[test]
    fn random_workloads_finish_and_free_everything(seed in any::<u64>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let blocks = rng.random_range(8..40);
        let budget = rng.random_range(8..48);
        let mut s = Scheduler::new(config(blocks, 4, budget, 8)).unwrap();
        let mut next = 0;
        let mut live: HashMap<SeqId, (usize, usize)> = HashMap::new();
        let mut finished = 0;
        for id in 0..40u64 {
            let len = rng.random_range(1..(blocks as usize * 4 / 2));
            let priority = rng.random_range(0..3);
            if s.add(SeqId(id), prompt(id as u32, len), SeqParams { priority, ..SeqParams::default() }).is_ok() {
                live.insert(SeqId(id), (len, rng.random_range(1..20)));
            }
            for _ in 0..rng.random_range(0..4) {
                let step = s.schedule();
                prop_assert!(step.num_tokens() <= budget);
                for (q, _) in &step.rejected {
                    live.remove(q);
                }
                run_step(&mut s, &step, &mut next);
                if rng.random_bool(0.05)
                    && let Some(&q) = live.keys().next()
                {
                    s.finish(q);
                    live.remove(&q);
                }
            }
        }
        let mut steps = 0;
        while !live.is_empty() {
            let step = s.schedule();
            prop_assert!(step.num_tokens() <= budget);
            for (q, _) in &step.rejected {
                live.remove(q);
            }
            run_step(&mut s, &step, &mut next);
            let done: Vec<SeqId> = live
                .iter()
                .filter(|(q, (p, n))| generated(&s, **q, *p) >= *n)
                .map(|(q, _)| *q)
                .collect();
            for q in done {
                s.finish(q);
                live.remove(&q);
                finished += 1;
            }
            steps += 1;
            prop_assert!(steps < 5000, "no progress: {:?}", s.stats());
        }
        prop_assert!(finished > 0);
        prop_assert!(s.is_empty());
        prop_assert_eq!(s.stats().kv.used_blocks, 0);
        s.check_invariants().unwrap();
    }
}

#[test]
fn drafts_ride_on_decodes_and_only_accepted_ones_stay() {
    // 6 blocks of 4 tokens, 8 tokens a step.
    let mut s = Scheduler::new(config(6, 4, 8, 4)).unwrap();
    let mut next = 100;
    s.add(SeqId(1), prompt(1, 6), SeqParams::default()).unwrap();
    // Drafts are refused before the prompt ran.
    assert!(matches!(
        s.propose(SeqId(1), vec![7]),
        Err(SchedulerError::WrongState { .. })
    ));
    let step = s.schedule();
    run_step(&mut s, &step, &mut next);
    assert_eq!(
        s.decoding()
            .map(|(id, t)| (id, t.len()))
            .collect::<Vec<_>>(),
        vec![(SeqId(1), 7)]
    );

    // Four drafts: the decode computes the sampled token and all four.
    s.propose(SeqId(1), vec![201, 202, 203, 204]).unwrap();
    let step = s.schedule();
    assert_eq!(step.seqs.len(), 1);
    let d = step.seqs[0];
    assert_eq!((d.start, d.len, d.draft, d.real_end()), (6, 5, 4, 7));
    assert_eq!(s.verifying(SeqId(1)), &[201, 202, 203, 204]);
    assert_eq!(s.blocks().seq_len(SeqId(1)).unwrap(), 11);
    s.complete(&step).unwrap();
    assert_eq!(s.computed(SeqId(1)), Some(7));
    // The target took two of them, then picked its own token.
    assert!(matches!(
        s.accept_draft(SeqId(1), 5),
        Err(SchedulerError::WrongState { .. })
    ));
    s.accept_draft(SeqId(1), 2).unwrap();
    s.push_token(SeqId(1), 300).unwrap();
    let t = s.tokens(SeqId(1)).unwrap();
    assert_eq!(&t[6..], &[101, 201, 202, 300]);
    assert_eq!(s.computed(SeqId(1)), Some(9));
    // The rejected drafts' slots (and the block only they used) are back.
    assert_eq!(s.blocks().seq_len(SeqId(1)).unwrap(), 9);
    assert_eq!(s.blocks().block_table(SeqId(1)).unwrap().len(), 3);
    assert!(s.verifying(SeqId(1)).is_empty());
    s.check_invariants().unwrap();

    // Drafts are cut to the budget (8 tokens: the sampled one and 7 drafts at most)...
    s.propose(SeqId(1), (400..420).collect()).unwrap();
    let step = s.schedule();
    assert_eq!((step.seqs[0].len, step.seqs[0].draft), (8, 7));
    s.complete(&step).unwrap();
    s.accept_draft(SeqId(1), 0).unwrap();
    s.push_token(SeqId(1), 301).unwrap();
    s.check_invariants().unwrap();

    // ...and dropped rather than preempt anyone: a second sequence holds the other blocks.
    s.add(SeqId(2), prompt(2, 12), SeqParams::default())
        .unwrap();
    let step = s.schedule();
    run_step(&mut s, &step, &mut next); // seq 1 decodes, seq 2 prefills 7 of 12
    assert_eq!(s.blocks().metrics().free_blocks, 0);
    // Seq 1's next slot is in its last block, its drafts would need two more.
    s.propose(SeqId(1), vec![1, 2, 3, 4, 5]).unwrap();
    let step = s.schedule();
    assert!(step.preempted.is_empty());
    assert_eq!((step.seqs[0].seq, step.seqs[0].draft), (SeqId(1), 0));
    assert_eq!(step.seqs[1].len, 5);
    // A step whose verdict never came: the next schedule drops its drafts.
    s.complete(&step).unwrap();
    s.push_token(SeqId(1), 302).unwrap();
    s.propose(SeqId(1), vec![9]).unwrap();
    s.finish(SeqId(2));
    let step = s.schedule();
    assert_eq!(step.seqs[0].draft, 1);
    s.complete(&step).unwrap();
    let step = s.schedule();
    assert!(step.is_empty() || step.seqs[0].draft == 0);
    assert_eq!(
        s.blocks().seq_len(SeqId(1)).unwrap(),
        s.tokens(SeqId(1)).unwrap().len()
    );
    s.check_invariants().unwrap();
    s.finish(SeqId(1));
    assert_eq!(s.blocks().metrics().used_blocks, 0);
}

/// With a kept pool (DeepSeek-V4's entries beside its window's rows), long prompts run in
/// chunks whose main blocks are taken chunk by chunk, so four 64-token prompts with a window
/// of 8 all finish through a main pool of 10 blocks of 4 tokens (each prompt alone is 16
/// blocks), preempting where the pool runs short; every sequence's tokens come out as a run
/// alone would make them.
#[test]
fn a_kept_pool_runs_long_prompts_through_a_small_main_pool() {
    let blocks = BlockManagerConfig {
        block_size: 4,
        watermark: 0.0,
        kept: Some(kiln_kv::KeptPool {
            num_blocks: 90,
            window: 8,
        }),
        ..BlockManagerConfig::new(10)
    };
    let mut cfg = SchedulerConfig::new(blocks);
    cfg.max_num_batched_tokens = 24;
    cfg.max_num_seqs = 4;
    let mut s = Scheduler::new(cfg).unwrap();
    for i in 0..4 {
        s.add(SeqId(i), prompt(i as u32, 64), SeqParams::default())
            .unwrap();
    }
    let mut next = 0;
    let mut steps = 0;
    let mut done = Vec::new();
    while done.len() < 4 {
        let step = s.schedule();
        assert!(step.num_tokens() <= 24);
        // Each sequence's chunk starts where its computed tokens end.
        for x in &step.seqs {
            assert_eq!(Some(x.start), s.computed(x.seq));
        }
        run_step(&mut s, &step, &mut next);
        assert!(s.blocks().metrics().used_blocks <= 10);
        // Three new tokens each, then the sequence finishes (its prompt intact).
        for i in 0..4 {
            let seq = SeqId(i);
            if !done.contains(&seq) && generated(&s, seq, 64) == 3 {
                assert_eq!(
                    &s.tokens(seq).unwrap()[..64],
                    prompt(i as u32, 64).as_slice()
                );
                assert!(s.finish(seq));
                done.push(seq);
            }
        }
        steps += 1;
        assert!(steps < 400, "no progress: {:?}", s.stats());
    }
    assert_eq!(s.blocks().metrics().used_blocks, 0);
    assert_eq!(s.blocks().kept_available_blocks(), Some(90));
}

#[test]
fn a_kept_pool_refuses_forks_and_a_second_window() {
    let blocks = BlockManagerConfig {
        kept: Some(kiln_kv::KeptPool {
            num_blocks: 8,
            window: 8,
        }),
        ..BlockManagerConfig::new(8)
    };
    let mut cfg = SchedulerConfig::new(blocks);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let err = s
        .add(
            SeqId(1),
            vec![1, 2],
            SeqParams {
                forks: 1,
                ..SeqParams::default()
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("cannot fork"), "{err}");
    cfg.sliding_window = Some(4);
    assert!(matches!(
        Scheduler::new(cfg),
        Err(SchedulerError::InvalidConfig {
            field: "sliding_window",
            ..
        })
    ));
}
