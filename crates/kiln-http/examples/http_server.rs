//! Embed kiln's OpenAI-compatible HTTP server in an application of your own: build an engine
//! over a real checkpoint, listen (`/health` is 503 while the model loads), attach the engine
//! to the `Serving` the front door reads, serve, and drain on the way out. The application here
//! is a client of itself: one chat completion and one streamed completion, over plain HTTP/1.1.
//!
//! `cargo run --release -p kiln-http --example http_server [MODEL.gguf|HF_DIR]` (default: the default
//! model, `models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `cargo xtask fetch-model`). The
//! device is the best GPU, else the CPU backend.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use kiln_api::{ApiConfig, Serving, ServingConfig};
use kiln_engine::{Checkpoint, EngineOptions, build, error_chain};
use kiln_http::HttpServer;
use kiln_model::LoadOptions;
use kiln_tensor::{Device, DeviceOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn main() -> ExitCode {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("http_server example: cannot start tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(path.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("http_server example: {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

/// One HTTP/1.1 POST with a JSON body: (status, body).
async fn post(addr: SocketAddr, path: &str, json: &str) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        json.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(json.as_bytes()).await?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).await?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_owned()))
}

async fn run(path: PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    // One `Serving` per process: a gRPC server (kiln-server) can share it, and with it the
    // engine, the drain and the metrics.
    let serving = Arc::new(Serving::new(ServingConfig::default()));
    let http = HttpServer::bind(
        "127.0.0.1:0".parse()?,
        serving.clone(),
        ApiConfig::new("smollm2"),
    )
    .await?;
    let addr = http.local_addr();
    println!("OpenAI API on http://{addr}/v1");

    // Loading uploads weights: off the async workers.
    let engine = tokio::task::spawn_blocking(move || {
        let checkpoint =
            Checkpoint::open(&path, LoadOptions::default()).map_err(|e| error_chain(&e))?;
        let device = Device::new(&DeviceOptions::default()).map_err(|e| error_chain(&e))?;
        build(checkpoint, &EngineOptions::new(device), &mut |_, _| {})
            .map(|b| b.engine)
            .map_err(|e| error_chain(&e))
    })
    .await??;
    // A warm-up request compiles every kernel, then /health turns 200.
    serving.attach(engine).await?;

    // Asked for a sentence: the bare question is a near tie for the default model at 8-bit
    // activations (the native CPU backend, as llama.cpp's), answered "L'Étoile, la Marseillaise".
    let (status, body) = post(
        addr,
        "/v1/chat/completions",
        r#"{"model": "smollm2", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}"#,
    )
    .await?;
    let reply: serde_json::Value = serde_json::from_str(&body)?;
    let content = reply["choices"][0]["message"]["content"]
        .as_str()
        .ok_or_else(|| format!("HTTP {status}: {body}"))?;
    println!("chat: {content:?} (usage {})", reply["usage"]);
    if !content.contains("Paris") {
        return Err(format!("expected Paris, got {content:?}").into());
    }

    // Streamed: Server-Sent Events, one chunk a token or so, then [DONE].
    let (status, body) = post(
        addr,
        "/v1/completions",
        r#"{"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 0, "stream": true}"#,
    )
    .await?;
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let mut text = String::new();
    for e in events.iter().filter(|e| **e != "[DONE]") {
        let chunk: serde_json::Value = serde_json::from_str(e)?;
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
    }
    println!(
        "stream: HTTP {status}, {} events: Once upon a time{text}",
        events.len()
    );
    if events.last() != Some(&"[DONE]") || text.is_empty() {
        return Err(format!("a stream ends with [DONE]: {body}").into());
    }

    // Listener closed first, then the drain: requests in flight finish.
    http.shutdown().await;
    Ok(())
}
