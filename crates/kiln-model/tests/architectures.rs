//! Tiny random-weight `llama` (llama3 rope scaling, head_dim override, untied head), `mistral`
//! (sliding window 7 over 40 tokens) and `qwen2` (q/k/v biases, tied head) models against
//! `transformers` float32 logits (`scripts/make_tiny_fixtures.py`), on every backend, through
//! the HF-folder loader. Tolerance 2e-5 + 2e-5·|ref| (measured: under 2e-6): two layers of f32
//! sums in another order.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use kiln_attention::KvCache;
use kiln_kv::{BlockId, KvDtype};
use kiln_model::{Arch, KvPoolConfig, LoadOptions, LogitsAt, Model, ModelFiles, SeqInput};
use kiln_tensor::{Recorder, RopeScaling};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny")
        .join(name)
}

fn check(name: &str) -> ModelFiles {
    let files = ModelFiles::open(&fixture(name), LoadOptions::default()).unwrap();
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    let ids: Vec<u32> = reference["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect();
    let cfg = files.config().clone();
    for (backend, dev) in common::devices() {
        let model = Model::load(&dev, cfg.clone(), files.weights()).unwrap();
        let kvc = cfg.kv_cache_config(KvPoolConfig {
            block_size: 16,
            num_blocks: 4,
            dtype: KvDtype::F32,
        });
        let mut cache = KvCache::new(&dev, kvc).unwrap();
        let table = [2, 0, 3].map(BlockId);
        let mut rec = Recorder::new(&dev);
        let logits = model
            .forward(
                &mut rec,
                &mut cache,
                &[SeqInput {
                    tokens: &ids,
                    block_table: &table,
                    context_len: ids.len(),
                }],
                LogitsAt::All,
            )
            .unwrap();
        rec.submit().unwrap();
        let got = logits.to_f32_vec().unwrap();
        assert_eq!(got.len(), want.len());
        let mut worst = 0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (g - w).abs();
            worst = worst.max(err);
            assert!(
                err <= 2e-5 + 2e-5 * w.abs(),
                "{name} {backend}: logit {i} (position {}): {g} vs {w}",
                i / cfg.vocab
            );
        }
        eprintln!("{name} {backend}: max |logit - reference| = {worst}");
    }
    files
}

#[test]
fn llama3_rope_scaling_head_dim_override_and_untied_head() {
    let f = check("llama3");
    let c = f.config();
    assert_eq!(
        (c.arch, c.head_dim, c.hidden, c.tie_embeddings),
        (Arch::Llama, 32, 64, false)
    );
    assert!(
        matches!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                original_max_position: 16,
                ..
            }
        ),
        "{:?}",
        c.rope_scaling
    );
}

#[test]
fn mistral_sliding_window() {
    let f = check("mistral");
    assert_eq!(
        (f.config().arch, f.config().sliding_window),
        (Arch::Mistral, Some(7))
    );
}

#[test]
fn qwen2_qkv_biases_and_tied_head() {
    let f = check("qwen2");
    let c = f.config();
    assert_eq!(
        (c.arch, c.qkv_bias, c.tie_embeddings, c.sliding_window),
        (Arch::Qwen2, true, true, None)
    );
}
