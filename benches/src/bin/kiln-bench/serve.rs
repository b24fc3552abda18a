//! `serve` scenario: the workload `vllm bench serve` runs, through kiln's own front doors
//! started in this process over the bench's engine (gRPC and the OpenAI HTTP API), and with
//! `--compare llama-server` through llama.cpp's server on the same GGUF: `requests` requests
//! of distinct token-id prompts, greedy, EOS ignored, streamed, at most `concurrency` in
//! flight, arriving as a Poisson process at `rate` requests/s (all at once without one).
//! Summaries in `vllm bench serve`'s terms: TTFT to the first streamed token, TPOT = (E2EL −
//! TTFT) / (output tokens − 1), ITL between streamed chunks, E2EL to the last.
//!
//! In-process the paired pass follows ([`crate::paired`]): each HTTP door's per-token cost
//! against gRPC.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kiln_server::pb;
use kiln_server::pb::generation_client::GenerationClient;
use kiln_tokenizer::{DecodeOptions, Tokenizer};
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
    /// An OpenAI- or Anthropic-compatible HTTP server's `api`, with this model name;
    /// `tokenizer` decodes the token-id prompts for the APIs that take text.
    Http {
        addr: SocketAddr,
        model: String,
        api: Api,
        tokenizer: Option<Tokenizer>,
    },
}

impl Door {
    /// One streamed request of `ids`, `out` tokens, greedy, EOS ignored where the door can
    /// ignore it.
    pub(crate) async fn one(self, ids: Vec<u32>, out: usize) -> anyhow::Result<Trace> {
        match self {
            Door::Grpc(c) => grpc_one(c, ids, out).await,
            Door::Http {
                addr,
                model,
                api,
                tokenizer,
            } => {
                let prompt = match (api, tokenizer) {
                    (Api::Completions, _) => json!(ids),
                    (_, Some(t)) => {
                        let options = DecodeOptions {
                            skip_special_tokens: true,
                        };
                        json!(
                            t.decode_with(&ids, options)
                                .with_context(|| format!("decoding a prompt for {}", api.path()))?
                        )
                    }
                    (_, None) => bail!("{} takes text: the door has no tokenizer", api.path()),
                };
                http_one(addr, &api.body(&model, prompt, out), api).await
            }
        }
    }
}

/// An HTTP API a door speaks: how a streamed request's body is built, which SSE events carry
/// text and where the usage is. The text APIs (all but completions) take the prompt as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// OpenAI's `/v1/completions`: token-id prompts, `ignore_eos` (vLLM's extra).
    Completions,
    /// OpenAI's `/v1/chat/completions`: one user message, `ignore_eos` (vLLM's extra).
    ChatCompletions,
    /// OpenAI's Responses API, `/v1/responses`: no `ignore_eos`, a stream may end at EOS.
    Responses,
    /// Anthropic's Messages API, `/v1/messages`: no `ignore_eos`, a stream may end at EOS.
    Messages,
}

impl Api {
    /// The APIs kiln's HTTP front door serves.
    pub const ALL: [Api; 4] = [
        Api::Completions,
        Api::ChatCompletions,
        Api::Responses,
        Api::Messages,
    ];

    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// Whether a request asks the server to ignore EOS (else a stream may end early).
    pub fn ignores_eos(self) -> bool {
        matches!(self, Api::Completions | Api::ChatCompletions)
    }

    /// A streamed, greedy request of `prompt` (ids for completions, else text), `out` tokens.
    fn body(self, model: &str, prompt: Value, out: usize) -> Value {
        match self {
            Api::Completions => json!({
                "model": model, "prompt": prompt, "max_tokens": out, "temperature": 0,
                "stream": true, "ignore_eos": true, "stream_options": {"include_usage": true},
            }),
            Api::ChatCompletions => json!({
                "model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": out, "temperature": 0, "stream": true, "ignore_eos": true,
                "stream_options": {"include_usage": true},
            }),
            Api::Responses => json!({
                "model": model, "input": prompt, "max_output_tokens": out, "temperature": 0,
                "stream": true, "store": false,
            }),
            Api::Messages => json!({
                "model": model, "max_tokens": out, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "stream": true,
            }),
        }
    }

    /// The text one SSE event's data carries (`None`: no text, or not a text event).
    fn text(self, v: &Value) -> Option<&str> {
        let kind = v.get("type").and_then(Value::as_str);
        let text = match self {
            Api::Completions => v.pointer("/choices/0/text"),
            Api::ChatCompletions => v.pointer("/choices/0/delta/content"),
            Api::Responses => v
                .get("delta")
                .filter(|_| kind == Some("response.output_text.delta")),
            Api::Messages => v
                .pointer("/delta/text")
                .filter(|_| kind == Some("content_block_delta"))
                .filter(|_| v.pointer("/delta/type") == Some(&json!("text_delta"))),
        };
        text.and_then(Value::as_str)
    }

    /// The output tokens the server counted, in the event that carries them.
    fn usage(self, v: &Value) -> Option<u64> {
        let at = match self {
            Api::Completions | Api::ChatCompletions => "/usage/completion_tokens",
            Api::Responses => "/response/usage/output_tokens",
            Api::Messages => "/usage/output_tokens",
        };
        v.pointer(at).and_then(Value::as_u64)
    }

