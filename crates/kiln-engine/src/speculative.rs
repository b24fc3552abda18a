//! Speculative decoding: proposers draft a few tokens per decoding sequence; the step loop
//! appends them to the sequence's decode, the target model computes logits at every one of
//! them in the same forward pass, and sampling keeps the longest prefix the target agrees with
//! plus one token of the target's own. Greedy, "agrees" means equal to its argmax. Sampling,
//! the drafts are point masses, for which the rejection rule (accept with min(1, p/q), else
//! draw from the normalised max(0, p − q); see [`rejection_sample`](crate::rejection_sample))
//! reduces to "accept with probability p(draft), else draw from p without the draft"; the
//! sampler realises it by checking the draft against its own seeded Gumbel-max draw
//! ([`Sampler::verify`](crate::Sampler::verify)), so speculation never changes a seeded
//! request's tokens. Accepted tokens cost one weight read for several tokens, which is what a
//! memory-bound decode lacks.
//!
//! Two proposers share the [`Proposer`] trait: [`NgramProposer`] (prompt lookup, no model) and
//! [`DraftProposer`](crate::DraftProposer) (a smaller model with the same tokenizer, on the same
//! device, with its own paged KV cache).

use kiln_kv::{KvMetrics, SeqId};

/// How proposals are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup: find the most recent earlier occurrence of the last `n` tokens (the
    /// largest `n` in `min_n ..= max_n` that occurs) in the prompt and output, and propose what
    /// followed it.
    Ngram { min_n: usize, max_n: usize },
    /// A draft model (given to [`Engine::start_with_draft`](crate::Engine::start_with_draft))
    /// proposes greedily, one forward pass per draft token.
    Draft,
}

/// Speculative decoding settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpecMethod,
    /// Draft tokens per sequence and step, `k` (at most; fewer near a length limit or when
    /// the proposer finds fewer).
    pub num_tokens: usize,
    /// The rule for large batches: no sequence speculates in a step when more than this many
    /// sequences are running. Speculation pays while a step is bound by reading the weights;
    /// once the batch itself fills the device's arithmetic, verifying `k` extra tokens per
    /// sequence costs more than the accepted tokens save (vLLM calls this
    /// `disable_by_batch_size`).
    pub disable_batch_size: usize,
}

impl SpeculativeConfig {
    /// Prompt lookup with n in 1..=3, k = 4, off above 8 running sequences.
    pub fn ngram() -> Self {
        Self {
            method: SpecMethod::Ngram { min_n: 1, max_n: 3 },
            num_tokens: 4,
            disable_batch_size: 8,
        }
    }

    /// A draft model with k = 4, off above 8 running sequences.
    pub fn draft() -> Self {
        Self {
            method: SpecMethod::Draft,
            ..Self::ngram()
        }
    }

    /// Rejects settings that cannot work, naming the field.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.num_tokens == 0 || self.num_tokens > 64 {
            return Err((
                "num_speculative_tokens",
                format!("{} must be in 1..=64", self.num_tokens),
            ));
        }
        if let SpecMethod::Ngram { min_n, max_n } = self.method
            && (min_n == 0 || max_n < min_n)
        {
            return Err((
                "prompt_lookup",
                format!("n range {min_n}..={max_n} must satisfy 1 <= min <= max"),
            ));
        }
        Ok(())
    }
}

/// One sequence a proposer drafts for this step.
#[derive(Debug, Clone, Copy)]
pub struct ProposeInput<'a> {
    pub seq: SeqId,
    /// The prompt and every token generated so far; the last one was sampled last step and is
    /// not in the target's KV cache yet.
    pub tokens: &'a [u32],
    /// Draft at most this many tokens.
    pub max_tokens: usize,
}

/// Drafts tokens for speculative decoding. Proposals are hints: a wrong or empty one costs
/// speed, never correctness, since the target model verifies every token.
pub trait Proposer: Send {
    /// One draft per input (at most its `max_tokens`, possibly empty), in order. An `Err`
    /// means no drafts this step; the engine logs it and decodes normally.
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Vec<u32>>, String>;

    /// `seq` is gone (finished, aborted): drop whatever is kept for it.
    fn release(&mut self, _seq: SeqId) {}

    /// The proposer's own KV pool, if it has one (a draft model's).
    fn kv_metrics(&self) -> Option<KvMetrics> {
        None
    }

    /// Checks the proposer's own bookkeeping against the sequences still alive.
    fn check(&self, _alive: &dyn Fn(SeqId) -> bool) -> Result<(), String> {
        Ok(())
    }
}

/// Prompt-lookup decoding: no model, no state. For the largest `n` in `max_n` down to `min_n`
/// whose last-`n`-token pattern occurred earlier in the prompt or output, propose up to `k`
/// tokens that followed its most recent earlier occurrence. Strong on extractive work
/// (summaries, quoting, code edits), where the answer repeats the prompt.
#[derive(Debug, Clone, Copy)]
pub struct NgramProposer {
    pub min_n: usize,
    pub max_n: usize,
}

impl NgramProposer {
    /// The continuation for one token sequence.
    pub fn lookup(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let len = tokens.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let pattern = &tokens[len - n..];
            // Most recent first: starts before `len - n`, so something follows the match.
            if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == pattern) {
                let from = start + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Vec<u32>>, String> {
        Ok(batch
            .iter()
            .map(|b| self.lookup(b.tokens, b.max_tokens))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_lookup_takes_the_longest_pattern_and_its_latest_occurrence() {
        let p = NgramProposer { min_n: 1, max_n: 3 };
        // "1 2 3 9 ... 1 2 3 7 ... 1 2 3": the latest earlier "1 2 3" is followed by 7 8.
        let t = [1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(p.lookup(&t, 2), vec![7, 8]);
        assert_eq!(p.lookup(&t, 5), vec![7, 8, 1, 2, 3]);
        // A continuation cut short by the end of the tokens.
        assert_eq!(p.lookup(&[4, 5, 4], 3), vec![5, 4]);
        // No 3-gram or 2-gram match, a 1-gram one.
        assert_eq!(p.lookup(&[6, 1, 7, 8, 1], 2), vec![7, 8]);
        // min_n = 2 refuses the 1-gram match.
        let p2 = NgramProposer { min_n: 2, max_n: 3 };
        assert!(p2.lookup(&[6, 1, 7, 8, 1], 2).is_empty());
        // Nothing to find, or nothing asked.
        assert!(p.lookup(&[1, 2, 3], 4).is_empty());
        assert!(p.lookup(&[1], 4).is_empty());
        assert!(p.lookup(&t, 0).is_empty());
    }

    #[test]
    fn config_validation_names_the_field() {
        let mut c = SpeculativeConfig::ngram();
        assert!(c.validate().is_ok());
        c.num_tokens = 0;
        assert_eq!(c.validate().unwrap_err().0, "num_speculative_tokens");
        c.num_tokens = 4;
        c.method = SpecMethod::Ngram { min_n: 3, max_n: 2 };
        assert_eq!(c.validate().unwrap_err().0, "prompt_lookup");
    }
}
