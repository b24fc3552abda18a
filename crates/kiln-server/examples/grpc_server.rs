//! Embed kiln's gRPC server in an application of your own: build an engine over a real
//! checkpoint, listen (health says NOT_SERVING while the model loads), attach the engine,
//! serve, and drain on the way out. The application here is a client of itself: it streams one
//! generation over gRPC and reads `/metrics`, kiln's and vLLM's names.
//!
//! `cargo run --release -p kiln-server --example grpc_server [MODEL.gguf|HF_DIR]` (default: the
//! default model, `models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched by `cargo xtask
//! fetch-model`). The device is the best GPU, else the CPU backend.

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_engine::{Checkpoint, EngineOptions, build, error_chain};
use kiln_model::LoadOptions;
use kiln_server::{Server, ServerConfig, pb};
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
            eprintln!("grpc_server example: cannot start tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(path.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("grpc_server example: {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

async fn run(path: PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    // Listen at once, on ports the OS picks: a probe sees NOT_SERVING until the engine is in.
    let local = "127.0.0.1:0".parse()?;
    let server = Server::bind(local, Some(local), ServerConfig::new("smollm2")).await?;
    println!(
        "gRPC on {}, metrics on {:?}",
        server.local_addr(),
        server.metrics_addr()
    );

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
    // A warm-up request compiles every kernel, then health turns SERVING.
    server.attach(engine).await?;

    let mut client =
        pb::generation_client::GenerationClient::connect(format!("http://{}", server.local_addr()))
            .await?;
    let request = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(
            "The capital of France is".into(),
        )),
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(pb::StoppingCriteria {
            max_new_tokens: Some(8),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = client.generate_stream(request).await?.into_inner();
    let mut text = String::new();
    while let Some(msg) = stream.message().await? {
        for o in &msg.outputs {
            text.push_str(&o.text);
        }
    }
    println!("The capital of France is{text}");
    if !text.contains("Paris") {
        return Err(format!("expected Paris, got {text:?}").into());
    }

    // The Prometheus text, as a scraper reads it: kiln's families and vLLM's.
    let addr = server.metrics_addr().ok_or("no metrics listener")?;
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kiln\r\nConnection: close\r\n\r\n")
        .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    for family in [
        "kiln_generation_tokens_total",
        "vllm:generation_tokens_total",
    ] {
        let line = body
            .lines()
            .find(|l| l.starts_with(family))
            .ok_or_else(|| format!("{family} missing from /metrics"))?;
        println!("{line}");
    }

    // Health NOT_SERVING, listeners closed (GOAWAY), requests in flight finished.
    server.shutdown().await;
    Ok(())
}
