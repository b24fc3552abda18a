//! Start an engine over a real checkpoint and stream one chat request token by token: what a
//! front door (gRPC, HTTP) does with an `EngineHandle`.
//!
//! `cargo run --release -p kiln-engine --example stream [MODEL.gguf|HF_DIR]` (default: the
//! default model, `models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `cargo xtask
//! fetch-model`). The device is the best GPU, else the CPU backend.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use kiln_engine::{Checkpoint, EngineOptions, Event, Request, build, error_chain};
use kiln_model::LoadOptions;
use kiln_tensor::{Device, DeviceOptions};
use kiln_tokenizer::{ChatMessage, ChatOptions};

fn main() -> ExitCode {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stream example: {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

fn run(path: &std::path::Path) -> Result<(), String> {
    let checkpoint = Checkpoint::open(path, LoadOptions::default()).map_err(|e| error_chain(&e))?;
    let device = Device::new(&DeviceOptions::default()).map_err(|e| error_chain(&e))?;
    eprintln!("device: {}", device.info());
    // The bare question is a near tie for this 135M model at 4-bit weights: with 8-bit
    // activations (the native CPU backend, and llama.cpp's CPU backend alike) its greedy answer
    // starts "L'Étoile, la Marseillaise"; asked for a sentence, every backend answers Paris.
    let prompt = checkpoint
        .tokenizer()
        .apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: "What is the capital of France? Answer in one sentence.".into(),
            }],
            &ChatOptions {
                add_generation_prompt: true,
            },
        )
        .map_err(|e| error_chain(&e))?;

    let built = build(checkpoint, &EngineOptions::new(device), &mut |_, _| {})
        .map_err(|e| error_chain(&e))?;
    eprintln!(
        "{:.1} MiB of weights loaded in {:?}; {}",
        built.weight_bytes as f64 / (1 << 20) as f64,
        built.load_time,
        built.kv
    );

    // Greedy by default; dropping the stream (or EngineHandle::abort) would free its KV blocks.
    let mut stream = built
        .engine
        .submit(Request::text(prompt).max_new_tokens(32))
        .map_err(|e| error_chain(&e))?;
    let mut text = String::new();
    let mut out = std::io::stdout().lock();
    while let Some(event) = stream.blocking_recv() {
        match event {
            // Not asked for here (`OutputOptions::prompt_logprobs`).
            Event::PromptLogprobs(_) => {}
            Event::Delta(d) => {
                text.push_str(&d.text);
                let _ = write!(out, "{}", d.text);
                let _ = out.flush();
            }
            Event::Finished(s) => {
                let _ = writeln!(out);
                eprintln!(
                    "finish {:?}: {} prompt + {} generated tokens, first token after {:?}, {:?} in all",
                    s.finish,
                    s.usage.prompt_tokens,
                    s.usage.completion_tokens,
                    s.timing.time_to_first_token,
                    s.timing.total
                );
                if !text.contains("Paris") {
                    return Err(format!("expected the answer to name Paris, got {text:?}"));
                }
                return Ok(());
            }
            Event::Error(e) => return Err(error_chain(&e)),
        }
    }
    Err("the stream ended without a summary".into())
}
