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

/// The eight lanes summed as the AVX2 reduction does: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
#[inline(always)]
pub(crate) fn lane_sum(a: &[f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// `out[r·m + i]` = row r of W · row i of X, for every row of `rows` and of `x`.
pub(crate) fn rows_portable(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
    let (m, groups) = (x.m, x.groups());
    let mut acc = vec![[0f32; 8]; m];
    let mut accb = vec![0f32; m];
    let mut q = [0i8; 32];
    for r in 0..rows.count() {
        acc.iter_mut().for_each(|a| *a = [0.0; 8]);
        accb.iter_mut().for_each(|a| *a = 0.0);
        for g in 0..groups {
            let (blk, gg) = rows.block(r, g);
            (rows.ints.quants)(blk, gg, &mut q);
            let s = (rows.ints.scales)(blk, gg);
            for i in 0..m {
                let at = x.slot(i, g);
                let xq = &x.q[32 * at..][..32];
                let dx = x.d[at];
                let (s0, s1) = group_scales(&s, dx);
                for (l, a) in acc[i].iter_mut().enumerate() {
                    let lane: i32 = (4 * l..4 * l + 4)
                        .map(|e| i32::from(q[e]) * i32::from(xq[e]))
                        .sum();
                    let sc = if l < 4 { s0 } else { s1 };
                    *a += sc * lane as f32;
                }
                offset_term(rows.ints, &s, dx, x.sums[at], &mut accb[i]);
            }
        }
        for i in 0..m {
            out[r * m + i] = lane_sum(&acc[i]) + accb[i];
        }
    }
}
