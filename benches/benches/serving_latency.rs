//! What an operator diagnoses a server with, measured through both front doors of one server:
//! time to first token (prefill plus queueing), inter-token latency (decode) and output
//! tokens/s per concurrency level, over gRPC (`GenerateStream`) and over the OpenAI-compatible
//! HTTP API (`POST /v1/completions`, `"stream": true`, Server-Sent Events), and the difference
//! between the two: what the HTTP layer (JSON chunks, SSE framing, HTTP/1.1) costs per request
//! and per token against gRPC on the same engine.
//!
//! The real server (`kiln_tests::TestServer`, default model SmolLM2-135M Q4_1) listens on
//! loopback with both front doors over one engine. Each level runs `KILN_BENCH_ROUNDS` rounds
//! (default 1); a round is `level` concurrent gRPC streams, then `level` concurrent HTTP
//! streams (or the other way round), never both protocols at once (but see the paired pass).
//! Greedy, EOS ignored, so every stream yields exactly `KILN_BENCH_TOKENS` tokens (default
//! 16). HTTP requests carry `max_tokens`, `temperature` 0, `ignore_eos`, `skip_special_tokens`
//! false and `stream_options.include_usage`. Special tokens are shown on both sides because
//! past EOS the model often emits `<|im_end|>` / `<|im_start|>`, which would otherwise decode
//! to no text: the gRPC message would carry only their ids and the HTTP API would send no
//! chunk, merging their decode steps into the next text gap.
//!
//! Prompts: each stream has its own ~30-token prompt, tokenized through the server's
//! `Tokenize` call before the round's clock starts and sent as token ids on both sides, so
//! neither side pays for tokenizing. Within a round both protocols get the same prompts but
//! for the ticket number that leads each one (same number of digits, so the same length; a
//! different first KV block, so the prefix cache never shortens a prefill, within or across
//! protocols: the `cached` count printed must stay 0).
//!
//! Order: which protocol goes first alternates from one round to the next, counting on across
//! levels (gRPC then HTTP, HTTP then gRPC, ...), so a warming cache, a clock step or a noisy
//! neighbour lands on each side as often first as second; with an even number of rounds each
//! protocol leads equally often at every level. Before the levels, one warm-up request goes
//! through each front door; after each half-round the server must be idle (no request, no KV
//! block).
//!
//! Client side, on both protocols, TTFT runs from sending the request to the first message
//! (gRPC) or chunk (HTTP) carrying non-empty text, and ITL is each gap between such messages.
//! With special tokens shown, the server holds text back only while a UTF-8 character is
//! incomplete (no stop strings here): then one message carries two tokens and its gap spans
//! two decode steps. gRPC sends such a step as a message with token ids and no text, the HTTP
//! API sends no chunk; counting text messages on both sides keeps ITL comparable, and each
//! line prints text messages against tokens (HTTP's from `usage.completion_tokens`, gRPC's
//! from the token ids). Every gRPC stream must end on LENGTH with `usage.completion_tokens`
//! equal to the tokens streamed; every HTTP stream must have `finish_reason` "length", a usage
//! chunk with the expected `completion_tokens`, then `[DONE]`. The server's own TTFT
//! (`timing.time_to_first_token_ns`, from the request's arrival at the engine) comes from each
//! gRPC stream's last message; the HTTP API has no such field. The HTTP client
//! (`kiln_tests::http`) opens a fresh HTTP/1.1 connection per request, so its TTFT includes a
//! loopback TCP connect; gRPC streams share one HTTP/2 channel.
//!
//! Decode-only ITL: a burst of `level` requests often reaches the engine across two steps (the
//! first arrivals start a step before the rest are in), and then the early streams' next gap
//! holds the others' whole prefill, seconds on a CPU. How a burst splits depends on
//! sub-millisecond timing, not on the protocol, yet it moves TTFT p99 and ITL p99 by more than
//! any protocol cost. So each line also gives ITL over the gaps that start once every stream
//! of the half-round has had its first text (pure decode steps of the whole batch).
//!
//! Paired pass: the sequential comparison shares the machine's noise only statistically, and
//! a step's time on a CPU backend drifts by more than the HTTP layer could cost, so after its
//! rounds each level runs once with `level` gRPC and `level` HTTP streams together in one
//! batch (twice the streams, so not part of the level's figures). Every decode step then
//! hands a token to both sides at the same moment, and the difference between the HTTP and
//! the gRPC arrival of the same step's text is the HTTP layer's extra latency per token, free
//! of step-time noise. Steps are told apart by time (decode-only arrivals split where two are
//! more than half a median step apart or a stream comes again), so on a backend whose steps
//! are shorter than the spread of one step's arrivals the figure blurs.
//!
//! Percentiles are nearest-rank over every sample of the level and protocol; tokens/s is all
//! output tokens over the summed wall time of that protocol's half-rounds. The comparison line
//! gives HTTP minus gRPC for TTFT p50, ITL p50 / p99 and decode-only ITL p50 / mean (where an
//! HTTP layer that takes CPU from the engine would show), and the ratio of tokens/s; the
//! paired line gives the per-token latency of the HTTP layer against gRPC. Client and server
//! share the machine, so on few cores the client's figures include some scheduling noise (and
//! the HTTP client's JSON parsing competes with the engine for cores).
//!
//! Env: `KILN_BACKEND` (auto|wgpu|cpu, default auto), `KILN_BENCH_LEVELS` (default `1,16`),
//! `KILN_BENCH_TOKENS`, `KILN_BENCH_ROUNDS` (an even number balances the order).
//!
//! Run: `cargo xtask fetch-model && cargo bench -p kiln-benches --bench serving_latency`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kiln_server::pb;
use kiln_server::pb::generation_client::GenerationClient;
use kiln_server::pb::tokenization_client::TokenizationClient;
use kiln_tensor::{BackendChoice, Device, DeviceOptions};
use kiln_tests::http::SseStream;
use kiln_tests::{Options, TestServer};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tonic::transport::Channel;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The KV cache block size the engine uses by default (`BlockManagerConfig::new`).
const BLOCK_TOKENS: usize = 16;
/// Generous upper bound on a prompt's length in tokens, for sizing the KV cache.
const PROMPT_TOKENS_MAX: usize = 64;

