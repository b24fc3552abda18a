//! Speculation in the step loop: before the schedule, the proposer drafts for the sequences
//! about to decode; after the forward pass, sampling keeps the drafts the target agrees with
//! plus one token of its own, and the scheduler keeps exactly those slots.

use std::time::Instant;

use kiln_kv::SeqId;
use kiln_model::StepOutput;
use kiln_scheduler::ScheduledSeq;

use super::{ProposeInput, Proposer, SpeculativeConfig};
use crate::error::{InternalError, error_chain};
use crate::output::{DevicePick, TokenOutcome};
use crate::request::RequestId;
use crate::step_loop::{Ending, Loop};

/// Speculative decoding as the step loop runs it.
pub(crate) struct Spec {
    pub cfg: SpeculativeConfig,
    pub proposer: Box<dyn Proposer>,
}

impl Loop {
    /// Drafts tokens for the sequences about to decode, unless the batch is too large for
    /// speculation to pay ([`SpeculativeConfig::disable_batch_size`]) or the request opted out.
    pub fn propose(&mut self) {
        let Some(spec) = &mut self.spec else {
            return;
        };
        if self.sched.stats().running > spec.cfg.disable_batch_size {
            return;
        }
        let max_model_len = self.info.max_model_len;
        let mut batch = Vec::new();
        for (seq, tokens) in self.sched.decoding() {
            let Some(r) = self
                .owner
                .get(&seq)
                .and_then(|&(rid, idx)| Some((self.requests.get(&rid)?, idx)))
            else {
                continue;
            };
            // k + 1 new tokens at most, within the request's and the context's limits.
            let k =
                r.0.draft_room(r.1)
                    .min(spec.cfg.num_tokens)
                    .min(max_model_len.saturating_sub(tokens.len() + 1));
            if k > 0 {
                batch.push(ProposeInput {
                    seq,
                    tokens,
                    max_tokens: k,
                });
            }
        }
        if batch.is_empty() {
            return;
        }
        let drafts = match spec.proposer.propose(&batch) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(
                    error = %error_chain(&e),
                    "proposer failed; decoding without drafts this step"
                );
                return;
            }
        };
        let vocab = self.info.vocab_size as u32;
        let proposals: Vec<(SeqId, Vec<u32>)> = batch
            .iter()
            .zip(drafts)
            .map(|(b, mut d)| {
                d.truncate(b.max_tokens);
                if let Some(bad) = d.iter().position(|&t| t >= vocab) {
                    d.truncate(bad);
                }
                (b.seq, d)
            })
            .collect();
        drop(batch);
        for (seq, d) in proposals {
            if let Err(e) = self.sched.propose(seq, d) {
                tracing::warn!(seq = seq.0, error = %e, "draft refused");
            }
        }
    }

    /// Sampling for a decode that verified drafts: the accepted drafts and the target's own
    /// next token go out; the rejected drafts' slots go back.
    pub fn verify(
        &mut self,
        rid: RequestId,
        idx: usize,
        row: usize,
        s: &ScheduledSeq,
        out: &StepOutput,
        now: Instant,
    ) {
        let Some(r) = self.requests.get_mut(&rid) else {
            return;
        };
        let draft = self.sched.verifying(s.seq).to_vec();
        let outcome = r.on_draft_rows(
            idx,
            &draft,
            |j| out.logits(row, j),
            |j| DevicePick {
                argmax: out.argmax(row, j),
                sampled: out.sampled(row, j),
            },
            now,
            &self.metrics,
        );
        let result = match outcome {
            Ok((TokenOutcome::Continue(token), accepted)) => self
                .sched
                .accept_draft(s.seq, accepted)
                .and_then(|()| self.sched.push_token(s.seq, token))
                .map_err(|e| InternalError::Scheduler(e).into()),
            Ok((TokenOutcome::Finished, _)) => {
                self.finish_seq(s.seq);
                Ok(())
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => self.flush(rid),
            Err(e) => self.end(rid, Ending::Error(e)),
        }
    }
}
