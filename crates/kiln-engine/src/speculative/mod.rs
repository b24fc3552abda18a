//! Speculative decoding: proposers draft a few tokens per decoding sequence; the step loop
//! appends them to the sequence's decode, the target model computes logits at every one of
//! them in the same forward pass, and sampling keeps the longest prefix the target agrees with
//! plus one token of the target's own. Greedy, "agrees" means equal to its argmax. Sampling,
//! the drafts are point masses, for which the rejection rule (accept with min(1, p/q), else
//! draw from the normalised max(0, p − q); the sampler's distribution tests hold a reference)
//! reduces to "accept with probability p(draft), else draw from p without the draft"; the
//! sampler realises it by checking the draft against its own seeded Gumbel-max draw
//! ([`Sampler::verify_masked`](crate::sampling::Sampler::verify_masked)), so speculation never changes a seeded
//! request's tokens. Accepted tokens cost one weight read for several tokens, which is what a
//! memory-bound decode lacks.
//!
//! Two proposers share the [`Proposer`] trait: [`NgramProposer`] (prompt lookup, no model,
//! `ngram.rs`) and [`DraftProposer`] (a smaller model with the same tokenizer, on the same
//! device, with its own paged KV cache, `draft.rs`). `verify.rs` is the step loop's side:
//! drafting before the schedule, and taking the verdict after the forward pass.

mod draft;
mod ngram;
mod verify;

pub use draft::{DraftModel, TokenizerMismatch};
pub(crate) use draft::{DraftProposer, check_same_tokenizer};
pub(crate) use ngram::NgramProposer;
pub(crate) use verify::Spec;

use kiln_kv::{KvError, KvMetrics, SeqId};
use kiln_model::ModelError;

use crate::InvariantError;

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
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Vec<u32>>, ProposeError>;

    /// `seq` is gone (finished, aborted): drop whatever is kept for it.
    fn release(&mut self, _seq: SeqId) {}

    /// The proposer's own KV pool, if it has one (a draft model's).
    fn kv_metrics(&self) -> Option<KvMetrics> {
        None
    }

    /// Checks the proposer's own bookkeeping against the sequences still alive.
    fn check(&self, _alive: &dyn Fn(SeqId) -> bool) -> Result<(), InvariantError> {
        Ok(())
    }
}

/// Why a proposer made no drafts this step.
#[derive(Debug, thiserror::Error)]
pub enum ProposeError {
    /// The draft model's step (or setting up its KV cache) failed.
    #[error("draft model")]
    Model(#[from] ModelError),
    /// The draft model's block bookkeeping refused an update.
    #[error("draft KV pool")]
    Kv(#[from] KvError),
    /// Anything else a proposer of your own fails with.
    #[error("proposer")]
    Other(#[source] Box<dyn std::error::Error + Send + Sync>),
}

#[cfg(test)]
mod tests {
    use super::*;

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
