//! Per-request state in the step loop: each output's sampler, detokenizer and stop matcher,
//! the stop rules, and the deltas waiting to be sent.

use std::time::Instant;

use kiln_kv::SeqId;
use kiln_tokenizer::{DecodeOptions, IncrementalDetokenizer, StopMatcher, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::EngineError;
use crate::constraint::{Committed, Guide};
use crate::error::InternalError;
use crate::handle::{EngineInfo, Submission};
use crate::metrics::EngineMetrics;
use crate::request::{
    Delta, Event, FinishReason, OutputOptions, PromptLogprobs, SpecStats, StoppingCriteria,
    TokenLogprobs,
};
use crate::sampling::{
    LogprobRequest, SampleError, Sampler, SamplingParams, TokenHistory, raw_logprobs,
};
use kiln_tensor::sample::{NO_TOKEN, RowSampling};
use rayon::prelude::*;

/// What the device computed for one logits row: its argmax, and the device sampler's pick
/// when the row was sampled there.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DevicePick {
    pub argmax: Option<u32>,
    pub sampled: Option<u32>,
}

/// What one sampled token did to its sequence.
pub(crate) enum TokenOutcome {
    /// Keep going; the token is fed back next step.
    Continue(u32),
    /// The sequence is done (the token may or may not be part of the output text).
    Finished,
}

pub(crate) struct OutState {
    pub seq: SeqId,
    sampler: Sampler,
    history: TokenHistory,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    pub generated: Vec<u32>,
    pub finish: Option<FinishReason>,
    last_at: Option<Instant>,
    pending: Delta,
    /// Verifying steps in a row that accepted no draft token.
    spec_misses: u32,
    /// Decode steps to go without drafting (the back-off after misses).
    spec_skip: u32,
    /// The request's constraint at this output's point (structured output).
    guide: Option<Guide>,
}

pub(crate) struct ReqState {
    pub tx: UnboundedSender<Event>,
    pub prompt_len: usize,
    pub n: usize,
    pub arrived: Instant,
    pub admitted: Option<Instant>,
    pub first_token: Option<Instant>,
    pub deadline: Option<Instant>,
    pub cached_tokens: usize,
    pub outs: Vec<OutState>,
    /// Speculative decoding figures, for the summary's timing.
    pub spec: SpecStats,
    speculate: bool,
    prompt: Vec<u32>,
    params: SamplingParams,
    seed: u64,
    stopping: StoppingCriteria,
    output: OutputOptions,
    eos: Vec<u32>,
    max_new: usize,
    /// Whether `max_new` is the context's limit rather than the request's.
    max_is_context: bool,
    /// The prompt's log-probabilities, while the prefill computes them.
    prompt_scores: Option<PromptScores>,
}

/// A prompt's log-probabilities as its prefill chunks compute them (a chunk recomputed after
/// preemption writes the same entries again).
struct PromptScores {
    /// Alternatives per token.
    top: usize,
    /// Entry `p` scores prompt token `p + 1` under the logits at position `p`.
    values: Vec<Option<TokenLogprobs>>,
    /// Sent to the caller: later chunks (a recompute) need no rows.
    sent: bool,
}

