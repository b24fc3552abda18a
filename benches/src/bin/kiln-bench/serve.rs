//! `serve` scenario: the workload `vllm bench serve` runs, through kiln's own front doors
//! started in this process over the bench's engine (gRPC and the OpenAI HTTP API), and with
//! `--compare llama-server` through llama.cpp's server on the same GGUF: `requests` requests
//! of distinct token-id prompts, greedy, EOS ignored, streamed, at most `concurrency` in
//! flight, arriving as a Poisson process at `rate` requests/s (all at once without one).
//! Summaries in `vllm bench serve`'s terms: TTFT to the first streamed token, TPOT = (E2EL −
//! TTFT) / (output tokens − 1), ITL between streamed chunks, E2EL to the last.
//!
//! Then, with both of kiln's doors in this process, the paired pass ([`paired`]): the doors
//! measured one after the other share the machine's noise only statistically, and on a CPU
//! backend a step's time drifts by more than an HTTP layer could cost. So `n` gRPC and `n`
//! HTTP streams run together in one batch: every decode step hands a token to both sides at
//! the same moment, and the difference between the HTTP and the gRPC arrival of one step's
//! tokens is what the HTTP layer (JSON chunks, SSE framing, HTTP/1.1) adds per token.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kiln_server::pb;
use kiln_server::pb::generation_client::GenerationClient;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::stats::{Prompts, ms};

/// What every door is sent.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Workload {
    pub requests: usize,
    pub concurrency: usize,
    /// Requests per second (Poisson arrivals); `None`: all at once.
    pub rate: Option<f64>,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

/// A front door to load.
#[derive(Debug, Clone)]
pub enum Door {
    Grpc(GenerationClient<Channel>),
    /// An OpenAI-compatible server's `/v1/completions`, with this model name.
    Http {
        addr: SocketAddr,
        model: String,
    },
}

impl Door {
    /// One streamed request of `ids`, `out` tokens, greedy, EOS ignored.
    async fn one(self, ids: Vec<u32>, out: usize) -> anyhow::Result<Trace> {
        match self {
            Door::Grpc(c) => grpc_one(c, ids, out).await,
            Door::Http { addr, model } => http_one(addr, &model, ids, out).await,
        }
    }
}

/// Mean, median and 99th percentile (nearest rank), in ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Dist {
    pub mean: f64,
    pub median: f64,
    pub p99: f64,
}

impl Dist {
    fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            median: nearest_rank(&v, 50),
            p99: nearest_rank(&v, 99),
        }
    }
}

/// The `p`th percentile of non-empty `sorted`, nearest rank.
fn nearest_rank(sorted: &[f64], p: usize) -> f64 {
    sorted[(sorted.len() * p).div_ceil(100).clamp(1, sorted.len()) - 1]
}

/// One door's results, as `vllm bench serve` reports them.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub door: String,
    pub workload: Workload,
    pub completed: usize,
    pub failed: usize,
    /// First error, if any failed.
    pub error: Option<String>,
    pub duration_s: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Dist,
    pub tpot_ms: Dist,
    pub itl_ms: Dist,
    pub e2el_ms: Dist,
}

/// One request's timeline: its start and the arrival of each streamed chunk (with the tokens
/// it carried).
struct Trace {
    start: Instant,
    chunks: Vec<(Instant, usize)>,
    end: Instant,
}