/// A front door of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    Grpc,
    Http,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Self::Grpc => "gRPC",
            Self::Http => "HTTP",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Grpc => 0,
            Self::Http => 1,
        }
    }
}

/// Where the streams go.
#[derive(Clone)]
struct Target {
    grpc: GenerationClient<Channel>,
    http: SocketAddr,
    /// The model id the HTTP API expects in `model`.
    model: String,
}

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
    let model = defaults.http.model_id.clone();
    let opts = Options {
        device,
        // Every stream of the paired pass at the largest level (both protocols' streams) runs
        // at once, none waits for memory.
        max_num_seqs: (2 * max_level).max(defaults.max_num_seqs),
        kv_blocks: defaults
            .kv_blocks
            .max((2 * max_level * (PROMPT_TOKENS_MAX + tokens).div_ceil(BLOCK_TOKENS)) as u32),
        // As in the engine_throughput bench, so the two compare.
        max_num_batched_tokens: 512,
        ..defaults
    };
    println!(
        "serving latency, gRPC and HTTP (OpenAI /v1/completions, SSE) on {} ({}, {}): \
         levels {levels:?}, {rounds} round(s) each, {tokens} new tokens per stream, greedy, \
         EOS ignored",
        info.name, info.backend, info.device_type
    );
    let t = Instant::now();
    let server = TestServer::start(opts).await;
    println!(
        "server up on {} (gRPC) and {} (HTTP) in {:.1} s",
        server.server.local_addr(),
        server.http_addr(),
        t.elapsed().as_secs_f64()
    );
    let target = Target {
        grpc: server.generation(),
        http: server.http_addr(),
        model,
    };
    let mut tokenizer = server.tokenization();

    // Warm-up: one short request through each whole path (connections, pipelines, pools).
    // Prompt ids, never reused, so no prompt is cached from an earlier one.
    let mut next_id = 0;
    for proto in [Proto::Grpc, Proto::Http] {
        let prompt = prompt_ids(&mut tokenizer, next_id, proto).await?;
        let warm = one_stream(proto, target.clone(), prompt, 4).await?;
        println!(
            "warm-up {}: TTFT {:.1} ms, {} tokens",
            proto.name(),
            ms(warm.ttft),
            warm.tokens
        );
    }
    next_id += 1;

    let mut base: [Option<(usize, f64)>; 2] = [None, None];
    let mut half_rounds = 0usize;
    for &level in &levels {
        let mut acc: [Vec<StreamSample>; 2] = [Vec::new(), Vec::new()];
        let mut steady: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        let mut walls = [Duration::ZERO; 2];
        for _ in 0..rounds {
            let order = if half_rounds.is_multiple_of(2) {
                [Proto::Grpc, Proto::Http]
            } else {
                [Proto::Http, Proto::Grpc]
            };
            half_rounds += 1;
            // Both protocols get the same `level` prompts but for the ticket number.
            let ids = next_id..next_id + level;
            next_id += level;
            for proto in order {
                // Prompts are tokenized before the clock starts.
                let mut prompts = Vec::with_capacity(level);
                for id in ids.clone() {
                    prompts.push(prompt_ids(&mut tokenizer, id, proto).await?);
                }
                let streams = prompts.into_iter().map(|p| (proto, p)).collect();
                let (samples, wall) = run_round(&target, streams, tokens).await?;
                steady[proto.index()].extend(steady_gaps(&samples));
                acc[proto.index()].extend(samples);
                walls[proto.index()] += wall;
                expect_idle(&server, proto.name(), level).await;
            }
        }
        let results = [Proto::Grpc, Proto::Http].map(|p| {
            let i = p.index();
            summarize(
                std::mem::take(&mut acc[i]),
                std::mem::take(&mut steady[i]),
                walls[i],
            )
        });
        for proto in [Proto::Grpc, Proto::Http] {
            let r = &results[proto.index()];
            let (base_level, base_tps) =
                *base[proto.index()].get_or_insert((level, r.tokens_per_s));
            let server = match proto {
                Proto::Grpc => format!(" (server p50 {})", fmt_ms(percentile(&r.server_ttft, 50))),
                Proto::Http => String::new(),
            };
            println!(
                "concurrency {level:>3} {} ({} streams, prompts {:.1} tokens avg, {} cached, \
                 {} text messages for {} tokens): TTFT p50 {} p99 {}{server}  \
                 ITL p50 {} p99 {} (decode only: p50 {} mean {})  \
                 {:.1} output tok/s ({:.2}x c={base_level})  wall {:.1} s",
                proto.name(),
                r.streams,
                r.prompt_tokens_avg,
                r.cached_prompt_tokens,
                r.chunks,
                r.tokens,
                fmt_ms(percentile(&r.ttft, 50)),
                fmt_ms(percentile(&r.ttft, 99)),
                fmt_ms(percentile(&r.itl, 50)),
                fmt_ms(percentile(&r.itl, 99)),
                fmt_ms(percentile(&r.steady, 50)),
                fmt_ms(mean(&r.steady)),
                r.tokens_per_s,
                r.tokens_per_s / base_tps,
                r.wall.as_secs_f64(),
            );
        }
        let (g, h) = (&results[0], &results[1]);
        println!(
            "concurrency {level:>3} HTTP - gRPC: TTFT p50 {}  ITL p50 {} p99 {}  \
             decode-only ITL p50 {} mean {} (per token)  tok/s HTTP/gRPC {:.3}x",
            fmt_diff(percentile(&h.ttft, 50), percentile(&g.ttft, 50)),
            fmt_diff(percentile(&h.itl, 50), percentile(&g.itl, 50)),
            fmt_diff(percentile(&h.itl, 99), percentile(&g.itl, 99)),
            fmt_diff(percentile(&h.steady, 50), percentile(&g.steady, 50)),
            fmt_diff(mean(&h.steady), mean(&g.steady)),
            h.tokens_per_s / g.tokens_per_s,
        );

        // The paired pass: `level` streams of each protocol in one batch, so every decode
        // step hands a token to both sides at the same moment.
        let ids = next_id..next_id + level;
        next_id += level;
        let mut streams = Vec::with_capacity(2 * level);
        for id in ids {
            for proto in [Proto::Grpc, Proto::Http] {
                streams.push((proto, prompt_ids(&mut tokenizer, id, proto).await?));
            }
        }
        let (samples, _) = run_round(&target, streams, tokens).await?;
        expect_idle(&server, "paired", level).await;
        let p = paired_offsets(&samples);
        println!(
            "concurrency {level:>3} paired ({level} gRPC + {level} HTTP streams in one batch): \
             HTTP minus gRPC arrival of a decode step's text: median {} mean {} \
             p10 {} p90 {} ({} steps)",
            fmt_offset(percentile_f(&p, 50)),
            fmt_offset((!p.is_empty()).then(|| p.iter().sum::<f64>() / p.len() as f64)),
            fmt_offset(percentile_f(&p, 10)),
            fmt_offset(percentile_f(&p, 90)),
            p.len(),
        );
    }
    server.shutdown().await;
    Ok(())
}

