//! Activations quantized for integer dot products: each 32-element group of a row of X as 32
//! `i8` and a scale, as ggml's `Q8_0` block holds it (quants `x · 127 / amax` rounded half
//! away from zero, the scale `amax / 127` stored at f16 precision), and the integer sums of
//! its two halves, which the formats with offsets need.
//!
//! Rows are stored in tiles of [`TILE`], the last one padded with zero rows (a lone row, as
//! decode has, is a tile of one, its quants contiguous). Within a tile,
//! group by group, the quants are interleaved four at a time: the group's chunk `c` (quants
//! `4c..4c + 4`) of the tile's row `j` lies at byte `4·(TILE·c + j)`. A kernel then multiplies
//! one 4-quant chunk of a weight row, broadcast, with the same chunk of all the tile's rows
//! in one instruction, each row's sum in its own 32-bit lane. Scales and half sums are kept
//! the same way: a tile's group holds [`TILE`] of each, one a row.

use std::ops::Range;

use rayon::prelude::*;

/// Rows of X a tile.
pub(crate) const TILE: usize = 16;

/// Four-quant chunks a group.
pub(crate) const CHUNKS: usize = 8;

/// Rows of X, quantized.
#[derive(Debug, Default)]
pub(crate) struct QuantX {
    pub m: usize,
    pub k: usize,
    /// Quants: 32 · [`TILE`] a tile's group, chunk-interleaved (see the module docs).
    pub q: Vec<i8>,
    /// Scales, one a slot ([`QuantX::slot`]).
    pub d: Vec<f32>,
    /// Sums of quants 0–15 of each slot.
    pub lo: Vec<i32>,
    /// Sums of quants 16–31 of each slot.
    pub hi: Vec<i32>,
}

impl QuantX {
    /// Quantize `x` (`m` rows of `k`, `k` a multiple of 32) into `self`, reusing its buffers;
    /// a task a tile, on the current rayon pool.
    pub fn fill(&mut self, x: &[f32], m: usize, k: usize) {
        debug_assert!(k.is_multiple_of(32) && x.len() == m * k);
        self.m = m;
        self.k = k;
        let width = self.width();
        let slots = m.div_ceil(width) * width * (k / 32);
        self.q.resize(32 * slots, 0);
        self.d.resize(slots, 0.0);
        self.lo.resize(slots, 0);
        self.hi.resize(slots, 0);
        let tile = width * (k / 32);
        self.q
            .par_chunks_mut(32 * tile)
            .zip(self.d.par_chunks_mut(tile))
            .zip(
                self.lo
                    .par_chunks_mut(tile)
                    .zip(self.hi.par_chunks_mut(tile)),
            )
            .zip(x.par_chunks(width * k))
            .for_each(|(((q, d), (lo, hi)), x)| fill_tile(x, k, width, q, d, lo, hi));
    }

    /// Rows a tile: [`TILE`], or one for a lone row.
    pub fn width(&self) -> usize {
        if self.m == 1 { 1 } else { TILE }
    }

    /// Groups a row.
    pub fn groups(&self) -> usize {
        self.k / 32
    }

    /// The rows of each tile, in order.
    pub fn tiles(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let (m, w) = (self.m, self.width());
        (0..m).step_by(w).map(move |i| i..(i + w).min(m))
    }

    /// The slots of the tile that starts at row `first`: a tile's width a group,
    /// group-major.
    pub fn tile_slots(&self, first: usize) -> Range<usize> {
        let w = self.width();
        let start = first / w * w * self.groups();
        start..start + w * self.groups()
    }

    /// Where group `g` of row `i` is stored: its index in `d`, `lo` and `hi`.
    pub fn slot(&self, i: usize, g: usize) -> usize {
        let w = self.width();
        (i / w * self.groups() + g) * w + i % w
    }

    /// The 32 quants of group `g` of row `i`.
    pub fn quants(&self, i: usize, g: usize) -> [i8; 32] {
        let w = self.width();
        let base = 32 * (self.slot(i, g) - i % w);
        let mut out = [0i8; 32];
        for (c, four) in out.chunks_exact_mut(4).enumerate() {
            let at = base + 4 * (w * c + i % w);
            four.copy_from_slice(&self.q[at..at + 4]);
        }
        out
    }

    /// The sums of the two halves of slot `at`'s quants.
    pub fn sums(&self, at: usize) -> [i32; 2] {
        [self.lo[at], self.hi[at]]
    }

    /// The values the quants stand for (`q·d`), row-major, for tests and references.
    #[cfg(test)]
    pub fn dequantized(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.m * self.k);
        for i in 0..self.m {
            for g in 0..self.groups() {
                let d = self.d[self.slot(i, g)];
                out.extend(self.quants(i, g).iter().map(|&v| f32::from(v) * d));
            }
        }
        out
    }
}

/// One tile of rows `x` (`k` wide, up to `width` rows) into its slots: the quants,
/// interleaved, the scales and the half sums; rows past `x`'s end are zero.
fn fill_tile(
    x: &[f32],
    k: usize,
    width: usize,
    q: &mut [i8],
    d: &mut [f32],
    lo: &mut [i32],
    hi: &mut [i32],
) {
    let rows = x.len() / k;
    for (g, ((q, d), (lo, hi))) in q
        .chunks_exact_mut(32 * width)
        .zip(d.chunks_exact_mut(width))
        .zip(lo.chunks_exact_mut(width).zip(hi.chunks_exact_mut(width)))
        .enumerate()
    {
        for j in 0..width {
            let mut qs = [0i8; 32];
            let mut scale = 0.0;
            if j < rows {
                let xs = &x[j * k + 32 * g..][..32];
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                scale = amax / 127.0;
                let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                for (q, &v) in qs.iter_mut().zip(xs) {
                    *q = (v * id).round() as i8;
                }
                scale = half::f16::from_f32(scale).to_f32();
            }
            let half = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum::<i32>();
            d[j] = scale;
            lo[j] = half(&qs[..16]);
            hi[j] = half(&qs[16..]);
            for (c, four) in qs.chunks_exact(4).enumerate() {
                q[4 * (width * c + j)..][..4].copy_from_slice(four);
            }
        }
    }
}
