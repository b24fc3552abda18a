//! The report: one table per scenario on stdout, every figure as JSON on disk.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use crate::llama_cpp::LlamaCpp;
use crate::roofline::Roofline;
use crate::scenarios::{Level, Prefix, Single, Sweep};
use crate::speculative::Speculative;

#[derive(Debug, Clone, Serialize)]
pub struct DeviceFacts {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    /// The native CPU backend's threads (0 on other devices and remote servers).
    pub threads: usize,
    /// The native CPU backend's SIMD level (empty elsewhere).
    pub cpu_isa: String,
}

/// How the in-process engine was sized (or what the server reported).
#[derive(Debug, Clone, Serialize)]
pub struct EngineFacts {
    pub kv_blocks: usize,
    pub block_size: usize,
    pub kv_dtype: String,
    pub kv_bytes_per_token: u64,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

/// The flags that shaped the workload.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    pub scenarios: Vec<&'static str>,
    pub levels: Vec<usize>,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub sweep_prompt_tokens: usize,
    pub sweep_new_tokens: usize,
    pub prefix_tokens: usize,
    pub prefix_question_tokens: usize,
    pub prefix_new_tokens: usize,
    pub prefix_requests: usize,
    pub spec_new_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub tool: &'static str,
    pub unix_time: u64,
    pub date_utc: String,
    pub model: String,
    /// `in-process` or `grpc`.
    pub mode: &'static str,
    pub grpc: Option<String>,
    pub device: DeviceFacts,
    pub engine: Option<EngineFacts>,
    /// Threads given to llama.cpp (`--threads`).
    pub threads: usize,
    /// What the OS reports as available parallelism.
    pub host_parallelism: usize,
    /// kiln's CPU backend runs on one thread; lavapipe takes `LP_NUM_THREADS` (all cores by
    /// default).
    pub lp_num_threads: Option<String>,
    pub workload: Workload,
    pub single: Option<Single>,
    pub sweep: Option<Sweep>,
    pub prefix: Option<Prefix>,
    pub roofline: Option<Roofline>,
    pub profile: Option<crate::profile::StreamProfile>,
    /// The profile's steps against the roofline's launch cost and bandwidth.
    pub budget: Option<Vec<crate::profile::Budget>>,
    pub speculative: Option<Speculative>,
    pub llama_cpp: Option<LlamaCpp>,
    /// The llama-bench style table (kiln's rows, then llama-bench's).
    pub table: Vec<crate::table::Row>,
    /// The serve scenario, one summary per front door.
    pub serve: Vec<crate::serve::Summary>,
    /// The serve scenario's paired pass of `/v1/completions` against gRPC (in one batch),
    /// in-process only; `serve_paired_doors` holds it too.
    pub serve_paired: Option<crate::paired::Paired>,
    /// The paired pass of every HTTP door against gRPC, each in its own batch (completions,
    /// chat completions, Responses, Messages; a door whose pass failed is left out and
    /// noted), in-process only.
    pub serve_paired_doors: Vec<crate::paired::Paired>,
    /// The structured scenario: mask times and constrained batches.
    pub structured: Option<crate::structured::Structured>,
    pub notes: Vec<String>,
}

impl Report {
    /// Records a note and prints it.
    pub fn note(&mut self, s: impl Into<String>) {
        let s = s.into();
        println!("note: {s}");
        self.notes.push(s);
    }

