//! The golden fixture from `transformers` (`scripts/make_model_fixtures.py`) and the runner
//! shared by the GGUF and HF-folder tests.
//!
//! Tolerances (logit units, logits are O(10)): |ours − reference| ≤ 2e-3 + 2e-4·|reference| for
//! the reference's top-5 at every prompt position and for the greedy token's logit. Only f32
//! summation order differs from PyTorch's (measured on lavapipe and the CPU backend: under
//! 1e-4); a wrong kernel is off by whole units. Greedy ids must equal the reference's; where the
//! reference's top-1/top-2 margin is below `NEAR_TIE` = 0.05 a different pick is accepted and
//! that sequence stops being compared (it has legitimately diverged).

use kiln_kv::{BlockManager, BlockManagerConfig, KvDtype, SeqConfig, SeqId};
use kiln_model::{KvPoolConfig, Model, ModelRunner, StepSeq};
use serde_json::Value;

pub const NEAR_TIE: f32 = 0.05;

pub fn tol(reference: f32) -> f32 {
    2e-3 + 2e-4 * reference.abs()
}

pub struct Case {
    pub name: String,
    pub ids: Vec<u32>,
    pub top5: Vec<Vec<(u32, f32)>>,
    pub greedy: Vec<(u32, f32, f32)>,
}

pub fn cases() -> Vec<Case> {
    let v: Value = serde_json::from_str(include_str!("../fixtures/smollm2_golden.json")).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            ids: c["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect(),
            top5: c["prompt_top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    p.as_array()
                        .unwrap()
                        .iter()
                        .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
                        .collect()
                })
                .collect(),
            greedy: c["greedy"]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| {
                    (
                        g["id"].as_u64().unwrap() as u32,
                        g["logit"].as_f64().unwrap() as f32,
                        g["margin"].as_f64().unwrap() as f32,
                    )
                })
                .collect(),
        })
        .collect()
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill every case in one step (logits at every position), then `steps - 1` greedy decode
/// steps with the sequences side by side, through the [`ModelRunner`] the engine uses; checks
/// both against the fixture and returns the prefill logits.
pub fn run(name: &str, model: Model, steps: usize) -> Vec<f32> {
    let cfg = model.config().clone();
    let cases = cases();
    assert!(cases.len() >= 6 && cases.iter().any(|c| c.ids.len() > 200));
    let mut kv = BlockManager::new(BlockManagerConfig::new(256)).unwrap();
    let pool = KvPoolConfig {
        block_size: 16,
        num_blocks: 256,
        dtype: KvDtype::F32,
    };
    let mut runner = ModelRunner::new(model, pool).unwrap();
    let seqs: Vec<SeqId> = (0..cases.len() as u64).map(SeqId).collect();
    for (s, c) in seqs.iter().zip(&cases) {
        kv.allocate(*s, &c.ids, SeqConfig::default()).unwrap();
    }
    // Prefill: every prompt in one step, logits at every position.
    let batch: Vec<StepSeq<'_>> = cases
        .iter()
        .zip(&seqs)
        .map(|(c, &s)| StepSeq {
            tokens: &c.ids,
            block_table: kv.block_table(s).unwrap(),
            context_len: c.ids.len(),
            logits_rows: c.ids.len(),
            read_logits: true,
        })
        .collect();
    let out = runner.step(&batch, &[]).unwrap();
    drop(batch);
    let logits: Vec<f32> = cases
        .iter()
        .enumerate()
        .flat_map(|(i, c)| (0..c.ids.len()).map(move |p| (i, p)))
        .flat_map(|(i, p)| out.logits(i, p).unwrap().to_vec())
        .collect();
    let prefill = logits.clone();
    let vocab = cfg.vocab;
    let mut row = 0;
    let mut worst = 0f32;
    for c in &cases {
        for (p, top) in c.top5.iter().enumerate() {
            let ours = &logits[(row + p) * vocab..(row + p + 1) * vocab];
            for &(id, want) in top {
                let got = ours[id as usize];
                worst = worst.max((got - want).abs());
                assert!(
                    (got - want).abs() <= tol(want),
                    "{name} {}: position {p}, token {id}: logit {got} vs reference {want}",
                    c.name
                );
            }
            let margin = top[0].1 - top[1].1;
            if margin >= NEAR_TIE {
                assert_eq!(
                    argmax(ours),
                    top[0].0,
                    "{name} {}: argmax at position {p}",
                    c.name
                );
            }
        }
        row += c.ids.len();
    }
    for (s, c) in seqs.iter().zip(&cases) {
        kv.commit(*s, &c.ids).unwrap();
    }
    // 32 greedy steps, the sequences side by side.
    let mut last: Vec<u32> = cases.iter().map(|c| c.greedy[0].0).collect();
    let mut live = vec![true; cases.len()];
    let mut lens: Vec<usize> = cases.iter().map(|c| c.ids.len()).collect();
    for (i, c) in cases.iter().enumerate() {
        // Step 0 is the prefill's last position.
        let ours = &logits[(cases[..=i].iter().map(|c| c.ids.len()).sum::<usize>() - 1) * vocab..]
            [..vocab];
        let (id, want, margin) = c.greedy[0];
        if argmax(ours) != id {
            assert!(margin < NEAR_TIE, "{name} {}: greedy step 0", c.name);
            live[i] = false;
        }
        last[i] = argmax(ours);
        let _ = want;
    }
    for step in 1..steps {
        for (i, &s) in seqs.iter().enumerate() {
            if let Some(copy) = kv.append_slots(s, 1).unwrap() {
                panic!("unexpected copy-on-write {copy:?} without forks");
            }
            lens[i] += 1;
        }
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let batch: Vec<StepSeq<'_>> = (0..cases.len())
            .map(|i| StepSeq {
                tokens: &toks[i],
                block_table: kv.block_table(seqs[i]).unwrap(),
                context_len: lens[i],
                logits_rows: 1,
                read_logits: true,
            })
            .collect();
        let out = runner.step(&batch, &[]).unwrap();
        drop(batch);
        for (i, c) in cases.iter().enumerate() {
            kv.commit(seqs[i], &toks[i]).unwrap();
            let ours = out.logits(i, 0).unwrap();
            let pick = argmax(ours);
            assert_eq!(
                out.argmax(i, 0),
                Some(pick),
                "{name} {}: device argmax",
                c.name
            );
            let (id, want, margin) = c.greedy[step];
            if live[i] {
                if pick != id {
                    assert!(
                        margin < NEAR_TIE,
                        "{name} {}: greedy step {step}: {pick} vs reference {id} (margin {margin})",
                        c.name
                    );
                    live[i] = false;
                } else {
                    worst = worst.max((ours[id as usize] - want).abs());
                    assert!(
                        (ours[id as usize] - want).abs() <= tol(want),
                        "{name} {}: step {step} logit",
                        c.name
                    );
                }
            }
            last[i] = pick;
        }
    }
    for s in seqs {
        kv.free(s).unwrap();
    }
    eprintln!(
        "{name}: max |logit - reference| = {worst}; sequences matching all {steps} steps: {}/{}",
        live.iter().filter(|&&l| l).count(),
        live.len()
    );
    assert!(
        live.iter().filter(|&&l| l).count() >= cases.len() - 1,
        "{name}: more than one sequence diverged"
    );
    prefill
}
