//! Paged attention on the native CPU backend: each (query token, head) a task on the
//! backend's thread pool, keys read in place through the block table (no gathered copy),
//! scores and softmax in f32. The plain reference (`reference.rs`, f64) is its oracle.

use kiln_tensor::CpuContext;
use rayon::prelude::*;

use crate::{AttnBatch, AttnConfig, KvCacheConfig};

/// Dot product with eight independent accumulators (vectorises).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a
        .chunks_exact(8)
        .remainder()
        .iter()
        .zip(b.chunks_exact(8).remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// `reference::paged_attention_host`'s result, computed on `cpu`'s threads.
pub(crate) fn paged_attention_native(
    cpu: &CpuContext,
    q: &[f32],
    kp: &[f32],
    vp: &[f32],
    batch: &AttnBatch,
    cfg: &KvCacheConfig,
    attn: &AttnConfig,
) -> Vec<f32> {
    let (bs, kvh, d, heads) = (cfg.block_size, cfg.kv_heads, cfg.head_dim, attn.heads);
    let (row, group) = (kvh * d, heads / kvh);
    let mut out = vec![0f32; q.len()];
    cpu.install(|| {
        out.par_chunks_mut(d).enumerate().for_each_init(
            Vec::new,
            |scores: &mut Vec<f32>, (idx, o)| {
                let (t, h) = (idx / heads, idx % heads);
                let table = &batch.tables[batch.info[2 * t] as usize..];
                let pos = batch.info[2 * t + 1] as usize;
                let first = attn.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let at = |j: usize| (table[j / bs] as usize * bs + j % bs) * row + (h / group) * d;
                let qrow = &q[idx * d..(idx + 1) * d];
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for j in first..=pos {
                    let s = dot(qrow, &kp[at(j)..at(j) + d]) * attn.scale;
                    max = max.max(s);
                    scores.push(s);
                }
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let inv = 1.0 / sum;
                for (&e, j) in scores.iter().zip(first..=pos) {
                    let w = e * inv;
                    for (x, y) in o.iter_mut().zip(&vp[at(j)..at(j) + d]) {
                        *x += w * y;
                    }
                }
            },
        );
    });
    out
}
