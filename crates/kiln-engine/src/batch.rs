//! Batch building: a [`Schedule`] becomes the model runner's [`StepSeq`]s (prefill chunks,
//! decodes, and decodes followed by the drafts they verify), with logits read back only for
//! the sequences that sample on the CPU, and every row of the prefill chunks whose prompt
//! tokens a request asked to score; then those prompt tokens are scored, and every sequence
//! that reached the end of its tokens samples its next token.

use std::time::Instant;

use kiln_kv::SeqId;
use kiln_model::{StepOutput, StepSeq};
use kiln_scheduler::Schedule;
use kiln_tensor::sample::RowSampling;

use crate::error::InternalError;
use crate::output::{DevicePick, ReqState, TokenOutcome};
use crate::step_loop::{Ending, Loop};

impl Loop {
    /// Runs the model over `schedule`: the argmax of every logits row, and the rows sampling
    /// needs on the CPU (penalties, logprobs, non-greedy sampling, `min_new_tokens`).
    pub fn forward(
        &mut self,
        schedule: &Schedule,
        prompt_rows: &[bool],
    ) -> Result<StepOutput, InternalError> {
        // A decode that verifies drafts computes its sampled token followed by the drafts.
        let mut with_drafts: Vec<Vec<u32>> = Vec::new();
        for s in schedule.seqs.iter().filter(|s| s.draft > 0) {
            let mut t = self
                .sched
                .tokens(s.seq)
                .and_then(|t| t.get(s.start..s.real_end()))
                .ok_or(InternalError::LostTokens(s.seq))?
                .to_vec();
            t.extend_from_slice(self.sched.verifying(s.seq));
            with_drafts.push(t);
        }
        // The rows the device samples, per scheduled sequence.
        let vocab = self.runner.vocab();
        let device_rows: Vec<Option<Vec<RowSampling>>> = schedule
            .seqs
            .iter()
            .zip(prompt_rows)
            .map(|(s, &prompt)| {
                if !(self.device_sampling && s.samples) || prompt {
                    return None;
                }
                let (rid, idx) = self.owner.get(&s.seq)?;
                let drafts = if s.draft > 0 {
                    self.sched.verifying(s.seq)
                } else {
                    &[]
                };
                self.requests.get(rid)?.device_rows(*idx, drafts, vocab)
            })
            .collect();
        self.device_sampled_rows +=
            device_rows.iter().flatten().map(Vec::len).sum::<usize>() as u64;
        let mut drafted = with_drafts.iter();
        let mut batch = Vec::with_capacity(schedule.seqs.len());
        for ((s, device), &prompt) in schedule.seqs.iter().zip(&device_rows).zip(prompt_rows) {
            let tokens = if s.draft > 0 {
                drafted.next().map(Vec::as_slice)
            } else {
                self.sched
                    .tokens(s.seq)
                    .and_then(|t| t.get(s.start..s.end()))
            }
            .filter(|t| t.len() == s.len)
            .ok_or(InternalError::LostTokens(s.seq))?;
            batch.push(StepSeq {
                tokens,
                block_table: self
                    .sched
                    .blocks()
                    .block_table(s.seq)
                    .map_err(|e| InternalError::Scheduler(e.into()))?,
                kept_table: self
                    .sched
                    .blocks()
                    .kept_table(s.seq)
                    .map_err(|e| InternalError::Scheduler(e.into()))?,
                context_len: s.end(),
                // One row per sequence, plus one per draft token it verifies; a chunk that
                // scores prompt tokens, all of them.
                logits_rows: if prompt { s.len } else { 1 + s.draft },
                read_logits: prompt || (s.samples && device.is_none() && self.needs_row(s.seq)),
                sample: device.as_deref(),
            });
        }
        self.runner
            .step(&batch, &schedule.copies)
            .map_err(InternalError::Forward)
    }

