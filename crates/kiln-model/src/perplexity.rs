//! Perplexity of a token sequence, scored by a [`ModelRunner`] over fixed-length windows, as
//! `transformers`' perplexity guide ("Perplexity of fixed-length models") computes it: windows
//! of `context` tokens starting every `stride` tokens, each window scoring the tokens that the
//! previous one did not reach (all but its first token when `stride == context`, the default:
//! non-overlapping windows); mean NLL over every scored token, PPL = exp(mean NLL).
//!
//! Each window runs through the runner's KV cache (its dtype is part of what is measured), in
//! prefill chunks of at most `chunk` tokens so that only a chunk's logits rows are read back.
//! The guide weights each window's mean loss by its token count less one, which miscounts
//! overlapping windows; here every scored token counts once, which is the same figure when
//! windows do not overlap.

use kiln_kv::BlockId;
use kiln_tensor::sample::LogSoftmax;

use crate::{ModelError, ModelRunner, Result, StepSeq};

/// How a sequence is cut into windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerplexityConfig {
    /// Tokens per window (the model sees at most this many at once).
    pub context: usize,
    /// Tokens between window starts; `context` gives non-overlapping windows.
    pub stride: usize,
    /// Prompt tokens per forward step within a window (bounds the logits read back).
    pub chunk: usize,
}

impl PerplexityConfig {
    /// Non-overlapping windows of `context` tokens.
    pub fn new(context: usize) -> Self {
        Self {
            context,
            stride: context,
            chunk: 128,
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |field, reason: String| Err(ModelError::Perplexity { field, reason });
        if self.context < 2 {
            return bad(
                "context",
                format!("{} tokens: a window needs at least 2", self.context),
            );
        }
        if self.stride == 0 || self.stride > self.context {
            return bad(
                "stride",
                format!("{} must be in 1..=context ({})", self.stride, self.context),
            );
        }
        if self.chunk == 0 {
            return bad("chunk", "must be at least 1".into());
        }
        Ok(())
    }
}

/// One window of the sequence and what it scored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowScore {
    /// The window is tokens `begin..end` of the sequence.
    pub begin: usize,
    pub end: usize,
    /// Tokens scored: the last `scored` of the window (each predicted from the tokens before
    /// it in the window).
    pub scored: usize,
    /// Sum of their negative log-likelihoods (natural log).
    pub nll_sum: f64,
}

impl WindowScore {
    pub fn mean_nll(&self) -> f64 {
        self.nll_sum / self.scored as f64
    }
}

/// The windows `(begin, end, scored)` of a `tokens`-long sequence, as the guide's loop makes
/// them: starts every `stride`, each scoring up to the previous window's end; windows that
/// would score nothing (a last window of one token) are left out.
pub fn windows(tokens: usize, cfg: &PerplexityConfig) -> Result<Vec<(usize, usize, usize)>> {
    cfg.check()?;
    let mut out = Vec::new();
    let mut prev_end = 0;
    let mut begin = 0;
    while begin < tokens {
        let end = (begin + cfg.context).min(tokens);
        // The window's first token has no prediction inside it.
        let scored = (end - prev_end).min(end - begin - 1);
        if scored > 0 {
            out.push((begin, end, scored));
        }
        prev_end = end;
        if end == tokens {
            break;
        }
        begin += cfg.stride;
    }
    Ok(out)
}

/// Negative log-likelihood of `target` under `logits`: the log-softmax every log-probability
/// kiln reports comes from ([`LogSoftmax`]: the engine's prompt and sampled tokens' too).
fn nll(logits: &[f32], target: u32) -> Result<f64> {
    let t = logits
        .get(target as usize)
        .ok_or_else(|| ModelError::Perplexity {
            field: "tokens",
            reason: format!(
                "token {target} is outside the {}-token vocabulary",
                logits.len()
            ),
        })?;
    Ok(-LogSoftmax::of(logits).at(*t))
}

