//! Shared helpers: where the model and fixtures are.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use kiln_tokenizer::Tokenizer;

pub mod cases;
pub mod pretok;
pub mod spm;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The default model's GGUF; an error (never a skip) when it has not been fetched.
pub use kiln_testkit::default_model_path as model_path;

pub fn hf_tokenizer() -> Result<Tokenizer, Box<dyn std::error::Error>> {
    Ok(Tokenizer::from_hf_dir(fixtures().join("smollm2"))?)
}

pub fn gguf_tokenizer() -> Result<Tokenizer, Box<dyn std::error::Error>> {
    Ok(Tokenizer::from_gguf_file(model_path()?)?)
}

pub fn golden() -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(fixtures().join("smollm2_golden.json"))?;
    Ok(serde_json::from_str(&text)?)
}

/// Reads a golden fixture written by `scripts/make_tokenizer_fixtures.py`.
pub fn golden_file(name: &str) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(fixtures().join(name))?;
    Ok(serde_json::from_str(&text)?)
}

/// The second model's GGUF (Gemma 3 270M), in the same folder as the default model; an error
/// (never a skip) when it has not been fetched.
pub fn gemma3_model_path() -> Result<PathBuf, String> {
    let path = kiln_testkit::model_dir().join("gemma-3-270m-q4_k_m.gguf");
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: run `cargo xtask fetch-model gemma-3-270m` (or set KILN_MODEL_DIR)",
            path.display()
        ))
    }
}

/// Gemma 3's tokenizer from its GGUF, built once per test binary (262,144 tokens).
pub fn gemma3_tokenizer() -> Result<Tokenizer, Box<dyn std::error::Error>> {
    static TOK: OnceLock<Result<Tokenizer, String>> = OnceLock::new();
    let tok = TOK.get_or_init(|| {
        let path = gemma3_model_path()?;
        Tokenizer::from_gguf_file(path).map_err(|e| e.to_string())
    });
    Ok(tok.clone()?)
}

/// Qwen2's real vocabulary (also Qwen3's), as llama.cpp ships it in a vocabulary-only GGUF.
pub fn qwen2_tokenizer() -> Result<Tokenizer, Box<dyn std::error::Error>> {
    Ok(Tokenizer::from_gguf_file(
        fixtures().join("qwen2/ggml-vocab-qwen2.gguf"),
    )?)
}
