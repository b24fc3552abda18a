//! Paged attention on the native CPU backend: each (query token, head) a task on the
//! backend's thread pool, keys read in place through the block table (no gathered copy),
//! scores and softmax in f32. The plain reference (`reference.rs`, f64) is its oracle.

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

/// Scores to weights, in place.
fn softmax(s: &mut [f32]) {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    s.iter_mut().for_each(|v| *v *= inv);
}

/// `reference::paged_attention_host`'s result, computed on `cpu`'s threads.
pub(crate) fn paged_attention_native<E: PoolElem>(
    cpu: &CpuContext,
    q: &[f32],
    kp: &[E],
    vp: &[E],
    batch: &AttnBatch,
    cfg: &KvCacheConfig,
    attn: &AttnConfig,
) -> Vec<f32> {
    let (bs, kvh, d, heads) = (cfg.block_size, cfg.kv_heads, cfg.head_dim, attn.heads);
    let (row, group) = (kvh * d, heads / kvh);
    let mut out = vec![0f32; q.len()];
    // A task takes the heads of a query token that share a KV head, the rows of that head
    // then read from memory once for all of them; or a head alone when that leaves fewer than
    // four tasks a thread (a decode step). Each head's scores are one `dots` over the keys,
    // its output one `axpys` over the values.
    let tokens = q.len() / (heads * d);
    let per_task = if tokens * kvh >= 4 * cpu.threads() {
        group
    } else {
        1
    };
    cpu.install(|| {
        out.par_chunks_mut(per_task * d).enumerate().for_each_init(
            <(Vec<f32>, Vec<usize>)>::default,
            |(scores, at), (idx, o)| {
                let (t, g) = (idx * per_task / heads, idx * per_task % heads / group);
                let table = &batch.tables[batch.info[2 * t] as usize..];
                let pos = batch.info[2 * t + 1] as usize;
                let first = attn.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                slots(table, bs, row, first, pos, at);
                // Where this KV head's row starts in each position's slot.
                at.iter_mut().for_each(|a| *a += g * d);
                let n = at.len();
                let qs = &q[idx * per_task * d..(idx + 1) * per_task * d];
                scores.clear();
                scores.resize(per_task * n, 0.0);
                for (qrow, s) in qs.chunks_exact(d).zip(scores.chunks_exact_mut(n)) {
                    E::dots(cpu, qrow, kp, at, s);
                    s.iter_mut().for_each(|v| *v *= attn.scale);
                    softmax(s);
                }
                for (o, w) in o.chunks_exact_mut(d).zip(scores.chunks_exact(n)) {
                    E::axpys(cpu, w, vp, at, o);
                }
            },
        );
    });
    out
}
