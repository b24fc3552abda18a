//! Paged attention on the native CPU backend: keys and values found through the block table
//! (no gathered copy of the context), a span of positions at a time for all the query heads
//! sharing a KV head, scores and softmax in f32, the spans combined as flash decoding does; a
//! task a (token, KV head), or a span when a batch has too few of those to share among the
//! threads.
//! Each pool format is read in its own bytes ([`KvRows`]): f32 and f16 rows in place, INT8
//! and INT4 rows widened to f32 a span at a time for the heads sharing them (INT4 in its
//! rotated basis, its key centres added back to the scores). The plain reference
//! (`reference.rs`, f64) is its oracle.

use std::cell::Cell;

use kiln_tensor::{CpuContext, Keep};
use rayon::prelude::*;

use crate::stored::{CENTRED_PAIRS, CentreTurns, KeyCentre, hadamard};
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

/// A K or V pool as native attention reads it, a span of rows at a time: `at` holds where
/// each of the span's rows starts (in elements: slot · kv_heads · head_dim, plus the KV
/// head's offset). [`KvRows::load`] runs once a span, before the query heads sharing its KV
/// head take their scores and values.
pub(crate) trait KvRows: Sync {
    /// The rows are in the rotated basis (INT4): queries are rotated to meet the keys, and
    /// outputs summed from the values rotated back, once a call.
    const ROTATED: bool = false;
    /// Positions a span over rows of `d` elements.
    fn span(_d: usize) -> usize {
        SPAN
    }
    /// What the span's rows need beside the pool (the rows widened, the keys' centres' turns),
    /// into `buf`.
    fn load(&self, _cpu: &CpuContext, _span: &Span, _at: &[usize], _buf: &mut SpanBuf) {}
    /// A query head · each key row, into `out`: `q` is the head in the model's basis, then
    /// as the rows are (rotated for rotated rows).
    fn dots(
        &self,
        cpu: &CpuContext,
        q: [&[f32]; 2],
        at: &[usize],
        buf: &mut SpanBuf,
        out: &mut [f32],
    );
    /// `o = Σ w[p] · value row p`, the rows in order (as they are: rotated rows give a
    /// rotated `o`), into a zeroed `o` (`w` may be used up).
    fn axpys(
        &self,
        cpu: &CpuContext,
        w: &mut [f32],
        at: &[usize],
        buf: &mut SpanBuf,
        o: &mut [f32],
    );
}

/// What [`KvRows::load`] keeps of a span for its heads.
#[derive(Default)]
pub(crate) struct SpanBuf {
    /// The rows widened to f32, one after another (INT8; INT4, in the rotated basis).
    rows: Vec<f32>,
    /// Where each widened row starts.
    starts: Vec<usize>,
    /// Per row, the (cos, sin) of each of the KV head's key centres (INT4 keys).
    turns: Vec<[f32; 2]>,
    /// The KV head's centres that move a key (whose turns `turns` holds, in order).
    centres: Vec<KeyCentre>,
    /// Their indices among all layers' centres.
    live: Vec<usize>,
    /// A query head's terms of each of them: what multiplies a key's cos, and its sin.
    terms: Vec<[f32; 2]>,
}

/// An element of a pool read as it is (f32, or f16), with the backend's vector helpers for it.
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

impl<E: PoolElem> KvRows for [E] {
    fn dots(
        &self,
        cpu: &CpuContext,
        [q, _]: [&[f32]; 2],
        at: &[usize],
        _: &mut SpanBuf,
        out: &mut [f32],
    ) {
        E::dots(cpu, q, self, at, out)
    }
    fn axpys(&self, cpu: &CpuContext, w: &mut [f32], at: &[usize], _: &mut SpanBuf, o: &mut [f32]) {
        E::axpys(cpu, w, self, at, o)
    }
}

/// A quantized pool's rows: each row's `d` elements stored as `Q`s, and its parameters. Read
/// by widening a span's rows to f32 once for all the query heads that share them, then taking
/// the f32 pools' dot products and sums over those.
pub(crate) struct QuantRows<'a, Q: Stored> {
    pub q: &'a [Q],
    pub params: &'a [Q::Params],
    pub d: usize,
}

/// An INT8 pool: each row's values and scale, widened to the values the format stands for
/// (value · scale).
pub(crate) type I8Rows<'a> = QuantRows<'a, i8>;

