//! The device sampler against its CPU reference (`kiln_tensor::sample::{process, pick}`),
//! on every wgpu configuration under test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{gpus, randn, rng};
use kiln_tensor::sample::{LogitEdit, NO_TOKEN, RowSampling, SamplingError, pick, process};
use kiln_tensor::{Device, Recorder, Tensor, TensorError};
use rand::Rng;

/// Picks of `rows` on `dev` (`[n, vocab]` logits).
fn run(dev: &Device, logits: &[f32], vocab: usize, rows: &[(usize, &RowSampling)]) -> Vec<u32> {
    let t = Tensor::from_f32(dev, &[logits.len() / vocab, vocab], logits).unwrap();
    let mut rec = Recorder::new(dev);
    let picks = rec.sample(&t, rows).unwrap();
    rec.submit().unwrap();
    picks.to_u32_vec().unwrap()
}

fn reference(logits: &[f32], vocab: usize, rows: &[(usize, &RowSampling)]) -> Vec<u32> {
    rows.iter()
        .map(|&(r, how)| {
            let processed = process(&logits[r * vocab..(r + 1) * vocab], how);
            pick(processed, how).unwrap_or(NO_TOKEN)
        })
        .collect()
}

fn knobs(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> RowSampling {
    RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        ..RowSampling::greedy()
    }
}

/// The settings under test, each with several seeds and draws.
fn settings(vocab: usize, r: &mut rand::rngs::StdRng) -> Vec<RowSampling> {
    let base = [
        knobs(0.0, 0, 1.0, 0.0),
        knobs(1.0, 0, 1.0, 0.0),
        knobs(0.7, 40, 1.0, 0.0),
        knobs(1.3, 1, 1.0, 0.0),
        knobs(1.0, 0, 0.9, 0.0),
        knobs(0.5, 0, 0.5, 0.0),
        knobs(1.0, 0, 1.0, 0.05),
        knobs(0.8, 50, 0.95, 0.02),
        knobs(2.0, 3, 0.3, 0.0),
    ];
    let mut out = Vec::new();
    for (i, b) in base.iter().enumerate() {
        for j in 0..3u64 {
            let mut s = b.clone();
            s.seed = r.random::<u64>();
            s.draw = j * 1_000_003 + (i as u64) * (1 << 40);
            match j {
                // Penalties, bias and suppression on a few ids.
                1 => {
                    let mut ids: Vec<u32> =
                        (0..12).map(|_| r.random_range(0..vocab as u32)).collect();
                    ids.sort_unstable();
                    ids.dedup();
                    s.edits = ids
                        .iter()
                        .enumerate()
                        .map(|(k, &id)| LogitEdit {
                            id,
                            add: match k % 4 {
                                0 => f32::NEG_INFINITY,
                                1 => 5.0,
                                _ => r.random_range(-2.0..2.0),
                            },
                            rep: [1.0, 1.3, 0.8][k % 3],
                            sub: [0.0, 0.4, 1.5][k % 3],
                        })
                        .collect();
                }
                // A mask allowing about a third of the vocabulary (shorter than the row).
                2 => {
                    let words = vocab.div_ceil(32).saturating_sub(1).max(1);
                    s.allowed = Some(
                        (0..words)
                            .map(|_| r.random::<u32>() & r.random::<u32>() | 1)
                            .collect(),
                    );
                }
                _ => {}
            }
            out.push(s);
        }
    }
    out
}

#[test]
fn the_device_sampler_picks_what_the_reference_picks() {
    let mut r = rng(11);
    for &(vocab, n, quantum) in &[(257usize, 3usize, 0.0f32), (5000, 2, 0.25), (49152, 2, 0.0)] {
        // With a quantum, logits come in steps, so thresholds fall on ties.
        let mut logits = randn(&mut r, n * vocab, 6.0);
        if quantum > 0.0 {
            logits
                .iter_mut()
                .for_each(|v| *v = (*v / quantum).round() * quantum);
        }
        let set = settings(vocab, &mut r);
        let rows: Vec<(usize, &RowSampling)> =
            set.iter().enumerate().map(|(i, s)| (i % n, s)).collect();
        let want = reference(&logits, vocab, &rows);
        assert_eq!(
            run(&Device::reference(), &logits, vocab, &rows),
            want,
            "cpu backend, vocab {vocab}"
        );
        for (name, dev) in gpus() {
            let got = run(&dev, &logits, vocab, &rows);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{name}: vocab {vocab}, row {i}: {:?}", rows[i].1);
            }
        }
    }
}

