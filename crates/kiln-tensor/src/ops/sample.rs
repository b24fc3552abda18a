//! Token sampling from logits rows: [`Recorder::sample`] picks one token per row on the
//! device (reading back an id, not a vocabulary-wide row), and [`pick`] is its CPU reference,
//! which is also what the engine's host sampler runs, so both follow one definition.
//!
//! A row is processed in this order: NaN → -inf and +inf → `f32::MAX`; the allowed-token
//! mask; each [`LogitEdit`] (suppression, bias, repetition penalty, presence/frequency
//! penalties, merged per id by the caller); NaN/inf normalised again. Then greedy is the first
//! index of the largest value; otherwise temperature, top-k (ties by lower id), top-p (the
//! shortest prefix, best first, whose mass reaches `top_p` of the kept mass), min-p (weight
//! relative to the best below `min_p` drops out), and one Gumbel-max draw: the candidate
//! maximising `(v − max) / T + G`, with standard Gumbel noise `G` hashed from
//! (seed, draw index, token id). The pick of draw `n` is thus a function of the seed, `n` and
//! the row alone, which is what lets speculative decoding verify drafts against it.
//!
//! The device computes in f32 (and draws `G` from 23 bits of the hash), the reference in f64
//! (53 bits): they pick the same token unless two candidates' keys, or a top-p / min-p
//! boundary, lie within f32 rounding of each other.

use bytemuck::{Pod, Zeroable};

use super::{require_dtype, subgroup_defines};
use crate::gpu::{Access, KernelDef};
use crate::{DType, Recorder, Result, Tensor, TensorError};

const SRC: &str = concat!(
    include_str!("../../wgsl/reduce.wgsl"),
    include_str!("../../wgsl/sample.wgsl")
);
static SAMPLE: KernelDef = KernelDef {
    name: "sample",
    source: SRC,
    bindings: &[
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::ReadWrite,
    ],
};

/// What [`Recorder::sample`] returns for a row with no possible token (every logit -inf
/// after the mask and the edits).
pub const NO_TOKEN: u32 = u32::MAX;

/// One logit's edit before sampling: `v → rep(v + add) − sub`, where `rep` divides a positive
/// value by `rep` and multiplies any other by it (HF's repetition penalty; 1 leaves it).
/// `add = -inf` suppresses the token. Edits of one row name distinct ids.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitEdit {
    pub id: u32,
    pub add: f32,
    pub rep: f32,
    pub sub: f32,
}

impl LogitEdit {
    /// An edit that changes nothing (to merge others into).
    pub fn none(id: u32) -> Self {
        Self {
            id,
            add: 0.0,
            rep: 1.0,
            sub: 0.0,
        }
    }

    fn apply(&self, v: f32) -> f32 {
        if self.add == f32::NEG_INFINITY || v == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        let mut v = v + self.add;
        if self.rep != 1.0 {
            v = if v > 0.0 { v / self.rep } else { v * self.rep };
        }
        v - self.sub
    }
}

/// How one row is sampled: the knobs of the draw (`temperature` 0 or `top_k` 1 is greedy;
/// `top_k` 0, `top_p` 1 and `min_p` 0 are off), the draw's identity, the row's edits and its
/// allowed-token mask (bit `id % 32` of word `id / 32`; ids past its end are not allowed).
#[derive(Debug, Clone, PartialEq)]
pub struct RowSampling {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    pub draw: u64,
    pub edits: Vec<LogitEdit>,
    pub allowed: Option<Vec<u32>>,
}

impl RowSampling {
    /// A greedy row with nothing edited.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            draw: 0,
            edits: Vec::new(),
            allowed: None,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Rejects what no row may ask (the engine validates requests earlier, naming fields).
    fn check(&self, vocab: usize) -> std::result::Result<(), SamplingError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(SamplingError::Temperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        let mut ids: Vec<u32> = self.edits.iter().map(|e| e.id).collect();
        ids.sort_unstable();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(SamplingError::EditOutsideVocab { id, vocab });
        }
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(SamplingError::TwoEdits(w[0]));
        }
        if let Some(e) = self
            .edits
            .iter()
            .find(|e| !(e.rep.is_finite() && e.rep > 0.0))
        {
            return Err(SamplingError::Repetition(e.rep));
        }
        Ok(())
    }
}

