//! The model runner against the model's own forward pass: the same logits rows, the readback
//! each sequence asks for and nothing else, block copies applied before the step writes, and
//! bad batches refused. On the tiny random llama, on every device under test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use kiln_attention::{KvCache, key_centres};
use kiln_kv::{BlockCopy, BlockId, KvDtype};
use kiln_model::{
    CALIBRATION_TOKENS, KvPoolConfig, LoadOptions, LogitsAt, Model, ModelError, ModelFiles,
    ModelRunner, SeqInput, StepSeq,
};
use kiln_tensor::{Device, Recorder};

const POOL: KvPoolConfig = KvPoolConfig {
    block_size: 4,
    num_blocks: 8,
    dtype: KvDtype::F32,
};

fn tiny(dev: &Device) -> Model {
    let dir = kiln_testkit::tiny_model_dir("llama3");
    let files = ModelFiles::open(&dir, LoadOptions::default()).unwrap();
    Model::load(dev, files.config().clone(), files.weights()).unwrap()
}

fn host_argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn a_step_reads_back_the_rows_each_sequence_asks_for() {
    let a: Vec<u32> = (10..16).collect();
    let b: Vec<u32> = (40..45).collect();
    let (ta, tb) = ([3, 1].map(BlockId), [6, 0].map(BlockId));
    for (name, dev) in common::devices() {
        let mut runner = ModelRunner::new(tiny(&dev), POOL).unwrap();
        let out = runner
            .step(
                &[
                    StepSeq {
                        tokens: &a,
                        block_table: &ta,
                        kept_table: &[],
                        context_len: a.len(),
                        logits_rows: 2,
                        read_logits: true,
                        sample: None,
                    },
                    StepSeq {
                        tokens: &b,
                        block_table: &tb,
                        kept_table: &[],
                        context_len: b.len(),
                        logits_rows: 1,
                        read_logits: false,
                        sample: None,
                    },
                ],
                &[],
            )
            .unwrap();
        // The model's own forward over a fresh cache of the same shape.
        let cfg = runner.config().unwrap().clone();
        let mut cache = KvCache::new(&dev, cfg.kv_cache_config(POOL)).unwrap();
        let mut rec = Recorder::new(&dev);
        let inputs = [
            SeqInput {
                tokens: &a,
                block_table: &ta,
                context_len: a.len(),
            },
            SeqInput {
                tokens: &b,
                block_table: &tb,
                context_len: b.len(),
            },
        ];
        let want = runner
            .model()
            .unwrap()
            .forward(&mut rec, &mut cache, &inputs, LogitsAt::Tail(&[2, 1]))
            .unwrap();
        rec.submit().unwrap();
        let want = want.to_f32_vec().unwrap();
        let rows: Vec<&[f32]> = want.chunks(cfg.vocab).collect();
        assert_eq!(rows.len(), 3);
        assert_eq!(out.logits(0, 0), Some(rows[0]), "{name}");
        assert_eq!(out.logits(0, 1), Some(rows[1]), "{name}");
        assert_eq!(out.logits(1, 0), None, "{name}: not asked for");
        assert_eq!(out.logits(0, 2), None, "{name}: past its rows");
        for (seq, row, r) in [(0, 0, 0), (0, 1, 1), (1, 0, 2)] {
            assert_eq!(out.argmax(seq, row), Some(host_argmax(rows[r])), "{name}");
        }
        assert_eq!(out.argmax(2, 0), None);
    }
}

/// A copy-on-write block copy runs before the step's own K/V writes: decoding into the copy
/// gives the logits of decoding into the original.
#[test]
fn block_copies_run_before_the_step() {
    let prompt: Vec<u32> = vec![7, 8, 9];
    let next = [11u32];
    for (name, dev) in common::devices() {
        let decode = |table: BlockId, copies: &[BlockCopy]| {
            let mut runner = ModelRunner::new(tiny(&dev), POOL).unwrap();
            let at0 = [BlockId(0)];
            runner
                .step(
                    &[StepSeq {
                        tokens: &prompt,
                        block_table: &at0,
                        kept_table: &[],
                        context_len: 3,
                        logits_rows: 1,
                        read_logits: false,
                        sample: None,
                    }],
                    &[],
                )
                .unwrap();
            let t = [table];
            runner
                .step(
                    &[StepSeq {
                        tokens: &next,
                        block_table: &t,
                        kept_table: &[],
                        context_len: 4,
                        logits_rows: 1,
                        read_logits: true,
                        sample: None,
                    }],
                    copies,
                )
                .unwrap()
                .logits(0, 0)
                .unwrap()
                .to_vec()
        };
        let copy = BlockCopy {
            src: BlockId(0),
            dst: BlockId(5),
        };
        assert_eq!(
            decode(BlockId(5), &[copy]),
            decode(BlockId(0), &[]),
            "{name}"
        );
    }
}

