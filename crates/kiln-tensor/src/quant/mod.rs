//! Block formats on the CPU: dequantize (the reference of the kernels), quantize (the
//! 32-element formats but the 5-bit ones, for load-time `--quantize` and test data), and the
//! device layout (`layout`).
//!
//! Host layouts (GGUF's as ggml defines them, and kiln's own `Q4_Z`, `Q8_Z`):
//! - `Q8_0`: f16 `d`, 32 × i8 `q`; value = q·d (34 bytes);
//! - `Q4_0`: f16 `d`, 16 bytes; low nibbles are elements 0–15, high nibbles 16–31;
//!   value = (q − 8)·d (18 bytes);
//! - `Q4_1`: f16 `d`, f16 `m`, 16 bytes of nibbles as in `Q4_0`; value = q·d + m (20 bytes);
//! - `Q4_Z` (kiln's, for GPTQ/AWQ/compressed-tensors 4-bit): f16 `d`, f16 `z`, 16 bytes of
//!   nibbles as in `Q4_0`; value = (q − z)·d (20 bytes); `Q8_Z`: f16 `d`, f16 `z`, 32 × u8 `q`;
//!   (q − z)·d (36). Computed in that order, in f32.
//! - `Q5_0`: f16 `d`, u32 `qh` (bit j is bit 4 of element j), nibbles as in `Q4_0`;
//!   value = (q − 16)·d (22 bytes); `Q5_1`: f16 `d`, f16 `m`, `qh`, nibbles; q·d + m (24);
//! - `Q2_K` (84 bytes a 256-element super-block): 16 bytes of (scale, min) nibbles for each
//!   16 elements, 64 bytes of 2-bit quants, f16 `d`, `dmin`; value = d·sc·q − dmin·m;
//! - `Q3_K` (110): 32 bytes of high bits, 64 of 2-bit quants, 12 bytes of 16 packed 6-bit
//!   scales, f16 `d`; value = d·(sc − 32)·(q − 4·!high);
//! - `Q4_K` (144): f16 `d`, `dmin`, 12 bytes of 8 packed 6-bit (scale, min), 128 bytes of
//!   nibbles; value = d·sc·q − dmin·m per 32 elements; `Q5_K` (176) adds 32 bytes of high
//!   bits before the nibbles;
//! - `Q6_K` (210): 128 bytes of low nibbles, 64 of 2-bit highs, 16 × i8 scales, f16 `d`;
//!   value = d·sc·(q − 32) per 16 elements.
//!
//! Element order within a K-quant super-block is ggml's (see `kquant.rs` for the indices).

mod format;
mod kquant;
mod layout;

use half::f16;

pub(crate) use format::{BlockSums, Format, Ints, scales};
pub(crate) use layout::{device_block_bytes, device_layout, from_device, to_device};

use crate::{DType, QK, Result, TensorError};

pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Checks that every block of `blocks` (host layout, whole blocks) has finite f16 scales: a
/// NaN or infinite scale is a corrupted file, and would poison every logit it touches.
pub(crate) fn check_blocks(dtype: DType, blocks: &[u8]) -> Result<()> {
    let format = dtype.format();
    let offsets = format.scale_offsets;
    if offsets.is_empty() && format.check.is_none() {
        return Ok(());
    }
    for (i, blk) in blocks.chunks_exact(dtype.block_bytes()).enumerate() {
        if let Some(problem) = format.check.and_then(|check| check(blk)) {
            return Err(TensorError::Invalid {
                op: "upload",
                detail: format!("{dtype:?} block {i} {problem}: the tensor data is corrupted"),
            });
        }
        for &at in offsets {
            let v = f16_at(blk, at);
            if !v.is_finite() {
                return Err(TensorError::Invalid {
                    op: "upload",
                    detail: format!(
                        "{dtype:?} block {i} has a non-finite scale ({v} at byte {at} of the \
                         block): the tensor data is corrupted"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Dequantize `blocks` (host layout) of `dtype` into `out` (`dtype.block_elems()` values a
/// block).
///
/// `out.len()` must be the block size × the number of blocks in `blocks`.
pub fn dequantize(dtype: DType, blocks: &[u8], out: &mut [f32]) -> Result<()> {
    let (bb, be) = (dtype.block_bytes(), dtype.block_elems());
    if !dtype.is_quantized()
        || !blocks.len().is_multiple_of(bb)
        || out.len() != blocks.len() / bb * be
    {
        return Err(TensorError::DataLength {
            what: format!("dequantize {dtype:?}"),
            expected: out.len() / be * bb,
            got: blocks.len(),
        });
    }
    for (blk, o) in blocks.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(dtype, blk, o);
    }
    Ok(())
}

/// Dequantize one block; `blk` has exactly `dtype.block_bytes()` bytes, `out` one slot an
/// element.
pub(crate) fn dequantize_block(dtype: DType, blk: &[u8], out: &mut [f32]) {
    match dtype {
        DType::Q8_0 => {
            let d = f16_at(blk, 0);
            for (o, &q) in out.iter_mut().zip(&blk[2..34]) {
                *o = f32::from(q as i8) * d;
            }
        }
        DType::Q4_0 => {
            let d = f16_at(blk, 0);
            nibbles(&blk[2..18], out, |q| (q - 8.0) * d);
        }
        DType::Q4_1 => {
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            nibbles(&blk[4..20], out, |q| q * d + m);
        }
        DType::Q4_Z => {
            let (d, z) = (f16_at(blk, 0), f16_at(blk, 2));
            nibbles(&blk[4..20], out, |q| (q - z) * d);
        }
        DType::Q8_Z => {
            let (d, z) = (f16_at(blk, 0), f16_at(blk, 2));
            for (o, &q) in out.iter_mut().zip(&blk[4..36]) {
                *o = (f32::from(q) - z) * d;
            }
        }
        DType::MXFP4 => {
            let d = e8m0_half(blk[0]);
            let v = |q: f32| f32::from(format::MXFP4_VALUES[q as usize]) * d;
            nibbles(&blk[1..17], out, v);
        }
        DType::FP8 => {
            let d = f32_at(blk, 0);
            for (o, &q) in out.iter_mut().zip(&blk[4..36]) {
                *o = e4m3(q) * d;
            }
        }
        _ => kquant::dequantize_block(dtype, blk, out),
    }
}

/// The little-endian f32 at byte `at` of a block.
fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The value of an OCP E4M3 (`float8_e4m3fn`) code: sign, 4 exponent bits (bias 7), 3
/// mantissa bits; subnormals at exponent 0 (m·2⁻⁹); no infinities. The NaN codes (`0x7f`,
/// `0xff`) give NaN; [`check_fp8`] keeps them off the device.
pub(crate) fn e4m3(q: u8) -> f32 {
    let (e, m) = (u32::from(q >> 3) & 0xf, u32::from(q & 7));
    let v = if e == 0 {
        m as f32 * (1.0 / 512.0)
    } else if e == 15 && m == 7 {
        f32::NAN
    } else {
        // Rebiased from 7 to 127, the mantissa at the top of f32's.
        f32::from_bits(((e + 120) << 23) | (m << 20))
    };
    if q & 0x80 != 0 { -v } else { v }
}

/// What is wrong with a block a format's own check refuses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum BadBlock {
    NonFiniteScale(f32),
    /// An E4M3 NaN code, at this element.
    NanCode(usize),
}

impl std::fmt::Display for BadBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadBlock::NonFiniteScale(d) => write!(f, "has a non-finite scale ({d})"),
            BadBlock::NanCode(j) => write!(f, "holds the E4M3 NaN code at element {j}"),
        }
    }
}

/// What is wrong with an `FP8` block: a scale that is not finite, or a NaN code.
pub(crate) fn check_fp8(blk: &[u8]) -> Option<BadBlock> {
    let d = f32_at(blk, 0);
    if !d.is_finite() {
        return Some(BadBlock::NonFiniteScale(d));
    }
    blk[4..36]
        .iter()
        .position(|&q| q & 0x7f == 0x7f)
        .map(BadBlock::NanCode)
}

/// Half the power of two an E8M0 exponent byte `e` stands for, 2^(e − 128), as ggml's
/// `ggml_e8m0_to_fp32_half` builds it (bits of an f32: a subnormal for e < 2). MXFP4 stores
/// its E2M1 values doubled, so this is the scale of its quants.
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let e = u32::from(e);
    f32::from_bits(if e < 2 {
        0x0020_0000 << e
    } else {
        (e - 1) << 23
    })
}

/// The 32 values of 16 nibble bytes (byte j: element j low, j + 16 high), each quant mapped
/// through `value`.
fn nibbles(qs: &[u8], out: &mut [f32], value: impl Fn(f32) -> f32) {
    for (i, &q) in qs.iter().enumerate() {
        out[i] = value(f32::from(q & 0x0f));
        out[i + 16] = value(f32::from(q >> 4));
    }
}

/// The 16 nibble bytes of 32 values (element j low, j + 16 high) quantized by `q`.
fn pack_nibbles(b: &[f32], q: impl Fn(f32) -> u8, out: &mut Vec<u8>) {
    out.extend((0..16).map(|i| q(b[i]) | (q(b[i + 16]) << 4)));
}

/// Quantize `x` (length a multiple of 32) to `dtype`'s host layout, as ggml's reference
/// quantizers do (round-to-nearest; `Q4_0` scales by the signed absolute maximum / −8);
/// `Q4_Z`/`Q8_Z` by each block's range (0 included) with an integer zero point.
/// Supports `Q8_0`, `Q4_0`, `Q4_1`, `Q4_Z` and `Q8_Z`; the other formats are only read.
pub fn quantize(dtype: DType, x: &[f32]) -> Result<Vec<u8>> {
    if !matches!(
        dtype,
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4_Z | DType::Q8_Z
    ) {
        return Err(TensorError::DType {
            op: "quantize",
            what: "the target format",
            dtype,
        });
    }
    if !x.len().is_multiple_of(QK) {
        return Err(TensorError::Invalid {
            op: "quantize",
            detail: format!(
                "{} elements is not a multiple of the block size {QK}",
                x.len()
            ),
        });
    }
    let mut out = Vec::with_capacity(x.len() / QK * dtype.block_bytes());
    for b in x.chunks_exact(QK) {
        match dtype {
            DType::Q8_0 => {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
            DType::Q4_0 => {
                let mut max = 0f32;
                for &v in b {
                    if v.abs() > max.abs() {
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                pack_nibbles(b, |v| ((v * id + 8.5) as i32).clamp(0, 15) as u8, &mut out);
            }
            DType::Q4_1 => {
                let min = b.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = b.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                pack_nibbles(
                    b,
                    |v| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8,
                    &mut out,
                );
            }
            DType::Q4_Z | DType::Q8_Z => {
                let qmax = if dtype == DType::Q4_Z { 15.0 } else { 255.0 };
                // The range takes in 0, as GPTQ's asymmetric quantizer does, so that the zero
                // point is an integer in 0..=qmax and 0 is exact.
                let min = b.iter().fold(0f32, |a, &v| a.min(v));
                let max = b.iter().fold(0f32, |a, &v| a.max(v));
                // Quantize against the f16 scale that is stored.
                let d = f16::from_f32((max - min) / qmax);
                let id = if d.to_f32() != 0.0 {
                    1.0 / d.to_f32()
                } else {
                    0.0
                };
                let z = (-min * id).round().clamp(0.0, qmax);
                out.extend_from_slice(&d.to_le_bytes());
                out.extend_from_slice(&f16::from_f32(z).to_le_bytes());
                let q = |v: f32| (v * id + z).round().clamp(0.0, qmax) as u8;
                if dtype == DType::Q4_Z {
                    pack_nibbles(b, q, &mut out);
                } else {
                    out.extend(b.iter().map(|&v| q(v)));
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// How far each output of X `[m, k]` · W `[n, k]`ᵀ may move when X is quantized to 8 bits a
/// [`QK`]-element block, as the native CPU backend and the integer dot product kernel do: each
/// element by at most half a step (its block's max |x| / 254), so output (i, r) by
/// Σ_c |w_rc|·step_c / 2. `w` is the weight as the reference dequantizes it, `k` a multiple of
/// [`QK`]; `m·n` bounds, row-major. The f32 sums' own rounding is the caller's to add. Tests
/// and `kiln-bench gpu-check` hold those backends to it.
pub fn int8_activation_bounds(x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
    let half_steps: Vec<f32> = x
        .chunks_exact(QK)
        .map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) / 254.0)
        .collect();
    let (k, blocks) = (k.max(QK), (k / QK).max(1));
    let mut out = Vec::with_capacity(x.len() / k * (w.len() / k));
    for row in half_steps.chunks_exact(blocks) {
        for wr in w.chunks_exact(k) {
            let per_block = wr
                .chunks_exact(QK)
                .map(|b| b.iter().map(|v| v.abs()).sum::<f32>());
            out.push(per_block.zip(row).map(|(wsum, h)| wsum * h).sum());
        }
    }
    out
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn blocks_with_a_non_finite_scale_are_refused() {
        for (dtype, at) in [
            (DType::Q4_K, 2),
            (DType::Q6_K, 208),
            (DType::Q3_K, 108),
            (DType::Q4_Z, 2),
            (DType::Q8_Z, 2),
        ] {
            let mut blocks = vec![0u8; 3 * dtype.block_bytes()];
            assert!(check_blocks(dtype, &blocks).is_ok());
            // Block 2's scale becomes +inf (f16 0x7c00), then NaN (0x7e00).
            for bits in [0x7c00u16, 0x7e00] {
                let b = 2 * dtype.block_bytes() + at;
                blocks[b..b + 2].copy_from_slice(&bits.to_le_bytes());
                let e = check_blocks(dtype, &blocks).unwrap_err().to_string();
                assert!(e.contains("block 2 has a non-finite scale"), "{e}");
            }
        }
    }

    /// Values worked out by hand from raw block bytes.
    #[test]
    fn q8_0_block_by_hand() {
        // d = 0.5 (f16 0x3800), q = 0, 1, -1, 2, -128, 127, then zeros.
        let mut blk = vec![0x00, 0x38];
        let mut qs = [0i8; 32];
        qs[..6].copy_from_slice(&[0, 1, -1, 2, -128, 127]);
        blk.extend(qs.iter().map(|&q| q as u8));
        let mut out = [0f32; 32];
        dequantize(DType::Q8_0, &blk, &mut out).unwrap();
        assert_eq!(&out[..6], &[0.0, 0.5, -0.5, 1.0, -64.0, 63.5]);
        assert!(out[6..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn q4_0_block_by_hand() {
        // d = 2.0 (f16 0x4000); byte 0 = 0xF0: element 0 = (0-8)*2 = -16, element 16 = (15-8)*2 = 14;
        // byte 15 = 0x98: element 15 = (8-8)*2 = 0, element 31 = (9-8)*2 = 2.
        let mut blk = vec![0x00, 0x40];
        let mut qs = [0x88u8; 16];
        qs[0] = 0xF0;
        qs[15] = 0x98;
        blk.extend_from_slice(&qs);
        let mut out = [0f32; 32];
        dequantize(DType::Q4_0, &blk, &mut out).unwrap();
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
        assert_eq!(out[15], 0.0);
        assert_eq!(out[31], 2.0);
        assert_eq!(out[1], 0.0);
    }

    /// One nibble block under two heads. Q4_1: d = 0.25 (f16 0x3400), m = −1 (0xBC00).
    /// Q4_Z: d = 0.25, z = 0.5 (0x3800), not an integer. Byte 0 = 0x3C holds q = 12 (element
    /// 0) and q = 3 (element 16); the other bytes are 0.
    #[test]
    fn q4_1_and_q4_z_blocks_by_hand() {
        for (dt, head, want) in [
            // 12·0.25 − 1, 3·0.25 − 1, then m.
            (
                DType::Q4_1,
                [0x00, 0x34, 0x00, 0xBC],
                [2.0, -0.25, -1.0, -1.0],
            ),
            // (12 − 0.5)·0.25, (3 − 0.5)·0.25, then (0 − 0.5)·0.25.
            (
                DType::Q4_Z,
                [0x00, 0x34, 0x00, 0x38],
                [2.875, 0.625, -0.125, -0.125],
            ),
        ] {
            let mut blk = head.to_vec();
            let mut qs = [0u8; 16];
            qs[0] = 0x3C;
            blk.extend_from_slice(&qs);
            let mut out = [0f32; 32];
            dequantize(dt, &blk, &mut out).unwrap();
            assert_eq!([out[0], out[16], out[1], out[31]], want, "{dt:?}");
        }
    }

    /// Q4_Z with z = 8 is Q4_0: the same nibbles and scale give the same values.
    #[test]
    fn q4_z_with_zero_point_8_is_q4_0() {
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = (j as u8 * 37) ^ 0xA5;
        }
        // d = 2.0 (f16 0x4000), z = 8.0 (f16 0x4800).
        let q40: Vec<u8> = [0x00, 0x40].iter().chain(&qs).copied().collect();
        let q4z: Vec<u8> = [0x00, 0x40, 0x00, 0x48]
            .iter()
            .chain(&qs)
            .copied()
            .collect();
        let (mut a, mut b) = ([0f32; 32], [0f32; 32]);
        dequantize(DType::Q4_0, &q40, &mut a).unwrap();
        dequantize(DType::Q4_Z, &q4z, &mut b).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn q8_z_block_by_hand() {
        // d = 0.5 (f16 0x3800), z = 128 (f16 0x5800); q = 0, 128, 255, 1 (unsigned).
        let mut blk = vec![0x00, 0x38, 0x00, 0x58];
        let mut qs = [128u8; 32];
        qs[..4].copy_from_slice(&[0, 128, 255, 1]);
        blk.extend_from_slice(&qs);
        let mut out = [0f32; 32];
        dequantize(DType::Q8_Z, &blk, &mut out).unwrap();
        assert_eq!(&out[..4], &[-64.0, 0.0, 63.5, -63.5]);
        assert!(out[4..].iter().all(|&v| v == 0.0));
        // d = 0.25 (0x3400), z = 2.5 (0x4100): q = 0 → −0.625, q = 3 → 0.125.
        blk[..4].copy_from_slice(&[0x00, 0x34, 0x00, 0x41]);
        blk[4..6].copy_from_slice(&[0, 3]);
        dequantize(DType::Q8_Z, &blk, &mut out).unwrap();
        assert_eq!(&out[..2], &[-0.625, 0.125]);
    }

    /// The zero-point quantizers store an integer zero point in range, and a block holding
    /// only integers times a power of two comes back exactly.
    #[test]
    fn zero_point_quantizers_store_integer_zero_points() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 7 % 16) as f32 - 5.0) * 0.5).collect();
        for (dt, qmax) in [(DType::Q4_Z, 15.0), (DType::Q8_Z, 255.0)] {
            let q = quantize(dt, &x).unwrap();
            for blk in q.chunks_exact(dt.block_bytes()) {
                let z = f16_at(blk, 2);
                assert!(
                    z.fract() == 0.0 && (0.0..=qmax).contains(&z),
                    "{dt:?} z = {z}"
                );
            }
        }
        // Values −2.5 … 5 in steps of 0.5: 15 steps, so Q4_Z has d = 0.5, z = 5 exactly.
        let q = quantize(DType::Q4_Z, &x).unwrap();
        let mut y = vec![0f32; 64];
        dequantize(DType::Q4_Z, &q, &mut y).unwrap();
        assert_eq!(y, x);
    }

    #[test]
    fn quantize_roundtrip_error_is_bounded() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for (dt, rel) in [
            (DType::Q8_0, 0.01),
            (DType::Q4_0, 0.15),
            (DType::Q4_1, 0.08),
            // Steps of (range with 0) / 15 or / 255, the range at most twice the maximum.
            (DType::Q4_Z, 0.07),
            (DType::Q8_Z, 0.005),
        ] {
            let q = quantize(dt, &x).unwrap();
            assert_eq!(q.len(), x.len() / 32 * dt.block_bytes());
            let mut y = vec![0f32; x.len()];
            dequantize(dt, &q, &mut y).unwrap();
            for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, c) in xb.iter().zip(yb) {
                    assert!((a - c).abs() <= rel * amax, "{dt:?} block {b}: {a} vs {c}");
                }
            }
        }
    }

    #[test]
    fn device_layout_roundtrips() {
        let x: Vec<f32> = (0..96).map(|i| (i as f32).sin()).collect();
        for dt in [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q4_Z,
            DType::Q8_Z,
        ] {
            let q = quantize(dt, &x).unwrap();
            let w = to_device(dt, &q);
            assert_eq!(w.len(), device_layout(dt, 3).words);
            assert_eq!(from_device(dt, bytemuck::cast_slice(&w), 3), q);
        }
    }

    /// The zero-point formats on the device: a `d|z` head word a block, then the quants
    /// verbatim from a 16-byte boundary; any bytes come back as they went in.
    #[test]
    fn zero_point_device_layout() {
        for (dt, quant_words) in [(DType::Q4_Z, 4), (DType::Q8_Z, 8)] {
            let bb = dt.block_bytes();
            let raw: Vec<u8> = (0..5 * bb)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
                .collect();
            let w = to_device(dt, &raw);
            // 5 head words, padded to 8, then 5 blocks of quants.
            assert_eq!(device_layout(dt, 5).qs_offset, 8);
            assert_eq!(w.len(), 8 + 5 * quant_words);
            let dev: &[u8] = bytemuck::cast_slice(&w);
            for (i, blk) in raw.chunks_exact(bb).enumerate() {
                assert_eq!(&dev[4 * i..4 * i + 4], &blk[..4], "{dt:?} head {i}");
                let q = 32 + i * quant_words * 4;
                assert_eq!(&dev[q..q + bb - 4], &blk[4..], "{dt:?} quants {i}");
            }
            assert_eq!(from_device(dt, dev, 5), raw, "{dt:?}");
            assert!(device_block_bytes(dt) >= bb.next_multiple_of(4));
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut out = [0f32; 32];
        assert!(dequantize(DType::Q8_0, &[0u8; 33], &mut out).is_err());
        assert!(dequantize(DType::F32, &[0u8; 4], &mut out[..1]).is_err());
        assert!(quantize(DType::Q4_0, &[0.0; 31]).is_err());
        assert!(quantize(DType::F16, &[0.0; 32]).is_err());
    }
}
