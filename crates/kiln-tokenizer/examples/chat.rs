//! Render a conversation with a model's own chat template, tokenize it, and stream the ids
//! back as UTF-8-safe text deltas: the tokenizer half of serving a chat request.
//!
//! `cargo run -p kiln-tokenizer --example chat [MODEL.gguf]` (default: the default model,
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `cargo xtask fetch-model`).

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_tokenizer::{ChatMessage, ChatOptions, DecodeOptions, Tokenizer, TokenizerError};

fn main() -> ExitCode {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chat example: {}: {e}", path.display());
            if !path.exists() {
                eprintln!(
                    "(fetch the default model with `cargo xtask fetch-model`, or pass a .gguf)"
                );
            }
            ExitCode::FAILURE
        }
    }
}

fn run(path: &std::path::Path) -> Result<(), TokenizerError> {
    let tok = Tokenizer::from_gguf_file(path)?;
    let sp = tok.special_tokens();
    println!(
        "vocabulary {} ids; bos {:?}, eos {:?}, stop ids {:?}",
        tok.vocab_size(),
        sp.bos,
        sp.eos,
        sp.stop_ids
    );

    let messages = [
        ChatMessage {
            role: "system".into(),
            content: "You are a concise assistant.".into(),
        },
        ChatMessage {
            role: "user".into(),
            content: "Say hello in French — and in 日本語.".into(),
        },
    ];
    let prompt = tok.apply_chat_template(
        &messages,
        &ChatOptions {
            add_generation_prompt: true,
        },
    )?;
    println!("--- prompt as the template renders it ---\n{prompt}---");

    let ids = tok.encode(&prompt)?;
    println!("{} tokens: {:?}", ids.len(), ids);

    // Streaming: deltas never split a character and add up to the whole decode.
    let mut detok = tok.detokenizer(DecodeOptions {
        skip_special_tokens: false,
    });
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&detok.push(id)?);
    }
    streamed.push_str(&detok.finish()?);
    assert_eq!(streamed, tok.decode(&ids)?);
    assert!(streamed.contains("日本語"));
    println!(
        "streamed decode equals the whole decode ({} bytes)",
        streamed.len()
    );
    Ok(())
}