/// An INT4 pool: each row's levels in the rotated basis (two a byte) and its scale and zero
/// point, widened to the rotated values. Queries meet the keys rotated (q·k = Hq·Hk), and
/// values are summed rotated (Σ p·v = H Σ p·Hv).
pub(crate) type I4Rows<'a> = QuantRows<'a, u8>;

/// What a quantized format stores its elements as.
pub(crate) trait Stored: Sized + Sync {
    /// A row's parameters.
    type Params: Copy + Sync;
    /// Elements one stored value holds.
    const ELEMS: usize;
    /// As [`KvRows::ROTATED`].
    const ROTATED: bool;
    /// A row's stored values `q` with its parameters, widened into `out`.
    fn widen(cpu: &CpuContext, q: &[Self], params: Self::Params, out: &mut [f32]);
}

impl Stored for i8 {
    type Params = f32;
    const ELEMS: usize = 1;
    const ROTATED: bool = false;
    fn widen(cpu: &CpuContext, q: &[i8], scale: f32, out: &mut [f32]) {
        cpu.widen_i8(q, scale, out)
    }
}

impl Stored for u8 {
    type Params = [half::f16; 2];
    const ELEMS: usize = 2;
    const ROTATED: bool = true;
    fn widen(cpu: &CpuContext, q: &[u8], params: [half::f16; 2], out: &mut [f32]) {
        let [scale, zero] = params.map(half::f16::to_f32);
        cpu.widen_u4(q, scale, zero, out)
    }
}

impl<Q: Stored> KvRows for QuantRows<'_, Q> {
    const ROTATED: bool = Q::ROTATED;
    fn span(d: usize) -> usize {
        (WIDE_FLOATS / d).clamp(8, SPAN)
    }
    fn load(&self, cpu: &CpuContext, _: &Span, at: &[usize], buf: &mut SpanBuf) {
        let d = self.d;
        buf.rows.resize(at.len() * d, 0.0);
        buf.starts.clear();
        buf.starts.extend((0..at.len()).map(|p| p * d));
        for (row, &a) in buf.rows.chunks_exact_mut(d).zip(at) {
            let q = &self.q[a / Q::ELEMS..][..d / Q::ELEMS];
            Q::widen(cpu, q, self.params[a / d], row);
        }
    }
    fn dots(
        &self,
        cpu: &CpuContext,
        [_, q]: [&[f32]; 2],
        _: &[usize],
        buf: &mut SpanBuf,
        out: &mut [f32],
    ) {
        cpu.dots(q, &buf.rows, &buf.starts, out)
    }
    fn axpys(
        &self,
        cpu: &CpuContext,
        w: &mut [f32],
        _: &[usize],
        buf: &mut SpanBuf,
        o: &mut [f32],
    ) {
        cpu.axpys(w, &buf.rows, &buf.starts, o)
    }
}

/// An INT4 key pool with the layer's key centres (`[kv_heads, CENTRED_PAIRS]`): a key's
/// score gets `q · R(p)·mean` of each centre back, `(cos, sin)` of its turn at the key's
/// position `p` looked up in `turns`.
pub(crate) struct CentredKeys<'a> {
    pub rows: I4Rows<'a>,
    pub centres: &'a [KeyCentre],
    /// The index of the layer's first centre among all layers' (as `turns` counts them).
    pub first: usize,
    pub turns: &'a CentreTurns,
}

