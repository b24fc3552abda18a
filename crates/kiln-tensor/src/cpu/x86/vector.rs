//! x86-64 forms of the vector helpers (`cpu::vector` defines them): dot products and
//! `y += w·x` over f32 or f16 rows, one row or many rows of a pool, on AVX2 with F16C, and
//! an INT8 or INT4 cache's rows widened to values.

use std::arch::x86_64::*;

use half::f16;

use super::super::vector::{LANES, axpy_portable, tail, widen_i8_portable, widen_u4_portable};

/// Eight f32s from `x` (at least eight long).
#[inline]
#[target_feature(enable = "avx2")]
fn load8(x: &[f32]) -> __m256 {
    bytemuck::pod_read_unaligned(bytemuck::cast_slice(&x[..8]))
}

/// Eight f16s from `x` (at least eight long), widened.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn widen8(x: &[f16]) -> __m256 {
    _mm256_cvtph_ps(bytemuck::pod_read_unaligned(bytemuck::cast_slice(&x[..8])))
}

macro_rules! vector {
    ($dot:ident, $axpy:ident, $elem:ty, $load:ident) => {
        /// `vector::dot_portable`, eight lanes a register.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::cpu) fn $dot(a: &[f32], b: &[$elem]) -> f32 {
            let n = a.len().min(b.len());
            let mut acc = _mm256_setzero_ps();
            for (x, y) in a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)) {
                acc = _mm256_add_ps(acc, _mm256_mul_ps(load8(x), $load(y)));
            }
            tail(a, b, bytemuck::cast::<__m256, [f32; LANES]>(acc))
        }

        /// `vector::axpy_portable`, eight elements a register.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::cpu) fn $axpy(w: f32, x: &[$elem], y: &mut [f32]) {
            let n = x.len().min(y.len());
            let wv = _mm256_set1_ps(w);
            for (yc, xc) in y[..n]
                .chunks_exact_mut(LANES)
                .zip(x[..n].chunks_exact(LANES))
            {
                let r = _mm256_add_ps(load8(yc), _mm256_mul_ps(wv, $load(xc)));
                yc.copy_from_slice(&bytemuck::cast::<__m256, [f32; LANES]>(r));
            }
            let whole = n / LANES * LANES;
            axpy_portable(w, &x[whole..n], &mut y[whole..n]);
        }
    };
}

vector!(dot_f32, axpy_f32, f32, load8);
vector!(dot_f16, axpy_f16, f16, widen8);

/// Elements of a row the many-row helpers take at a time: eight registers of the fixed
/// operand (`a` of the dot products, `y` of the sums), reused for every row of the pool.
const CHUNK: usize = 8 * LANES;

/// Rows of the pool whose lanes `dots` keeps while it walks `a` a chunk at a time.
const DOT_ROWS: usize = 64;