/// What a row's [`RowSampling`] asks that no row may.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be finite and >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("edit of token {id} outside the vocabulary of {vocab}")]
    EditOutsideVocab { id: u32, vocab: usize },
    #[error("two edits of token {0}")]
    TwoEdits(u32),
    #[error("repetition factor must be finite and > 0, got {0}")]
    Repetition(f32),
}

/// Parameters of `sample.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n: u32,
    vocab: u32,
    /// Bits that hold any token id (the id searches' length).
    id_bits: u32,
    _pad: u32,
}

/// Invocations per row: enough that a GPU streams a 50–250k vocabulary in few iterations.
const SAMPLE_WG: u32 = 256;

/// Words of one row's header in the info buffer.
const HEADER_WORDS: usize = 12;

impl Recorder {
    /// One token per entry of `rows` (`(logits row, how)`), as U32 `[rows.len()]`
    /// ([`NO_TOKEN`] where nothing is possible). `logits` is F32 `[.., vocab]`.
    pub fn sample(&mut self, logits: &Tensor, rows: &[(usize, &RowSampling)]) -> Result<Tensor> {
        const OP: &str = "sample";
        require_dtype(OP, "the logits", logits, &[DType::F32])?;
        self.check_device(OP, &[logits])?;
        let (n_rows, vocab) = (logits.rows(), logits.cols());
        if rows.is_empty() || vocab == 0 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("{} rows of {vocab} logits to sample", rows.len()),
            });
        }
        for &(row, how) in rows {
            if row >= n_rows {
                return Err(TensorError::OutOfRange {
                    op: OP,
                    what: "logits row",
                    index: row,
                    limit: n_rows,
                });
            }
            how.check(vocab)
                .map_err(|source| TensorError::Sampling { row, source })?;
        }
        let Some(ctx) = self.gpu().cloned() else {
            let x = logits.host_f32()?;
            return Ok(Tensor::host_u32_with(&[rows.len()], |picks| {
                for (p, &(row, how)) in picks.iter_mut().zip(rows) {
                    let processed = process(&x[row * vocab..(row + 1) * vocab], how);
                    *p = pick(processed, how).unwrap_or(NO_TOKEN);
                }
            }));
        };
        let info = info_words(rows, vocab);
        let device = self.device().clone();
        let info = Tensor::from_u32(&device, &[info.len()], &info)?;
        let work = Tensor::gpu_output(&ctx, DType::F32, &[rows.len(), vocab], OP)?;
        let out = Tensor::gpu_output(&ctx, DType::U32, &[rows.len()], OP)?;
        let params = Params {
            n: rows.len() as u32,
            vocab: vocab as u32,
            id_bits: usize::BITS - (vocab - 1).leading_zeros(),
            _pad: 0,
        };
        let defines = subgroup_defines(self.device().info().subgroups, SAMPLE_WG);
        let bind = vec![(logits.clone(), 0), (info, 0), (work, 0), (out.clone(), 0)];
        self.dispatch(&SAMPLE, &defines, &params, bind, rows.len() as u32)?;
        Ok(out)
    }
}

/// The info buffer of `sample.wgsl`: a header of [`HEADER_WORDS`] per row (logits row,
/// temperature, top_k, top_p, min_p, seed lo/hi, draw lo/hi, first edit word, edits, first
/// mask word or `u32::MAX`), then every row's edits (id, add, rep, sub: 4 words each), then
/// every row's mask (`vocab / 32` words, shorter masks padded with zeros).
fn info_words(rows: &[(usize, &RowSampling)], vocab: usize) -> Vec<u32> {
    let mask_words = vocab.div_ceil(32);
    let edits: usize = rows.iter().map(|(_, h)| h.edits.len()).sum();
    let masks = rows.iter().filter(|(_, h)| h.allowed.is_some()).count();
    let mut w = vec![0u32; rows.len() * HEADER_WORDS];
    w.reserve(edits * 4 + masks * mask_words);
    for (i, &(row, h)) in rows.iter().enumerate() {
        let edit0 = w.len() as u32;
        for e in &h.edits {
            w.extend([e.id, e.add.to_bits(), e.rep.to_bits(), e.sub.to_bits()]);
        }
        let mask0 = match &h.allowed {
            Some(m) => {
                let at = w.len() as u32;
                w.extend(m.iter().take(mask_words));
                w.resize(at as usize + mask_words, 0);
                at
            }
            None => u32::MAX,
        };
        let head = [
            row as u32,
            h.temperature.to_bits(),
            h.top_k,
            h.top_p.to_bits(),
            h.min_p.to_bits(),
            h.seed as u32,
            (h.seed >> 32) as u32,
            h.draw as u32,
            (h.draw >> 32) as u32,
            edit0,
            h.edits.len() as u32,
            mask0,
        ];
        w[i * HEADER_WORDS..(i + 1) * HEADER_WORDS].copy_from_slice(&head);
    }
    w
}