/// Every sample of one protocol at one concurrency level.
struct LevelResult {
    streams: usize,
    ttft: Vec<Duration>,
    server_ttft: Vec<Duration>,
    itl: Vec<Duration>,
    /// ITL samples of the decode-only phase ([`steady_gaps`]).
    steady: Vec<Duration>,
    prompt_tokens_avg: f64,
    cached_prompt_tokens: u64,
    tokens: usize,
    /// Messages (gRPC) or chunks (HTTP) that carried text.
    chunks: usize,
    tokens_per_s: f64,
    wall: Duration,
}

fn summarize(samples: Vec<StreamSample>, steady: Vec<Duration>, wall: Duration) -> LevelResult {
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let mut r = LevelResult {
        streams: samples.len(),
        ttft: samples.iter().map(|s| s.ttft).collect(),
        server_ttft: samples.iter().filter_map(|s| s.server_ttft).collect(),
        itl: samples.iter().flat_map(StreamSample::gaps).collect(),
        steady,
        prompt_tokens_avg: samples.iter().map(|s| s.prompt_tokens as f64).sum::<f64>()
            / samples.len().max(1) as f64,
        cached_prompt_tokens: samples.iter().map(|s| s.cached_prompt_tokens).sum(),
        tokens,
        chunks: samples.iter().map(|s| s.times.len()).sum(),
        tokens_per_s: tokens as f64 / wall.as_secs_f64(),
        wall,
    };
    r.ttft.sort_unstable();
    r.server_ttft.sort_unstable();
    r.itl.sort_unstable();
    r.steady.sort_unstable();
    r
}

