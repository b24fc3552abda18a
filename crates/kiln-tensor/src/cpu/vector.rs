//! Vector helpers of the native backend for kernels outside this crate (paged attention):
//! dot products and `y += w·x` over f32 or f16 rows, and an INT8 or INT4 cache's rows widened
//! to the values they stand for.
//!
//! Numerics, defined by the portable forms here and reproduced bit for bit by the x86 ones:
//! a dot product runs eight lanes, the product of element `e` added to lane `e % 8`, the lanes
//! summed in order (0 to 7), then the sum of the products past the last whole eight added;
//! `y += w·x` is a product then a sum an element. The many-row forms (`dots`, `axpys`: rows of
//! a pool at given starts) are those one row after another.

use half::f16;

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
        for ((acc, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *acc += x * y.f32();
        }
    }
    tail(a, b, acc)
}

/// The lanes summed in order, plus the sum of the products of `a` and `b` past their last
/// whole eight.
pub(super) fn tail<E: Elem>(a: &[f32], b: &[E], acc: [f32; LANES]) -> f32 {
    let n = a.len().min(b.len());
    let whole = n / LANES * LANES;
    let rest: f32 = a[whole..n]
        .iter()
        .zip(&b[whole..n])
        .map(|(&x, &y)| x * y.f32())
        .sum();
    acc.iter().sum::<f32>() + rest
}

/// `s[i] = e^(s[i] − shift)` (libm's `expf`, within an ulp: a softmax's terms decide greedy
/// picks, and the gated activations' polynomial, a few ulp off, moved a golden pick), and their
/// sum as a dot product sums: eight lanes, the lanes in order, then the rest. The same at
/// every ISA.
pub(super) fn exps(s: &mut [f32], shift: f32) -> f32 {
    s.iter_mut().for_each(|v| *v = (*v - shift).exp());
    let mut acc = [0f32; LANES];
    let mut chunks = s.chunks_exact(LANES);
    for c in &mut chunks {
        acc.iter_mut().zip(c).for_each(|(a, &v)| *a += v);
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

pub(super) fn axpy_portable<E: Elem>(w: f32, x: &[E], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += w * x.f32();
    }
}

/// [`dot_portable`] of `a` with each row of `pool` that starts at one of `starts` (as long as
/// `a`), into `out`.
pub(super) fn dots_portable<E: Elem>(a: &[f32], pool: &[E], starts: &[usize], out: &mut [f32]) {
    for (o, &s) in out.iter_mut().zip(starts) {
        *o = dot_portable(a, &pool[s..s + a.len()]);
    }
}

/// [`axpy_portable`] of each `w[p]` with the row of `pool` at `starts[p]` (as long as `y`),
/// in turn.
pub(super) fn axpys_portable<E: Elem>(w: &[f32], pool: &[E], starts: &[usize], y: &mut [f32]) {
    for (&w, &s) in w.iter().zip(starts) {
        axpy_portable(w, &pool[s..s + y.len()], y);
    }
}

/// `out[e] = q[e] · scale`.
pub(super) fn widen_i8_portable(q: &[i8], scale: f32, out: &mut [f32]) {
    for (o, &q) in out.iter_mut().zip(q) {
        *o = f32::from(q) * scale;
    }
}

/// `out[e] = level e · scale + zero` (a product, then a sum), for the levels of `packed`, two
/// a byte: element 2i in byte i's low nibble, 2i + 1 in its high nibble.
pub(super) fn widen_u4_portable(packed: &[u8], scale: f32, zero: f32, out: &mut [f32]) {
    for (pair, &b) in out.chunks_exact_mut(2).zip(packed) {
        pair[0] = f32::from(b & 15) * scale + zero;
        pair[1] = f32::from(b >> 4) * scale + zero;
    }
}
