//! One assistant turn with a tool, as every kiln front door runs it: a conversation rendered
//! into prompt tokens (the model's chat template, the tool shown to it), the call forced under
//! the grammar of the tool's parameters, the output read back as a reply with a call.
//!
//! `cargo run --release -p kiln-api --example one_turn [MODEL.gguf|HF_DIR]` (default: the
//! default model, `models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `cargo xtask
//! fetch-model`). Runs on the native CPU backend.

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_api::{ApiConfig, Conversation, Message, Role, SamplingOverlay, Tool};
use kiln_engine::{Checkpoint, EngineOptions, build, error_chain};
use kiln_model::LoadOptions;
use kiln_tensor::Device;
use kiln_tokenizer::ToolChoice;
use serde_json::json;

fn main() -> ExitCode {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("one_turn example: {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

fn run(path: &std::path::Path) -> Result<(), String> {
    let checkpoint = Checkpoint::open(path, LoadOptions::default()).map_err(|e| error_chain(&e))?;
    let device = Device::cpu().map_err(|e| error_chain(&e))?;
    let engine = build(checkpoint, &EngineOptions::new(device), &mut |_, _| {})
        .map_err(|e| error_chain(&e))?
        .engine;
    let cfg = ApiConfig::new("smollm2");

    let mut chat = Conversation::new(vec![Message::new(
        Role::User,
        "What is the weather in Paris?",
    )]);
    chat.tools = vec![Tool {
        name: "get_weather".into(),
        description: Some("Current weather in a city".into()),
        parameters: Some(
            json!({"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}),
        ),
    }];
    chat.tool_choice = Some(ToolChoice::Function("get_weather".into()));
    let prepared = chat
        .prepare(engine.tokenizer(), engine.info(), &cfg)
        .map_err(|e| error_chain(&e))?;
    println!("prompt: {} tokens", prepared.ids.len());

    let greedy = SamplingOverlay {
        temperature: Some(0.0),
        ..SamplingOverlay::default()
    };
    let mut request = cfg
        .request(engine.info(), &greedy, Some(64), None)
        .map_err(|e| error_chain(&e))?;
    let format = prepared.apply(&mut request);
    let out = engine
        .submit(request)
        .map_err(|e| error_chain(&e))?
        .blocking_collect()
        .map_err(|e| error_chain(&e))?;
    let first = out.outputs.first().ok_or("no output")?;
    let reply = format.read(&first.text, first.finish.as_ref());
    println!("raw output: {}", first.text);
    for call in &reply.calls {
        println!("call: {}({})", call.name, call.arguments);
    }
    println!("finish: {:?}", reply.finish);
    if reply.calls.is_empty() {
        return Err("the forced call was not read back".into());
    }
    Ok(())
}