/// Scores tokens `begin..end` of `tokens` as one window whose last `scored` tokens count.
/// The window occupies blocks `0..` of the runner's pool (nothing else may be running).
pub fn score_window(
    runner: &mut ModelRunner,
    tokens: &[u32],
    (begin, end, scored): (usize, usize, usize),
    chunk: usize,
) -> Result<WindowScore> {
    let window = tokens
        .get(begin..end)
        .filter(|w| scored < w.len())
        .ok_or_else(|| ModelError::Perplexity {
            field: "window",
            reason: format!(
                "{begin}..{end} scoring {scored} does not fit {} tokens",
                tokens.len()
            ),
        })?;
    let pool = runner
        .cache_config()
        .ok_or_else(|| ModelError::Perplexity {
            field: "model",
            reason: "DeepSeek-V4's pools are scored through the engine's prompt logprobs".into(),
        })?;
    let (block_size, blocks) = (pool.block_size, pool.num_blocks);
    if window.len() > block_size * blocks {
        return Err(ModelError::Perplexity {
            field: "context",
            reason: format!(
                "a {}-token window needs more than the pool's {blocks} blocks of {block_size}",
                window.len()
            ),
        });
    }
    let table: Vec<BlockId> = (0..window.len().div_ceil(block_size) as u32)
        .map(BlockId)
        .collect();
    // Logits at position p predict token p + 1: the rows before each scored token.
    let first_row = window.len() - 1 - scored;
    let mut nll_sum = 0.0;
    let mut done = 0;
    while done < window.len() {
        let n = chunk.max(1).min(window.len() - done);
        let (lo, hi) = (done, done + n);
        // This chunk's rows that predict a scored token (never the window's last position).
        let rows_from = first_row.max(lo);
        let rows_to = hi.min(window.len() - 1);
        let wanted = rows_to.saturating_sub(rows_from);
        // The runner reads back a tail of the chunk: from `rows_from` to its end.
        let tail = if wanted > 0 { hi - rows_from } else { 1 };
        let out = runner.step(
            &[StepSeq {
                tokens: &window[lo..hi],
                block_table: &table,
                kept_table: &[],
                context_len: hi,
                logits_rows: tail,
                read_logits: wanted > 0,
                sample: None,
            }],
            &[],
        )?;
        for r in 0..wanted {
            let logits = out.logits(0, r).ok_or(ModelError::Readback {
                got: r,
                want: wanted,
            })?;
            nll_sum += nll(logits, window[rows_from + r + 1])?;
        }
        done = hi;
    }
    Ok(WindowScore {
        begin,
        end,
        scored,
        nll_sum,
    })
}

/// Totals over windows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    pub scored_tokens: usize,
    pub nll_sum: f64,
}

impl Perplexity {
    pub fn of(windows: &[WindowScore]) -> Self {
        Self {
            scored_tokens: windows.iter().map(|w| w.scored).sum(),
            nll_sum: windows.iter().map(|w| w.nll_sum).sum(),
        }
    }

    pub fn mean_nll(&self) -> f64 {
        self.nll_sum / self.scored_tokens as f64
    }

    pub fn ppl(&self) -> f64 {
        self.mean_nll().exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_overlapping_windows_score_all_but_their_first_token() {
        let w = windows(1030, &PerplexityConfig::new(512)).unwrap();
        assert_eq!(w, vec![(0, 512, 511), (512, 1024, 511), (1024, 1030, 5)]);
        // A last window of one token scores nothing and is left out.
        let w = windows(1025, &PerplexityConfig::new(512)).unwrap();
        assert_eq!(w, vec![(0, 512, 511), (512, 1024, 511)]);
    }

    #[test]
    fn strided_windows_score_what_the_previous_one_did_not_reach() {
        let cfg = PerplexityConfig {
            stride: 256,
            ..PerplexityConfig::new(512)
        };
        let w = windows(1000, &cfg).unwrap();
        assert_eq!(w, vec![(0, 512, 511), (256, 768, 256), (512, 1000, 232)]);
        let scored: usize = w.iter().map(|x| x.2).sum();
        assert_eq!(scored, 999, "every token after the first, once");
    }

    #[test]
    fn bad_windows_name_the_field() {
        let e = windows(10, &PerplexityConfig::new(1)).unwrap_err();
        assert!(e.to_string().contains("context"), "{e}");
        let cfg = PerplexityConfig {
            stride: 600,
            ..PerplexityConfig::new(512)
        };
        assert!(
            windows(10, &cfg)
                .unwrap_err()
                .to_string()
                .contains("stride")
        );
    }

    #[test]
    fn nll_is_the_log_softmax() {
        let l = [1.0f32, 2.0, 3.0];
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((nll(&l, 1).unwrap() - (z.ln() - 2.0)).abs() < 1e-12);
        assert!(nll(&l, 3).is_err());
    }
}