/// `prompts.len()` concurrent streams over `proto`; their samples and the wall time.
/// Every stream ended, so nothing may still run or hold KV blocks.
async fn expect_idle(server: &TestServer, what: &str, level: usize) {
    let kv = server.wait_until_idle(Duration::from_secs(5)).await;
    if kv.used_blocks != 0 || kv.running_requests != 0 || kv.waiting_requests != 0 {
        println!(
            "WARNING: server not idle after {what} streams at concurrency {level}: \
             {} blocks used, {} running, {} waiting",
            kv.used_blocks, kv.running_requests, kv.waiting_requests
        );
    }
}

/// The streams, all at once; their samples and the wall time.
async fn run_round(
    target: &Target,
    streams: Vec<(Proto, Vec<u32>)>,
    tokens: usize,
) -> Result<(Vec<StreamSample>, Duration), BoxError> {
    let mut samples = Vec::with_capacity(streams.len());
    let start = Instant::now();
    let mut set = JoinSet::new();
    for (proto, prompt) in streams {
        set.spawn(one_stream(proto, target.clone(), prompt, tokens));
    }
    while let Some(joined) = set.join_next().await {
        samples.push(joined.map_err(|e| format!("a stream task failed: {e}"))??);
    }
    Ok((samples, start.elapsed()))
}