/// NaN → -inf (never picked); +inf → `f32::MAX` (keeps max-subtraction free of inf − inf).
pub fn sanitize(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else if v == f32::INFINITY {
        f32::MAX
    } else {
        v
    }
}

/// Descending logit, ties by lower id: a total order, so partitions and sorts are deterministic.
pub fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The log-softmax of one raw logits row, in f64 (what every log-probability kiln reports
/// is: sampled tokens', prompt tokens', `kiln perplexity`'s). NaN counts as -inf, +inf as
/// `f32::MAX` ([`sanitize`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogSoftmax {
    /// The row's largest logit; -inf when none is finite.
    max: f64,
    /// `ln Σ exp(x − max)`.
    ln_sum: f64,
}

impl LogSoftmax {
    pub fn of(logits: &[f32]) -> Self {
        let max = logits
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(sanitize(v)));
        if max == f32::NEG_INFINITY {
            return Self {
                max: f64::NEG_INFINITY,
                ln_sum: 0.0,
            };
        }
        let m = f64::from(max);
        let sum: f64 = logits
            .iter()
            .map(|&v| (f64::from(sanitize(v)) - m).exp())
            .sum();
        Self {
            max: m,
            ln_sum: sum.ln(),
        }
    }

    /// The log-probability of a logit `v` of the row.
    pub fn at(&self, v: f32) -> f64 {
        let v = sanitize(v);
        if v == f32::NEG_INFINITY || self.max == f64::NEG_INFINITY {
            f64::NEG_INFINITY
        } else {
            // (v − max) first: near f32::MAX, max + ln_sum would round ln_sum away.
            (f64::from(v) - self.max) - self.ln_sum
        }
    }
}

/// One token's place in a logits row: its log-probability, its rank and the row's best.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRank {
    /// -inf for an id outside the row or a row with no finite logit.
    pub logprob: f64,
    /// 1 for the most likely token; ties go to the lower id, as in `top`. An id outside
    /// the row ranks after every token.
    pub rank: usize,
    /// The `top_n` most likely tokens and their log-probabilities, best first, ties by lower
    /// id: its first entry is the row's argmax.
    pub top: Vec<(u32, f64)>,
}

/// `token`'s log-probability and rank in `logits` (raw: no penalty, bias or temperature),
/// and the row's `top_n` best.
pub fn token_rank(logits: &[f32], token: u32, top_n: usize) -> TokenRank {
    let lsm = LogSoftmax::of(logits);
    let own = logits.get(token as usize).map(|&v| (token, sanitize(v)));
    let rank = match own {
        Some(t) => {
            1 + logits
                .iter()
                .enumerate()
                .filter(|&(i, &v)| by_logit_desc(&(i as u32, sanitize(v)), &t).is_lt())
                .count()
        }
        None => logits.len() + 1,
    };
    // One pass keeping the best `n` in order (n is small: a logprobs request's alternatives).
    let n = top_n.min(logits.len());
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &v) in logits.iter().enumerate() {
            let c = (i as u32, sanitize(v));
            if best.len() == n && best.last().is_some_and(|w| by_logit_desc(&c, w).is_ge()) {
                continue;
            }
            let at = best.partition_point(|b| by_logit_desc(b, &c).is_lt());
            best.insert(at, c);
            best.truncate(n);
        }
    }
    let top = best.into_iter().map(|(t, v)| (t, lsm.at(v))).collect();
    TokenRank {
        logprob: own.map_or(f64::NEG_INFINITY, |(_, v)| lsm.at(v)),
        rank,
        top,
    }
}

