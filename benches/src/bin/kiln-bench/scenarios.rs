//! The serving scenarios: single stream, concurrency sweep, shared prefix.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::stats::{Prompts, Sample, mean_ms, ms, pct_ms, rate};
use crate::target::{Job, Target};

/// Compiles pipelines and fills pools before anything is timed: one prompt long enough for
/// the prefill kernels and a few decode steps, then a batch wide enough for the batched
/// decode kernels (`batch` sequences at once).
pub async fn warm_up(
    t: &Target,
    p: &mut Prompts,
    prompt: usize,
    batch: usize,
) -> anyhow::Result<()> {
    t.run(Job {
        ids: p.fresh(prompt),
        new_tokens: 4,
    })
    .await
    .context("warm-up")?;
    if batch > 1 {
        let jobs = (0..batch)
            .map(|_| Job {
                ids: p.fresh(16),
                new_tokens: 3,
            })
            .collect();
        t.run_all(jobs).await.context("warm-up batch")?;
    }
    Ok(())
}

/// One request, nothing else running.
#[derive(Debug, Clone, Serialize)]
pub struct Single {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Submission to the first token (prefill plus one sampling step).
    pub ttft_ms: f64,
    /// The engine's own TTFT (from arrival at the engine), when reported.
    pub server_ttft_ms: Option<f64>,
    /// Prompt tokens / TTFT.
    pub prefill_tokens_per_s: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub itl_mean_ms: Option<f64>,
    /// First token to last token.
    pub decode_ms: f64,
    /// (new tokens - 1) / decode time.
    pub decode_tokens_per_s: Option<f64>,
    pub e2e_ms: f64,
    /// The greedy continuation (for comparing with another engine).
    pub token_ids: Vec<u32>,
    /// The prompt, so another engine can run the very same one.
    #[serde(skip)]
    pub prompt_ids: Vec<u32>,
}

pub async fn single(
    t: &Target,
    p: &mut Prompts,
    prompt: usize,
    new: usize,
) -> anyhow::Result<Single> {
    let ids = p.fresh(prompt);
    let s = t
        .run(Job {
            ids: ids.clone(),
            new_tokens: new,
        })
        .await
        .context("single stream")?;
    let mut gaps = s.gaps();
    gaps.sort_unstable();
    Ok(Single {
        prompt_tokens: prompt,
        new_tokens: new,
        ttft_ms: ms(s.ttft()),
        server_ttft_ms: s.server_ttft.map(ms),
        prefill_tokens_per_s: rate(prompt as f64, s.ttft()),
        itl_p50_ms: pct_ms(&gaps, 50),
        itl_p99_ms: pct_ms(&gaps, 99),
        itl_mean_ms: mean_ms(&gaps),
        decode_ms: ms(s.decode_time()),
        decode_tokens_per_s: rate(new.saturating_sub(1) as f64, s.decode_time()),
        e2e_ms: ms(s.e2e()),
        token_ids: s.token_ids,
        prompt_ids: ids,
    })
}

/// One concurrency level of the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct Level {
    pub concurrency: usize,
    pub output_tokens: usize,
    pub wall_s: f64,
    /// All output tokens / wall time (first submission to last token).
    pub output_tokens_per_s: Option<f64>,
    /// Output tokens/s over that of concurrency 1 (when the sweep has it).
    pub ratio_to_c1: Option<f64>,
    /// Output tokens/s over the single-stream scenario's decode tokens/s (when it ran).
    pub ratio_to_single_decode: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    /// Mean over requests of each one's decode rate ((new - 1) / its decode time).
    pub per_request_decode_tokens_per_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub levels: Vec<Level>,
}

pub async fn sweep(
    t: &Target,
    p: &mut Prompts,
    levels: &[usize],
    prompt: usize,
    new: usize,
    single_decode: Option<f64>,
    mut progress: impl FnMut(&Level),
) -> anyhow::Result<Sweep> {
    let mut out = Vec::with_capacity(levels.len());
    let mut c1 = None;
    for &c in levels {
        let jobs = (0..c)
            .map(|_| Job {
                ids: p.fresh(prompt),
                new_tokens: new,
            })
            .collect();
        let start = Instant::now();
        let samples = t
            .run_all(jobs)
            .await
            .with_context(|| format!("sweep at concurrency {c}"))?;
        let wall = samples
            .iter()
            .filter_map(|s| s.token_times.last())
            .max()
            .map_or(Duration::ZERO, |last| *last - start);
        let mut l = level(c, &samples, new, wall);
        if c == 1 {
            c1 = l.output_tokens_per_s;
        }
        l.ratio_to_single_decode = ratio(l.output_tokens_per_s, single_decode);
        l.ratio_to_c1 = ratio(l.output_tokens_per_s, c1);
        progress(&l);
        out.push(l);
    }
    // Levels measured before concurrency 1 (an unsorted --levels) get their ratio now.
    for l in &mut out {
        l.ratio_to_c1 = ratio(l.output_tokens_per_s, c1);
    }
    Ok(Sweep {
        prompt_tokens: prompt,
        new_tokens: new,
        levels: out,
    })
}

