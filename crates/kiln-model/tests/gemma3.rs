//! Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors) against golden fixtures
//! from Hugging Face `transformers` (float32, the GGUF dequantized by transformers itself;
//! `scripts/make_model_fixtures.py gemma-3-270m`), as GGUF and as the HF folder kiln exports
//! from it, on the CPU and wgpu backends.
//!
//! Seven prompts with BOS, one of 850 tokens (338 past the 512-token sliding window of the
//! local layers), run as one batch: one prefill step, then greedy decode steps side by side.
//! Tolerances are `common::golden`'s (2e-3 + 2e-4·|reference| logit units). The prefill
//! checks the reference's top-5 at each prompt's last 24 positions (a row of every position
//! would be 0.9 GB of logits for this vocabulary). Greedy ids must equal the reference's except
//! after a near-tie (top-1/top-2 margin under 0.05, `NEAR_TIE`); the fixture has such ties in
//! four of its seven cases (first at steps 1, 7, 11 and 14), so up to four may diverge there.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use kiln_model::export::{HfExport, write_hf_folder};
use kiln_model::{
    Activation, Arch, GgufSource, LoadOptions, Model, ModelConfig, ModelFiles, Weight, WeightSource,
};

const TAIL: usize = 24;
const MAY_DIVERGE: usize = 4;

#[test]
fn config_from_gguf_has_the_gemma3_layer_pattern() {
    let src = GgufSource::open(&kiln_testkit::gemma3_model()).unwrap();
    let c = ModelConfig::from_gguf(src.file()).unwrap();
    assert_eq!(
        (c.arch, c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim),
        (Arch::Gemma3, 18, 640, 4, 1, 256)
    );
    assert_eq!((c.ffn, c.vocab, c.tie_embeddings), (2048, 262_144, true));
    assert_eq!(c.activation, Activation::GeluTanh);
    assert!(c.qk_norm && c.sandwich_norms && c.final_logit_softcap.is_none());
    assert_eq!(c.attn_scale, 1.0 / 16.0);
    assert_eq!(c.embed_scale, Some(640f32.sqrt()));
    for (l, a) in c.attention.iter().enumerate() {
        if (l + 1) % 6 == 0 {
            assert_eq!((a.window, a.rope.theta), (None, 1_000_000.0), "layer {l}");
        } else {
            assert_eq!((a.window, a.rope.theta), (Some(512), 10_000.0), "layer {l}");
        }
    }
    // One block table serves every layer: full-attention layers keep every block.
    assert_eq!((c.kv_window(), c.attention_mix()), (None, (15, 3)));
    assert!(src.has(Weight::PostFfnNorm(17)) && !src.has(Weight::LmHead));
}

#[test]
fn gguf_matches_transformers_on_every_backend() {
    let src = GgufSource::open(&kiln_testkit::gemma3_model()).unwrap();
    let cfg = ModelConfig::from_gguf(src.file()).unwrap();
    for (name, dev) in common::devices() {
        let model = Model::load(&dev, cfg.clone(), &src).unwrap();
        common::golden::run_cases(
            name,
            model,
            32,
            common::golden::gemma3_cases(),
            Some(TAIL),
            MAY_DIVERGE,
            common::golden::Tolerance::GEMMA3_INT8_X,
        );
    }
}

/// The HF folder kiln writes from the GGUF (norms stored as `w`, not llama.cpp's `1 + w`;
/// `gemma3_text` config) loads as transformers' own export does and matches the same golden.
/// A folder under the system temp dir, removed when dropped (also on a failed assertion).
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn hf_folder_from_gguf_matches_transformers() {
    let dir = TempDir(std::env::temp_dir().join(format!("kiln-gemma3-hf-{}", std::process::id())));
    write_hf_folder(&kiln_testkit::gemma3_model(), &dir.0, &HfExport::default()).unwrap();
    let files = ModelFiles::open(&dir.0, LoadOptions::default()).unwrap();
    let cfg = files.config().clone();
    assert_eq!((cfg.arch, cfg.norm_offset), (Arch::Gemma3, 1.0));
    for (name, dev) in common::devices() {
        let model = Model::load(&dev, cfg.clone(), files.weights()).unwrap();
        common::golden::run_cases(
            &format!("hf {name}"),
            model,
            8,
            common::golden::gemma3_cases(),
            Some(TAIL),
            MAY_DIVERGE,
            common::golden::Tolerance::GEMMA3_INT8_X,
        );
    }
}