macro_rules! many {
    ($dots:ident, $axpys:ident, $elem:ty, $load:ident) => {
        /// `vector::dots_portable`: each row's eight lanes as `$dot` sums them, `a` read a
        /// chunk at a time for a batch of rows.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::cpu) fn $dots(a: &[f32], pool: &[$elem], starts: &[usize], out: &mut [f32]) {
            let (d, whole) = (a.len(), a.len() / LANES * LANES);
            let mut lanes = [_mm256_setzero_ps(); DOT_ROWS];
            for (starts, out) in starts.chunks(DOT_ROWS).zip(out.chunks_mut(DOT_ROWS)) {
                lanes.iter_mut().for_each(|l| *l = _mm256_setzero_ps());
                for c in (0..whole).step_by(CHUNK) {
                    let regs = ((whole - c) / LANES).min(CHUNK / LANES);
                    let mut q = [_mm256_setzero_ps(); CHUNK / LANES];
                    for (i, q) in q.iter_mut().enumerate().take(regs) {
                        *q = load8(&a[c + LANES * i..]);
                    }
                    for (acc, &s) in lanes.iter_mut().zip(starts) {
                        let row = &pool[s + c..];
                        for (i, q) in q.iter().enumerate().take(regs) {
                            let v = $load(&row[LANES * i..]);
                            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(*q, v));
                        }
                    }
                }
                for ((o, &s), acc) in out.iter_mut().zip(starts).zip(&lanes) {
                    let acc = bytemuck::cast::<__m256, [f32; LANES]>(*acc);
                    *o = tail(a, &pool[s..s + d], acc);
                }
            }
        }

        /// `vector::axpys_portable`: `y` held a chunk at a time in registers while every
        /// row adds its product, in order.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::cpu) fn $axpys(w: &[f32], pool: &[$elem], starts: &[usize], y: &mut [f32]) {
            let (n, whole) = (y.len(), y.len() / LANES * LANES);
            for c in (0..whole).step_by(CHUNK) {
                let regs = ((whole - c) / LANES).min(CHUNK / LANES);
                let mut acc = [_mm256_setzero_ps(); CHUNK / LANES];
                for (i, acc) in acc.iter_mut().enumerate().take(regs) {
                    *acc = load8(&y[c + LANES * i..]);
                }
                for (&w, &s) in w.iter().zip(starts) {
                    let (wv, row) = (_mm256_set1_ps(w), &pool[s + c..]);
                    for (i, acc) in acc.iter_mut().enumerate().take(regs) {
                        let v = $load(&row[LANES * i..]);
                        *acc = _mm256_add_ps(*acc, _mm256_mul_ps(wv, v));
                    }
                }
                for (i, acc) in acc.iter().enumerate().take(regs) {
                    let at = c + LANES * i;
                    y[at..at + LANES]
                        .copy_from_slice(&bytemuck::cast::<__m256, [f32; LANES]>(*acc));
                }
            }
            for (&w, &s) in w.iter().zip(starts) {
                axpy_portable(w, &pool[s + whole..s + n], &mut y[whole..n]);
            }
        }
    };
}

many!(dots_f32, axpys_f32, f32, load8);
many!(dots_f16, axpys_f16, f16, widen8);

/// `vector::widen_i8_portable`, eight values a step.
#[target_feature(enable = "avx2")]
pub(in crate::cpu) fn widen_i8(q: &[i8], scale: f32, out: &mut [f32]) {
    let n = q.len().min(out.len());
    let s = _mm256_set1_ps(scale);
    for (o, q) in out[..n].chunks_exact_mut(8).zip(q[..n].chunks_exact(8)) {
        let eight = _mm_cvtsi64_si128(bytemuck::pod_read_unaligned(bytemuck::cast_slice(q)));
        let v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), s);
        o.copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(v));
    }
    let whole = n / 8 * 8;
    widen_i8_portable(&q[whole..n], scale, &mut out[whole..n]);
}

/// `vector::widen_u4_portable`, sixteen levels (eight bytes) a step.
#[target_feature(enable = "avx2")]
pub(in crate::cpu) fn widen_u4(packed: &[u8], scale: f32, zero: f32, out: &mut [f32]) {
    let n = packed.len().min(out.len() / 2);
    let (s, z, low) = (
        _mm256_set1_ps(scale),
        _mm256_set1_ps(zero),
        _mm_set1_epi8(15),
    );
    let value = |levels: __m128i| {
        _mm256_add_ps(
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(levels)), s),
            z,
        )
    };
    for (o, b) in out[..2 * n]
        .chunks_exact_mut(16)
        .zip(packed[..n].chunks_exact(8))
    {
        let bytes = _mm_cvtsi64_si128(bytemuck::pod_read_unaligned(b));
        let lo = _mm_and_si128(bytes, low);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        // Low and high nibbles alternate: element 2i, then 2i + 1.
        let levels = _mm_unpacklo_epi8(lo, hi);
        o[..8].copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(value(levels)));
        o[8..].copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(value(_mm_srli_si128(
            levels, 8,
        ))));
    }
    let whole = n / 8 * 8;
    widen_u4_portable(&packed[whole..n], scale, zero, &mut out[2 * whole..2 * n]);
}
