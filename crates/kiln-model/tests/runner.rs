//! The model runner against the model's own forward pass: the same logits rows, the readback
//! each sequence asks for and nothing else, block copies applied before the step writes, and
//! bad batches refused. On the tiny random llama, on every device under test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use kiln_attention::KvCache;
use kiln_kv::{BlockCopy, BlockId, KvDtype};
use kiln_model::{
    KvPoolConfig, LoadOptions, LogitsAt, Model, ModelFiles, ModelRunner, SeqInput, StepSeq,
};
use kiln_tensor::{Device, Recorder};

const POOL: KvPoolConfig = KvPoolConfig {
    block_size: 4,
    num_blocks: 8,
    dtype: KvDtype::F32,
};

fn tiny(dev: &Device) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/llama3");
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
                        context_len: a.len(),
                        logits_rows: 2,
                        read_logits: true,
                    },
                    StepSeq {
                        tokens: &b,
                        block_table: &tb,
                        context_len: b.len(),
                        logits_rows: 1,
                        read_logits: false,
                    },
                ],
                &[],
            )
            .unwrap();
        // The model's own forward over a fresh cache of the same shape.
        let cfg = runner.config().clone();
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
                        context_len: 3,
                        logits_rows: 1,
                        read_logits: false,
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
                        context_len: 4,
                        logits_rows: 1,
                        read_logits: true,
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
    let dev = Device::cpu();
    let mut runner = ModelRunner::new(tiny(&dev), POOL).unwrap();
    let t = [BlockId(0)];
    let seq = |rows| StepSeq {
        tokens: &[1, 2],
        block_table: &t,
        context_len: 2,
        logits_rows: rows,
        read_logits: true,
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
