//! Shared helpers: where the model and fixtures are.

#![allow(dead_code)]

use std::path::PathBuf;

use kiln_tokenizer::Tokenizer;

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
