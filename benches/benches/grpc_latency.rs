//! What an operator diagnoses a server with, measured over real gRPC: time to first token
//! (prefill plus queueing), inter-token latency (decode) and output tokens/s per concurrency
//! level, with the tokens/s ratio to concurrency 1 (continuous batching should raise it).
//!
//! The real server (`kiln_tests::TestServer`, default model SmolLM2-135M Q4_1) listens on
//! loopback; each level runs `KILN_BENCH_ROUNDS` rounds (default 1) of `level` concurrent
//! `GenerateStream` calls, each a distinct ~30-token prompt, greedy, EOS ignored, so every
//! stream yields exactly `KILN_BENCH_TOKENS` tokens (default 16). Client side, TTFT runs from
//! sending the request to the first message carrying tokens and ITL is each gap between
//! token-carrying messages; the server's own TTFT (`timing.time_to_first_token_ns`, from the
//! request's arrival at the engine) comes from each stream's last message. Percentiles are
//! nearest-rank over every sample of the level; tokens/s is all output tokens over the
//! level's wall time. Client and server share the machine, so on few cores the client's
//! figures include some scheduling noise.
//!
//! Env: `KILN_BACKEND` (auto|wgpu|cpu, default auto), `KILN_BENCH_LEVELS` (default `1,16`),
//! `KILN_BENCH_TOKENS`, `KILN_BENCH_ROUNDS`.
//!
//! Run: `cargo xtask fetch-model && cargo bench -p kiln-benches --bench grpc_latency`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kiln_server::pb;
use kiln_server::pb::generation_client::GenerationClient;
use kiln_tensor::{BackendChoice, Device, DeviceOptions};
use kiln_tests::{Options, TestServer};
use tokio::task::JoinSet;
use tonic::transport::Channel;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The KV cache block size the engine uses by default (`BlockManagerConfig::new`).
const BLOCK_TOKENS: usize = 16;
/// Generous upper bound on a prompt's length in tokens, for sizing the KV cache.
const PROMPT_TOKENS_MAX: usize = 64;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), BoxError> {
    // `cargo bench` passes `--bench`; nothing else is expected.
    let levels = env_list("KILN_BENCH_LEVELS", &[1, 16])?;
    let tokens = env_num("KILN_BENCH_TOKENS", 16)?;
    let rounds = env_num("KILN_BENCH_ROUNDS", 1)?;
    let max_level = levels.iter().copied().max().unwrap_or(1);

    let device = Device::new(&DeviceOptions {
        backend: BackendChoice::from_env()?,
        ..DeviceOptions::default()
    })?;
    let info = device.info();
    let defaults = Options::default();
    let opts = Options {
        device,
        // Every stream of the largest level runs at once, none waits for memory.
        max_num_seqs: max_level.max(defaults.max_num_seqs),
        kv_blocks: defaults
            .kv_blocks
            .max((max_level * (PROMPT_TOKENS_MAX + tokens).div_ceil(BLOCK_TOKENS)) as u32),
        // As in the engine_throughput bench, so the two compare.
        max_num_batched_tokens: 512,
        ..defaults
    };
    println!(
        "gRPC latency on {} ({}, {}): levels {levels:?}, {rounds} round(s) each, \
         {tokens} new tokens per stream, greedy, EOS ignored",
        info.name, info.backend, info.device_type
    );
    let t = Instant::now();
    let server = TestServer::start(opts).await;
    println!(
        "server up on {} in {:.1} s",
        server.server.local_addr(),
        t.elapsed().as_secs_f64()
    );
    let client = server.generation();

    // Warm-up: one short request through the whole path (connection, pipelines, pools).
    // Prompt ids, never reused, so no prompt is cached from an earlier one.
    let mut next_id = 0;
    let warm = one_stream(client.clone(), request(next_id, 4), 4).await?;
    next_id += 1;
    println!(
        "warm-up: TTFT {:.0} ms, {} tokens",
        ms(warm.ttft),
        warm.tokens
    );

    let mut base: Option<(usize, f64)> = None;
    for &level in &levels {
        let r = run_level(&client, level, rounds, tokens, &mut next_id).await?;
        let (base_level, base_tps) = *base.get_or_insert((level, r.tokens_per_s));
        println!(
            "concurrency {level:>3} ({} streams, prompts {:.0} tokens avg, {} cached): \
             TTFT p50 {} p99 {} (server p50 {})  ITL p50 {} p99 {}  \
             {:.1} output tok/s ({:.2}x c={base_level})  wall {:.1} s",
            r.streams,
            r.prompt_tokens_avg,
            r.cached_prompt_tokens,
            fmt_ms(percentile(&r.ttft, 50)),
            fmt_ms(percentile(&r.ttft, 99)),
            fmt_ms(percentile(&r.server_ttft, 50)),
            fmt_ms(percentile(&r.itl, 50)),
            fmt_ms(percentile(&r.itl, 99)),
            r.tokens_per_s,
            r.tokens_per_s / base_tps,
            r.wall.as_secs_f64(),
        );
        // Every stream ended, so nothing may still run or hold KV blocks.
        let kv = server.wait_until_idle(Duration::from_secs(5)).await;
        if kv.used_blocks != 0 || kv.running_requests != 0 || kv.waiting_requests != 0 {
            println!(
                "WARNING: server not idle after the level: {} blocks used, {} running, {} waiting",
                kv.used_blocks, kv.running_requests, kv.waiting_requests
            );
        }
    }
    server.shutdown().await;
    Ok(())
}