#[test]
fn bad_steps_are_errors() {
    let dev = Device::reference();
    let mut runner = ModelRunner::new(tiny(&dev), POOL).unwrap();
    let t = [BlockId(0)];
    let seq = |rows| StepSeq {
        tokens: &[1, 2],
        block_table: &t,
        kept_table: &[],
        context_len: 2,
        logits_rows: rows,
        read_logits: true,
        sample: None,
    };
    for rows in [0, 3] {
        let e = runner.step(&[seq(rows)], &[]).unwrap_err();
        assert!(e.to_string().contains("logits for its last"), "{e}");
    }
    let bad_copy = BlockCopy {
        src: BlockId(0),
        dst: BlockId(99),
    };
    let e = runner.step(&[seq(1)], &[bad_copy]).unwrap_err();
    assert!(e.to_string().contains("block copy"), "{e}");
}

/// An INT4 runner's keys are centred on the model's pre-RoPE mean key over the calibration
/// tokens (positions 1.. of at most the model's context, run in chunks): the centres of the
/// keys its own forward pass leaves in an F32 cache. Other dtypes keep zero centres; fewer
/// than two tokens are an error.
#[test]
fn an_int4_runner_centres_keys_on_the_calibration_mean() {
    let tokens: Vec<u32> = (0..300u32).map(|i| 3 + (i * 37) % 120).collect();
    for (name, dev) in common::devices() {
        let pool = KvPoolConfig {
            block_size: 16,
            num_blocks: 4,
            dtype: KvDtype::Int4,
        };
        let runner = ModelRunner::calibrated(tiny(&dev), pool, &tokens).unwrap();
        let n = tokens
            .len()
            .min(CALIBRATION_TOKENS)
            .min(runner.config().unwrap().max_position);
        let blocks = n.div_ceil(16);
        let cfg = runner.config().unwrap().kv_cache_config(KvPoolConfig {
            block_size: 16,
            num_blocks: blocks as u32,
            dtype: KvDtype::F32,
        });
        let mut cache = KvCache::new(&dev, cfg).unwrap();
        let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
        let mut rec = Recorder::new(&dev);
        runner
            .model()
            .unwrap()
            .forward(
                &mut rec,
                &mut cache,
                &[SeqInput {
                    tokens: &tokens[..n],
                    block_table: &table,
                    context_len: n,
                }],
                LogitsAt::Last,
            )
            .unwrap();
        rec.submit().unwrap();
        let positions: Vec<u32> = (1..n as u32).collect();
        let want: Vec<_> = runner
            .model()
            .unwrap()
            .layer_ropes()
            .iter()
            .enumerate()
            .flat_map(|(l, rope)| {
                key_centres(
                    rope,
                    &cache.keys(l, &positions).unwrap(),
                    &positions,
                    cfg.kv_heads,
                )
            })
            .collect();
        let got = runner.cache().unwrap().key_centres();
        assert_eq!(got.len(), want.len(), "{name}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((g.lo, g.hi, g.freq), (w.lo, w.hi, w.freq), "{name}");
            for (a, b) in g.mean.iter().zip(&w.mean) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "{name}: {g:?} vs {w:?}"
                );
            }
        }
        assert!(
            got.iter().any(|c| c.mean[0].abs() > 1e-3),
            "{name}: all zero"
        );
        let f16 = ModelRunner::calibrated(
            tiny(&dev),
            KvPoolConfig {
                dtype: KvDtype::F16,
                ..pool
            },
            &[],
        )
        .unwrap();
        assert!(
            f16.cache()
                .unwrap()
                .key_centres()
                .iter()
                .all(|c| c.mean == [0.0; 2]),
            "{name}"
        );
        let e = ModelRunner::calibrated(tiny(&dev), pool, &tokens[..1]).unwrap_err();
        assert!(matches!(e, ModelError::Calibration(_)), "{name}: {e}");
        assert!(e.to_string().contains("1 calibration tokens"), "{e}");
    }
}