/// Per decode step of a paired pass, in ms: the mean arrival of the HTTP streams' text from
/// that step minus the gRPC streams'. Steps are told apart by time: arrivals from
/// [`steady_gaps`]'s decode-only phase, sorted, split wherever two are more than half a
/// median step apart or a stream would appear twice (a step gives each stream one token, and
/// the last steps, with fewer streams left, are shorter); steps that reached only one protocol
/// are left out.
fn paired_offsets(samples: &[StreamSample]) -> Vec<f64> {
    let Some(all_started) = all_started(samples) else {
        return Vec::new();
    };
    let mut step = steady_gaps(samples);
    step.sort_unstable();
    let Some(half_step) = percentile(&step, 50).map(|d| d / 2) else {
        return Vec::new();
    };
    // (arrival, protocol, stream).
    let mut arrivals: Vec<(Instant, Proto, usize)> = samples
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.times.iter().map(move |&t| (t, s.proto, i)))
        .filter(|&(t, _, _)| t >= all_started)
        .collect();
    arrivals.sort_by_key(|&(t, _, _)| t);
    let mut offsets = Vec::new();
    let mut cluster: Vec<(Instant, Proto, usize)> = Vec::new();
    let mut close = |cluster: &mut Vec<(Instant, Proto, usize)>| {
        let mean_of = |proto: Proto| {
            let side: Vec<f64> = cluster
                .iter()
                .filter(|&&(_, p, _)| p == proto)
                .map(|&(t, _, _)| ms(t - all_started))
                .collect();
            (!side.is_empty()).then(|| side.iter().sum::<f64>() / side.len() as f64)
        };
        if let (Some(h), Some(g)) = (mean_of(Proto::Http), mean_of(Proto::Grpc)) {
            offsets.push(h - g);
        }
        cluster.clear();
    };
    for a in arrivals {
        let next_step = cluster.last().is_some_and(|&(t, _, _)| a.0 - t > half_step)
            || cluster.iter().any(|&(_, _, i)| i == a.2);
        if next_step {
            close(&mut cluster);
        }
        cluster.push(a);
    }
    close(&mut cluster);
    offsets.sort_by(f64::total_cmp);
    offsets
}

/// What one stream measured.
struct StreamSample {
    proto: Proto,
    ttft: Duration,
    /// When each text-carrying message arrived (the first is TTFT's end).
    times: Vec<Instant>,
    /// gRPC only: the engine's own TTFT.
    server_ttft: Option<Duration>,
    tokens: usize,
    prompt_tokens: u64,
    cached_prompt_tokens: u64,
}

async fn one_stream(
    proto: Proto,
    target: Target,
    prompt: Vec<u32>,
    expect: usize,
) -> Result<StreamSample, BoxError> {
    match proto {
        Proto::Grpc => grpc_stream(target.grpc, request(prompt, expect), expect).await,
        Proto::Http => http_stream(target.http, &target.model, prompt, expect).await,
    }
}

/// Runs one `GenerateStream` call to its end; an error unless it yields exactly `expect`
/// tokens and ends on LENGTH.
async fn grpc_stream(
    mut client: GenerationClient<Channel>,
    req: pb::GenerateRequest,
    expect: usize,
) -> Result<StreamSample, BoxError> {
    let sent = Instant::now();
    let mut stream = client.generate_stream(req).await?.into_inner();
    let mut clock = TextClock::new(sent, expect);
    let mut tokens = 0;
    let mut finish = None;
    let mut last = None;
    while let Some(msg) = stream.message().await? {
        let now = Instant::now();
        tokens += msg.outputs.iter().map(|o| o.token_ids.len()).sum::<usize>();
        if msg.outputs.iter().any(|o| !o.text.is_empty()) {
            clock.text_at(now);
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
        server_ttft: Some(Duration::from_nanos(timing.time_to_first_token_ns)),
        prompt_tokens: u64::from(usage.prompt_tokens),
        cached_prompt_tokens: u64::from(usage.cached_prompt_tokens),
        ..clock.sample(Proto::Grpc, id, tokens)?
    })
}