/// A row as sampling sees it: sanitized, masked, edited, sanitized again.
pub fn process(logits: &[f32], how: &RowSampling) -> Vec<f32> {
    let mut x: Vec<f32> = logits.iter().map(|&v| sanitize(v)).collect();
    if let Some(mask) = &how.allowed {
        for (i, v) in x.iter_mut().enumerate() {
            let word = mask.get(i / 32).copied().unwrap_or(0);
            if word >> (i % 32) & 1 == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    for e in &how.edits {
        if let Some(v) = x.get_mut(e.id as usize) {
            *v = sanitize(e.apply(*v));
        }
    }
    x
}

/// The token `how` picks from a [`process`]ed row, or `None` when every value is -inf: the
/// CPU reference of [`Recorder::sample`].
pub fn pick(processed: Vec<f32>, how: &RowSampling) -> Option<u32> {
    if how.is_greedy() {
        return argmax(&processed);
    }
    let w = candidates(processed, how)?;
    let mut best: Option<(u32, f64)> = None;
    for &(id, wi) in &w {
        if wi > 0.0 {
            let key = wi.ln() + gumbel(how.seed, how.draw, id);
            if best.is_none_or(|(_, b)| key > b) {
                best = Some((id, key));
            }
        }
    }
    best.map(|(id, _)| id)
}

/// First index of the largest value; `None` when every entry is -inf.
fn argmax(x: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v > f32::NEG_INFINITY && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// The distribution a draw picks from: candidate ids with unnormalised weights (zero for
/// what min-p dropped), after temperature, top-k, top-p and min-p.
fn candidates(processed: Vec<f32>, how: &RowSampling) -> Option<Vec<(u32, f64)>> {
    let mut cand: Vec<(u32, f32)> = processed
        .into_iter()
        .enumerate()
        .filter(|&(_, v)| v > f32::NEG_INFINITY)
        .map(|(i, v)| (i as u32, v))
        .collect();
    if cand.is_empty() {
        return None;
    }
    let top_k = how.top_k as usize;
    if top_k > 0 && top_k < cand.len() {
        // Partition instead of sorting the whole vocabulary; only the kept part is sorted.
        cand.select_nth_unstable_by(top_k - 1, by_logit_desc);
        cand.truncate(top_k);
        cand.sort_unstable_by(by_logit_desc);
    } else if top_k > 0 || how.top_p < 1.0 {
        cand.sort_unstable_by(by_logit_desc);
    }
    // Unnormalised weights relative to the best candidate, which therefore weighs exactly 1
    // and survives every filter below (top_p keeps >= 1 token, min_p <= 1).
    let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
    let (m, t) = (f64::from(max), f64::from(how.temperature));
    let mut w: Vec<f64> = cand
        .iter()
        .map(|c| ((f64::from(c.1) - m) / t).exp())
        .collect();
    if how.top_p < 1.0 {
        let target = f64::from(how.top_p) * w.iter().sum::<f64>();
        let mut mass = 0.0;
        let keep = w
            .iter()
            .position(|wi| {
                mass += wi;
                mass >= target
            })
            .map_or(w.len(), |n| n + 1);
        w.truncate(keep);
    }
    if how.min_p > 0.0 {
        let floor = f64::from(how.min_p);
        w.iter_mut()
            .filter(|wi| **wi < floor)
            .for_each(|wi| *wi = 0.0);
    }
    Some(cand.iter().zip(w).map(|(c, wi)| (c.0, wi)).collect())
}

/// splitmix64's finaliser: a well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Standard Gumbel noise for token `id` in draw `draw` of `seed`.
pub fn gumbel(seed: u64, draw: u64, id: u32) -> f64 {
    let bits = mix(seed ^ mix(draw ^ mix(u64::from(id))));
    // A uniform in (0, 1): 53 bits, centred in their cell, so never 0 or 1.
    let u = ((bits >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -(-u.ln()).ln()
}
