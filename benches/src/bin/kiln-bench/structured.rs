//! The structured scenario: what constrained decoding costs, in one run.
//!
//! - Mask computation per token: each constraint's greedy answer (through the engine) is
//!   replayed through a fresh matcher from [`ConstraintCompiler`], timing `compute_mask` at
//!   every token; p50, p99 and max per constraint.
//! - Decode rate of a batch of 8 greedy chat streams with 0, 4 and 8 of them under a JSON
//!   schema that cannot complete within the run (an array of at least 100 objects), so every
//!   stream decodes exactly `new_tokens`; the runs alternate, twice each, and each
//!   configuration's figure is the mean of its two; with the mean mask time and the mean time
//!   sampling waited for a mask per constrained token, from the engine's histograms.

use std::time::Instant;

use anyhow::{Context, bail};
use kiln_engine::{Constraint, ConstraintCompiler, EngineHandle, Request};
use serde::Serialize;
use serde_json::json;

use crate::stats::Sample;
use crate::target::{chat_text, collect_engine};

#[derive(Debug, Clone, Serialize)]
pub struct MaskTimes {
    pub constraint: &'static str,
    /// Masks timed (tokens of the answer, including its first).
    pub tokens: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BatchRun {
    pub constrained: usize,
    pub streams: usize,
    /// Decode tokens over the decode window (first token of any stream to the last token).
    pub decode_tok_s: f64,
    /// Against the unconstrained batch of the same run.
    pub vs_unconstrained: f64,
    /// Mean per constrained token over the runs, from the engine's histograms: computing the
    /// mask (on a worker) and what sampling waited for it after the forward pass.
    pub mask_compute_us: Option<f64>,
    pub mask_wait_us: Option<f64>,
}

/// (sum, count) of a histogram in the engine's Prometheus text.
fn histogram(e: &EngineHandle, name: &str) -> (f64, f64) {
    let text = e.metrics().encode();
    let value = |suffix: &str| {
        let key = format!("{name}_{suffix} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("sum"), value("count"))
}

const MASK: &str = "kiln_structured_output_mask_seconds";
const WAIT: &str = "kiln_structured_output_mask_wait_seconds";

#[derive(Debug, Clone, Serialize)]
pub struct Structured {
    pub masks: Vec<MaskTimes>,
    pub new_tokens: usize,
    pub batch: Vec<BatchRun>,
}

/// Streams of the batch runs.
pub const STREAMS: usize = 8;
/// Tokens each batch stream decodes.
pub const NEW_TOKENS: usize = 64;
/// The longest sequence: a chat prompt and a 160-token answer.
pub const LONGEST: usize = 256;

fn constraints() -> Vec<(&'static str, &'static str, Constraint)> {
    vec![
        (
            "person schema",
            "Describe a fictional person as JSON.",
            Constraint::JsonSchema(json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "email": {"type": ["string", "null"], "maxLength": 40}
                },
                "required": ["name", "age", "email"],
                "additionalProperties": false
            })),
        ),
        (
            "order schema (nested array)",
            "Write an example shop order as JSON.",
            Constraint::JsonSchema(json!({
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                    "items": {
                        "type": "array", "minItems": 1, "maxItems": 3,
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string", "maxLength": 12},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 9}
                            },
                            "required": ["sku", "qty"],
                            "additionalProperties": false
                        }
                    },
                    "status": {"enum": ["new", "paid", "shipped"]}
                },
                "required": ["id", "items", "status"],
                "additionalProperties": false
            })),
        ),
        (
            "json_object",
            "Give a JSON object with the keys name and colour for a cat.",
            Constraint::JsonObject,
        ),
        (
            "regex",
            "Make up a licence plate.",
            Constraint::Regex("[A-Z]{2}-[0-9]{3}-[A-Z]{2}".into()),
        ),
    ]
}

/// A schema no answer of `new_tokens` tokens completes: every stream runs to the end.
fn endless_schema() -> Constraint {
    Constraint::JsonSchema(json!({
        "type": "array",
        "minItems": 100,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "price": {"type": "number", "minimum": 0},
                "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}, "maxItems": 3}
            },
            "required": ["name", "price", "tags"],
            "additionalProperties": false
        }
    }))
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(i).copied().unwrap_or(f64::NAN)
}

async fn generate(e: &EngineHandle, r: Request) -> anyhow::Result<Sample> {
    let submitted = Instant::now();
    let stream = e.submit(r).context("submitting a request")?;
    collect_engine(stream, 0, 0, submitted).await
}