impl KvRows for CentredKeys<'_> {
    const ROTATED: bool = true;
    fn span(d: usize) -> usize {
        <I4Rows<'_> as KvRows>::span(d)
    }
    fn load(&self, cpu: &CpuContext, span: &Span, at: &[usize], buf: &mut SpanBuf) {
        self.rows.load(cpu, span, at, buf);
        let SpanBuf {
            centres,
            live,
            turns,
            ..
        } = buf;
        let head = self.first + span.kv_head * CENTRED_PAIRS;
        live.clear();
        live.extend((head..head + CENTRED_PAIRS).filter(|&i| self.turns.moves(i)));
        centres.clear();
        centres.extend(live.iter().map(|&i| self.centres[i - self.first]));
        turns.clear();
        for pos in span.lo..=span.hi {
            turns.extend(live.iter().filter_map(|&i| self.turns.at(i, pos)));
        }
    }
    fn dots(
        &self,
        cpu: &CpuContext,
        q: [&[f32]; 2],
        at: &[usize],
        buf: &mut SpanBuf,
        out: &mut [f32],
    ) {
        self.rows.dots(cpu, q, at, buf, out);
        let q = q[0];
        let n = buf.centres.len();
        if n == 0 {
            return;
        }
        // q · R(p)·(a, b) = cos·(q_lo·a + q_hi·b) + sin·(q_hi·a − q_lo·b).
        buf.terms.clear();
        buf.terms.extend(buf.centres.iter().map(|c| {
            let (lo, hi) = (q[usize::from(c.lo)], q[usize::from(c.hi)]);
            let [a, b] = c.mean;
            [lo * a + hi * b, hi * a - lo * b]
        }));
        for (o, turns) in out.iter_mut().zip(buf.turns.chunks_exact(n)) {
            for ([c, s], [x, y]) in turns.iter().zip(&buf.terms) {
                *o += c * x + s * y;
            }
        }
    }
    fn axpys(
        &self,
        cpu: &CpuContext,
        w: &mut [f32],
        at: &[usize],
        buf: &mut SpanBuf,
        o: &mut [f32],
    ) {
        self.rows.axpys(cpu, w, at, buf, o)
    }
}

/// Positions a span (at most; [`KvRows::span`]). A (query token, KV head) reads its keys a
/// span at a time: each span's scores, softmax terms and weighted values are kept apart
/// (their max, sum and output) and the spans are then combined in order. Spans start at
/// multiples of the pool's span length, so a token's result depends on its position and
/// window (and the cache's format and head size) only, never on its batch or on how the spans
/// were shared among threads.
const SPAN: usize = 64;

/// Floats of a span's K (or V) rows a widened pool keeps at a time: 16 KiB each, so both
/// stay in the L1 cache while the heads sharing them read them.
const WIDE_FLOATS: usize = 4096;

/// Floats a head's partial result over one span: its max score, its sum of terms, then its
/// `head_dim` outputs.
fn partial_len(d: usize) -> usize {
    d + 2
}

/// A span of one (token, KV head): the token, the KV head, and the positions `lo..=hi`.
#[derive(Clone, Copy)]
pub(crate) struct Span {
    token: usize,
    kv_head: usize,
    lo: usize,
    hi: usize,
}

/// The spans (of `len` positions) of token `t` for KV head `g`, in order, pushed to `out`.
fn spans_of(
    batch: &AttnBatch,
    attn: &AttnConfig,
    (t, g): (usize, usize),
    len: usize,
    out: &mut Vec<Span>,
) {
    let pos = batch.info[2 * t + 1] as usize;
    let first = attn.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    for c in first / len..=pos / len {
        out.push(Span {
            token: t,
            kv_head: g,
            lo: first.max(c * len),
            hi: pos.min(c * len + len - 1),
        });
    }
}

/// What a task reuses: a span's scores, its slots, and what its K and V rows loaded.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    at: Vec<usize>,
    k: SpanBuf,
    v: SpanBuf,
}

/// A call of paged attention, but for the layer's pools: the queries, the step's block
/// tables and positions, the cache's shape and the attention's.
pub(crate) struct Attend<'a> {
    pub cpu: &'a CpuContext,
    pub q: &'a [f32],
    /// The attention sinks, one per query head ([`AttnConfig::sinks`]).
    pub sinks: Option<&'a [f32]>,
    pub batch: &'a AttnBatch,
    pub cfg: &'a KvCacheConfig,
    pub attn: &'a AttnConfig,
    /// The cache's lists for a call, kept from call to call.
    pub lists: &'a Keep<CallLists>,
}

