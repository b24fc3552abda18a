//! Vector helpers of the native backend for kernels outside this crate (paged attention):
//! dot products and `y += w·x` over f32 or f16 rows.
//!
//! Numerics, defined by the portable forms here and reproduced bit for bit by the x86 ones:
//! a dot product runs eight lanes, element `e` fused-multiply-added into lane `e % 8`, the
//! lanes summed in `dot::lane_sum`'s order, then the elements past the last whole eight added
//! one by one; `y += w·x` is one fused multiply-add an element.

use half::f16;

use super::dot::lane_sum;

/// Elements a SIMD step.
pub(super) const LANES: usize = 8;

/// An element of a row, widened (exactly) to f32.
pub(crate) trait Elem: Copy {
    fn f32(self) -> f32;
}

impl Elem for f32 {
    fn f32(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

pub(super) fn dot_portable<E: Elem>(a: &[f32], b: &[E]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    for (x, y) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l].f32(), acc[l]);
        }
    }
    tail(a, b, lane_sum(&acc))
}

/// `s` plus the products of `a` and `b` past their last whole eight, one by one.
pub(super) fn tail<E: Elem>(a: &[f32], b: &[E], mut s: f32) -> f32 {
    let n = a.len().min(b.len());
    let whole = n / LANES * LANES;
    for (&x, &y) in a[whole..n].iter().zip(&b[whole..n]) {
        s = x.mul_add(y.f32(), s);
    }
    s
}

pub(super) fn axpy_portable<E: Elem>(w: f32, x: &[E], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = w.mul_add(x.f32(), *y);
    }
}