pub async fn run(e: &EngineHandle, new_tokens: usize) -> anyhow::Result<Structured> {
    let compiler = ConstraintCompiler::new(e.tokenizer(), &e.info().eos_ids)
        .context("structured output is not available for this model")?;
    let eos = &e.info().eos_ids;
    let mut masks = Vec::new();
    for (name, prompt, c) in constraints() {
        let text = chat_text(e.tokenizer(), prompt)?;
        let out = generate(
            e,
            Request::text(text)
                .max_new_tokens(LONGEST - 96)
                .constrain(c.clone()),
        )
        .await?;
        let mut m = compiler.compile(&c).context("compiling")?;
        let mut us = Vec::with_capacity(out.token_ids.len());
        for &t in &out.token_ids {
            let t0 = Instant::now();
            m.compute_mask()
                .map_err(|err| anyhow::anyhow!("{name}: mask: {err}"))?;
            us.push(t0.elapsed().as_secs_f64() * 1e6);
            if eos.contains(&t) {
                break;
            }
            m.consume_token(t)
                .map_err(|err| anyhow::anyhow!("{name}: token {t}: {err}"))?;
        }
        us.sort_by(f64::total_cmp);
        masks.push(MaskTimes {
            constraint: name,
            tokens: us.len(),
            p50_us: percentile(&us, 0.5),
            p99_us: percentile(&us, 0.99),
            max_us: us.last().copied().unwrap_or(f64::NAN),
        });
    }

    let prompts = [
        "List products of a hardware shop as JSON.",
        "List products of a bakery as JSON.",
        "List products of a bookshop as JSON.",
        "List products of a garden centre as JSON.",
        "List products of a toy shop as JSON.",
        "List products of a pharmacy as JSON.",
        "List products of a bike shop as JSON.",
        "List products of a music shop as JSON.",
    ];
    // Per configuration: decode rates, and the histograms' (sum, count) growth.
    let mut rates: Vec<(usize, Vec<f64>, [f64; 4])> = [0, 4, 8]
        .iter()
        .map(|&k| (k, Vec::new(), [0.0; 4]))
        .collect();
    for _ in 0..2 {
        for (k, got, hist) in &mut rates {
            let (m0, w0) = (histogram(e, MASK), histogram(e, WAIT));
            let mut streams = Vec::with_capacity(STREAMS);
            for (i, p) in prompts.iter().enumerate() {
                let mut r = Request::text(chat_text(e.tokenizer(), p)?).max_new_tokens(new_tokens);
                r.stopping.ignore_eos = true;
                r.speculate = false;
                if i < *k {
                    r.constraint = Some(endless_schema());
                }
                let submitted = Instant::now();
                streams.push((submitted, e.submit(r).context("submitting a request")?));
            }
            let mut samples = Vec::with_capacity(STREAMS);
            for (submitted, s) in streams {
                samples.push(collect_engine(s, 0, new_tokens, submitted).await?);
            }
            let first = samples.iter().filter_map(|s| s.token_times.first()).min();
            let last = samples.iter().filter_map(|s| s.token_times.last()).max();
            let (Some(first), Some(last)) = (first, last) else {
                bail!("a batch produced no tokens");
            };
            if let Some(s) = samples.iter().find(|s| s.token_ids.len() != new_tokens) {
                bail!(
                    "a stream of the batch ended after {} of {new_tokens} tokens",
                    s.token_ids.len()
                );
            }
            let tokens: usize = samples.iter().map(|s| s.token_ids.len() - 1).sum();
            got.push(tokens as f64 / (*last - *first).as_secs_f64());
            let (m1, w1) = (histogram(e, MASK), histogram(e, WAIT));
            for (h, d) in hist
                .iter_mut()
                .zip([m1.0 - m0.0, m1.1 - m0.1, w1.0 - w0.0, w1.1 - w0.1])
            {
                *h += d;
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let base = mean(&rates[0].1);
    let per = |sum: f64, count: f64| (count > 0.0).then(|| sum / count * 1e6);
    let batch = rates
        .iter()
        .map(|(k, v, h)| BatchRun {
            constrained: *k,
            streams: STREAMS,
            decode_tok_s: mean(v),
            vs_unconstrained: mean(v) / base,
            mask_compute_us: per(h[0], h[1]),
            mask_wait_us: per(h[2], h[3]),
        })
        .collect();
    Ok(Structured {
        masks,
        new_tokens,
        batch,
    })
}

pub fn print(s: &Structured) {
    println!("\n== structured output");
    println!("mask computation per token (greedy answer replayed through a fresh matcher):");
    println!("| constraint | tokens | p50 µs | p99 µs | max µs |");
    println!("|---|---|---|---|---|");
    for m in &s.masks {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} |",
            m.constraint, m.tokens, m.p50_us, m.p99_us, m.max_us
        );
    }
    println!(
        "decode, batch of {} greedy streams x {} tokens:",
        s.batch.first().map_or(0, |b| b.streams),
        s.new_tokens
    );
    println!("| constrained | decode tok/s | vs unconstrained | mask µs/token | waited µs/token |");
    println!("|---|---|---|---|---|");
    let us = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0}"));
    for b in &s.batch {
        println!(
            "| {} of {} | {:.1} | {:.2}x | {} | {} |",
            b.constrained,
            b.streams,
            b.decode_tok_s,
            b.vs_unconstrained,
            us(b.mask_compute_us),
            us(b.mask_wait_us)
        );
    }
}
