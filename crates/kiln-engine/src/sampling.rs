//! Per-sequence token sampling: logit processing (suppression, bias, penalties), then greedy or
//! temperature / top-k / top-p / min-p sampling, plus raw logprobs.
//!
//! Each sequence owns its [`Sampler`] and RNG, so its tokens depend only on its seed and its own
//! logits, never on what else shares the batch.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::field::Field;
use crate::request::TokenLogprobs;
use kiln_tensor::sample::{LogitEdit, RowSampling, pick, token_rank};

/// Per-request sampling settings (engine-level, plain Rust; the gRPC layer converts to it).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: usize,
    /// In (0, 1]; 1 means off.
    pub top_p: f32,
    /// In [0, 1]; 0 means off.
    pub min_p: f32,
    /// HF/vLLM: for ids seen in prompt or output, positive logits are divided by it, others
    /// multiplied. 1 means off.
    pub repetition_penalty: f32,
    /// OpenAI/vLLM, output tokens only: `logit -= presence * (count > 0)`.
    pub presence_penalty: f32,
    /// OpenAI/vLLM, output tokens only: `logit -= frequency * count`.
    pub frequency_penalty: f32,
    /// Added to the logit of each id; each bias in [-100, 100].
    pub logit_bias: BTreeMap<u32, f32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Rejects settings the sampler cannot honour, naming the field so the client can fix it.
    pub fn validate(&self, vocab: usize) -> Result<(), ParamError> {
        let bad = |field, rule, got: f32| Err(ParamError::new(field, format!("{rule}, got {got}")));
        let (t, rp) = (self.temperature, self.repetition_penalty);
        if !(t.is_finite() && t >= 0.0) {
            return bad(Field::Temperature, "must be finite and >= 0", t);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(Field::TopP, "must be in (0, 1]", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(Field::MinP, "must be in [0, 1]", self.min_p);
        }
        if !(rp.is_finite() && rp > 0.0) {
            return bad(Field::RepetitionPenalty, "must be finite and > 0", rp);
        }
        for (field, v) in [
            (Field::PresencePenalty, self.presence_penalty),
            (Field::FrequencyPenalty, self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(field, "must be in [-2, 2]", v);
            }
        }
        for (&id, &bias) in &self.logit_bias {
            if id as usize >= vocab {
                let reason = format!("token id {id} is outside the vocabulary of {vocab}");
                return Err(ParamError::new(Field::LogitBias, reason));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return bad(Field::LogitBias, "each bias must be in [-100, 100]", bias);
            }
        }
        Ok(())
    }

    /// temperature == 0 or top_k == 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// True unless the pick is a plain argmax of the raw logits (greedy, no penalties, no bias),
    /// which the engine can run on the GPU, reading back only the id. Per-call needs are not
    /// covered here: a non-empty `suppress` list or a logprob request also needs the row.
    pub fn needs_logits(&self) -> bool {
        !self.is_greedy()
            || self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct ParamError {
    pub field: Field,
    pub reason: String,
}

impl ParamError {
    fn new(field: Field, reason: String) -> Self {
        Self { field, reason }
    }
}

/// Token counts a sequence has seen, kept incrementally so penalties cost O(distinct ids), not
/// O(sequence length), per step.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    /// Every id in the prompt or the output: the repetition penalty applies once to each.
    seen: HashSet<u32>,
    /// Output ids only: presence and frequency penalties ignore the prompt.
    output_counts: HashMap<u32, u32>,
    output_len: usize,
}

impl TokenHistory {
    pub fn new(prompt: &[u32]) -> Self {
        Self {
            seen: prompt.iter().copied().collect(),
            ..Self::default()
        }
    }

    pub fn push_output(&mut self, token: u32) {
        self.seen.insert(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.output_len += 1;
    }

    #[cfg(test)]
    pub fn output_len(&self) -> usize {
        self.output_len
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// What one sampling step picked.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log-softmax of the RAW logits (before suppression, penalties, bias, temperature: vLLM's
    /// default "raw logprobs") at `token`; `Some` only when requested.
    pub logprob: Option<f32>,
    /// `token`'s rank under the same distribution (1: the most likely); `Some` with the
    /// logprobs.
    pub rank: Option<usize>,
    /// The `top_logprobs` most likely tokens under the same raw distribution, best first, ties
    /// by lower id. Empty unless requested.
    pub top: Vec<TokenLogprob>,
}

/// How much log-probability information a request wants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogprobRequest {
    pub logprobs: bool,
    pub top_logprobs: usize,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("the logits row is empty")]
    EmptyLogits,
    /// Every logit is -inf or NaN after suppression, bias and penalties.
    #[error("no token is possible: every logit is -inf or NaN after processing")]
    NoCandidates,
}

/// One sequence's sampler: parameters plus its own seed, so the same seed and the same logits
/// give the same tokens no matter what else is batched.
///
/// A draw is a Gumbel-max pick: the candidate maximising `ln w + G`, where `w` is its weight
/// after temperature and the filters and `G` is Gumbel noise hashed from (seed, draw index,
/// token id). That is exact sampling from the normalised weights, and it makes the token of
/// draw `n` a function of the seed, `n` and the logits alone: speculative decoding can verify a
/// draft at any position by checking it against that very pick, so a seeded request gives the
/// same tokens with speculation on or off.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    /// Draws made so far (the index of the next one).
    draws: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Self {
        Self {
            params,
            seed,
            draws: 0,
        }
    }

    /// [`sample_masked`](Self::sample_masked) without a mask (tests).
    #[cfg(test)]
    pub fn sample(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
        suppress: &[u32],
        want: LogprobRequest,
    ) -> Result<Sampled, SampleError> {
        self.sample_masked(logits, history, suppress, None, want)
    }

    /// Picks the next token from one row of logits (length = vocab), among the ids `allowed`
    /// sets (bit `id % 32` of word `id / 32`; ids past its end are not allowed) before
    /// anything else, when there is a mask: structured output's. Expects validated params;
    /// invalid ones never panic but may yield `NoCandidates`.
    ///
    /// Order: suppress (for min_new_tokens) → logit_bias → repetition penalty →
    /// presence/frequency → greedy argmax (first index on ties), or temperature → top_k → top_p →
    /// min_p → one draw. A non-greedy call that succeeds makes exactly one draw, even if one
    /// candidate is left, so a sequence's draw count depends only on its own steps; greedy makes
    /// none. NaN logits count as -inf and +inf as `f32::MAX` (so ties at +inf share the mass).
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
        suppress: &[u32],
        allowed: Option<&[u32]>,
        want: LogprobRequest,
    ) -> Result<Sampled, SampleError> {
        if logits.is_empty() {
            return Err(SampleError::EmptyLogits);
        }
        let how = self.row_sampling(history, suppress, allowed, logits.len(), 0);
        let processed = kiln_tensor::sample::process(logits, &how);
        let token = pick(processed, &how).ok_or(SampleError::NoCandidates)?;
        self.took();
        Ok(with_logprobs(logits, token, want))
    }

    /// How the row of this sequence's draw `ahead` draws from now is sampled, on the device
    /// ([`kiln_tensor::Recorder::sample`]) or here: the knobs, the draw's identity, the
    /// suppression, bias and penalties merged per id into [`LogitEdit`]s (ids at or past
    /// `vocab` dropped), and the mask.
    pub fn row_sampling(
        &self,
        history: &TokenHistory,
        suppress: &[u32],
        allowed: Option<&[u32]>,
        vocab: usize,
        ahead: u64,
    ) -> RowSampling {
        let p = &self.params;
        RowSampling {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            seed: self.seed,
            draw: self.draws + ahead,
            edits: edits(p, history, suppress, vocab),
            allowed: allowed.map(<[u32]>::to_vec),
        }
    }

    /// Records that a row was sampled (here or on the device): a draw when not greedy, so
    /// the next draw is the next index.
    pub fn took(&mut self) {
        if !self.params.is_greedy() {
            self.draws += 1;
        }
    }

    /// [`verify_masked`](Self::verify_masked) without a mask (tests).
    #[cfg(test)]
    pub fn verify(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
        suppress: &[u32],
        draft: Option<u32>,
        want: LogprobRequest,
    ) -> Result<(Sampled, bool), SampleError> {
        self.verify_masked(logits, history, suppress, None, draft, want)
    }

    /// Speculative decoding's check of one draft token against this row (the target model's
    /// logits at the draft's position): the token is exactly what
    /// [`sample_masked`](Self::sample_masked) would pick here, and the draft is accepted when it is that token. Greedy, that is the
    /// longest-agreeing-prefix rule. Sampling, the drafts of kiln's proposers are point masses
    /// (n-gram lookup, a greedy draft model), for which the rejection rule of speculative
    /// sampling (Leviathan et al. 2023; the general form is the reference in this module's
    /// distribution tests) reads: accept with probability p(draft), else draw from p without
    /// the draft. The Gumbel-max draw realises exactly that rule (the draft is the pick with
    /// probability p(draft); given it is not, the pick follows p without it) while coupling it
    /// to plain sampling, so outputs do not depend on whether, or how much, a step speculated.
    /// `draft: None` is a plain `sample_masked` (the bonus token after a fully accepted draft).
    /// `allowed` is structured output's mask. Returns the token and whether it is the
    /// accepted draft.
    pub fn verify_masked(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
        suppress: &[u32],
        allowed: Option<&[u32]>,
        draft: Option<u32>,
        want: LogprobRequest,
    ) -> Result<(Sampled, bool), SampleError> {
        let Some(draft) = draft else {
            let s = self.sample_masked(logits, history, suppress, allowed, want)?;
            return Ok((s, false));
        };
        if logits.is_empty() {
            return Err(SampleError::EmptyLogits);
        }
        let s = self.sample_masked(logits, history, suppress, allowed, want)?;
        let accepted = s.token == draft;
        Ok((s, accepted))
    }
}