impl Attend<'_> {
    /// The partials of every head sharing `span`'s KV head (`group` of them), into `out`
    /// (`group` partials): each key and value row is read from memory once for all of them.
    /// `qk` is the queries as the keys are (rotated for rotated keys).
    fn span_partials<K: KvRows + ?Sized, V: KvRows + ?Sized>(
        &self,
        (kp, vp): (&K, &V),
        qk: &[f32],
        span: Span,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        let (cpu, batch, cfg, attn) = (self.cpu, self.batch, self.cfg, self.attn);
        let (bs, kvh, d, heads) = (cfg.block_size, cfg.kv_heads, cfg.head_dim, attn.heads);
        let group = heads / kvh;
        let table = &batch.tables[batch.info[2 * span.token] as usize..];
        let Scratch { scores, at, k, v } = scratch;
        slots(table, bs, kvh * d, span.lo, span.hi, at);
        // Where this KV head's row starts in each position's slot.
        at.iter_mut().for_each(|a| *a += span.kv_head * d);
        scores.resize(at.len(), 0.0);
        kp.load(cpu, &span, at, k);
        vp.load(cpu, &span, at, v);
        let q0 = (span.token * heads + span.kv_head * group) * d;
        let heads_of = q0..q0 + group * d;
        for ((qrow, qk), p) in self.q[heads_of.clone()]
            .chunks_exact(d)
            .zip(qk[heads_of].chunks_exact(d))
            .zip(out.chunks_exact_mut(partial_len(d)))
        {
            kp.dots(cpu, [qrow, qk], at, k, scores);
            let mut max = f32::NEG_INFINITY;
            for v in scores.iter_mut() {
                *v *= attn.scale;
                max = max.max(*v);
            }
            let sum = cpu.exps(scores, max);
            let (head, o) = p.split_at_mut(2);
            head.copy_from_slice(&[max, sum]);
            o.fill(0.0);
            vp.axpys(cpu, scores, at, v, o);
        }
    }
}

/// Out (`group` heads of `d`) from each head's partials over its spans (`spans` of them, each
/// `group` partials), combined in span order: every span's terms and outputs rescaled to the
/// largest max, the outputs' sum divided by the terms' sum. The heads' `sinks` (a logit each,
/// with no value row) join the max and the terms.
fn combine(partials: &[f32], group: usize, d: usize, sinks: Option<&[f32]>, out: &mut [f32]) {
    let stride = group * partial_len(d);
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        let at = h * partial_len(d);
        let sink = sinks.map(|s| s[h]);
        let max = partials
            .chunks_exact(stride)
            .fold(sink.unwrap_or(f32::NEG_INFINITY), |m, c| m.max(c[at]));
        o.fill(0.0);
        let mut sum = sink.map_or(0.0, |s| (s - max).exp());
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

/// A task's computation of one span's partials (`Attend::span_partials` over given pools).
trait Partials: Fn(Span, &mut Scratch, &mut [f32]) + Sync {}
impl<F: Fn(Span, &mut Scratch, &mut [f32]) + Sync> Partials for F {}

impl Attend<'_> {
    /// `reference::paged_attention_host`'s result over pools `kp` and `vp`, computed on the
    /// native backend's threads.
    pub(crate) fn attention<K, V>(&self, kp: &K, vp: &V, out: &mut [f32])
    where
        K: KvRows + ?Sized,
        V: KvRows + ?Sized,
    {
        let (cpu, q, d) = (self.cpu, self.q, self.cfg.head_dim);
        self.lists.with(|lists| {
            let CallLists {
                kept: call,
                query: rotated,
            } = &mut *lists;
            // The query in the keys' basis.
            let qk = if K::ROTATED {
                rotated.clear();
                rotated.extend_from_slice(q);
                rotated.chunks_exact_mut(d).for_each(hadamard);
                &rotated[..]
            } else {
                q
            };
            let partials = |span: Span, s: &mut Scratch, p: &mut [f32]| {
                self.span_partials((kp, vp), qk, span, s, p)
            };
            let len = K::span(d).min(V::span(d));
            let tokens = q.len() / (self.attn.heads * d);
            if tokens * self.cfg.kv_heads >= 4 * cpu.threads() {
                self.by_pairs(&partials, len, out);
            } else {
                self.by_spans(&partials, len, out, call);
            }
            if V::ROTATED {
                out.chunks_exact_mut(d).for_each(hadamard);
            }
            lists.trim();
        })
    }

    /// The sinks of the query heads that share KV head `kv_head`.
    fn group_sinks(&self, kv_head: usize) -> Option<&[f32]> {
        let group = self.attn.heads / self.cfg.kv_heads;
        self.sinks.map(|s| &s[kv_head * group..][..group])
    }

    /// Floats of one (token, KV head)'s output (its group's heads), and of a span's partials.
    fn group_floats(&self) -> [usize; 2] {
        let group = self.attn.heads / self.cfg.kv_heads;
        [
            group * self.cfg.head_dim,
            group * partial_len(self.cfg.head_dim),
        ]
    }

    /// Enough (token, KV head) pairs to share: a task a pair, its spans in turn.
    fn by_pairs(&self, partials: &impl Partials, len: usize, out: &mut [f32]) {
        let (batch, attn, kvh, d) = (self.batch, self.attn, self.cfg.kv_heads, self.cfg.head_dim);
        let [per_pair, per_span] = self.group_floats();
        self.cpu.install(|| {
            out.par_chunks_mut(per_pair)
                .enumerate()
                .for_each(|(idx, o)| {
                    kept(|k| {
                        k.spans.clear();
                        spans_of(batch, attn, (idx / kvh, idx % kvh), len, &mut k.spans);
                        k.partials.resize(k.spans.len() * per_span, 0.0);
                        let ps = k.partials.chunks_exact_mut(per_span);
                        for (&span, p) in k.spans.iter().zip(ps) {
                            partials(span, &mut k.scratch, p);
                        }
                        combine(&k.partials, per_pair / d, d, self.group_sinks(idx % kvh), o);
                    })
                });
        });
    }

    /// Few pairs (a decode step): a task a span, so that every thread has work; then each
    /// pair's spans combined.
    fn by_spans(&self, partials: &impl Partials, len: usize, out: &mut [f32], call: &mut Kept) {
        let (batch, attn, kvh, d) = (self.batch, self.attn, self.cfg.kv_heads, self.cfg.head_dim);
        let [per_pair, per_span] = self.group_floats();
        let tokens = self.q.len() / (attn.heads * d);
        let Kept {
            spans,
            ends,
            partials: ps,
            ..
        } = call;
        spans.clear();
        ends.clear();
        for t in 0..tokens {
            for g in 0..kvh {
                spans_of(batch, attn, (t, g), len, spans);
                ends.push(spans.len());
            }
        }
        ps.resize(spans.len() * per_span, 0.0);
        self.cpu.install(|| {
            ps.par_chunks_mut(per_span)
                .zip(&*spans)
                .for_each(|(p, &span)| kept(|k| partials(span, &mut k.scratch, p)));
        });
        let mut from = 0;
        for (idx, (o, &to)) in out.chunks_exact_mut(per_pair).zip(&*ends).enumerate() {
            let sinks = self.group_sinks(idx % kvh);
            combine(
                &ps[from * per_span..to * per_span],
                per_pair / d,
                d,
                sinks,
                o,
            );
            from = to;
        }
    }
}

