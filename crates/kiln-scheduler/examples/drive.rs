//! Drive the scheduler by hand, as an engine does: four requests share a pool too small for
//! all of them, so prompts are cut into chunks, decodes run first each step, and a sequence is
//! preempted (its blocks freed, recomputed later) when a decode needs a block that is not there.
//! The "model" here is a stand-in that answers each position with the token after it.
//!
//! `cargo run -p kiln-scheduler --example drive`

use std::collections::HashMap;

use kiln_kv::{BlockManagerConfig, SeqId};
use kiln_scheduler::{Scheduler, SchedulerConfig, SchedulerError, SeqParams};

const NEW_TOKENS: usize = 12;

fn main() -> Result<(), SchedulerError> {
    let blocks = BlockManagerConfig {
        block_size: 4,
        watermark: 0.0,
        ..BlockManagerConfig::new(12)
    };
    let mut cfg = SchedulerConfig::new(blocks);
    cfg.max_num_batched_tokens = 16;
    cfg.max_num_seqs = 4;
    let mut s = Scheduler::new(cfg)?;

    let mut prompt_len = HashMap::new();
    for i in 0..4u64 {
        let prompt: Vec<u32> = (0..10).map(|t| (100 * i as u32) + t).collect();
        prompt_len.insert(SeqId(i), prompt.len());
        s.add(SeqId(i), prompt, SeqParams::default())?;
    }

    let mut step = 0;
    let mut done = Vec::new();
    while !s.is_empty() {
        let plan = s.schedule();
        step += 1;
        let layout: Vec<String> = plan
            .seqs
            .iter()
            .map(|q| format!("{}:{}+{}", q.seq.0, q.start, q.len))
            .collect();
        println!(
            "step {step:2}: {} decodes, {} tokens [{}]{}",
            plan.num_decodes(),
            plan.num_tokens(),
            layout.join(" "),
            if plan.preempted.is_empty() {
                String::new()
            } else {
                format!(
                    " preempted {:?}",
                    plan.preempted.iter().map(|q| q.0).collect::<Vec<_>>()
                )
            }
        );
        assert!(plan.num_tokens() <= 16);
        // Here an engine copies plan.copies' blocks, runs the model over plan.seqs, and samples
        // a token for each sequence whose chunk reaches its end.
        s.complete(&plan)?;
        for q in plan.seqs.iter().filter(|q| q.samples) {
            let Some(&last) = s.tokens(q.seq).and_then(|t| t.last()) else {
                return Err(SchedulerError::UnknownSeq(q.seq));
            };
            s.push_token(q.seq, last + 1)?;
            let generated = s.tokens(q.seq).map_or(0, |t| t.len()) - prompt_len[&q.seq];
            if generated == NEW_TOKENS {
                let tokens = s.tokens(q.seq).map(<[u32]>::to_vec).unwrap_or_default();
                s.finish(q.seq);
                done.push((q.seq, tokens));
            }
        }
        s.check_invariants()?;
        assert!(step < 200, "the scheduler stopped making progress");
    }

    let stats = s.stats();
    println!(
        "{} requests in {step} steps, {} preemptions",
        done.len(),
        stats.preemptions
    );
    for (seq, tokens) in &done {
        // Preempted or not, every sequence got the tokens its own stand-in model gives.
        let first = tokens[0];
        assert!(
            tokens
                .iter()
                .enumerate()
                .all(|(i, &t)| t == first + i as u32)
        );
        println!("  seq {}: {:?}", seq.0, &tokens[prompt_len[seq]..]);
    }
    assert_eq!(done.len(), 4);
    assert_eq!(stats.kv.used_blocks, 0);
    Ok(())
}