/// Every sample of one concurrency level.
struct LevelResult {
    streams: usize,
    ttft: Vec<Duration>,
    server_ttft: Vec<Duration>,
    itl: Vec<Duration>,
    prompt_tokens_avg: f64,
    cached_prompt_tokens: u64,
    tokens_per_s: f64,
    wall: Duration,
}

async fn run_level(
    client: &GenerationClient<Channel>,
    level: usize,
    rounds: usize,
    tokens: usize,
    next_id: &mut usize,
) -> Result<LevelResult, BoxError> {
    let mut samples = Vec::with_capacity(level * rounds);
    let mut wall = Duration::ZERO;
    for _ in 0..rounds {
        let start = Instant::now();
        let mut set = JoinSet::new();
        for _ in 0..level {
            set.spawn(one_stream(
                client.clone(),
                request(*next_id, tokens),
                tokens,
            ));
            *next_id += 1;
        }
        while let Some(joined) = set.join_next().await {
            samples.push(joined.map_err(|e| format!("a stream task failed: {e}"))??);
        }
        wall += start.elapsed();
    }
    let mut r = LevelResult {
        streams: samples.len(),
        ttft: samples.iter().map(|s| s.ttft).collect(),
        server_ttft: samples.iter().map(|s| s.server_ttft).collect(),
        itl: samples.iter().flat_map(|s| s.itl.iter().copied()).collect(),
        prompt_tokens_avg: samples.iter().map(|s| s.prompt_tokens as f64).sum::<f64>()
            / samples.len().max(1) as f64,
        cached_prompt_tokens: samples
            .iter()
            .map(|s| u64::from(s.cached_prompt_tokens))
            .sum(),
        tokens_per_s: samples.iter().map(|s| s.tokens).sum::<usize>() as f64 / wall.as_secs_f64(),
        wall,
    };
    r.ttft.sort_unstable();
    r.server_ttft.sort_unstable();
    r.itl.sort_unstable();
    Ok(r)
}

/// What one stream measured.
struct StreamSample {
    ttft: Duration,
    /// Gaps between consecutive token-carrying messages.
    itl: Vec<Duration>,
    server_ttft: Duration,
    tokens: usize,
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
}