async fn grpc_one(
    mut c: GenerationClient<Channel>,
    ids: Vec<u32>,
    out: usize,
) -> anyhow::Result<Trace> {
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids })),
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(pb::StoppingCriteria {
            max_new_tokens: Some(out as u32),
            ignore_eos: true,
            ..Default::default()
        }),
        output: Some(pb::OutputOptions {
            return_token_ids: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let start = Instant::now();
    let mut stream = c.generate_stream(req).await?.into_inner();
    let mut chunks = Vec::new();
    while let Some(msg) = stream.message().await? {
        let n: usize = msg.outputs.iter().map(|o| o.token_ids.len()).sum();
        if n > 0 {
            chunks.push((Instant::now(), n));
        }
    }
    Ok(Trace {
        start,
        chunks,
        end: Instant::now(),
    })
}

async fn http_one(
    addr: SocketAddr,
    model: &str,
    ids: Vec<u32>,
    out: usize,
) -> anyhow::Result<Trace> {
    let body = json!({
        "model": model,
        "prompt": ids,
        "max_tokens": out,
        "temperature": 0,
        "stream": true,
        "ignore_eos": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    tcp.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = http::Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body.collect().await?.to_bytes();
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&bytes));
    }
    let (mut buf, mut chunks, mut usage) = (String::new(), Vec::new(), None);
    'read: while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        let now = Instant::now();
        buf.push_str(&String::from_utf8_lossy(&data));
        // Server-Sent Events: `data: {json}` events separated by a blank line.
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(d) = line.strip_prefix("data:").map(str::trim_start) else {
                    continue;
                };
                if d == "[DONE]" {
                    break 'read;
                }
                let v: Value = serde_json::from_str(d).with_context(|| format!("chunk {d:?}"))?;
                if let Some(e) = v.get("error") {
                    bail!("an error event: {e}");
                }
                if let Some(u) = v
                    .pointer("/usage/completion_tokens")
                    .and_then(Value::as_u64)
                {
                    usage = Some(u as usize);
                }
                let text = v.pointer("/choices/0/text").and_then(Value::as_str);
                if text.is_some_and(|t| !t.is_empty()) {
                    chunks.push((now, 1));
                }
            }
        }
    }
    // With the usage chunk the token count is the server's (a chunk may carry several
    // tokens, or none while a character is incomplete); spread it over the chunks.
    let streamed = chunks.len();
    if let Some(n) = usage
        && n >= streamed
        && let Some(last) = chunks.last_mut()
    {
        last.1 = n - (streamed - 1);
    }
    Ok(Trace {
        start,
        chunks,
        end: Instant::now(),
    })
}

/// Runs `w` through `door`.
pub async fn run(door: &Door, name: &str, w: &Workload, prompts: &mut Prompts) -> Summary {
    let sem = Arc::new(Semaphore::new(w.concurrency.max(1)));
    let mut rng = StdRng::seed_from_u64(0x5e21e);
    let mut set = JoinSet::new();
    let began = Instant::now();
    for _ in 0..w.requests {
        if let Some(rate) = w.rate {
            // Exponential gaps: a Poisson process of `rate` arrivals a second.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            tokio::time::sleep(Duration::from_secs_f64(-u.ln() / rate)).await;
        }
        let permit = sem.clone().acquire_owned().await;
        let ids = prompts.fresh(w.prompt_tokens);
        let (door, out) = (door.clone(), w.output_tokens);
        set.spawn(async move {
            let _permit = permit;
            door.one(ids, out).await
        });
    }
    let mut traces = Vec::new();
    let mut errors = Vec::new();
    while let Some(j) = set.join_next().await {
        match j {
            Ok(Ok(t)) if !t.chunks.is_empty() => traces.push(t),
            Ok(Ok(_)) => errors.push("a request streamed no tokens".to_owned()),
            Ok(Err(e)) => errors.push(format!("{e:#}")),
            Err(e) => errors.push(format!("a request task failed: {e}")),
        }
    }
    let duration = began.elapsed().as_secs_f64();
    let output: usize = traces
        .iter()
        .map(|t| t.chunks.iter().map(|c| c.1).sum::<usize>())
        .sum();
    let input = traces.len() * w.prompt_tokens;
    let ttft: Vec<f64> = traces.iter().map(|t| ms(t.chunks[0].0 - t.start)).collect();
    let e2el: Vec<f64> = traces.iter().map(|t| ms(t.end - t.start)).collect();
    let tpot: Vec<f64> = traces
        .iter()
        .filter_map(|t| {
            let n: usize = t.chunks.iter().map(|c| c.1).sum();
            (n > 1).then(|| ms(t.chunks[t.chunks.len() - 1].0 - t.chunks[0].0) / (n - 1) as f64)
        })
        .collect();
    let itl: Vec<f64> = traces
        .iter()
        .flat_map(|t| {
            t.chunks
                .windows(2)
                .map(|p| ms(p[1].0 - p[0].0))
                .collect::<Vec<_>>()
        })
        .collect();
    Summary {
        door: name.to_owned(),
        workload: *w,
        completed: traces.len(),
        failed: errors.len(),
        error: errors.into_iter().next(),
        duration_s: duration,
        input_tokens: input,
        output_tokens: output,
        request_throughput: traces.len() as f64 / duration,
        output_throughput: output as f64 / duration,
        total_token_throughput: (input + output) as f64 / duration,
        ttft_ms: Dist::of(ttft),
        tpot_ms: Dist::of(tpot),
        itl_ms: Dist::of(itl),
        e2el_ms: Dist::of(e2el),
    }
}