/// A [`Sampled`] for `token`, with raw logprobs when `want` asks.
fn with_logprobs(logits: &[f32], token: u32, want: LogprobRequest) -> Sampled {
    if !(want.logprobs || want.top_logprobs > 0) {
        return Sampled {
            token,
            logprob: None,
            rank: None,
            top: Vec::new(),
        };
    }
    let t = raw_logprobs(logits, token, want.top_logprobs);
    Sampled {
        token,
        logprob: want.logprobs.then_some(t.logprob),
        rank: Some(t.rank),
        top: t.top,
    }
}

/// `token`'s log-probability and rank under the raw logits, and the `top_n` best (best
/// first, ties by lower id), by kiln-tensor's one definition ([`token_rank`]): what sampled
/// tokens, prompt tokens and `kiln perplexity` report. NaN counts as -inf, +inf as
/// `f32::MAX`; an id outside the row, or a row with no finite logit, gets -inf.
pub fn raw_logprobs(logits: &[f32], token: u32, top_n: usize) -> TokenLogprobs {
    let r = token_rank(logits, token, top_n);
    TokenLogprobs {
        token,
        logprob: r.logprob as f32,
        rank: r.rank,
        top: r
            .top
            .into_iter()
            .map(|(token, logprob)| TokenLogprob {
                token,
                logprob: logprob as f32,
            })
            .collect(),
    }
}

