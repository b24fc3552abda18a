//! The `kiln` binary on the second model, Gemma 3 270M (Q4_K_M GGUF), as a user runs it:
//! tokenize, greedy generation on both backends against `transformers`' greedy text (the
//! golden fixture's `story` case), `info`'s attention and memory lines, and a missing Gemma
//! tensor as one clear error line.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{kiln, stdout};

fn model() -> String {
    kiln_testkit::gemma3_model().display().to_string()
}

#[test]
fn tokenize_adds_bos_as_gemmas_tokenizer_does() {
    let o = kiln(&[
        "tokenize",
        "--model",
        &model(),
        "--text",
        "The capital of France is",
    ]);
    assert_eq!(stdout(&o).trim(), r#"{"ids":[2,818,5279,529,7001,563]}"#);
}

#[test]
fn generate_greedy_matches_transformers_on_both_backends() {
    let m = model();
    // The native CPU backend's 8-bit activations may leave the reference at a near-tie
    // (crates/kiln-model/tests/common/tolerance.rs: llama.cpp's own picks differ at margins
    // up to 2.33 on this model): the reference's margin for " little" is 0.058 (the steps
    // before it: 0.45 and more), for " Lily" 0.062.
    for (backend, text) in [
        ("cpu", ", there was a"),
        ("wgpu", ", there was a little girl named Lily."),
    ] {
        let o = kiln(&[
            "generate",
            "--model",
            &m,
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "10",
            "--temperature",
            "0",
            "--backend",
            backend,
            "--json",
        ]);
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        // transformers (float32, the GGUF dequantized by itself): the golden `story` case.
        assert_eq!(
            v["prompt_token_ids"],
            serde_json::json!([2, 14946, 3324, 496, 990]),
            "{backend}"
        );
        assert!(
            v["text"].as_str().unwrap().starts_with(text),
            "{backend}: {v}"
        );
        assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0, "{backend}: {v}");
    }
}

#[test]
fn info_explains_the_mixed_attention_kv_cost() {
    let out = stdout(&kiln(&["info", "--model", &model(), "--backend", "cpu"]));
    assert!(
        out.contains(
            "attention: 15 layers with a 512-token sliding window (RoPE base 10000), 3 with \
             full attention (RoPE base 1000000); every layer keeps every token's K/V"
        ),
        "{out}"
    );
    // 18 layers × 1 KV head × 256 dims × 2 (K and V) × 2 bytes (f16).
    assert!(out.contains("18432 bytes per token"), "{out}");
}

/// The Gemma file rewritten by `edit` (which may drop a tensor, returning false, or change
/// its bytes) as `name`, run with `kiln generate`; returns its stderr after checking the
/// failure is one line naming the file, exit 1, never a panic.
fn generate_fails_on_edited_copy(name: &str, edit: impl Fn(&str, &mut Vec<u8>) -> bool) -> String {
    let src = kiln_gguf::GgufFile::open(model()).unwrap();
    let bytes = std::fs::read(model()).unwrap();
    let mut w = kiln_gguf::GgufWriter::new();
    for (k, v) in src.metadata().iter() {
        w.metadata(k, v.clone());
    }
    for t in src.tensors() {
        let mut data = src.tensor_data(&bytes, t).unwrap().to_vec();
        if edit(&t.name, &mut data) {
            w.tensor(&t.name, &t.dims, t.ggml_type, data);
        }
    }
    let dir = std::env::temp_dir().join(format!("kiln-gemma3-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, w.to_bytes().unwrap()).unwrap();
    let p = path.to_str().unwrap();
    let o = kiln(&[
        "generate",
        "--model",
        p,
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--backend",
        "cpu",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked") && err.contains(name), "{err}");
    err
}

/// A Gemma file without one of its norms: one error line naming the file and tensor, exit 1.
#[test]
fn a_missing_gemma_tensor_is_one_clear_error() {
    let err = generate_fails_on_edited_copy("missing-norm.gguf", |name, _| {
        name != "blk.3.post_ffw_norm.weight"
    });
    assert!(err.contains("blk.3.post_ffw_norm.weight"), "{err}");
}

/// A K-quant block whose scale is NaN (Q6_K's `d`: the last two bytes of a 210-byte block).
#[test]
fn a_corrupted_k_quant_block_is_one_clear_error() {
    let err = generate_fails_on_edited_copy("nan-scale.gguf", |name, data| {
        if name == "blk.1.ffn_down.weight" {
            data[3 * 210 + 208..3 * 210 + 210].copy_from_slice(&0x7e00u16.to_le_bytes());
        }
        true
    });
    assert!(
        err.contains("blk.1.ffn_down.weight")
            && err.contains("Q6_K block 3 has a non-finite scale"),
        "{err}"
    );
}