    /// Writes `<out>/kiln-bench-<unix>.json` and `<out>/latest.json`; returns the first.
    pub fn write(&self, out: &Path) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let json = serde_json::to_string_pretty(self).context("encoding the report")?;
        let path = out.join(format!("kiln-bench-{}.json", self.unix_time));
        for p in [&path, &out.join("latest.json")] {
            std::fs::write(p, format!("{json}\n"))
                .with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(path)
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` of a Unix time.
pub fn utc(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Days since 1970-01-01 to a proleptic Gregorian date, by 400-year eras.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// A figure with `prec` decimals, or `-`.
pub fn f(v: Option<f64>, prec: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.prec$}"))
}

pub fn print_header(r: &Report) {
    println!("kiln-bench  {}", r.date_utc);
    println!("  model    {}", r.model);
    match &r.grpc {
        Some(addr) => println!(
            "  target   kiln serve at {addr} (device: {})",
            r.device.name
        ),
        None => println!(
            "  device   {} ({}, {})",
            r.device.name, r.device.backend, r.device.device_type
        ),
    }
    if let Some(e) = &r.engine {
        println!(
            "  engine   {} KV blocks of {} tokens ({}, {} bytes/token), {} seqs/step, {} tokens/step",
            e.kv_blocks,
            e.block_size,
            e.kv_dtype,
            e.kv_bytes_per_token,
            e.max_num_seqs,
            e.max_num_batched_tokens
        );
    }
    let kiln = if r.device.threads > 0 {
        format!(
            "kiln's native CPU backend {} ({})",
            r.device.threads, r.device.cpu_isa
        )
    } else {
        "kiln's device its own".into()
    };
    println!(
        "  threads  {} for llama.cpp (host parallelism {}; {kiln}{})",
        r.threads,
        r.host_parallelism,
        r.lp_num_threads
            .as_ref()
            .map_or(String::new(), |t| format!(", LP_NUM_THREADS={t}"))
    );
    println!();
}

pub fn print_single(s: &Single) {
    println!(
        "single stream: {}-token prompt, {} new tokens (greedy, EOS ignored)",
        s.prompt_tokens, s.new_tokens
    );
    println!(
        "  TTFT           {:>9.1} ms   prefill {} tokens/s{}",
        s.ttft_ms,
        f(s.prefill_tokens_per_s, 1),
        s.server_ttft_ms
            .map_or(String::new(), |t| format!("   (engine TTFT {t:.1} ms)"))
    );
    println!(
        "  ITL p50 / p99  {:>9} / {} ms   mean {} ms",
        f(s.itl_p50_ms, 2),
        f(s.itl_p99_ms, 2),
        f(s.itl_mean_ms, 2)
    );
    println!(
        "  decode         {:>9} tokens/s   ({:.0} ms for {} tokens after the first)",
        f(s.decode_tokens_per_s, 1),
        s.decode_ms,
        s.new_tokens.saturating_sub(1)
    );
    println!();
}

pub fn print_sweep_header(prompt: usize, new: usize) {
    println!(
        "concurrency sweep: {prompt}-token prompts, {new} new tokens each, all submitted at once"
    );
    println!(
        "  {:>5} {:>11} {:>7} {:>9} {:>10} {:>10} {:>9} {:>9} {:>8}",
        "conc",
        "out tok/s",
        "x c=1",
        "x single",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "wall s"
    );
}

pub fn print_level(l: &Level) {
    println!(
        "  {:>5} {:>11} {:>7} {:>9} {:>10} {:>10} {:>9} {:>9} {:>8.2}",
        l.concurrency,
        f(l.output_tokens_per_s, 1),
        f(l.ratio_to_c1, 2),
        f(l.ratio_to_single_decode, 2),
        f(l.ttft_p50_ms, 1),
        f(l.ttft_p99_ms, 1),
        f(l.itl_p50_ms, 2),
        f(l.itl_p99_ms, 2),
        l.wall_s
    );
}

pub fn print_prefix(p: &Prefix) {
    println!(
        "shared prefix: {}-token system prompt + {}-token questions, {} new tokens, {} requests \
         one after another (after one warm request)",
        p.prefix_tokens, p.question_tokens, p.new_tokens, p.with_cache.requests
    );
    println!(
        "  {:<14} {:>9} {:>12} {:>11} {:>11}",
        "", "hit rate", "TTFT mean", "TTFT p50", "TTFT max"
    );
    for run in std::iter::once(&p.with_cache).chain(&p.without_cache) {
        println!(
            "  {:<14} {:>8.1}% {:>9} ms {:>8} ms {:>8} ms",
            if run.prefix_caching {
                "with cache"
            } else {
                "without cache"
            },
            run.hit_rate * 100.0,
            f(run.ttft_mean_ms, 1),
            f(run.ttft_p50_ms, 1),
            f(run.ttft_max_ms, 1)
        );
    }
    if let Some(s) = p.ttft_speedup {
        println!("  TTFT speed-up from the prefix cache: {s:.2}x");
    }
    if let Some(n) = &p.note {
        println!("  ({n})");
    }
    println!();
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

pub fn print_roofline(r: &Roofline) {
    let c = &r.ceilings;
    println!("roofline");
    println!(
        "  copy bandwidth  {:>9.2} GB/s   ({}, {} MiB each way; read + write counted)",
        c.copy_bandwidth_gb_s,
        c.copy_method,
        c.copy_bytes >> 20
    );
    println!(
        "  launch cost     {:>9.1} us      (a submit of 256 one-workgroup launches, less one of one)",
        c.dispatch_us
    );
    let rates: Vec<String> = c
        .matmul_rates
        .iter()
        .map(|r| format!("{} m={} {:.2}", r.dtype, r.m, r.gflop_s))
        .collect();
    println!(
        "  matmul          {:>9.2} GFLOP/s ({}; n=k={}; all: {})",
        c.matmul_gflop_s,
        c.matmul_best,
        c.matmul_n_k[0],
        rates.join(", ")
    );
    println!(
        "  decode   bytes/step {:.1} MB = weights {:.1} MB + KV {:.1} MB ({} tokens x {} B)",
        r.decode_bytes_per_step as f64 / 1e6,
        r.weight_bytes as f64 / 1e6,
        (r.decode_bytes_per_step - r.weight_bytes) as f64 / 1e6,
        r.decode_context_tokens,
        r.kv_bytes_per_token
    );
    println!(
        "           {} tokens/s -> {} GB/s = {} of the copy bandwidth (ceiling {:.1} tokens/s at batch 1)",
        f(r.decode_tokens_per_s, 1),
        f(r.decode_achieved_gb_s, 2),
        pct(r.decode_share_of_bandwidth),
        r.decode_ceiling_tokens_per_s
    );
    println!(
        "  prefill  {:.3} GFLOP/token ({:.1} M parameters; {}-token prompt incl. attention)",
        r.prefill_flops_per_token / 1e9,
        r.params.total as f64 / 1e6,
        r.prefill_tokens
    );
    println!(
        "           {} tokens/s -> {} GFLOP/s = {} of the matmul rate",
        f(r.prefill_tokens_per_s, 1),
        f(r.prefill_achieved_gflop_s, 2),
        pct(r.prefill_share_of_matmul)
    );
    if let Some(n) = &r.note {
        println!("  ({n})");
    }
    println!();
}

pub fn print_speculative(s: &Speculative) {
    println!(
        "speculative decoding: {}{}{}; one stream, greedy chat prompts, up to {} new tokens \
         (EOS stops earlier); best of {} runs each way, alternating",
        s.method,
        s.num_speculative_tokens
            .map_or(String::new(), |k| format!(", k = {k}")),
        s.draft_model
            .as_ref()
            .map_or(String::new(), |d| format!(", draft {d}")),
        s.max_new_tokens,
        s.rounds
    );
    println!(
        "  {:<11} {:>6} {:>6} {:>10} {:>10} {:>8} {:>7} {:>8} {:>10} {:>8}  identical",
        "workload",
        "prompt",
        "tokens",
        "base tok/s",
        "spec tok/s",
        "speed-up",
        "accept",
        "mean acc",
        "tok/verify",
        "tok/step",
    );
    for c in &s.cases {
        println!(
            "  {:<11} {:>6} {:>6} {:>10} {:>10} {:>8} {:>7} {:>8.2} {:>10} {:>8}  {}",
            c.workload,
            c.prompt_tokens,
            c.generated_tokens,
            f(c.baseline_decode_tokens_per_s, 1),
            f(c.speculative_decode_tokens_per_s, 1),
            c.speedup.map_or_else(|| "-".into(), |v| format!("{v:.2}x")),
            pct(Some(c.acceptance_rate)),
            c.mean_accepted_length,
            f(c.tokens_per_verify_step, 2),
            f(c.tokens_per_target_step, 2),
            match c.first_difference {
                None => "yes".to_owned(),
                Some(i) => format!("no (from token {i})"),
            }
        );
    }
    println!(
        "  (accept: accepted / proposed draft tokens; mean acc: accepted per verifying step; \
         tok/verify: tokens per verifying step;\n   tok/step: decode tokens per target forward \
         pass, steps without a draft included)"
    );
    for n in &s.notes {
        println!("  ({n})");
    }
    println!();
}

pub fn print_llama_cpp(l: &LlamaCpp, kiln: &Single) {
    println!(
        "kiln vs llama.cpp (llama-cpp-python {}, CPU, {} threads): {}-token prompt, {} new tokens",
        l.version, l.threads, l.prompt_tokens, l.new_tokens
    );
    println!(
        "  {:<16} {:>11} {:>11} {:>15}",
        "", "kiln", "llama.cpp", "kiln/llama.cpp"
    );
    let row = |name: &str, k: Option<f64>, o: Option<f64>, r: Option<f64>, prec: usize| {
        println!(
            "  {name:<16} {:>11} {:>11} {:>15}",
            f(k, prec),
            f(o, prec),
            f(r, 2)
        );
    };
    row(
        "prefill tok/s",
        kiln.prefill_tokens_per_s,
        Some(l.prefill_tokens_per_s),
        l.kiln_prefill_ratio,
        1,
    );
    row(
        "decode tok/s",
        kiln.decode_tokens_per_s,
        l.decode_tokens_per_s,
        l.kiln_decode_ratio,
        1,
    );
    row("TTFT ms", Some(kiln.ttft_ms), Some(l.ttft_ms), None, 1);
    row("ITL p50 ms", kiln.itl_p50_ms, l.itl_p50_ms, None, 2);
    row("ITL p99 ms", kiln.itl_p99_ms, l.itl_p99_ms, None, 2);
    println!(
        "  greedy continuations agree on the first {} of {} tokens",
        l.matching_leading_tokens, l.new_tokens
    );
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_767_225_599), "2025-12-31 23:59:59 UTC");
        assert_eq!(f(None, 1), "-");
        assert_eq!(f(Some(1.26), 1), "1.3");
    }
}
