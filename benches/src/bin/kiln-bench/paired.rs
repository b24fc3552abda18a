//! The serve scenario's paired pass, with kiln's doors in this process, once per HTTP door
//! ([`Api`]: completions, chat completions, Responses, Messages): the doors measured one after
//! the other share the machine's noise only statistically, and on a CPU backend a step's time
//! drifts by more than an HTTP layer could cost. So `n` gRPC and `n` HTTP streams run
//! together in one batch: every decode step hands a token to both sides at the same moment,
//! and the difference between the HTTP and the gRPC arrival of one step's tokens is what that
//! door (its JSON events, SSE framing, HTTP/1.1) adds per token. The text doors are sent the
//! token-id prompt decoded; Responses and Messages cannot ignore EOS, so their streams may end
//! early, and only the steps that reached both doors count.

use anyhow::{Context, bail};
use serde::Serialize;
use tokio::task::JoinSet;

use crate::serve::{Api, Dist, Door, Trace, nearest_rank};
use crate::stats::{Prompts, ms};

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

/// The paired pass of one HTTP door: `streams` gRPC and `streams` HTTP requests in one batch.
#[derive(Debug, Clone, Serialize)]
pub struct Paired {
    /// The HTTP door's API (`completions`, `chat_completions`, `responses`, `messages`).
    pub door: Api,
    pub path: &'static str,
    pub streams_per_door: usize,
    /// The token-id prompt's length; the text doors are sent it decoded, which their chat
    /// template and tokenizer make a little longer.
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Whether the HTTP requests asked to ignore EOS; without, a stream may end early and
    /// its later steps reach gRPC only.
    pub http_ignores_eos: bool,
    /// Tokens each HTTP stream delivered (the server's count), fewest first.
    pub http_stream_tokens: Vec<usize>,
    /// Decode steps that reached both doors.
    pub steps: usize,
    /// Per such step: the mean HTTP arrival of its tokens minus the mean gRPC arrival.
    pub http_minus_grpc_ms: Option<Spread>,
    /// Gaps between streamed chunks once every stream had its first (pure decode steps of the
    /// whole batch), per door: gRPC, then HTTP.
    pub decode_itl_ms: [Dist; 2],
}

/// Runs the paired pass of `http` against `grpc` (see the module's notes). Steps are told
/// apart by time: the arrivals after every stream had its first token, sorted, split wherever
/// two are more than half a median decode gap apart or a stream would appear twice (a step
/// gives each stream one token). Steps that reached only one door are left out (a step whose
/// token completes no text sends no HTTP chunk).
pub async fn run(
    grpc: &Door,
    http: &Door,
    streams: usize,
    prompt_tokens: usize,
    output_tokens: usize,
    prompts: &mut Prompts,
) -> anyhow::Result<Paired> {
    let door = match http {
        Door::Http { api, .. } => *api,
        Door::Grpc(_) => bail!("the paired pass pairs an HTTP door with gRPC"),
    };
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
    let mut http_stream_tokens: Vec<usize> = traces
        .iter()
        .filter(|(side, _)| *side == 1)
        .map(|(_, t)| t.chunks.iter().map(|c| c.1).sum())
        .collect();
    http_stream_tokens.sort_unstable();
    Ok(Paired {
        door,
        path: door.path(),
        http_ignores_eos: door.ignores_eos(),
        http_stream_tokens,
        streams_per_door: streams,
        prompt_tokens,
        output_tokens,
        steps: offsets.len(),
        http_minus_grpc_ms: Spread::of(offsets),
        decode_itl_ms: [Dist::of(g), Dist::of(h)],
    })
}

/// Prints the paired passes, one line per HTTP door.
pub fn print(p: &[Paired]) {
    let Some(first) = p.first() else {
        return;
    };
    println!(
        "paired pass: each HTTP door in its own batch with as many gRPC streams, {n} + {n} \
         ({} prompt tokens -> {} output tokens each)",
        first.prompt_tokens,
        first.output_tokens,
        n = first.streams_per_door
    );
    println!(
        "  {:<22} {:>5} {:>8} {:>8} {:>8} {:>8}   {:>21}   {:>21}   HTTP tokens per stream",
        "HTTP door",
        "steps",
        "median",
        "mean",
        "p10",
        "p90",
        "gRPC ITL med/mean/p99",
        "HTTP ITL med/mean/p99",
    );
    let dist = |d: Dist| format!("{:.2}/{:.2}/{:.2}", d.median, d.mean, d.p99);
    for x in p {
        let offset = x.http_minus_grpc_ms.map_or_else(
            || format!("{:>35}", "no step reached both"),
            |o| {
                format!(
                    "{:>+8.3} {:>+8.3} {:>+8.3} {:>+8.3}",
                    o.median, o.mean, o.p10, o.p90
                )
            },
        );
        let tokens: Vec<String> = x.http_stream_tokens.iter().map(usize::to_string).collect();
        println!(
            "  {:<22} {:>5} {offset}   {:>21}   {:>21}   {}{}",
            x.path,
            x.steps,
            dist(x.decode_itl_ms[0]),
            dist(x.decode_itl_ms[1]),
            tokens.join(","),
            if x.http_ignores_eos {
                ""
            } else {
                " (ends at EOS)"
            }
        );
    }
    println!(
        "  (median..p90: HTTP minus gRPC arrival of a decode step's tokens, ms, over the steps \
         that reached both doors; ITL: decode only, ms)"
    );
    println!();
}