fn level(c: usize, samples: &[Sample], new: usize, wall: Duration) -> Level {
    let mut ttft: Vec<Duration> = samples.iter().map(Sample::ttft).collect();
    let mut itl: Vec<Duration> = samples.iter().flat_map(Sample::gaps).collect();
    ttft.sort_unstable();
    itl.sort_unstable();
    let tokens: usize = samples.iter().map(|s| s.token_ids.len()).sum();
    let per_req: Vec<f64> = samples
        .iter()
        .filter_map(|s| rate(new.saturating_sub(1) as f64, s.decode_time()))
        .collect();
    Level {
        concurrency: c,
        output_tokens: tokens,
        wall_s: wall.as_secs_f64(),
        output_tokens_per_s: rate(tokens as f64, wall),
        ratio_to_c1: None,
        ratio_to_single_decode: None,
        ttft_p50_ms: pct_ms(&ttft, 50),
        ttft_p99_ms: pct_ms(&ttft, 99),
        itl_p50_ms: pct_ms(&itl, 50),
        itl_p99_ms: pct_ms(&itl, 99),
        per_request_decode_tokens_per_s: (!per_req.is_empty())
            .then(|| per_req.iter().sum::<f64>() / per_req.len() as f64),
    }
}

/// `a / b` when both are known and `b > 0`.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// One run of the shared-prefix workload.
#[derive(Debug, Clone, Serialize)]
pub struct PrefixRun {
    pub prefix_caching: bool,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    /// Cached prompt tokens / prompt tokens, over the measured requests.
    pub hit_rate: f64,
    pub ttft_mean_ms: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_max_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Prefix {
    pub prefix_tokens: usize,
    pub question_tokens: usize,
    pub new_tokens: usize,
    pub with_cache: PrefixRun,
    pub without_cache: Option<PrefixRun>,
    /// Mean TTFT without the cache / with it.
    pub ttft_speedup: Option<f64>,
    pub note: Option<String>,
}

/// The shared system prompt and the salts of the questions, so a second engine sees exactly
/// the same prompts.
#[derive(Debug, Clone)]
pub struct PrefixWorkload {
    pub system: Vec<u32>,
    pub questions: Vec<Vec<u32>>,
    pub warm: Vec<u32>,
    pub new_tokens: usize,
}

impl PrefixWorkload {
    pub fn new(p: &mut Prompts, prefix: usize, question: usize, n: usize, new: usize) -> Self {
        Self {
            system: p.fresh(prefix),
            warm: p.fresh(question),
            questions: (0..n).map(|_| p.fresh(question)).collect(),
            new_tokens: new,
        }
    }

    fn job(&self, q: &[u32]) -> Job {
        let mut ids = self.system.clone();
        ids.extend_from_slice(q);
        Job {
            ids,
            new_tokens: self.new_tokens,
        }
    }
}

/// One warm request (it fills the cache with the shared prefix), then the questions one
/// after another.
pub async fn prefix_run(
    t: &Target,
    w: &PrefixWorkload,
    prefix_caching: bool,
) -> anyhow::Result<PrefixRun> {
    t.run(w.job(&w.warm))
        .await
        .context("shared prefix: warm request")?;
    let mut samples = Vec::with_capacity(w.questions.len());
    for q in &w.questions {
        samples.push(t.run(w.job(q)).await.context("shared prefix")?);
    }
    let prompt_tokens: usize = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached: usize = samples.iter().map(|s| s.cached_prompt_tokens).sum();
    let mut ttft: Vec<Duration> = samples.iter().map(Sample::ttft).collect();
    ttft.sort_unstable();
    Ok(PrefixRun {
        prefix_caching,
        requests: samples.len(),
        prompt_tokens,
        cached_prompt_tokens: cached,
        hit_rate: if prompt_tokens == 0 {
            0.0
        } else {
            cached as f64 / prompt_tokens as f64
        },
        ttft_mean_ms: mean_ms(&ttft),
        ttft_p50_ms: pct_ms(&ttft, 50),
        ttft_max_ms: ttft.last().map(|d| ms(*d)),
    })
}