    /// Whether the event ends the stream (the OpenAI doors end theirs with `data: [DONE]`).
    fn ends(self, v: &Value) -> bool {
        let kind = v.get("type").and_then(Value::as_str);
        match self {
            Api::Completions | Api::ChatCompletions => false,
            Api::Responses => matches!(kind, Some("response.completed" | "response.incomplete")),
            Api::Messages => kind == Some("message_stop"),
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
    pub(crate) fn of(mut v: Vec<f64>) -> Self {
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
pub(crate) fn nearest_rank(sorted: &[f64], p: usize) -> f64 {
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
pub(crate) struct Trace {
    pub start: Instant,
    pub chunks: Vec<(Instant, usize)>,
    pub end: Instant,
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

/// Streams `body` to `api`'s path at `addr` over HTTP/1.1 and times each text event.
async fn http_one(addr: SocketAddr, body: &Value, api: Api) -> anyhow::Result<Trace> {
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
        .uri(api.path())
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
        // Server-Sent Events: `data: {json}` lines (after an `event:` line on the Responses
        // and Messages doors, which repeat the name as the data's `type`) and a blank line.
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
                let kind = v.get("type").and_then(Value::as_str);
                if v.get("error").is_some() || matches!(kind, Some("error" | "response.failed")) {
                    bail!("an error event: {v}");
                }
                if let Some(u) = api.usage(&v) {
                    usage = Some(u as usize);
                }
                if api.text(&v).is_some_and(|t| !t.is_empty()) {
                    chunks.push((now, 1));
                }
                if api.ends(&v) {
                    break 'read;
                }
            }
        }
    }
    // With the usage the token count is the server's (a chunk may carry several tokens, or
    // none while a character is incomplete); spread it over the chunks.
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
    // Each door's output throughput as a ratio to llama-server's, where it ran.
    if let Some(peer) = s.iter().find(|x| x.door == "llama-server") {
        line("  vs llama-server:", &|x| {
            format!("{:.2}x", x.output_throughput / peer.output_throughput)
        });
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each door's text, usage and end read from events in its wire shape (as kiln-http
    /// writes them), and nothing read from the events around them.
    #[test]
    fn each_api_reads_its_own_events() {
        let cases = [
            (
                Api::Completions,
                json!({"choices": [{"index": 0, "text": "Hi"}]}),
                json!({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 5}}),
                None,
                json!({"choices": [{"index": 0, "delta": {"content": "no"}}]}),
            ),
            (
                Api::ChatCompletions,
                json!({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
                json!({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 5}}),
                None,
                json!({"choices": [{"index": 0, "text": "no"}]}),
            ),
            (
                Api::Responses,
                json!({"type": "response.output_text.delta", "delta": "Hi"}),
                json!({"type": "response.incomplete",
                       "response": {"usage": {"input_tokens": 8, "output_tokens": 5}}}),
                Some(json!({"type": "response.completed",
                            "response": {"usage": {"output_tokens": 5}}})),
                json!({"type": "response.reasoning_text.delta", "delta": "no"}),
            ),
            (
                Api::Messages,
                json!({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": "Hi"}}),
                json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                       "usage": {"input_tokens": 8, "output_tokens": 5}}),
                Some(json!({"type": "message_stop"})),
                json!({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "thinking_delta", "text": "no"}}),
            ),
        ];
        for (api, text, usage, end, other) in cases {
            assert_eq!(api.text(&text), Some("Hi"), "{api:?}");
            assert_eq!(api.text(&other), None, "{api:?}");
            assert_eq!(api.usage(&usage), Some(5), "{api:?}");
            assert_eq!(api.usage(&text), None, "{api:?}");
            assert!(!api.ends(&text), "{api:?}");
            // The Responses door ends on either of its last events.
            assert_eq!(api.ends(&usage), api == Api::Responses, "{api:?}");
            if let Some(end) = end {
                assert!(api.ends(&end), "{api:?}");
            }
        }
    }

    /// The bodies carry the prompt where each API takes it, and ask to ignore EOS only where
    /// the API can.
    #[test]
    fn bodies_follow_each_api() {
        for api in Api::ALL {
            let b = api.body("m", json!("a prompt"), 7);
            let prompt = match api {
                Api::Completions => b.pointer("/prompt"),
                Api::Responses => b.pointer("/input"),
                Api::ChatCompletions | Api::Messages => b.pointer("/messages/0/content"),
            };
            assert_eq!(prompt, Some(&json!("a prompt")), "{api:?}");
            let max = ["max_tokens", "max_output_tokens"]
                .iter()
                .find_map(|k| b.get(*k));
            assert_eq!(max, Some(&json!(7)), "{api:?}");
            assert_eq!(b["stream"], true, "{api:?}");
            assert_eq!(b["temperature"], 0, "{api:?}");
            assert_eq!(
                b.get("ignore_eos") == Some(&json!(true)),
                api.ignores_eos(),
                "{api:?}"
            );
        }
    }
}
