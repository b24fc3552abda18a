//! Aggregate output tokens/s of the engine at concurrency 1, 4 and 16 on the default model
//! (SmolLM2-135M Q4_1), with the ratio to concurrency 1: continuous batching shares each
//! step's weight read across sequences, so decode throughput should grow with concurrency
//! until the step turns compute-bound.
//!
//! Each level submits `c` requests at once (a distinct 32-token prompt each, 48 new tokens,
//! EOS ignored) and times them to the last token; TTFT and ITL are the means over requests.
//! The backend comes from `KILN_BACKEND` (`auto` if unset); `KILN_BENCH_LEVELS=1,4` picks levels.
//!
//! Run: `cargo xtask fetch-model && cargo bench -p kiln-benches --bench engine_throughput`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kiln_engine::{Checkpoint, EngineHandle, EngineOptions, Event, KvSize, Request};
use kiln_model::LoadOptions;
use kiln_tensor::{BackendChoice, Device, DeviceOptions};

const PROMPT: usize = 32;
const NEW: usize = 48;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes `--bench`; nothing else is expected.
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        return Err(format!(
            "{} is missing: run `cargo xtask fetch-model`",
            path.display()
        )
        .into());
    }
    let backend = BackendChoice::from_env()?;
    let dev = Device::new(&DeviceOptions {
        backend,
        ..DeviceOptions::default()
    })?;
    let levels: Vec<usize> = std::env::var("KILN_BENCH_LEVELS")
        .unwrap_or_else(|_| "1,4,16".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let opts = EngineOptions {
        kv_size: KvSize::Blocks(1024),
        max_num_seqs: Some(16),
        max_num_batched_tokens: Some(512),
        ..EngineOptions::new(dev.clone())
    };
    let checkpoint = Checkpoint::open(&path, LoadOptions::default())?;
    let engine = kiln_engine::build(checkpoint, &opts, &mut |_, _| {})?.engine;
    println!(
        "engine throughput on {} ({PROMPT}-token prompts, {NEW} new tokens each)",
        dev.info().name
    );
    // Warm-up: pipelines compiled, pools filled.
    run_level(&engine, 1, 1000)?;
    let mut base = None;
    for &c in &levels {
        let r = run_level(&engine, c, c as u32 * 100)?;
        let base_tps = *base.get_or_insert(r.tokens_per_s);
        println!(
            "concurrency {c:>2}: {:>7.1} output tok/s ({:.2}x c=1)  TTFT {:>7.0} ms  ITL {:>6.1} ms  wall {:.1} s",
            r.tokens_per_s,
            r.tokens_per_s / base_tps,
            r.ttft.as_secs_f64() * 1e3,
            r.itl.as_secs_f64() * 1e3,
            r.wall.as_secs_f64()
        );
    }
    engine.shutdown_blocking(kiln_engine::ShutdownMode::Drain);
    Ok(())
}

struct LevelResult {
    tokens_per_s: f64,
    ttft: Duration,
    itl: Duration,
    wall: Duration,
}

fn run_level(
    e: &EngineHandle,
    c: usize,
    salt: u32,
) -> Result<LevelResult, Box<dyn std::error::Error>> {
    let start = Instant::now();
    let streams = (0..c as u32)
        .map(|i| {
            // Distinct prompts, so the prefix cache does not shorten prefill.
            let ids = (0..PROMPT as u32)
                .map(|j| 1000 + ((salt + i) * 37 + j * 11) % 40_000)
                .collect();
            let mut r = Request::tokens(ids).max_new_tokens(NEW);
            r.stopping.ignore_eos = true;
            e.submit(r)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut tokens = 0;
    let (mut ttft, mut itl) = (Duration::ZERO, Duration::ZERO);
    for mut s in streams {
        while let Some(ev) = s.blocking_recv() {
            match ev {
                Event::Delta(d) => tokens += d.token_ids.len(),
                Event::Finished(sum) => {
                    ttft += sum.timing.time_to_first_token;
                    let gaps = sum.usage.completion_tokens.saturating_sub(1).max(1) as u32;
                    itl += sum.timing.decode / gaps;
                    break;
                }
                Event::Error(err) => return Err(err.into()),
            }
        }
    }
    let wall = start.elapsed();
    Ok(LevelResult {
        tokens_per_s: tokens as f64 / wall.as_secs_f64(),
        ttft: ttft / c as u32,
        itl: itl / c as u32,
        wall,
    })
}