/// Suppression, bias and penalties as one edit per id, in the documented order: suppressed
/// ids go to -inf; others get their bias, then the repetition penalty when seen in the prompt
/// or output, then `frequency · count + presence` off when in the output.
fn edits(
    params: &SamplingParams,
    history: &TokenHistory,
    suppress: &[u32],
    vocab: usize,
) -> Vec<LogitEdit> {
    fn at(by_id: &mut BTreeMap<u32, LogitEdit>, id: u32) -> &mut LogitEdit {
        by_id.entry(id).or_insert_with(|| LogitEdit::none(id))
    }
    let mut by_id: BTreeMap<u32, LogitEdit> = BTreeMap::new();
    for &id in suppress {
        at(&mut by_id, id).add = f32::NEG_INFINITY;
    }
    for (&id, &bias) in &params.logit_bias {
        at(&mut by_id, id).add += bias;
    }
    let rp = params.repetition_penalty;
    if rp != 1.0 {
        for &id in &history.seen {
            at(&mut by_id, id).rep = rp;
        }
    }
    let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
    if presence != 0.0 || frequency != 0.0 {
        for (&id, &count) in &history.output_counts {
            at(&mut by_id, id).sub = frequency * count as f32 + presence;
        }
    }
    by_id
        .into_values()
        .filter(|e| (e.id as usize) < vocab)
        .collect()
}

/// The row as sampling sees it (tests): the mask, then the edits.
#[cfg(test)]
fn process(
    logits: &[f32],
    params: &SamplingParams,
    history: &TokenHistory,
    suppress: &[u32],
    allowed: Option<&[u32]>,
) -> Vec<f32> {
    let how =
        Sampler::new(params.clone(), 0).row_sampling(history, suppress, allowed, logits.len(), 0);
    kiln_tensor::sample::process(logits, &how)
}