#[test]
fn equal_logits_draw_by_the_hash_alone() {
    // Every token equally likely: the pick is the id with the largest Gumbel noise, so the
    // device's 64-bit hash must be the CPU's, draw after draw.
    let vocab = 3000;
    let logits = vec![0.5f32; vocab];
    let mut r = rng(12);
    let set: Vec<RowSampling> = (0..24)
        .map(|d| RowSampling {
            seed: r.random(),
            draw: d,
            ..knobs(1.0, 0, 1.0, 0.0)
        })
        .collect();
    let rows: Vec<(usize, &RowSampling)> = set.iter().map(|s| (0, s)).collect();
    let want = reference(&logits, vocab, &rows);
    // Different draws pick different tokens.
    let distinct: std::collections::HashSet<_> = want.iter().collect();
    assert!(distinct.len() > 20, "{want:?}");
    for (name, dev) in gpus() {
        assert_eq!(run(&dev, &logits, vocab, &rows), want, "{name}");
    }
}

#[test]
fn ties_at_the_top_k_threshold_keep_the_lowest_ids() {
    // 10 tokens share the best logit: top-k 4 keeps ids 3, 9, 20, 31 whatever the draw.
    let vocab = 700;
    let mut logits = vec![-3.0f32; vocab];
    let tied = [3usize, 9, 20, 31, 40, 77, 100, 400, 500, 699];
    for &i in &tied {
        logits[i] = 2.0;
    }
    let set: Vec<RowSampling> = (0..40)
        .map(|d| RowSampling {
            seed: 7,
            draw: d,
            ..knobs(1.0, 4, 1.0, 0.0)
        })
        .collect();
    let rows: Vec<(usize, &RowSampling)> = set.iter().map(|s| (0, s)).collect();
    let want = reference(&logits, vocab, &rows);
    assert!(want.iter().all(|t| [3, 9, 20, 31].contains(t)), "{want:?}");
    for (name, dev) in gpus() {
        assert_eq!(run(&dev, &logits, vocab, &rows), want, "{name}");
    }
}

#[test]
fn a_row_with_nothing_possible_picks_no_token() {
    let vocab = 100;
    let logits = randn(&mut rng(13), vocab, 1.0);
    let nothing = RowSampling {
        allowed: Some(vec![0b100, 0, 0, 0]),
        edits: vec![LogitEdit {
            add: f32::NEG_INFINITY,
            ..LogitEdit::none(2)
        }],
        ..knobs(0.0, 0, 1.0, 0.0)
    };
    let sampled = RowSampling {
        temperature: 1.0,
        ..nothing.clone()
    };
    let only_two = RowSampling {
        edits: Vec::new(),
        ..sampled.clone()
    };
    let rows = [(0, &nothing), (0, &sampled), (0, &only_two)];
    for (name, dev) in gpus().into_iter().chain([("cpu", Device::reference())]) {
        assert_eq!(
            run(&dev, &logits, vocab, &rows),
            vec![NO_TOKEN, NO_TOKEN, 2],
            "{name}"
        );
    }
}

#[test]
fn bad_rows_are_refused_before_anything_runs() {
    let dev = Device::reference();
    let t = Tensor::from_f32(&dev, &[2, 10], &[0.0; 20]).unwrap();
    let mut rec = Recorder::new(&dev);
    let ok = RowSampling::greedy();
    assert!(matches!(
        rec.sample(&t, &[(2, &ok)]),
        Err(TensorError::OutOfRange {
            index: 2,
            limit: 2,
            ..
        })
    ));
    let outside = RowSampling {
        edits: vec![LogitEdit::none(10)],
        ..RowSampling::greedy()
    };
    let twice = RowSampling {
        edits: vec![LogitEdit::none(1), LogitEdit::none(1)],
        ..RowSampling::greedy()
    };
    let hot = knobs(-1.0, 0, 1.0, 0.0);
    for (bad, why) in [
        (
            &outside,
            SamplingError::EditOutsideVocab { id: 10, vocab: 10 },
        ),
        (&twice, SamplingError::TwoEdits(1)),
        (&hot, SamplingError::Temperature(-1.0)),
    ] {
        let e = rec.sample(&t, &[(1, &ok), (0, bad)]).unwrap_err();
        assert!(
            matches!(&e, TensorError::Sampling { row: 0, source } if *source == why),
            "{e}"
        );
        assert_eq!(
            std::error::Error::source(&e).map(ToString::to_string),
            Some(why.to_string())
        );
    }
}
