//! The speculative scenario: decode tokens/s of one stream with and without speculative
//! decoding, on an extractive chat prompt (the answer repeats the prompt, where prompt lookup
//! shines) and on free generation (where it has little to find). One engine serves both
//! sides, so the weights and the device are the same; `Request::speculate` turns drafting off
//! for the baseline. Runs alternate (baseline, speculative, baseline, ...) so that machine
//! noise hits both alike, and the best run of each side is reported.

use anyhow::Context;
use kiln_engine::SpecStats;
use kiln_tokenizer::Tokenizer;
use serde::Serialize;

use crate::scenarios::ratio;
use crate::stats::{Sample, ms, rate};
use crate::target::{ChatJob, Target, chat_text};

/// Baseline/speculative pairs per workload.
pub const ROUNDS: usize = 2;

/// A made-up passage for the extractive workload: plain prose, no lists, nothing the model
/// would want to reformat.
const PASSAGE: &str = "The town of Elmbridge grew up around a stone bridge that farmers \
built across the River Wend in 1312. For two hundred years it was little more than a market, \
where wool, cheese and timber changed hands every Thursday. In 1548 a fire destroyed most of \
the wooden houses near the square, and the townspeople rebuilt them in brick from the clay pits \
on the eastern hill. The railway arrived in 1861, bringing a station, a brewery and a small iron \
foundry that made parts for steam engines. By 1900 the population had reached six thousand, and \
the old market hall was turned into a library and a school. During the great flood of 1947 the \
river rose higher than the arches of the bridge, and boats carried families from the lower \
streets to the church on the hill. The foundry closed in 1968, but the brewery still runs today, \
and every summer the town holds a fair on the meadow beside the river to remember the farmers \
who built the first bridge.";

/// A workload: a name and the user message (rendered with the model's chat template).
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: &'static str,
    pub user: String,
}

/// The extractive workload, then free generation.
pub fn workloads() -> Vec<Workload> {
    vec![
        Workload {
            name: "extractive",
            user: format!("Repeat the following passage exactly, word for word.\n\n{PASSAGE}"),
        },
        Workload {
            name: "free",
            user: "Write a short story about a lighthouse keeper.".into(),
        },
    ]
}

/// The longest workload prompt in tokens, encoded as the engine encodes a text prompt.
pub fn longest_prompt(tok: &Tokenizer) -> anyhow::Result<usize> {
    let mut longest = 0;
    for w in workloads() {
        let ids = tok
            .encode(&chat_text(tok, &w.user)?)
            .map_err(|e| anyhow::anyhow!("encoding the {} prompt: {e}", w.name))?;
        longest = longest.max(ids.len());
    }
    Ok(longest)
}

/// One measured request.
#[derive(Debug, Clone, Serialize)]
pub struct SpecRun {
    pub speculate: bool,
    pub generated_tokens: usize,
    pub ttft_ms: f64,
    /// First token to last token.
    pub decode_ms: f64,
    /// (generated tokens - 1) / decode time.
    pub decode_tokens_per_s: Option<f64>,
    pub proposed_tokens: u64,
    pub accepted_tokens: u64,
    pub verify_steps: u64,
    #[serde(skip)]
    pub token_ids: Vec<u32>,
}

impl SpecRun {
    fn new(speculate: bool, s: &Sample) -> Self {
        let n = s.token_ids.len();
        Self {
            speculate,
            generated_tokens: n,
            ttft_ms: ms(s.ttft()),
            decode_ms: ms(s.decode_time()),
            decode_tokens_per_s: rate(n.saturating_sub(1) as f64, s.decode_time()),
            proposed_tokens: s.spec.proposed_tokens,
            accepted_tokens: s.spec.accepted_tokens,
            verify_steps: s.spec.verify_steps,
            token_ids: s.token_ids.clone(),
        }
    }
}