/// Runs one `GenerateStream` call to its end; an error unless it yields exactly `expect`
/// tokens and ends on LENGTH.
async fn one_stream(
    mut client: GenerationClient<Channel>,
    req: pb::GenerateRequest,
    expect: usize,
) -> Result<StreamSample, BoxError> {
    let sent = Instant::now();
    let mut stream = client.generate_stream(req).await?.into_inner();
    let (mut ttft, mut prev) = (None, None);
    let mut itl = Vec::with_capacity(expect);
    let mut tokens = 0;
    let mut finish = None;
    let mut last = None;
    while let Some(msg) = stream.message().await? {
        let now = Instant::now();
        let n: usize = msg.outputs.iter().map(|o| o.token_ids.len()).sum();
        if n > 0 {
            tokens += n;
            match prev {
                None => ttft = Some(now - sent),
                Some(p) => itl.push(now - p),
            }
            prev = Some(now);
        }
        if let Some(f) = msg.outputs.iter().find_map(|o| o.finish.clone()) {
            finish = Some(f);
        }
        last = Some(msg);
    }
    let last = last.ok_or("the stream ended without any message")?;
    let id = &last.request_id;
    let timing = last
        .timing
        .ok_or_else(|| format!("{id}: the last message carries no timing"))?;
    let usage = last
        .usage
        .ok_or_else(|| format!("{id}: the last message carries no usage"))?;
    let reason = finish.map(|f| f.reason);
    if tokens != expect
        || usage.completion_tokens as usize != expect
        || reason != Some(pb::FinishReason::Length as i32)
    {
        return Err(format!(
            "{id}: expected {expect} tokens ending on LENGTH, got {tokens} streamed, \
             usage.completion_tokens {}, finish reason {reason:?}",
            usage.completion_tokens
        )
        .into());
    }
    Ok(StreamSample {
        ttft: ttft.ok_or_else(|| format!("{id}: no message carried tokens"))?,
        itl,
        server_ttft: Duration::from_nanos(timing.time_to_first_token_ns),
        tokens,
        prompt_tokens: usage.prompt_tokens,
        cached_prompt_tokens: usage.cached_prompt_tokens,
    })
}

/// A distinct ~30-token prompt per `id`, greedy, EOS ignored, token ids returned (a text
/// delta may be empty while a multi-byte character is incomplete, so count ids, not text).
fn request(id: usize, max_new_tokens: usize) -> pb::GenerateRequest {
    const TOPICS: &[&str] = &[
        "lighthouses",
        "sourdough bread",
        "migrating geese",
        "old steam trains",
        "tide pools",
        "mountain huts",
        "paper lanterns",
        "winter gardens",
        "jazz records",
        "desert stars",
        "river ferries",
        "honey bees",
        "chess openings",
    ];
    const CITIES: &[&str] = &[
        "Lisbon", "Oslo", "Kyoto", "Quito", "Dakar", "Perth", "Tallinn", "Cusco", "Hanoi", "Porto",
        "Bergen",
    ];
    const COLOURS: &[&str] = &[
        "amber", "teal", "crimson", "ochre", "violet", "indigo", "sage",
    ];
    // The id leads, so prompts differ within their first KV block and the prefix cache
    // never shortens a prefill.
    let text = format!(
        "Ticket {id}: write a short, friendly note about {} for a reader in {}, and mention \
         the colour {} twice before you finish.",
        TOPICS[id % TOPICS.len()],
        CITIES[id % CITIES.len()],
        COLOURS[id % COLOURS.len()],
    );
    let mut r = kiln_tests::greedy(&text, u32::try_from(max_new_tokens).unwrap_or(u32::MAX));
    if let Some(s) = r.stopping.as_mut() {
        s.ignore_eos = true;
    }
    r.output = Some(pb::OutputOptions {
        return_token_ids: true,
        ..Default::default()
    });
    r
}

/// Nearest-rank percentile of sorted samples: the smallest sample with at least `p`% of the
/// samples at or below it (so p99 of fewer than 100 samples is the maximum).
fn percentile(sorted: &[Duration], p: usize) -> Option<Duration> {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn fmt_ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("{:.1} ms", ms(d)))
}

fn env_num(name: &str, default: usize) -> Result<usize, BoxError> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{name} must be a positive integer, got {v:?}").into()),
        },
        _ => Ok(default),
    }
}

fn env_list(name: &str, default: &[usize]) -> Result<Vec<usize>, BoxError> {
    let Ok(v) = std::env::var(name) else {
        return Ok(default.to_vec());
    };
    let parsed: Option<Vec<usize>> = v
        .split(',')
        .map(|s| s.trim().parse().ok().filter(|&n: &usize| n > 0))
        .collect();
    match parsed {
        Some(l) if !l.is_empty() => Ok(l),
        _ => Err(format!("{name} must be comma-separated positive integers, got {v:?}").into()),
    }
}