/// Independent streams for outputs `1..n` of one seed (output 0 uses the seed itself).
fn seed_for(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    // splitmix64 of the seed and index: well-spread and stable across versions.
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl ReqState {
    /// Output 0's guide comes with the submission (its first mask already computing).
    pub fn new(sub: &mut Submission, seq: SeqId, tokenizer: &Tokenizer, info: &EngineInfo) -> Self {
        let guide = sub.guide.take();
        let r = &sub.request;
        let room = info.max_model_len - sub.prompt_ids.len();
        let max_new = r.stopping.max_new_tokens(room);
        // The context ended it, not a limit the request (or its front door) set.
        let max_is_context = (r.stopping.max_new_tokens)
            .or(r.stopping.default_max_new_tokens)
            .is_none_or(|m| m > room);
        let mut state = Self {
            tx: sub.tx.clone(),
            prompt_len: sub.prompt_ids.len(),
            n: r.n,
            arrived: sub.arrived,
            admitted: None,
            first_token: None,
            deadline: r.deadline,
            cached_tokens: 0,
            outs: Vec::with_capacity(r.n),
            spec: SpecStats::default(),
            speculate: r.speculate,
            prompt: sub.prompt_ids.clone(),
            params: r.sampling.clone(),
            seed: sub.seed,
            stopping: r.stopping.clone(),
            output: r.output,
            eos: info.eos_ids.clone(),
            max_new,
            max_is_context,
            prompt_scores: r.output.prompt_logprobs.map(|top| PromptScores {
                top,
                values: vec![None; sub.prompt_ids.len().saturating_sub(1)],
                sent: false,
            }),
        };
        state.add_output(seq, tokenizer, guide);
        state
    }

    /// Whether a chunk of output 0's sequence from position `start` must read back every
    /// logits row: it holds positions whose logits score a prompt token still unscored.
    pub fn wants_prompt_rows(&self, start: usize) -> bool {
        self.prompt_scores
            .as_ref()
            .is_some_and(|s| !s.sent && start < s.values.len())
    }

    /// Scores the prompt tokens that `rows` logits rows from position `start` predict (`row(i)`
    /// is the logits at position `start + i`).
    pub fn score_prompt<'r>(
        &mut self,
        start: usize,
        rows: usize,
        row: impl Fn(usize) -> Option<&'r [f32]>,
    ) -> Result<(), EngineError> {
        let Some(s) = &mut self.prompt_scores else {
            return Ok(());
        };
        // The rows scoring a prompt token (a chunk's last position may predict none).
        let rows = rows.min(s.values.len().saturating_sub(start));
        let logits = (0..rows)
            .map(|i| row(i).ok_or(InternalError::State("prompt logits row not read back")))
            .collect::<Result<Vec<_>, _>>()?;
        let (prompt, top) = (&self.prompt, s.top);
        // A row is a vocabulary's log-softmax: the rows of a long chunk, on every core.
        let scored: Vec<TokenLogprobs> = logits
            .par_iter()
            .enumerate()
            .map(|(i, l)| raw_logprobs(l, prompt[start + i + 1], top))
            .collect();
        let slots = s.values.get_mut(start..start + rows).unwrap_or_default();
        for (slot, t) in slots.iter_mut().zip(scored) {
            *slot = Some(t);
        }
        Ok(())
    }

    /// The prompt's log-probabilities, once, when every one is known.
    pub fn take_prompt_logprobs(&mut self) -> Option<PromptLogprobs> {
        let s = self.prompt_scores.as_mut().filter(|s| !s.sent)?;
        let scores: Option<Vec<TokenLogprobs>> = s.values.iter().cloned().collect();
        let scores = scores?;
        s.sent = true;
        s.values = Vec::new();
        Some(PromptLogprobs {
            first: self.prompt.first().copied()?,
            scores,
        })
    }

    /// Whether the prompt's log-probabilities are asked for and not all known yet (nothing
    /// may be sent before them).
    pub fn awaits_prompt_logprobs(&self) -> bool {
        self.prompt_scores.as_ref().is_some_and(|s| !s.sent)
    }

    /// Adds output `outs.len()` on sequence `seq`, under `guide` when constrained.
    pub fn add_output(&mut self, seq: SeqId, tokenizer: &Tokenizer, guide: Option<Guide>) {
        let index = self.outs.len();
        self.outs.push(OutState {
            seq,
            sampler: Sampler::new(self.params.clone(), seed_for(self.seed, index)),
            history: TokenHistory::new(&self.prompt),
            detok: tokenizer.detokenizer(DecodeOptions {
                skip_special_tokens: self.output.skip_special_tokens,
            }),
            stop: StopMatcher::new(self.stopping.stop.iter().cloned()),
            generated: Vec::new(),
            finish: None,
            last_at: None,
            spec_misses: 0,
            spec_skip: 0,
            guide,
            pending: Delta {
                index,
                token_ids: Vec::new(),
                text: String::new(),
                logprobs: Vec::new(),
                finish: None,
            },
        });
    }

    /// A copy of output 0's guide for another output (`None`: unconstrained).
    pub fn fork_guide(&mut self, metrics: &EngineMetrics) -> Result<Option<Guide>, EngineError> {
        match self.outs.first_mut().and_then(|o| o.guide.as_mut()) {
            Some(g) => Ok(Some(g.fork(metrics).map_err(InternalError::Constraint)?)),
            None => Ok(None),
        }
    }

    /// Whether the other `n - 1` outputs still have to fork from output 0.
    pub fn wants_forks(&self) -> bool {
        self.n > 1 && self.outs.len() == 1
    }

    /// Every sequence this request has had.
    pub fn seqs(&self) -> Vec<SeqId> {
        self.outs.iter().map(|o| o.seq).collect()
    }

    pub fn all_finished(&self) -> bool {
        self.outs.len() == self.n && self.outs.iter().all(|o| o.finish.is_some())
    }

    /// Ids banned for output `idx` `ahead` tokens from now: EOS and stop ids until
    /// `min_new_tokens` exist.
    fn suppressed(&self, idx: usize, ahead: usize) -> Vec<u32> {
        let generated = self.outs.get(idx).map_or(0, |o| o.generated.len()) + ahead;
        if generated >= self.stopping.min_new_tokens {
            return Vec::new();
        }
        let mut ids = self.stopping.stop_token_ids.clone();
        if !self.stopping.ignore_eos {
            ids.extend(&self.eos);
        }
        ids
    }

    /// Whether output `idx` needs its logits row on the CPU (anything beyond a plain argmax).
    pub fn needs_row(&self, idx: usize) -> bool {
        let generated = self.outs.get(idx).map_or(0, |o| o.generated.len());
        let suppressing = generated < self.stopping.min_new_tokens
            && (!self.stopping.stop_token_ids.is_empty()
                || (!self.stopping.ignore_eos && !self.eos.is_empty()));
        let constrained = self.outs.get(idx).is_some_and(|o| o.guide.is_some());
        self.params.needs_logits()
            || constrained
            || self.output.logprobs
            || self.output.top_logprobs > 0
            || suppressing
    }

    /// How the device samples output `idx`'s rows this step: one [`RowSampling`] for its next
    /// token and one after each of `drafts` (each as if the drafts before it were accepted,
    /// which is when its pick is used). `None` when the rows come back to the host instead
    /// (logprobs, a grammar's mask, which is computed while the step runs) or a plain device
    /// argmax is the pick.
    pub fn device_rows(
        &self,
        idx: usize,
        drafts: &[u32],
        vocab: usize,
    ) -> Option<Vec<RowSampling>> {
        let o = self.outs.get(idx)?;
        // The first token of n > 1 outputs is sampled n times from output 0's row.
        let fanning_out = self.n > 1 && self.first_token.is_none();
        if !self.needs_row(idx)
            || fanning_out
            || o.guide.is_some()
            || self.output.logprobs
            || self.output.top_logprobs > 0
        {
            return None;
        }
        let mut history = std::borrow::Cow::Borrowed(&o.history);
        let mut rows = Vec::with_capacity(drafts.len() + 1);
        for j in 0..=drafts.len() {
            if j > 0 {
                history.to_mut().push_output(drafts[j - 1]);
            }
            let suppress = self.suppressed(idx, j);
            rows.push(
                o.sampler
                    .row_sampling(&history, &suppress, None, vocab, j as u64),
            );
        }
        Some(rows)
    }

    /// Draft tokens output `idx` may verify in one step: its verification yields up to one
    /// token more than it drafts, so one less than it may still generate (0: do not draft).
    /// After verifying steps that accepted nothing, an output backs off: it decodes 1, 2, 4,
    /// 8, then 16 steps without drafts after 1, 2, 3, 4, 5+ such steps in a row, so a stream
    /// the proposer cannot predict (free generation under prompt lookup) pays for few
    /// wasted verifications; one accepted token resets it.
    pub fn draft_room(&self, idx: usize) -> usize {
        match self.outs.get(idx) {
            Some(o)
                if self.speculate
                    && o.finish.is_none()
                    && o.spec_skip == 0
                    && o.guide.is_none() =>
            {
                self.max_new.saturating_sub(o.generated.len() + 1)
            }
            _ => 0,
        }
    }

    /// Picks output `idx`'s next token from its row (or what the device picked), applies the
    /// stop rules and queues the delta.
    pub fn on_row(
        &mut self,
        idx: usize,
        row: Option<&[f32]>,
        device: DevicePick,
        now: Instant,
        metrics: &EngineMetrics,
    ) -> Result<TokenOutcome, EngineError> {
        if self.max_new == 0 {
            // Scoring the prompt alone: nothing to generate.
            let o = (self.outs.get_mut(idx))
                .ok_or(InternalError::State("output index out of range"))?;
            o.finish = Some(FinishReason::Length);
            o.pending.finish = Some(FinishReason::Length);
            return Ok(TokenOutcome::Finished);
        }
        let (token, logprobs, _) = self.pick(idx, row, device, None, metrics)?;
        if let Some(o) = self.outs.get_mut(idx) {
            o.spec_skip = o.spec_skip.saturating_sub(1);
        }
        self.apply(idx, token, logprobs, now, metrics)
    }

    /// Verifies output `idx`'s drafts against the target's rows (`row(j)` / `device(j)` at
    /// draft position `j`, `j = draft.len()` the one after the last draft): takes each draft
    /// token the target accepts, then the target's own token, stopping early if the output
    /// finishes. Returns the last outcome and how many drafts were accepted.
    pub fn on_draft_rows<'r>(
        &mut self,
        idx: usize,
        draft: &[u32],
        row: impl Fn(usize) -> Option<&'r [f32]>,
        device: impl Fn(usize) -> DevicePick,
        now: Instant,
        metrics: &EngineMetrics,
    ) -> Result<(TokenOutcome, usize), EngineError> {
        let mut accepted = 0;
        let mut outcome = TokenOutcome::Finished;
        for j in 0..=draft.len() {
            let (token, logprobs, ok) =
                self.pick(idx, row(j), device(j), draft.get(j).copied(), metrics)?;
            accepted += usize::from(ok);
            outcome = self.apply(idx, token, logprobs, now, metrics)?;
            if !ok || matches!(outcome, TokenOutcome::Finished) {
                break;
            }
        }
        if let Some(o) = self.outs.get_mut(idx) {
            o.spec_misses = if accepted == 0 { o.spec_misses + 1 } else { 0 };
            o.spec_skip = match o.spec_misses {
                0 => 0,
                m => 1 << (m - 1).min(4),
            };
        }
        self.spec.proposed_tokens += draft.len() as u64;
        self.spec.accepted_tokens += accepted as u64;
        self.spec.verify_steps += 1;
        metrics.verified(draft.len(), accepted);
        Ok((outcome, accepted))
    }

    /// Output `idx`'s token from the device sampler, a row, or the device argmax, checked
    /// against `draft` when one was proposed here; returns the token, its logprobs and
    /// whether it is the draft.
    fn pick(
        &mut self,
        idx: usize,
        row: Option<&[f32]>,
        device: DevicePick,
        draft: Option<u32>,
        metrics: &EngineMetrics,
    ) -> Result<(u32, Option<TokenLogprobs>, bool), EngineError> {
        if let Some(token) = device.sampled {
            let Some(o) = self.outs.get_mut(idx) else {
                return Err(InternalError::State("output index out of range").into());
            };
            if token == NO_TOKEN {
                return Err(InternalError::Sampling(SampleError::NoCandidates).into());
            }
            o.sampler.took();
            return Ok((token, None, draft == Some(token)));
        }
        let mut suppress = self.suppressed(idx, 0);
        let needs_row = self.needs_row(idx);
        let want = LogprobRequest {
            logprobs: self.output.logprobs,
            top_logprobs: self.output.top_logprobs,
        };
        let internal = |what: &'static str| EngineError::from(InternalError::State(what));
        let Some(o) = self.outs.get_mut(idx) else {
            return Err(internal("output index out of range"));
        };
        if needs_row {
            let row = row.ok_or_else(|| internal("logits row was not read back"))?;
            let allowed = match &mut o.guide {
                Some(g) => Some(g.mask(metrics).map_err(InternalError::Constraint)?),
                None => None,
            };
            if let Some(mask) = allowed
                && only_suppressed(mask, &suppress)
            {
                // The grammar wins over min_new_tokens: it may allow nothing but EOS.
                suppress.clear();
            }
            let (s, ok) = o
                .sampler
                .verify_masked(row, &o.history, &suppress, allowed, draft, want)
                .map_err(InternalError::Sampling)?;
            let lp = (want.logprobs || want.top_logprobs > 0).then(|| TokenLogprobs {
                token: s.token,
                logprob: s.logprob.unwrap_or(f32::NEG_INFINITY),
                rank: s.rank.unwrap_or(usize::MAX),
                top: s.top,
            });
            Ok((s.token, lp, ok))
        } else {
            let token = device
                .argmax
                .ok_or_else(|| internal("argmax was not read back"))?;
            Ok((token, None, draft == Some(token)))
        }
    }

    /// Appends a picked token to output `idx`: stop rules, detokenization, the pending delta.
    fn apply(
        &mut self,
        idx: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        now: Instant,
        metrics: &EngineMetrics,
    ) -> Result<TokenOutcome, EngineError> {
        if self.first_token.is_none() {
            self.first_token = Some(now);
            metrics.ttft.observe((now - self.arrived).as_secs_f64());
        }
        let Some(o) = self.outs.get_mut(idx) else {
            return Err(InternalError::State("output index out of range").into());
        };
        if let Some(t) = o.last_at {
            metrics.itl.observe((now - t).as_secs_f64());
        }
        o.last_at = Some(now);
        metrics.generation_tokens.inc();
        o.generated.push(token);
        o.history.push_output(token);
        o.pending.token_ids.push(token);
        o.pending.logprobs.extend(logprobs);

        let stops_allowed = o.generated.len() > self.stopping.min_new_tokens;
        let mut finish = None;
        if stops_allowed && !self.stopping.ignore_eos && self.eos.contains(&token) {
            finish = Some(FinishReason::EosToken);
        } else if stops_allowed && self.stopping.stop_token_ids.contains(&token) {
            finish = Some(FinishReason::StopToken(token));
        } else {
            let text = o.detok.push(token).map_err(InternalError::Detokenize)?;
            if let Some(hit) = o.push_text(&text, stops_allowed, &self.stopping) {
                finish = Some(hit);
            }
        }
        if finish.is_none()
            && let Some(g) = &mut o.guide
            && g.commit(token, metrics)
                .map_err(InternalError::Constraint)?
                == Committed::Complete
        {
            finish = Some(FinishReason::ConstraintComplete);
        }
        if finish.is_none() && o.generated.len() >= self.max_new {
            finish = Some(if self.max_is_context {
                FinishReason::ContextLength
            } else {
                FinishReason::Length
            });
        }
        let Some(reason) = finish else {
            return Ok(TokenOutcome::Continue(token));
        };
        if !matches!(reason, FinishReason::StopSequence(_)) {
            // Flush what the detokenizer and the stop matcher still hold.
            let tail = o.detok.finish().map_err(InternalError::Detokenize)?;
            if let Some(hit) = o.push_text(&tail, stops_allowed, &self.stopping) {
                o.finish = Some(hit.clone());
                o.pending.finish = Some(hit);
                return Ok(TokenOutcome::Finished);
            }
            let held = o.stop.finish();
            o.pending.text.push_str(&held);
        }
        o.finish = Some(reason.clone());
        o.pending.finish = Some(reason);
        Ok(TokenOutcome::Finished)
    }

    /// Deltas with something in them, ready to send.
    pub fn take_deltas(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        for (index, o) in self.outs.iter_mut().enumerate() {
            let p = &mut o.pending;
            if p.token_ids.is_empty() && p.text.is_empty() && p.finish.is_none() {
                continue;
            }
            out.push(std::mem::replace(
                p,
                Delta {
                    index,
                    token_ids: Vec::new(),
                    text: String::new(),
                    logprobs: Vec::new(),
                    finish: None,
                },
            ));
        }
        out
    }
}

/// Whether every id `mask` allows is in `suppress` (so suppressing would leave nothing).
fn only_suppressed(mask: &[u32], suppress: &[u32]) -> bool {
    mask.iter().enumerate().all(|(w, &bits)| {
        (0..32).all(|b| bits >> b & 1 == 0 || suppress.contains(&((w * 32 + b) as u32)))
    })
}

impl OutState {
    /// Passes new text through the stop matcher (once stops are allowed) into the pending
    /// delta; returns the finish reason when a stop string completed.
    fn push_text(
        &mut self,
        text: &str,
        stops_allowed: bool,
        stopping: &StoppingCriteria,
    ) -> Option<FinishReason> {
        if stopping.stop.is_empty() || !stops_allowed {
            self.pending.text.push_str(text);
            return None;
        }
        let out = self.stop.push(text);
        self.pending.text.push_str(&out.text);
        let hit = out.hit?;
        if stopping.include_stop_str_in_output {
            self.pending.text.push_str(&hit.stop);
        }
        Some(FinishReason::StopSequence(hit.stop))
    }
}
