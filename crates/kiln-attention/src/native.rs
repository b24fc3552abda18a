//! Paged attention on the native CPU backend: keys and values read in place through the block
//! table (no gathered copy), a span of positions at a time for all the query heads sharing a
//! KV head, scores and softmax in f32, the spans combined as flash decoding does; a task a
//! (token, KV head), or a span when a batch has too few of those to share among the threads.
//! The plain reference (`reference.rs`, f64) is its oracle.

use kiln_tensor::CpuContext;
use rayon::prelude::*;

use crate::{AttnBatch, AttnConfig, KvCacheConfig};

/// Where positions `from..=to` of a sequence start in a pool (`table` its block table, `bs`
/// positions a block, `row` floats a position), pushed to `out`: one lookup a block, not a
/// division a position.
fn slots(table: &[u32], bs: usize, row: usize, from: usize, to: usize, out: &mut Vec<usize>) {
    out.clear();
    let (first, last) = (from / bs, to / bs);
    for (b, &id) in table[first..=last]
        .iter()
        .enumerate()
        .map(|(i, id)| (first + i, id))
    {
        let lo = if b == first { from % bs } else { 0 };
        let hi = if b == last { to % bs } else { bs - 1 };
        let base = id as usize * bs;
        out.extend((lo..=hi).map(|i| (base + i) * row));
    }
}

/// An element of a host K/V pool (f32, or f16), with the backend's vector helpers for it.
pub(crate) trait PoolElem: Copy + Send + Sync {
    /// `q` · each row of `pool` at `starts`, into `out`.
    fn dots(cpu: &CpuContext, q: &[f32], pool: &[Self], starts: &[usize], out: &mut [f32]);
    /// `o += w[p] · row p` for each row of `pool` at `starts`, in order.
    fn axpys(cpu: &CpuContext, w: &[f32], pool: &[Self], starts: &[usize], o: &mut [f32]);
}

impl PoolElem for f32 {
    fn dots(cpu: &CpuContext, q: &[f32], pool: &[f32], starts: &[usize], out: &mut [f32]) {
        cpu.dots(q, pool, starts, out)
    }
    fn axpys(cpu: &CpuContext, w: &[f32], pool: &[f32], starts: &[usize], o: &mut [f32]) {
        cpu.axpys(w, pool, starts, o)
    }
}

impl PoolElem for half::f16 {
    fn dots(cpu: &CpuContext, q: &[f32], pool: &[Self], starts: &[usize], out: &mut [f32]) {
        cpu.dots_f16(q, pool, starts, out)
    }
    fn axpys(cpu: &CpuContext, w: &[f32], pool: &[Self], starts: &[usize], o: &mut [f32]) {
        cpu.axpys_f16(w, pool, starts, o)
    }
}

/// Positions a span. A (query token, KV head) reads its keys a span at a time: each span's
/// scores, softmax terms and weighted values are kept apart (their max, sum and output) and
/// the spans are then combined in order. Spans start at multiples of `SPAN` positions, so a
/// token's result depends on its position and window only, never on its batch or on how
/// the spans were shared among threads.
const SPAN: usize = 64;

/// Floats a head's partial result over one span: its max score, its sum of terms, then its
/// `head_dim` outputs.
fn partial_len(d: usize) -> usize {
    d + 2
}

/// A span of one (token, KV head): the token, the KV head, and the positions `lo..=hi`.
#[derive(Clone, Copy)]
struct Span {
    token: usize,
    kv_head: usize,
    lo: usize,
    hi: usize,
}

/// The spans of token `t` for KV head `g`, in order, pushed to `out`.
fn spans_of(batch: &AttnBatch, attn: &AttnConfig, t: usize, g: usize, out: &mut Vec<Span>) {
    let pos = batch.info[2 * t + 1] as usize;
    let first = attn.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    for c in first / SPAN..=pos / SPAN {
        out.push(Span {
            token: t,
            kv_head: g,
            lo: first.max(c * SPAN),
            hi: pos.min(c * SPAN + SPAN - 1),
        });
    }
}

/// What a task reuses: a span's scores and its slots.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    at: Vec<usize>,
}

/// A call of paged attention, but for the layer's pools: the queries, the step's block
/// tables and positions, the cache's shape and the attention's.
pub(crate) struct Attend<'a> {
    pub cpu: &'a CpuContext,
    pub q: &'a [f32],
    pub batch: &'a AttnBatch,
    pub cfg: &'a KvCacheConfig,
    pub attn: &'a AttnConfig,
}

