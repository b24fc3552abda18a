//! Shared helpers: where the model and fixtures are.

#![allow(dead_code)]

use std::path::PathBuf;

use kiln_tokenizer::Tokenizer;

pub mod spm;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The default model's GGUF; an error (never a skip) when it has not been fetched.
pub fn model_path() -> Result<PathBuf, String> {
    let dir = match std::env::var_os("KILN_MODEL_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"),
    };
    let path = dir.join(MODEL_FILE);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: run `cargo xtask fetch-model` (or set KILN_MODEL_DIR)",
            path.display()
        ))
    }
}

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