    /// For each of the step's chunks, whether every logits row comes back to score prompt
    /// tokens: a prefill chunk of a request that scores its prompt, holding positions whose
    /// logits score a prompt token not yet scored. Decided once a step, for `forward` and
    /// `score_prompts`.
    pub fn prompt_rows(&self, schedule: &Schedule) -> Vec<bool> {
        let wants = |s: &kiln_scheduler::ScheduledSeq| {
            s.draft == 0
                && self
                    .owner
                    .get(&s.seq)
                    .filter(|(_, idx)| *idx == 0)
                    .and_then(|(rid, _)| self.requests.get(rid))
                    .is_some_and(|r| r.wants_prompt_rows(s.start))
        };
        schedule.seqs.iter().map(wants).collect()
    }

    /// Scores the prompt tokens this step's prefill chunks computed the logits of (a request
    /// gets them when its prompt is all scored: `flush`).
    pub fn score_prompts(&mut self, schedule: &Schedule, prompt_rows: &[bool], out: &StepOutput) {
        for (row, (s, _)) in schedule
            .seqs
            .iter()
            .zip(prompt_rows)
            .enumerate()
            .filter(|(_, (_, p))| **p)
        {
            let Some(&(rid, _)) = self.owner.get(&s.seq) else {
                continue; // ended during this step
            };
            let Some(r) = self.requests.get_mut(&rid) else {
                continue;
            };
            let scored = match out.rows(row) {
                rows if rows == s.len => r.score_prompt(s.start, rows, |i| out.logits(row, i)),
                _ => Err(InternalError::State(
                    "a scored chunk's logits rows did not all come back",
                )
                .into()),
            };
            if let Err(e) = scored {
                self.end(rid, crate::step_loop::Ending::Error(e));
            }
        }
    }

    /// Whether `seq`'s output samples on the CPU (so its logits row must come back).
    fn needs_row(&self, seq: SeqId) -> bool {
        self.owner
            .get(&seq)
            .and_then(|(rid, idx)| Some((self.requests.get(rid)?, *idx)))
            .is_some_and(|(r, idx)| r.needs_row(idx))
    }

    /// Samples every sequence that reached the end of its tokens, applies the stop rules and
    /// sends the deltas.
    pub fn sample_all(&mut self, schedule: &Schedule, out: &StepOutput) {
        let now = Instant::now();
        for (row, s) in schedule.seqs.iter().enumerate() {
            if !s.samples {
                continue;
            }
            let Some(&(rid, idx)) = self.owner.get(&s.seq) else {
                continue; // ended during this step
            };
            // n > 1: the prompt is done, so the other outputs fork from it now.
            if idx == 0
                && self.requests.get(&rid).is_some_and(ReqState::wants_forks)
                && let Err(e) = self.fork(rid, s.seq)
            {
                self.end(rid, Ending::Error(e));
                continue;
            }
            if s.draft > 0 {
                self.verify(rid, idx, row, s, out, now);
                continue;
            }
            let Some(r) = self.requests.get_mut(&rid) else {
                continue;
            };
            // The sampled row is the chunk's last (a chunk scoring its prompt has one a
            // position).
            let last = out.rows(row).saturating_sub(1);
            let indices: Vec<usize> = if idx == 0 && r.first_token.is_none() {
                (0..r.outs.len()).collect()
            } else {
                vec![idx]
            };
            let mut ended = None;
            for i in indices {
                let Some(seq) = r.outs.get(i).map(|o| o.seq) else {
                    ended = Some(InternalError::State("output index out of range").into());
                    break;
                };
                let outcome = r.on_row(
                    i,
                    out.logits(row, last),
                    DevicePick {
                        argmax: out.argmax(row, last),
                        // Only output `idx`'s own row was sampled on the device.
                        sampled: out.sampled(row, last).filter(|_| i == idx),
                    },
                    now,
                    &self.metrics,
                );
                match outcome {
                    Ok(TokenOutcome::Continue(token)) => {
                        if let Err(e) = self.sched.push_token(seq, token) {
                            ended = Some(InternalError::Scheduler(e).into());
                            break;
                        }
                    }
                    Ok(TokenOutcome::Finished) => {
                        // `finish_seq`, spelled out: `r` still borrows the requests.
                        self.sched.finish(seq);
                        self.owner.remove(&seq);
                        if let Some(spec) = &mut self.spec {
                            spec.proposer.release(seq);
                        }
                    }
                    Err(e) => {
                        ended = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = ended {
                self.end(rid, Ending::Error(e));
                continue;
            }
            self.flush(rid);
        }
    }
}