/// Prints summaries side by side in `vllm bench serve`'s layout.
pub fn print(s: &[Summary]) {
    let Some(first) = s.first() else {
        return;
    };
    let w = first.workload;
    println!(
        "serving: {} requests of {} prompt tokens -> {} output tokens, at most {} in flight, {} (greedy, EOS ignored, streamed)",
        w.requests,
        w.prompt_tokens,
        w.output_tokens,
        w.concurrency,
        w.rate.map_or("all at once".to_owned(), |r| format!(
            "{r} requests/s (Poisson)"
        ))
    );
    let line = |label: &str, f: &dyn Fn(&Summary) -> String| {
        let cells: Vec<String> = s.iter().map(|x| format!("{:>18}", f(x))).collect();
        println!("{label:<40}{}", cells.join(""));
    };
    let head: Vec<String> = s.iter().map(|x| format!("{:>18}", x.door)).collect();
    println!("{:=^40}{}", " Serving Benchmark Result ", head.join(""));
    line("Successful requests:", &|x| x.completed.to_string());
    line("Failed requests:", &|x| x.failed.to_string());
    line("Benchmark duration (s):", &|x| {
        format!("{:.2}", x.duration_s)
    });
    line("Total input tokens:", &|x| x.input_tokens.to_string());
    line("Total generated tokens:", &|x| x.output_tokens.to_string());
    line("Request throughput (req/s):", &|x| {
        format!("{:.2}", x.request_throughput)
    });
    line("Output token throughput (tok/s):", &|x| {
        format!("{:.2}", x.output_throughput)
    });
    line("Total Token throughput (tok/s):", &|x| {
        format!("{:.2}", x.total_token_throughput)
    });
    type Pick = fn(&Summary) -> Dist;
    let dists: [(&str, &str, Pick); 4] = [
        ("Time to First Token", "TTFT", |x| x.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", |x| {
            x.tpot_ms
        }),
        ("Inter-token Latency", "ITL", |x| x.itl_ms),
        ("End-to-end Latency", "E2EL", |x| x.e2el_ms),
    ];
    for (title, short, get) in dists {
        println!("{:-^40}", title);
        line(&format!("Mean {short} (ms):"), &|x| {
            format!("{:.2}", get(x).mean)
        });
        line(&format!("Median {short} (ms):"), &|x| {
            format!("{:.2}", get(x).median)
        });
        line(&format!("P99 {short} (ms):"), &|x| {
            format!("{:.2}", get(x).p99)
        });
    }
    println!("{:=^40}", "");
    for x in s {
        if let Some(e) = &x.error {
            println!("  {}: {} failed, the first: {e}", x.door, x.failed);
        }
    }
    println!();
}

/// Spread of a per-step figure, in ms: mean, median, 10th and 90th percentiles (nearest rank).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    pub mean: f64,
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Option<Self> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            median: nearest_rank(&v, 50),
            p10: nearest_rank(&v, 10),
            p90: nearest_rank(&v, 90),
        })
    }
}

/// The paired pass: `streams` gRPC and `streams` HTTP requests in one batch.
#[derive(Debug, Clone, Serialize)]
pub struct Paired {
    pub streams_per_door: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Decode steps that reached both doors.
    pub steps: usize,
    /// Per such step: the mean HTTP arrival of its tokens minus the mean gRPC arrival.
    pub http_minus_grpc_ms: Option<Spread>,
    /// Gaps between streamed chunks once every stream had its first (pure decode steps of the
    /// whole batch), per door: gRPC, then HTTP.
    pub decode_itl_ms: [Dist; 2],
}