/// Runs one streamed `POST /v1/completions` to its end; an error unless its usage chunk says
/// exactly `expect` completion tokens, a choice ends with `finish_reason` "length" and the
/// stream ends with `[DONE]`.
async fn http_stream(
    addr: SocketAddr,
    model: &str,
    prompt: Vec<u32>,
    expect: usize,
) -> Result<StreamSample, BoxError> {
    let body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": expect,
        "temperature": 0,
        "ignore_eos": true,
        "skip_special_tokens": false,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let sent = Instant::now();
    let mut stream = SseStream::open(addr, "/v1/completions", &body).await;
    if stream.status != 200 {
        let rest = stream.rest().await;
        return Err(format!("HTTP {}: {rest:?}", stream.status).into());
    }
    let mut clock = TextClock::new(sent, expect);
    let mut finish: Option<String> = None;
    let mut usage: Option<Value> = None;
    let mut done = false;
    let mut id = String::new();
    while let Some(data) = stream.next_data().await {
        let now = Instant::now();
        if done {
            return Err(format!("{id}: an event after [DONE]: {data}").into());
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value =
            serde_json::from_str(&data).map_err(|e| format!("{id}: bad chunk ({e}): {data}"))?;
        if chunk.get("error").is_some() {
            return Err(format!("{id}: an error event: {data}").into());
        }
        if let Some(i) = chunk["id"].as_str() {
            i.clone_into(&mut id);
        }
        let choices = chunk["choices"].as_array().map_or(&[][..], Vec::as_slice);
        if choices
            .iter()
            .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
        {
            clock.text_at(now);
        }
        if let Some(f) = choices.iter().find_map(|c| c["finish_reason"].as_str()) {
            finish = Some(f.to_owned());
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
    }
    let usage = usage.ok_or_else(|| format!("{id}: no usage chunk"))?;
    let completion = usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
    if !done || completion != expect || finish.as_deref() != Some("length") {
        return Err(format!(
            "{id}: expected {expect} tokens ending on \"length\" then [DONE], got \
             usage.completion_tokens {completion}, finish_reason {finish:?}, [DONE] {done}"
        )
        .into());
    }
    let usage_of = |key: &str| usage[key].as_u64().unwrap_or(0);
    Ok(StreamSample {
        server_ttft: None,
        prompt_tokens: usage_of("prompt_tokens"),
        cached_prompt_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        ..clock.sample(Proto::Http, &id, completion)?
    })
}

impl StreamSample {
    /// Gaps between consecutive text-carrying messages.
    fn gaps(&self) -> impl Iterator<Item = Duration> + '_ {
        self.times.windows(2).map(|w| w[1] - w[0])
    }
}

/// The ITL samples of one half-round's decode-only phase: gaps that start once every stream
/// has had its first text, so no prefill shares their steps. A burst of requests can reach the
/// engine across more than one step (the first arrivals start before the rest are in), and
/// then the early streams' next gap holds the others' whole prefill; how a burst splits
/// depends on sub-millisecond timing, not on the protocol, so these samples leave it out.
fn steady_gaps(samples: &[StreamSample]) -> Vec<Duration> {
    let Some(all_started) = all_started(samples) else {
        return Vec::new();
    };
    samples
        .iter()
        .flat_map(|s| s.times.windows(2))
        .filter(|w| w[0] >= all_started)
        .map(|w| w[1] - w[0])
        .collect()
}

/// When the last of `samples` to start had its first text.
fn all_started(samples: &[StreamSample]) -> Option<Instant> {
    samples
        .iter()
        .filter_map(|s| s.times.first())
        .max()
        .copied()
}

/// When a stream's text-carrying messages arrived.
struct TextClock {
    sent: Instant,
    times: Vec<Instant>,
}

impl TextClock {
    fn new(sent: Instant, expect: usize) -> Self {
        Self {
            sent,
            times: Vec::with_capacity(expect),
        }
    }

    fn text_at(&mut self, now: Instant) {
        self.times.push(now);
    }

    /// The sample of a stream that carried `tokens` tokens (an error when more messages than
    /// tokens carried text); server TTFT and prompt counts left unset.
    fn sample(self, proto: Proto, id: &str, tokens: usize) -> Result<StreamSample, BoxError> {
        let Some(&first) = self.times.first() else {
            return Err(format!("{id}: no message carried text").into());
        };
        if self.times.len() > tokens {
            return Err(format!(
                "{id}: {} text messages for {tokens} tokens",
                self.times.len()
            )
            .into());
        }
        Ok(StreamSample {
            proto,
            ttft: first - self.sent,
            times: self.times,
            server_ttft: None,
            tokens,
            prompt_tokens: 0,
            cached_prompt_tokens: 0,
        })
    }
}

/// The ~30-token prompt `id` for `proto`, as token ids from the server's tokenizer. Both
/// protocols' prompts `id` are the same text but for their ticket numbers, which have the
/// same number of digits (so the prompts have the same length) and differ in the first KV
/// block (so neither reuses the other's cached prompt).
async fn prompt_ids(
    tokenizer: &mut TokenizationClient<Channel>,
    id: usize,
    proto: Proto,
) -> Result<Vec<u32>, BoxError> {
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
    // The ticket leads, so prompts differ within their first KV block and the prefix cache
    // never shortens a prefill.
    // 10 + 2 id is even, the next odd: never on either side of a power of ten.
    let ticket = 10 + 2 * id + proto.index();
    let text = format!(
        "Ticket {ticket}: write a short, friendly note about {} for a reader in {}, and mention \
         the colour {} twice before you finish.",
        TOPICS[id % TOPICS.len()],
        CITIES[id % CITIES.len()],
        COLOURS[id % COLOURS.len()],
    );
    let ids = tokenizer
        .tokenize(pb::TokenizeRequest {
            input: Some(pb::tokenize_request::Input::Text(text)),
            return_tokens: false,
        })
        .await?
        .into_inner()
        .token_ids;
    Ok(ids)
}

/// A token-id prompt, greedy, EOS ignored, special tokens shown, token ids returned (a text
/// delta may be empty while a multi-byte character is incomplete, so count ids, not text).
fn request(prompt: Vec<u32>, max_new_tokens: usize) -> pb::GenerateRequest {
    let mut r = kiln_tests::greedy("", u32::try_from(max_new_tokens).unwrap_or(u32::MAX));
    r.prompt = Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
        ids: prompt,
    }));
    if let Some(s) = r.stopping.as_mut() {
        s.ignore_eos = true;
    }
    r.output = Some(pb::OutputOptions {
        return_token_ids: true,
        skip_special_tokens: Some(false),
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

/// [`percentile`] of sorted plain numbers.
fn percentile_f(sorted: &[f64], p: usize) -> Option<f64> {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied()
}

/// A signed offset in ms, to the hundredth.
fn fmt_offset(ms: Option<f64>) -> String {
    ms.map_or_else(|| "-".into(), |ms| format!("{ms:+.2} ms"))
}

fn mean(samples: &[Duration]) -> Option<Duration> {
    let n = u32::try_from(samples.len()).ok().filter(|&n| n > 0)?;
    Some(samples.iter().sum::<Duration>() / n)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn fmt_ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), |d| format!("{:.1} ms", ms(d)))
}

/// `a - b` in ms with its sign, to the hundredth (the HTTP layer's cost is small).
fn fmt_diff(a: Option<Duration>, b: Option<Duration>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:+.2} ms", ms(a) - ms(b)),
        _ => "-".into(),
    }
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
