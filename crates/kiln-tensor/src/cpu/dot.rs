//! The portable integer matmul kernel: the definition of the native backend's numerics, which
//! every SIMD kernel reproduces bit for bit (see the module docs of `cpu`).

use super::QuantX;
use crate::DType;
use crate::quant::Ints;

/// Rows of a block-quantized weight, as a kernel reads them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub dtype: DType,
    pub ints: &'static Ints,
    pub block_bytes: usize,
    /// 32-element groups a block (1, or 8 for the K-quants).
    pub groups_per_block: usize,
    pub row_bytes: usize,
    /// Whole rows, host layout.
    pub w: &'a [u8],
}

impl Rows<'_> {
    /// Block of group `g` of row `r`, and the group's index within it.
    #[inline(always)]
    pub fn block(&self, r: usize, g: usize) -> (&[u8], usize) {
        let at = r * self.row_bytes + (g / self.groups_per_block) * self.block_bytes;
        (
            &self.w[at..at + self.block_bytes],
            g % self.groups_per_block,
        )
    }

    pub fn count(&self) -> usize {
        self.w.len() / self.row_bytes
    }
}

/// The scales of one group for one row of X: `a·dx` of each half.
#[inline(always)]
pub(crate) fn group_scales(s: &[f32; 4], dx: f32) -> (f32, f32) {
    (s[0] * dx, s[1] * dx)
}

/// The offset term of one group for one row of X: b·dx·Σxq, by halves where the format's
/// scales change every 16 elements.
#[inline(always)]
pub(crate) fn offset_term(ints: &Ints, s: &[f32; 4], dx: f32, sums: [i32; 2], accb: &mut f32) {
    if !ints.offset {
        return;
    }
    if ints.span == 32 {
        *accb += (s[2] * dx) * (sums[0] + sums[1]) as f32;
    } else {
        *accb += (s[2] * dx) * sums[0] as f32;
        *accb += (s[3] * dx) * sums[1] as f32;
    }
}

/// The integer dot products of one group of W's quants `q` with X's `xq`: of both halves
/// where format's scales change every 16 elements, else of all 32 (and 0).
#[inline(always)]
pub(crate) fn group_dots(ints: &Ints, q: &[i8; 32], xq: &[i8; 32]) -> (i32, i32) {
    let dot =
        |r: std::ops::Range<usize>| -> i32 { r.map(|e| i32::from(q[e]) * i32::from(xq[e])).sum() };
    if ints.span == 16 {
        (dot(0..16), dot(16..32))
    } else {
        (dot(0..32), 0)
    }
}

/// `out[r·m + i]` = row r of W · row i of X, for every row of `rows` and of `x`.
pub(crate) fn rows_portable(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
    let (m, groups) = (x.m, x.groups());
    // Per row of X: the scaled products of each half (one where scales span 32 elements),
    // and the offset terms.
    let mut acc = vec![[0f32; 3]; m];
    let mut q = [0i8; 32];
    for r in 0..rows.count() {
        acc.iter_mut().for_each(|a| *a = [0.0; 3]);
        for g in 0..groups {
            let (blk, gg) = rows.block(r, g);
            (rows.ints.quants)(blk, gg, &mut q);
            let s = (rows.ints.scales)(blk, gg);
            for (i, [a0, a1, b]) in acc.iter_mut().enumerate() {
                let at = x.slot(i, g);
                let dx = x.d[at];
                let (s0, s1) = group_scales(&s, dx);
                let (t0, t1) = group_dots(rows.ints, &q, &x.quants(i, g));
                *a0 += s0 * t0 as f32;
                if rows.ints.span == 16 {
                    *a1 += s1 * t1 as f32;
                }
                offset_term(rows.ints, &s, dx, x.sums(at), b);
            }
        }
        for (i, [a0, a1, b]) in acc.iter().enumerate() {
            out[r * m + i] = (a0 + a1) + b;
        }
    }
}
