//! The one place in kiln where `unsafe` is allowed: calls into the `#[target_feature]`
//! kernels of `x86`, each made only after the CPU was checked for those features
//! ([`Isa::detect`] caps every [`CpuContext`](super::CpuContext)'s level). A tidy test fails
//! on `unsafe` anywhere else.
#![allow(unsafe_code)]

use half::f16;

use super::dot::{Rows, rows_portable};
use super::vector::{
    axpy_portable, axpys_portable, dot_portable, dots_portable, widen_i8_portable,
    widen_u4_portable,
};
use super::{Isa, QuantX};

/// `out[r·m + i]` = row r of `rows` · row i of `x`, at level `isa` (which the CPU must have).
pub(crate) fn rows(isa: Isa, rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::{fid, rows_avx2, rows_avx512};
        use crate::DType;
        debug_assert!(isa <= Isa::detect());
        macro_rules! call {
            ($kernel:ident) => {
                match rows.dtype {
                    // SAFETY: `isa` is at most `Isa::detect()`, which saw the kernel's features.
                    DType::Q8_0 => unsafe { $kernel::<{ fid::Q8_0 }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q4_0 => unsafe { $kernel::<{ fid::Q4_0 }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q4_1 => unsafe { $kernel::<{ fid::Q4_1 }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q5_0 => unsafe { $kernel::<{ fid::Q5_0 }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q5_1 => unsafe { $kernel::<{ fid::Q5_1 }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q2_K => unsafe { $kernel::<{ fid::Q2_K }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q3_K => unsafe { $kernel::<{ fid::Q3_K }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q4_K => unsafe { $kernel::<{ fid::Q4_K }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q5_K => unsafe { $kernel::<{ fid::Q5_K }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q6_K => unsafe { $kernel::<{ fid::Q6_K }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q4_Z => unsafe { $kernel::<{ fid::Q4_Z }>(rows, x, out) },
                    // SAFETY: as above.
                    DType::Q8_Z => unsafe { $kernel::<{ fid::Q8_Z }>(rows, x, out) },
                    _ => rows_portable(rows, x, out),
                }
            };
        }
        match isa {
            Isa::Avx512 => return call!(rows_avx512),
            Isa::Avx2 => return call!(rows_avx2),
            Isa::Scalar => {}
        }
    }
    let _ = isa;
    rows_portable(rows, x, out)
}

macro_rules! vector {
    ($dot:ident, $axpy:ident, $elem:ty) => {
        /// `vector::dot_portable` at level `isa` (which the CPU must have).
        pub(crate) fn $dot(isa: Isa, a: &[f32], b: &[$elem]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            if isa >= Isa::Avx2 {
                debug_assert!(isa <= Isa::detect());
                // SAFETY: `isa` is at most `Isa::detect()`, which saw AVX2, FMA and F16C.
                return unsafe { super::x86::$dot(a, b) };
            }
            let _ = isa;
            dot_portable(a, b)
        }

        /// `vector::axpy_portable` at level `isa` (which the CPU must have).
        pub(crate) fn $axpy(isa: Isa, w: f32, x: &[$elem], y: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if isa >= Isa::Avx2 {
                debug_assert!(isa <= Isa::detect());
                // SAFETY: as above.
                return unsafe { super::x86::$axpy(w, x, y) };
            }
            let _ = isa;
            axpy_portable(w, x, y)
        }
    };
}

vector!(dot_f32, axpy_f32, f32);
vector!(dot_f16, axpy_f16, f16);

macro_rules! many {
    ($dots:ident, $axpys:ident, $elem:ty) => {
        /// `vector::dots_portable` at level `isa` (which the CPU must have).
        pub(crate) fn $dots(
            isa: Isa,
            a: &[f32],
            pool: &[$elem],
            starts: &[usize],
            out: &mut [f32],
        ) {
            assert!(starts.iter().all(|&s| s + a.len() <= pool.len()) && out.len() >= starts.len());
            #[cfg(target_arch = "x86_64")]
            if isa >= Isa::Avx2 {
                debug_assert!(isa <= Isa::detect());
                // SAFETY: `isa` is at most `Isa::detect()`, which saw AVX2, FMA and F16C.
                return unsafe { super::x86::$dots(a, pool, starts, out) };
            }
            let _ = isa;
            dots_portable(a, pool, starts, out)
        }

        /// `vector::axpys_portable` at level `isa` (which the CPU must have).
        pub(crate) fn $axpys(isa: Isa, w: &[f32], pool: &[$elem], starts: &[usize], y: &mut [f32]) {
            assert!(starts.iter().all(|&s| s + y.len() <= pool.len()) && w.len() >= starts.len());
            #[cfg(target_arch = "x86_64")]
            if isa >= Isa::Avx2 {
                debug_assert!(isa <= Isa::detect());
                // SAFETY: as above.
                return unsafe { super::x86::$axpys(w, pool, starts, y) };
            }
            let _ = isa;
            axpys_portable(w, pool, starts, y)
        }
    };
}

many!(dots_f32, axpys_f32, f32);
many!(dots_f16, axpys_f16, f16);

/// `vector::widen_i8_portable` at level `isa` (which the CPU must have).
pub(crate) fn widen_i8(isa: Isa, q: &[i8], scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        debug_assert!(isa <= Isa::detect());
        // SAFETY: `isa` is at most `Isa::detect()`, which saw AVX2.
        return unsafe { super::x86::widen_i8(q, scale, out) };
    }
    let _ = isa;
    widen_i8_portable(q, scale, out)
}

/// `vector::widen_u4_portable` at level `isa` (which the CPU must have).
pub(crate) fn widen_u4(isa: Isa, packed: &[u8], scale: f32, zero: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        debug_assert!(isa <= Isa::detect());
        // SAFETY: `isa` is at most `Isa::detect()`, which saw AVX2.
        return unsafe { super::x86::widen_u4(packed, scale, zero, out) };
    }
    let _ = isa;
    widen_u4_portable(packed, scale, zero, out)
}