/// Lists kept between calls, so that once warm a step allocates nothing for them: a task's
/// scratch (a pool thread's, [`TASK`]), a call's spans (and where each pair's end) and their
/// partials (a cache's, [`CallLists`]).
#[derive(Default)]
struct Kept {
    scratch: Scratch,
    spans: Vec<Span>,
    ends: Vec<usize>,
    partials: Vec<f32>,
}

/// The most floats of partials a thread keeps between calls (4 MiB): a long context's
/// partials are given back rather than held for good.
const KEEP_FLOATS: usize = 1 << 20;

impl Kept {
    fn trim(&mut self) {
        if self.partials.capacity() > KEEP_FLOATS {
            self.partials = Vec::new();
        }
    }
}

/// What a cache keeps between attention calls: a call's lists ([`Kept`]: its spans, where
/// each pair's end, their partials) and the query rotated into the INT4 keys' basis. Kept by
/// the cache, not a thread: a step runs on whichever of the pool's threads takes it.
#[derive(Default)]
pub(crate) struct CallLists {
    kept: Kept,
    query: Vec<f32>,
}

impl CallLists {
    fn trim(&mut self) {
        self.kept.trim();
        if self.query.capacity() > KEEP_FLOATS {
            self.query = Vec::new();
        }
    }
}

thread_local! {
    /// A pool thread's [`Kept`], for the tasks it runs.
    static TASK: Cell<Kept> = Cell::default();
}

/// `f` over this thread's task [`Kept`], taken out while `f` runs and put back after: a
/// nested use (none is made: a task does not wait on the pool) would find it empty rather than
/// borrowed.
fn kept<R>(f: impl FnOnce(&mut Kept) -> R) -> R {
    let mut k = TASK.take();
    let r = f(&mut k);
    k.trim();
    TASK.set(k);
    r
}