#[cfg(test)]
mod distribution;

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_tensor::sample::by_logit_desc;
    use proptest::prelude::{
        Just, Strategy, any, prop_assert, prop_assert_eq, prop_oneof, proptest,
    };
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const NONE: LogprobRequest = LogprobRequest {
        logprobs: false,
        top_logprobs: 0,
    };

    /// Default params (temperature 1, everything off) with one edit.
    fn with(edit: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        edit(&mut p);
        p
    }

    /// The greedy pick under `p`'s penalties and bias.
    fn gpick(p: &SamplingParams, logits: &[f32], h: &TokenHistory) -> u32 {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                ..p.clone()
            },
            0,
        );
        s.sample(logits, h, &[], NONE).unwrap().token
    }

    fn draws(p: &SamplingParams, seed: u64, x: &[f32], sup: &[u32], n: usize) -> Vec<u32> {
        let (mut s, h) = (Sampler::new(p.clone(), seed), TokenHistory::default());
        let mut next = || s.sample(x, &h, sup, NONE).unwrap().token;
        (0..n).map(|_| next()).collect()
    }

    /// How often each id came up in `n` draws.
    fn counts(p: &SamplingParams, seed: u64, x: &[f32], sup: &[u32], n: usize) -> Vec<usize> {
        let mut c = vec![0; x.len()];
        for t in draws(p, seed, x, sup, n) {
            c[t as usize] += 1;
        }
        c
    }

    fn history(prompt: &[u32], output: &[u32]) -> TokenHistory {
        let mut h = TokenHistory::new(prompt);
        output.iter().for_each(|&t| h.push_output(t));
        h
    }

    #[test]
    fn greedy_is_argmax_with_first_index_ties_and_uses_no_randomness() {
        let (g, h) = (SamplingParams::greedy(), TokenHistory::default());
        assert_eq!(gpick(&g, &[1.0, 3.0, 2.0, 3.0], &h), 1);
        assert_eq!(gpick(&g, &[f32::NEG_INFINITY, -5.0, -5.0], &h), 1);
        // top_k == 1 is greedy too, whatever the temperature.
        let k1 = with(|p| (p.top_k, p.temperature) = (1, 5.0));
        assert!(k1.is_greedy() && !k1.needs_logits() && !g.needs_logits());
        let mut s = Sampler::new(k1, 9);
        assert_eq!(s.sample(&[0.0, 2.0, 2.0], &h, &[], NONE).unwrap().token, 1);
        assert_eq!(s.draws, 0);
    }

    #[test]
    fn penalties_and_bias_follow_the_formulas_exactly() {
        let h = history(&[0, 1], &[2, 2, 3]);
        assert_eq!(h.output_len(), 3);
        let p = with(|p| {
            (p.presence_penalty, p.frequency_penalty) = (0.5, 0.25);
            p.repetition_penalty = 2.0;
            p.logit_bias = [(0, 1.0), (4, 1.5)].into();
        });
        // id0: (2+1)/2; id1: -1*2; id2: 0.5/2 - 0.25*2 - 0.5; id3: 3/2 - 0.25 - 0.5;
        // id4: -2+1.5 (unseen); id5 suppressed. Every value is exact in f32.
        let got = process(&[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], &p, &h, &[5], None);
        assert_eq!(got, [1.5, -2.0, -0.75, 0.75, -0.5, f32::NEG_INFINITY]);
    }

    #[test]
    fn each_penalty_flips_a_greedy_pick() {
        let (prompt0, out0, out000) = (
            history(&[0], &[]),
            history(&[], &[0]),
            history(&[], &[0; 3]),
        );
        let presence = with(|p| p.presence_penalty = 0.2);
        assert_eq!(gpick(&presence, &[1.0, 0.9], &out0), 1); // 0.8 < 0.9
        assert_eq!(gpick(&presence, &[1.0, 0.9], &prompt0), 0); // the prompt does not count
        let freq = with(|p| p.frequency_penalty = 0.05);
        assert_eq!(gpick(&freq, &[1.0, 0.9], &out0), 0); // 0.95 > 0.9
        assert_eq!(gpick(&freq, &[1.0, 0.9], &out000), 1); // 0.85 < 0.9
        assert_eq!(gpick(&freq, &[1.0, 0.9], &prompt0), 0);
        // Repetition divides positive logits and multiplies the rest, prompt or output.
        let rep = with(|p| p.repetition_penalty = 1.5);
        assert_eq!(gpick(&rep, &[2.0, 1.5], &prompt0), 1); // 1.33 < 1.5
        assert_eq!(gpick(&rep, &[-1.0, -1.2], &prompt0), 1); // -1.5 < -1.2
        assert_eq!(gpick(&rep, &[-1.0, -1.2], &out0), 1);
        let greedy = |p: &SamplingParams| SamplingParams {
            temperature: 0.0,
            ..p.clone()
        };
        assert!(
            [presence, freq, rep]
                .iter()
                .all(|p| greedy(p).needs_logits())
        );
    }

    #[test]
    fn logit_bias_can_force_or_forbid_a_token() {
        let logits = [5.0, 0.0, 0.0, 0.0];
        // The others keep probability ~e^-95 each.
        let force = with(|p| p.logit_bias = [(2, 100.0)].into());
        assert!(draws(&force, 1, &logits, &[], 200).iter().all(|&t| t == 2));
        assert!(
            SamplingParams {
                temperature: 0.0,
                ..force
            }
            .needs_logits()
        );
        let forbid = with(|p| p.logit_bias = [(0, -100.0)].into());
        assert_eq!(gpick(&forbid, &logits, &TokenHistory::default()), 1);
    }

    #[test]
    fn suppress_forbids_a_token_even_when_it_is_the_max() {
        let (logits, h) = ([0.0, 10.0, 0.0], TokenHistory::default());
        let mut g = Sampler::new(SamplingParams::greedy(), 0);
        assert_eq!(g.sample(&logits, &h, &[1], NONE).unwrap().token, 0);
        let c = counts(&SamplingParams::default(), 3, &logits, &[1], 300);
        assert!(c[1] == 0 && c[0] > 0 && c[2] > 0, "{c:?}");
        // Out-of-range ids are ignored; suppressing everything is an error, not a panic.
        assert_eq!(g.sample(&logits, &h, &[7], NONE).unwrap().token, 1);
        for p in [SamplingParams::greedy(), SamplingParams::default()] {
            let got = Sampler::new(p, 0).sample(&logits, &h, &[0, 1, 2], NONE);
            assert_eq!(got, Err(SampleError::NoCandidates));
        }
    }

    #[test]
    fn top_k_top_p_and_min_p_keep_what_they_should() {
        let logits = [1.0, 3.0, 2.0, f32::NEG_INFINITY, 2.9];
        let k2 = with(|p| p.top_k = 2);
        let c = counts(&k2, 7, &logits, &[], 500);
        assert!(c[1] > 0 && c[4] > 0 && c[1] + c[4] == 500, "{c:?}");
        // A three-way tie for the best: top_k 2 keeps the lower ids 1 and 2.
        let c = counts(&k2, 8, &[1.0, 3.0, 3.0, 3.0], &[], 500);
        assert!(c[1] > 0 && c[2] > 0 && c[1] + c[2] == 500, "{c:?}");
        let tiny = with(|p| p.top_p = 0.01);
        assert!(draws(&tiny, 3, &logits, &[], 100).iter().all(|&t| t == 1));
        // Probabilities 0.5, 0.3, 0.2: the smallest prefix reaching 0.75 is {0, 1}.
        let lg = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let c = counts(&with(|p| p.top_p = 0.75), 4, &lg, &[], 500);
        assert!(c[0] > 0 && c[1] > 0 && c[2] == 0, "{c:?}");
        // Probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.2 puts the floor at 0.1, dropping id 3,
        // which does come up (~100 expected) with the same seed and no min_p.
        let lg = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        let c = counts(&with(|p| p.min_p = 0.2), 5, &lg, &[], 2000);
        assert!(c[0] > 0 && c[1] > 0 && c[2] > 0 && c[3] == 0, "{c:?}");
        assert!(counts(&SamplingParams::default(), 5, &lg, &[], 2000)[3] > 0);
    }

    #[test]
    fn seeds_decide_the_sequence_with_one_draw_per_call() {
        let (flat, p) = ([0.0; 8], SamplingParams::default());
        assert_eq!(draws(&p, 42, &flat, &[], 50), draws(&p, 42, &flat, &[], 50));
        // Two seeds agreeing on 50 uniform draws over 8 tokens has probability 8^-50.
        assert_ne!(draws(&p, 42, &flat, &[], 50), draws(&p, 43, &flat, &[], 50));
        // A call with a single candidate left still consumes exactly one draw.
        let h = TokenHistory::default();
        let (mut a, mut b) = (Sampler::new(p.clone(), 11), Sampler::new(p, 11));
        let one = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
        assert_eq!(a.sample(&one, &h, &[], NONE).unwrap().token, 1);
        b.sample(&flat, &h, &[], NONE).unwrap();
        let next = |s: &mut Sampler| s.sample(&flat, &h, &[], NONE).unwrap().token;
        assert!((0..20).all(|_| next(&mut a) == next(&mut b)));
    }

    #[test]
    fn empirical_frequencies_match_softmax() {
        // Each count is Binomial(n, p_i). The seed is fixed, so this is deterministic; a 4σ band
        // would fail for a given token with probability ~6e-5 under another seed.
        let (logits, n) = ([0.0f32, 1.0, 2.0, 0.5, -1.0], 20_000);
        for (t, seed) in [(1.0f32, 1u64), (0.5, 2)] {
            let e: Vec<f64> = logits.iter().map(|&x| (f64::from(x / t)).exp()).collect();
            let z: f64 = e.iter().sum();
            let c = counts(&with(|p| p.temperature = t), seed, &logits, &[], n);
            for (i, p) in e.iter().map(|e| e / z).enumerate() {
                let (mean, sigma) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
                let msg = format!("t={t} id={i} n={} mean={mean:.1} sigma={sigma:.1}", c[i]);
                assert!((c[i] as f64 - mean).abs() <= 4.0 * sigma, "{msg}");
            }
        }
    }

    #[test]
    fn raw_logprobs_match_an_independent_log_softmax() {
        let logits = [1.5f32, -0.25, 3.0, f32::NEG_INFINITY, 3.0, 0.0, 2.0, -7.0];
        let finite = logits.iter().filter(|v| v.is_finite());
        let z = finite.map(|&v| f64::from(v).exp()).sum::<f64>().ln();
        for (i, &x) in logits.iter().enumerate() {
            let TokenLogprobs {
                logprob: lp, top, ..
            } = raw_logprobs(&logits, i as u32, 0);
            let want = if x.is_finite() {
                f64::from(x) - z
            } else {
                f64::NEG_INFINITY
            };
            assert!(top.is_empty() && (lp == f32::NEG_INFINITY) == x.is_infinite());
            assert!(
                x.is_infinite() || (f64::from(lp) - want).abs() < 1e-5,
                "{i}: {lp}"
            );
        }
        let TokenLogprobs {
            logprob: _, top, ..
        } = raw_logprobs(&logits, 0, 4);
        let ids: Vec<u32> = top.iter().map(|t| t.token).collect();
        assert_eq!(ids, [2, 4, 6, 0]); // the tie at 3.0 lists the lower id first
        assert!(top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert!((f64::from(top[3].logprob) - (1.5 - z)).abs() < 1e-5);
        // top_n past the vocabulary is clamped; an id outside it gets -inf.
        let TokenLogprobs {
            logprob: lp, top, ..
        } = raw_logprobs(&logits, 99, 100);
        assert_eq!((lp, top.len()), (f32::NEG_INFINITY, logits.len()));
        // Max-subtraction keeps huge logits exact.
        let lp = raw_logprobs(&[1000.0, 1000.0], 0, 0).logprob;
        assert!((lp + std::f32::consts::LN_2).abs() < 1e-6);
    }

    #[test]
    fn sampled_logprobs_are_raw_and_only_when_requested() {
        let (logits, h) = ([0.0f32, 1.0, 2.0], TokenHistory::default());
        let mut s = Sampler::new(with(|p| p.logit_bias = [(0, 100.0)].into()), 0);
        let want = LogprobRequest {
            logprobs: true,
            top_logprobs: 2,
        };
        let TokenLogprobs {
            logprob: lp,
            rank,
            top,
            ..
        } = raw_logprobs(&logits, 0, 2);
        assert_eq!(rank, 3, "token 0 is the least likely of three");
        let expect = Sampled {
            token: 0,
            logprob: Some(lp),
            rank: Some(rank),
            top,
        };
        assert_eq!(s.sample(&logits, &h, &[], want), Ok(expect));
        let only_top = LogprobRequest {
            logprobs: false,
            top_logprobs: 1,
        };
        let got = s.sample(&logits, &h, &[], only_top).unwrap();
        assert_eq!((got.logprob, got.top.len(), got.top[0].token), (None, 1, 2));
        let none = s.sample(&logits, &h, &[], NONE).unwrap();
        assert_eq!((none.logprob, none.top.len()), (None, 0));
    }

    #[test]
    fn validate_names_each_bad_field() {
        assert_eq!(SamplingParams::default().validate(10), Ok(()));
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let cases = [
            (Field::Temperature, with(|p| p.temperature = -0.1)),
            (Field::Temperature, with(|p| p.temperature = nan)),
            (Field::Temperature, with(|p| p.temperature = inf)),
            (Field::TopP, with(|p| p.top_p = 0.0)),
            (Field::TopP, with(|p| p.top_p = 1.01)),
            (Field::MinP, with(|p| p.min_p = -0.1)),
            (Field::MinP, with(|p| p.min_p = 1.5)),
            (
                Field::RepetitionPenalty,
                with(|p| p.repetition_penalty = 0.0),
            ),
            (
                Field::RepetitionPenalty,
                with(|p| p.repetition_penalty = inf),
            ),
            (Field::PresencePenalty, with(|p| p.presence_penalty = 2.5)),
            (Field::PresencePenalty, with(|p| p.presence_penalty = nan)),
            (
                Field::FrequencyPenalty,
                with(|p| p.frequency_penalty = -2.5),
            ),
            (
                Field::LogitBias,
                with(|p| p.logit_bias = [(10, 1.0)].into()),
            ),
            (
                Field::LogitBias,
                with(|p| p.logit_bias = [(1, 101.0)].into()),
            ),
            (Field::LogitBias, with(|p| p.logit_bias = [(1, nan)].into())),
        ];
        for (field, p) in cases {
            let e = p.validate(10).unwrap_err();
            assert_eq!(e.field, field, "{p:?}");
            assert!(e.to_string().starts_with(&format!("{field}: ")), "{e}");
        }
        let edge = with(|p| {
            (p.temperature, p.top_p, p.min_p) = (0.0, 1.0, 1.0);
            (p.presence_penalty, p.frequency_penalty) = (-2.0, 2.0);
            p.logit_bias = [(9, -100.0)].into();
        });
        assert_eq!(edge.validate(10), Ok(()));
    }

    #[test]
    fn degenerate_rows_error_and_nan_counts_as_minus_infinity() {
        let (h, ninf) = (TokenHistory::default(), f32::NEG_INFINITY);
        for p in [SamplingParams::greedy(), SamplingParams::default()] {
            let mut s = Sampler::new(p, 0);
            assert_eq!(s.sample(&[], &h, &[], NONE), Err(SampleError::EmptyLogits));
            let dead = s.sample(&[ninf, f32::NAN, ninf], &h, &[], NONE);
            assert_eq!(dead, Err(SampleError::NoCandidates));
        }
        assert_eq!(raw_logprobs(&[f32::NAN, ninf], 0, 1).logprob, ninf);
        let logits = [f32::NAN, 1.0, f32::NAN, 0.5];
        assert_eq!(gpick(&SamplingParams::default(), &logits, &h), 1);
        let c = counts(&SamplingParams::default(), 6, &logits, &[], 300);
        assert!(c[0] == 0 && c[2] == 0 && c[1] > 0 && c[3] > 0, "{c:?}");
        assert_eq!(raw_logprobs(&logits, 0, 0).logprob, ninf);
        let total: f32 = [1, 3]
            .map(|i| raw_logprobs(&logits, i, 0).logprob.exp())
            .iter()
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn infinite_logits_share_the_mass_instead_of_poisoning_it() {
        let inf = [f32::INFINITY, 0.0, f32::INFINITY];
        let c = counts(&with(|p| p.temperature = 0.3), 7, &inf, &[], 300);
        assert!(c[0] > 0 && c[2] > 0 && c[1] == 0, "{c:?}");
        assert!((raw_logprobs(&inf, 2, 0).logprob + std::f32::consts::LN_2).abs() < 1e-6);
        // A penalty below 1 pushes f32::MAX to +inf; that still samples.
        let mut s = Sampler::new(with(|p| p.repetition_penalty = 0.5), 0);
        let got = s.sample(&[f32::MAX, 0.0], &history(&[0], &[]), &[], NONE);
        assert_eq!(got.map(|s| s.token), Ok(0));
    }

    #[test]
    fn full_vocab_top_k_and_top_logprobs_agree_with_a_full_sort() {
        let mut rng = StdRng::seed_from_u64(5);
        let logits: Vec<f32> = (0..49_152).map(|_| rng.random_range(-10.0..10.0)).collect();
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| by_logit_desc(&(a, logits[a as usize]), &(b, logits[b as usize])));
        let p = with(|p| (p.top_k, p.top_p, p.temperature) = (40, 0.9, 0.7));
        let picks = draws(&p, 1, &logits, &[], 50);
        assert!(picks.iter().all(|t| order[..40].contains(t)));
        let TokenLogprobs {
            logprob: lp, top, ..
        } = raw_logprobs(&logits, order[0], 5);
        assert_eq!(top.iter().map(|t| t.token).collect::<Vec<_>>(), order[..5]);
        assert_eq!(top[0].logprob, lp);
    }

    fn arb_params() -> impl Strategy<Value = SamplingParams> {
        let temperature = prop_oneof![Just(0.0f32), 0.05f32..3.0];
        let (top_k, top_p, min_p, rep) = (0usize..6, 0.05f32..=1.0, 0.0f32..0.5, 0.5f32..2.0);
        let sampling = (temperature, top_k, top_p, min_p);
        let penalties = (rep, -2.0f32..2.0, -2.0f32..2.0);
        (sampling, penalties).prop_map(|(s, pen)| {
            with(|p| {
                (p.temperature, p.top_k, p.top_p, p.min_p) = s;
                (
                    p.repetition_penalty,
                    p.presence_penalty,
                    p.frequency_penalty,
                ) = pen;
            })
        })
    }

    proptest! {
        #[test]
        fn sampled_token_is_never_suppressed_and_within_top_k(
            (logits, prompt, output, suppress) in (1u32..40).prop_flat_map(|v| {
                let logit = prop_oneof![
                    8 => -20.0f32..20.0,
                    1 => Just(f32::NEG_INFINITY),
                    1 => Just(f32::NAN),
                ];
                let ids = |n| proptest::collection::vec(0..v, 0..n);
                (proptest::collection::vec(logit, v as usize), ids(8), ids(8), ids(4))
            }),
            p in arb_params(),
            seed in any::<u64>(),
        ) {
            let h = history(&prompt, &output);
            let processed = process(&logits, &p, &h, &suppress, None);
            match Sampler::new(p.clone(), seed).sample(&logits, &h, &suppress, NONE) {
                Ok(got) => {
                    prop_assert!(!suppress.contains(&got.token));
                    let x = processed[got.token as usize];
                    prop_assert!(x.is_finite());
                    let better = processed.iter().filter(|&&v| v > x).count();
                    prop_assert!(p.top_k == 0 || better < p.top_k, "{better} beat the pick");
                }
                Err(e) => {
                    prop_assert_eq!(e, SampleError::NoCandidates);
                    prop_assert!(processed.iter().all(|v| *v == f32::NEG_INFINITY));
                }
            }
        }

        /// Under a mask, every pick is an allowed id (bias and penalties cannot bring a
        /// masked id back), greedy picks the best allowed one, and an empty mask is
        /// `NoCandidates`.
        #[test]
        fn masked_picks_are_allowed_ids(
            (logits, mask) in (1usize..80).prop_flat_map(|v| (
                proptest::collection::vec(-20.0f32..20.0, v),
                proptest::collection::vec(any::<u32>(), v.div_ceil(32)),
            )),
            p in arb_params(),
            seed in any::<u64>(),
        ) {
            let allowed = |id: usize| mask[id / 32] >> (id % 32) & 1 == 1;
            let h = history(&[0], &[1]);
            let got = Sampler::new(p.clone(), seed).sample_masked(&logits, &h, &[], Some(&mask), NONE);
            match got {
                Ok(s) => {
                    prop_assert!(allowed(s.token as usize));
                    if p.is_greedy() {
                        let unmasked = process(&logits, &p, &h, &[], None);
                        let best = (0..logits.len()).filter(|&i| allowed(i))
                            .map(|i| unmasked[i]).fold(f32::NEG_INFINITY, f32::max);
                        prop_assert_eq!(unmasked[s.token as usize], best);
                    }
                }
                Err(e) => {
                    prop_assert_eq!(e, SampleError::NoCandidates);
                    prop_assert!((0..logits.len()).all(|i| !allowed(i)));
                }
            }
        }
    }
}
