//! Tiny random-weight models against `transformers` float32 logits
//! (`scripts/make_tiny_fixtures.py`), on every backend, through the HF-folder loader: `llama`
//! (llama3 rope scaling, head_dim override, untied head), `mistral` (sliding window 7 over 40
//! tokens), `qwen2` (q/k/v biases, tied head), `qwen3` (q/k RMSNorm, no biases, head_dim
//! independent of hidden/heads; and with YaRN RoPE scaling, `qwen3_yarn`) and `gemma3` (sliding-window layers of 8 over 40 tokens beside
//! a full-attention layer, a RoPE base per layer kind with linear scaling on the full layer,
//! `1 + w` norms before and after attention and MLP, GELU-tanh, `query_pre_attn_scalar`,
//! scaled embeddings, final logit soft-capping). Tolerance 2e-5 + 2e-5·|ref| (measured: under
//! 2e-6): a few layers of f32 sums in another order.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use kiln_model::{Arch, LoadOptions, Model, ModelFiles};
use kiln_tensor::RopeScaling;

fn fixture(name: &str) -> PathBuf {
    kiln_testkit::tiny_model_dir(name)
}

fn check(name: &str) -> ModelFiles {
    let files = ModelFiles::open(&fixture(name), LoadOptions::default()).unwrap();
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    let ids = common::tiny::ids(&reference["input_ids"]);
    let want = common::tiny::logits(&reference["logits"]);
    let cfg = files.config().clone();
    for (backend, dev) in common::devices() {
        let model = Model::load(&dev, cfg.clone(), files.weights()).unwrap();
        let got = common::tiny::forward_all(&model, &dev, &ids);
        common::tiny::assert_logits_close(&got, &want, cfg.vocab, &format!("{name} {backend}"));
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
            c.attention[0].rope.scaling,
            RopeScaling::Llama3 {
                original_max_position: 16,
                ..
            }
        ),
        "{:?}",
        c.attention[0].rope.scaling
    );
}

#[test]
fn mistral_sliding_window() {
    let f = check("mistral");
    assert_eq!(
        (f.config().arch, f.config().sliding_window()),
        (Arch::Mistral, Some(7))
    );
}

#[test]
fn qwen2_qkv_biases_and_tied_head() {
    let f = check("qwen2");
    let c = f.config();
    assert_eq!(
        (c.arch, c.qkv_bias, c.tie_embeddings, c.sliding_window()),
        (Arch::Qwen2, true, true, None)
    );
}

#[test]
fn gemma3_mixed_windows_rope_bases_norms_and_softcap() {
    let f = check("gemma3");
    let c = f.config();
    assert_eq!(
        (c.arch, c.head_dim, c.hidden, c.heads, c.kv_heads),
        (Arch::Gemma3, 32, 64, 4, 2)
    );
    assert_eq!(
        (
            c.qk_norm,
            c.sandwich_norms,
            c.norm_offset,
            c.final_logit_softcap
        ),
        (true, true, 1.0, Some(10.0))
    );
    assert_eq!(c.attn_scale, 1.0 / 24f32.sqrt());
    let windows: Vec<Option<usize>> = c.attention.iter().map(|a| a.window).collect();
    assert_eq!(windows, [Some(8), Some(8), None, Some(8)]);
    assert_eq!(
        c.attention[2].rope.scaling,
        RopeScaling::Linear { factor: 4.0 }
    );
    assert_eq!(
        (c.attention[2].rope.theta, c.attention[0].rope.theta),
        (100_000.0, 10_000.0)
    );
    assert_eq!(
        c.kv_window(),
        None,
        "a full-attention layer needs every block"
    );
}

#[test]
fn qwen3_qk_norm_without_biases() {
    let f = check("qwen3");
    let c = f.config();
    assert_eq!(
        (
            c.arch,
            c.qk_norm,
            c.qkv_bias,
            c.head_dim,
            c.hidden / c.heads
        ),
        (Arch::Qwen3, true, false, 32, 16)
    );
    assert_eq!(c.sliding_window(), None);
}

#[test]
fn qwen3_yarn_rope_scaling() {
    let f = check("qwen3_yarn");
    let scaling = f.config().attention[0].rope.scaling;
    assert_eq!(
        scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 4f32.ln() + 1.0,
            truncate: true,
        }
    );
}
