//! CPU attention: the plain contiguous reference, and the paged host path built on it.

use crate::{AttnBatch, AttnConfig, KvCacheConfig};

/// Plain attention of queries `q [tq, heads, d]` at absolute positions `q_pos` over one
/// sequence's contiguous `k`, `v` `[len, kv_heads, d]`: query at position p sees keys
/// `p - window + 1 ..= p` (or `0..=p`). Head h's sink, where `sinks` are given, joins the
/// softmax as one more score with no value row. Softmax in f64.
#[allow(clippy::too_many_arguments)]
pub fn contiguous_attention(
    q: &[f32],
    q_pos: &[usize],
    k: &[f32],
    v: &[f32],
    heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let group = heads / kv_heads;
    let mut out = vec![0f32; q.len()];
    for (t, &pos) in q_pos.iter().enumerate() {
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..heads {
            let kh = h / group;
            let qrow = &q[(t * heads + h) * d..(t * heads + h + 1) * d];
            let scores: Vec<f64> = (first..=pos)
                .map(|j| {
                    let krow = &k[(j * kv_heads + kh) * d..(j * kv_heads + kh + 1) * d];
                    qrow.iter()
                        .zip(krow)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * f64::from(scale)
                })
                .collect();
            let sink = sinks.map(|s| f64::from(s[h]));
            let m = scores
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
            let o = &mut out[(t * heads + h) * d..(t * heads + h + 1) * d];
            for (i, j) in (first..=pos).enumerate() {
                let vrow = &v[(j * kv_heads + kh) * d..(j * kv_heads + kh + 1) * d];
                for (x, y) in o.iter_mut().zip(vrow) {
                    *x += (e[i] / sum * f64::from(*y)) as f32;
                }
            }
        }
    }
    out
}

/// The CPU backend's paged attention: gather each sequence's rows through its block table,
/// then run the contiguous reference.
pub(crate) fn paged_attention_host(
    q: &[f32],
    kp: &[f32],
    vp: &[f32],
    batch: &AttnBatch,
    cfg: &KvCacheConfig,
    attn: &AttnConfig,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let (bs, kvh, d, heads) = (cfg.block_size, cfg.kv_heads, cfg.head_dim, attn.heads);
    let row = kvh * d;
    let mut out = vec![0f32; q.len()];
    let mut t = 0;
    while t < batch.tokens {
        // Tokens of one sequence share their table offset and are consecutive.
        let offset = batch.info[2 * t];
        let mut end = t;
        while end < batch.tokens && batch.info[2 * end] == offset {
            end += 1;
        }
        let last_pos = batch.info[2 * end - 1] as usize;
        let table = &batch.tables[offset as usize..];
        let mut k = vec![0f32; (last_pos + 1) * row];
        let mut v = vec![0f32; (last_pos + 1) * row];
        let first_needed = attn.window.map_or(0, |w| {
            (batch.info[2 * t + 1] as usize + 1).saturating_sub(w)
        });
        for j in first_needed..=last_pos {
            let slot = table[j / bs] as usize * bs + j % bs;
            k[j * row..(j + 1) * row].copy_from_slice(&kp[slot * row..(slot + 1) * row]);
            v[j * row..(j + 1) * row].copy_from_slice(&vp[slot * row..(slot + 1) * row]);
        }
        let pos: Vec<usize> = (t..end).map(|i| batch.info[2 * i + 1] as usize).collect();
        let o = contiguous_attention(
            &q[t * heads * d..end * heads * d],
            &pos,
            &k,
            &v,
            heads,
            kvh,
            d,
            attn.scale,
            attn.window,
            sinks,
        );
        out[t * heads * d..end * heads * d].copy_from_slice(&o);
        t = end;
    }
    out
}
