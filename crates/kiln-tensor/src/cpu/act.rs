//! Activations quantized for integer dot products: each 32-element group of a row of X as 32
//! `i8` with an f32 scale (amax / 127, rounded half away from zero, as ggml's `Q8_0`), and the
//! integer sums of its two halves, which the formats with offsets need.
//!
//! Rows are stored in tiles of [`TILE`] (the last one may be narrower), group-major within a
//! tile: a kernel that decodes a group of W once for every row of a tile finds those rows'
//! groups side by side.

use std::ops::Range;

use rayon::prelude::*;

/// Rows of X a tile.
pub(crate) const TILE: usize = 16;

/// Rows of X, quantized.
#[derive(Debug, Default)]
pub(crate) struct QuantX {
    pub m: usize,
    pub k: usize,
    /// Quants, 32 a group slot ([`QuantX::slot`]).
    pub q: Vec<i8>,
    /// −128 · the sums of each four quants, eight a group slot: where a lane of
    /// `vpdpbusd(q + 128, x)` starts so that it sums q·x (signed quants made unsigned).
    pub neg: Vec<[i32; 8]>,
    /// Scales, one a group slot.
    pub d: Vec<f32>,
    /// Sums of quants 0–15 and 16–31, one a group slot.
    pub sums: Vec<[i32; 2]>,
}

impl QuantX {
    /// Quantize `x` (`m` rows of `k`, `k` a multiple of 32) into `self`, reusing its buffers;
    /// a task a tile, on the current rayon pool.
    pub fn fill(&mut self, x: &[f32], m: usize, k: usize) {
        debug_assert!(k.is_multiple_of(32) && x.len() == m * k);
        self.m = m;
        self.k = k;
        self.q.resize(m * k, 0);
        self.neg.resize(m * k / 32, [0; 8]);
        self.d.resize(m * k / 32, 0.0);
        self.sums.resize(m * k / 32, [0, 0]);
        let g = k / 32;
        self.q
            .par_chunks_mut(TILE * k)
            .zip(self.neg.par_chunks_mut(TILE * g))
            .zip(self.d.par_chunks_mut(TILE * g))
            .zip(self.sums.par_chunks_mut(TILE * g))
            .zip(x.par_chunks(TILE * k))
            .for_each(|((((q, neg), d), sums), x)| {
                fill_tile(x, k, q, d, sums);
                for (n, q) in neg.iter_mut().zip(q.chunks_exact(32)) {
                    for (n, four) in n.iter_mut().zip(q.chunks_exact(4)) {
                        *n = -128 * four.iter().map(|&v| i32::from(v)).sum::<i32>();
                    }
                }
            });
    }
    /// Groups a row.
    pub fn groups(&self) -> usize {
        self.k / 32
    }

    /// The rows of each tile, in order.
    pub fn tiles(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let m = self.m;
        (0..m).step_by(TILE).map(move |i| i..(i + TILE).min(m))
    }

    /// The group slots of the tile of `rows`: `rows.len()` slots a group, group-major.
    pub fn tile_slots(&self, rows: &Range<usize>) -> Range<usize> {
        let first = rows.start * self.groups();
        first..first + rows.len() * self.groups()
    }

    /// Where group `g` of row `i` is stored (its index in `d` and `sums`; its quants start
    /// at 32 times it).
    pub fn slot(&self, i: usize, g: usize) -> usize {
        let t = i / TILE * TILE;
        let width = TILE.min(self.m - t);
        t * self.groups() + g * width + (i - t)
    }

    /// The values the quants stand for (`q·d`), row-major, for tests and references.
    #[cfg(test)]
    pub fn dequantized(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.m * self.k);
        for i in 0..self.m {
            for g in 0..self.groups() {
                let at = self.slot(i, g);
                let d = self.d[at];
                out.extend(
                    self.q[32 * at..32 * at + 32]
                        .iter()
                        .map(|&v| f32::from(v) * d),
                );
            }
        }
        out
    }
}

/// One tile of rows `x` (`k` wide) into its group slots: the quants, scales and half sums,
/// group-major.
fn fill_tile(x: &[f32], k: usize, q: &mut [i8], d: &mut [f32], sums: &mut [[i32; 2]]) {
    let width = x.len() / k;
    for (i, row) in x.chunks_exact(k).enumerate() {
        for (g, xs) in row.chunks_exact(32).enumerate() {
            let at = g * width + i;
            let qs = &mut q[32 * at..32 * at + 32];
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(xs) {
                *q = (v * id).round() as i8;
            }
            let half = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum::<i32>();
            d[at] = scale;
            sums[at] = [half(&qs[..16]), half(&qs[16..])];
        }
    }
}