impl Attend<'_> {
    /// The partials of every head sharing `span`'s KV head (`group` of them), into `out`
    /// (`group` partials): each key and value row is read from memory once for all of them.
    fn span_partials<E: PoolElem>(
        &self,
        [kp, vp]: [&[E]; 2],
        span: Span,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        let (cpu, batch, cfg, attn) = (self.cpu, self.batch, self.cfg, self.attn);
        let (bs, kvh, d, heads) = (cfg.block_size, cfg.kv_heads, cfg.head_dim, attn.heads);
        let group = heads / kvh;
        let table = &batch.tables[batch.info[2 * span.token] as usize..];
        let Scratch { scores, at } = scratch;
        slots(table, bs, kvh * d, span.lo, span.hi, at);
        // Where this KV head's row starts in each position's slot.
        at.iter_mut().for_each(|a| *a += span.kv_head * d);
        scores.resize(at.len(), 0.0);
        let q0 = (span.token * heads + span.kv_head * group) * d;
        for (qrow, p) in self.q[q0..q0 + group * d]
            .chunks_exact(d)
            .zip(out.chunks_exact_mut(partial_len(d)))
        {
            E::dots(cpu, qrow, kp, at, scores);
            let mut max = f32::NEG_INFINITY;
            for v in scores.iter_mut() {
                *v *= attn.scale;
                max = max.max(*v);
            }
            let sum = cpu.exps(scores, max);
            let (head, o) = p.split_at_mut(2);
            head.copy_from_slice(&[max, sum]);
            o.fill(0.0);
            E::axpys(cpu, scores, vp, at, o);
        }
    }
}

/// Out (`group` heads of `d`) from each head's partials over its spans (`spans` of them, each
/// `group` partials), combined in span order: every span's terms and outputs rescaled to the
/// largest max, the outputs' sum divided by the terms' sum.
fn combine(partials: &[f32], group: usize, d: usize, out: &mut [f32]) {
    let stride = group * partial_len(d);
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        let at = h * partial_len(d);
        let max = partials
            .chunks_exact(stride)
            .fold(f32::NEG_INFINITY, |m, c| m.max(c[at]));
        o.fill(0.0);
        let mut sum = 0f32;
        for c in partials.chunks_exact(stride) {
            let p = &c[at..at + partial_len(d)];
            let f = (p[0] - max).exp();
            sum += f * p[1];
            o.iter_mut().zip(&p[2..]).for_each(|(o, v)| *o += f * v);
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

impl Attend<'_> {
    /// `reference::paged_attention_host`'s result over pools `kp` and `vp`, computed on the
    /// native backend's threads.
    pub(crate) fn attention<E: PoolElem>(&self, kp: &[E], vp: &[E]) -> Vec<f32> {
        let (cpu, q, batch, attn) = (self.cpu, self.q, self.batch, self.attn);
        let (kvh, d, heads) = (self.cfg.kv_heads, self.cfg.head_dim, attn.heads);
        let group = heads / kvh;
        let per_span = group * partial_len(d);
        let mut out = vec![0f32; q.len()];
        let tokens = q.len() / (heads * d);
        let partials =
            |span: Span, s: &mut Scratch, p: &mut [f32]| self.span_partials([kp, vp], span, s, p);
        if tokens * kvh >= 4 * cpu.threads() {
            // Enough (token, KV head) pairs to share: a task a pair, its spans in turn.
            cpu.install(|| {
                out.par_chunks_mut(group * d).enumerate().for_each_init(
                    <(Scratch, Vec<Span>, Vec<f32>)>::default,
                    |(s, spans, ps), (idx, o)| {
                        spans.clear();
                        spans_of(batch, attn, idx / kvh, idx % kvh, spans);
                        ps.resize(spans.len() * per_span, 0.0);
                        for (&span, p) in spans.iter().zip(ps.chunks_exact_mut(per_span)) {
                            partials(span, s, p);
                        }
                        combine(ps, group, d, o);
                    },
                );
            });
            return out;
        }
        // Few pairs (a decode step): a task a span, so that every thread has work; then each
        // pair's spans combined.
        let mut spans = Vec::new();
        let mut ends = Vec::with_capacity(tokens * kvh);
        for t in 0..tokens {
            for g in 0..kvh {
                spans_of(batch, attn, t, g, &mut spans);
                ends.push(spans.len());
            }
        }
        let mut ps = vec![0f32; spans.len() * per_span];
        cpu.install(|| {
            ps.par_chunks_mut(per_span)
                .zip(&spans)
                .for_each_init(Scratch::default, |s, (p, &span)| partials(span, s, p));
        });
        let mut from = 0;
        for (o, &to) in out.chunks_exact_mut(group * d).zip(&ends) {
            combine(&ps[from * per_span..to * per_span], group, d, o);
            from = to;
        }
        out
    }
}