/// One workload, both sides.
#[derive(Debug, Clone, Serialize)]
pub struct SpecCase {
    pub workload: &'static str,
    pub prompt_tokens: usize,
    /// Tokens the first baseline run generated (EOS may end it before the limit).
    pub generated_tokens: usize,
    /// Best baseline run.
    pub baseline_decode_tokens_per_s: Option<f64>,
    /// Best speculative run.
    pub speculative_decode_tokens_per_s: Option<f64>,
    /// Speculative over baseline decode tokens/s.
    pub speedup: Option<f64>,
    /// The speculative runs' draft tokens, summed.
    pub proposed_tokens: u64,
    pub accepted_tokens: u64,
    pub verify_steps: u64,
    /// Accepted over proposed draft tokens.
    pub acceptance_rate: f64,
    /// Draft tokens accepted per verifying step.
    pub mean_accepted_length: f64,
    /// Tokens a verifying step yields: its accepted drafts plus the target's own token.
    pub tokens_per_verify_step: Option<f64>,
    /// Decode tokens per forward pass of the target, steps that drafted nothing included:
    /// (generated - 1) / (generated - 1 - accepted), over the speculative runs.
    pub tokens_per_target_step: Option<f64>,
    /// Whether every run (both sides) produced the first baseline's greedy tokens.
    pub identical: bool,
    /// The first position where some run differs from the first baseline.
    pub first_difference: Option<usize>,
    /// In the order they ran.
    pub runs: Vec<SpecRun>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Speculative {
    /// What drafts: `ngram (n 1..=3)`, `draft model`, or the server's config over `--grpc`.
    pub method: String,
    /// k (`None` over `--grpc`: the server's).
    pub num_speculative_tokens: Option<usize>,
    /// The draft model's file, when one drafts.
    pub draft_model: Option<String>,
    /// Most tokens per run; EOS may end a run earlier.
    pub max_new_tokens: usize,
    pub rounds: usize,
    pub cases: Vec<SpecCase>,
    pub notes: Vec<String>,
}

/// What the scenario says about its setup (filled in by the caller, which knows the flags).
#[derive(Debug, Clone)]
pub struct Setup {
    pub method: String,
    pub num_speculative_tokens: Option<usize>,
    pub draft_model: Option<String>,
    pub max_new_tokens: usize,
    pub notes: Vec<String>,
}

/// Warms the verifying pass up (an untimed speculative request), then runs every workload
/// [`ROUNDS`] times each way, alternating.
pub async fn run(t: &Target, setup: Setup) -> anyhow::Result<Speculative> {
    let all = workloads();
    let mut notes = setup.notes;
    if let Some(first) = all.first() {
        eprintln!("kiln-bench: warming up speculative decoding");
        t.run_chat(&ChatJob {
            user: first.user.clone(),
            new_tokens: 16,
            speculate: true,
        })
        .await
        .context("speculative warm-up")?;
    }
    let mut cases = Vec::with_capacity(all.len());
    for w in &all {
        let mut runs = Vec::with_capacity(2 * ROUNDS);
        let mut prompt_tokens = 0;
        for round in 0..ROUNDS {
            for speculate in [false, true] {
                eprintln!(
                    "kiln-bench: speculative: {} {} ({}/{ROUNDS})",
                    w.name,
                    if speculate { "speculative" } else { "baseline" },
                    round + 1
                );
                let s = t
                    .run_chat(&ChatJob {
                        user: w.user.clone(),
                        new_tokens: setup.max_new_tokens,
                        speculate,
                    })
                    .await
                    .with_context(|| format!("speculative scenario, {} workload", w.name))?;
                prompt_tokens = s.prompt_tokens;
                runs.push(SpecRun::new(speculate, &s));
            }
        }
        let case = summarize(w.name, prompt_tokens, runs);
        if case.proposed_tokens == 0 {
            notes.push(format!(
                "{}: no draft tokens were proposed{}",
                w.name,
                if setup.num_speculative_tokens.is_none() {
                    " (was the server started with --speculative?)"
                } else {
                    ""
                }
            ));
        }
        cases.push(case);
    }
    Ok(Speculative {
        method: setup.method,
        num_speculative_tokens: setup.num_speculative_tokens,
        draft_model: setup.draft_model,
        max_new_tokens: setup.max_new_tokens,
        rounds: ROUNDS,
        cases,
        notes,
    })
}

/// The figures of one workload's runs.
pub fn summarize(workload: &'static str, prompt_tokens: usize, runs: Vec<SpecRun>) -> SpecCase {
    let best = |speculate: bool| {
        runs.iter()
            .filter(|r| r.speculate == speculate)
            .filter_map(|r| r.decode_tokens_per_s)
            .reduce(f64::max)
    };
    let (base, spec) = (best(false), best(true));
    let mut stats = SpecStats::default();
    let (mut decode_tokens, mut target_steps) = (0u64, 0u64);
    for r in runs.iter().filter(|r| r.speculate) {
        stats.proposed_tokens += r.proposed_tokens;
        stats.accepted_tokens += r.accepted_tokens;
        stats.verify_steps += r.verify_steps;
        let d = r.generated_tokens.saturating_sub(1) as u64;
        decode_tokens += d;
        target_steps += d.saturating_sub(r.accepted_tokens);
    }
    let reference = runs.first().map_or(&[][..], |r| &r.token_ids[..]);
    let first_difference = runs
        .iter()
        .filter_map(|r| first_difference(reference, &r.token_ids))
        .min();
    SpecCase {
        workload,
        prompt_tokens,
        generated_tokens: runs.first().map_or(0, |r| r.generated_tokens),
        baseline_decode_tokens_per_s: base,
        speculative_decode_tokens_per_s: spec,
        speedup: ratio(spec, base),
        proposed_tokens: stats.proposed_tokens,
        accepted_tokens: stats.accepted_tokens,
        verify_steps: stats.verify_steps,
        acceptance_rate: stats.acceptance_rate(),
        mean_accepted_length: stats.mean_accepted_length(),
        tokens_per_verify_step: (stats.verify_steps > 0)
            .then(|| 1.0 + stats.mean_accepted_length()),
        tokens_per_target_step: (target_steps > 0)
            .then(|| decode_tokens as f64 / target_steps as f64),
        identical: first_difference.is_none(),
        first_difference,
        runs,
    }
}

/// The first position where `a` and `b` differ (a length difference counts), if any.
pub fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or_else(|| (a.len() != b.len()).then(|| a.len().min(b.len())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(speculate: bool, tok_s: f64, ids: &[u32], accepted: u64, steps: u64) -> SpecRun {
        SpecRun {
            speculate,
            generated_tokens: ids.len(),
            ttft_ms: 1.0,
            decode_ms: 1.0,
            decode_tokens_per_s: Some(tok_s),
            proposed_tokens: 4 * steps,
            accepted_tokens: accepted,
            verify_steps: steps,
            token_ids: ids.to_vec(),
        }
    }

    #[test]
    fn differences_count_lengths_too() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2]), Some(2));
        assert_eq!(first_difference(&[], &[5]), Some(0));
    }

    #[test]
    fn summary_takes_the_best_run_of_each_side() {
        let ids: Vec<u32> = (0..9).collect();
        // Each speculative run: 8 decode tokens, 6 of them accepted drafts over 2 verify steps.
        let runs = vec![
            run(false, 10.0, &ids, 0, 0),
            run(true, 24.0, &ids, 6, 2),
            run(false, 12.0, &ids, 0, 0),
            run(true, 30.0, &ids, 6, 2),
        ];
        let c = summarize("extractive", 40, runs);
        assert_eq!(c.baseline_decode_tokens_per_s, Some(12.0));
        assert_eq!(c.speculative_decode_tokens_per_s, Some(30.0));
        assert_eq!(c.speedup, Some(2.5));
        assert_eq!(
            (c.proposed_tokens, c.accepted_tokens, c.verify_steps),
            (16, 12, 4)
        );
        assert_eq!(c.acceptance_rate, 0.75);
        assert_eq!(c.mean_accepted_length, 3.0);
        assert_eq!(c.tokens_per_verify_step, Some(4.0));
        // 16 decode tokens over 16 - 12 = 4 target steps.
        assert_eq!(c.tokens_per_target_step, Some(4.0));
        assert!(c.identical);
        assert_eq!(c.generated_tokens, 9);
    }

    #[test]
    fn summary_flags_a_changed_output_and_no_drafts() {
        let ids: Vec<u32> = (0..5).collect();
        let mut other = ids.clone();
        other[3] = 99;
        let c = summarize(
            "free",
            7,
            vec![run(false, 10.0, &ids, 0, 0), run(true, 9.0, &other, 0, 0)],
        );
        assert!(!c.identical);
        assert_eq!(c.first_difference, Some(3));
        assert_eq!((c.acceptance_rate, c.tokens_per_verify_step), (0.0, None));
        assert_eq!(c.tokens_per_target_step, Some(1.0));
        assert_eq!(c.speedup, Some(0.9));
    }
}