/// Runs the paired pass through kiln's two doors (see the module's notes). Steps are told
/// apart by time: the arrivals after every stream had its first token, sorted, split wherever
/// two are more than half a median decode gap apart or a stream would appear twice (a step
/// gives each stream one token). Steps that reached only one door are left out (a step whose
/// token completes no text sends no HTTP chunk).
pub async fn paired(
    grpc: &Door,
    http: &Door,
    streams: usize,
    prompt_tokens: usize,
    output_tokens: usize,
    prompts: &mut Prompts,
) -> anyhow::Result<Paired> {
    let mut set = JoinSet::new();
    for i in 0..2 * streams {
        let door = if i % 2 == 0 { grpc } else { http }.clone();
        let ids = prompts.fresh(prompt_tokens);
        set.spawn(async move { (i % 2, door.one(ids, output_tokens).await) });
    }
    let mut traces: Vec<(usize, Trace)> = Vec::with_capacity(2 * streams);
    while let Some(j) = set.join_next().await {
        let (side, t) = j.context("a paired request task failed")?;
        let t = t.with_context(|| format!("a paired {} request", ["gRPC", "HTTP"][side]))?;
        if t.chunks.is_empty() {
            bail!(
                "a paired {} request streamed no tokens",
                ["gRPC", "HTTP"][side]
            );
        }
        traces.push((side, t));
    }
    let all_started = traces
        .iter()
        .map(|(_, t)| t.chunks[0].0)
        .max()
        .context("no paired streams")?;
    let mut itl: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for (side, t) in &traces {
        itl[*side].extend(
            t.chunks
                .windows(2)
                .filter(|w| w[0].0 >= all_started)
                .map(|w| ms(w[1].0 - w[0].0)),
        );
    }
    let mut gaps: Vec<f64> = itl.concat();
    gaps.sort_by(f64::total_cmp);
    let half_step = gaps.get(gaps.len() / 2).map_or(0.0, |m| m / 2.0);
    // (arrival in ms after all_started, door, stream).
    let mut arrivals: Vec<(f64, usize, usize)> = traces
        .iter()
        .enumerate()
        .flat_map(|(i, (side, t))| {
            t.chunks
                .iter()
                .filter(|c| c.0 >= all_started)
                .map(move |c| (ms(c.0 - all_started), *side, i))
        })
        .collect();
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut offsets = Vec::new();
    let mut step: Vec<(f64, usize, usize)> = Vec::new();
    let mut close = |step: &mut Vec<(f64, usize, usize)>| {
        let mean = |side: usize| {
            let v: Vec<f64> = step.iter().filter(|a| a.1 == side).map(|a| a.0).collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
        };
        if let (Some(g), Some(h)) = (mean(0), mean(1)) {
            offsets.push(h - g);
        }
        step.clear();
    };
    for a in arrivals {
        let next =
            step.last().is_some_and(|l| a.0 - l.0 > half_step) || step.iter().any(|s| s.2 == a.2);
        if next {
            close(&mut step);
        }
        step.push(a);
    }
    close(&mut step);
    let [g, h] = itl;
    Ok(Paired {
        streams_per_door: streams,
        prompt_tokens,
        output_tokens,
        steps: offsets.len(),
        http_minus_grpc_ms: Spread::of(offsets),
        decode_itl_ms: [Dist::of(g), Dist::of(h)],
    })
}

/// Prints the paired pass.
pub fn print_paired(p: &Paired) {
    println!(
        "paired pass: {n} gRPC + {n} HTTP streams in one batch ({} prompt tokens -> {} output tokens each)",
        p.prompt_tokens,
        p.output_tokens,
        n = p.streams_per_door
    );
    match p.http_minus_grpc_ms {
        Some(o) => println!(
            "  HTTP minus gRPC arrival of a decode step's tokens (ms): median {:+.2}  mean {:+.2}  p10 {:+.2}  p90 {:+.2}  ({} steps)",
            o.median, o.mean, o.p10, o.p90, p.steps
        ),
        None => println!("  no decode step reached both doors"),
    }
    let [g, h] = p.decode_itl_ms;
    println!(
        "  decode-only ITL (ms): gRPC median {:.2} mean {:.2} p99 {:.2}; HTTP median {:.2} mean {:.2} p99 {:.2}",
        g.median, g.mean, g.p99, h.median, h.mean, h.p99
    );
    println!();
}
