//! GGUF block formats on the CPU: quantize, dequantize, and the device layout.
//!
//! Host (GGUF) layout, 32 elements a block:
//! - `Q8_0`: f16 `d`, 32 × i8 `q`; value = q·d (34 bytes);
//! - `Q4_0`: f16 `d`, 16 bytes; low nibbles are elements 0–15, high nibbles 16–31;
//!   value = (q − 8)·d (18 bytes);
//! - `Q4_1`: f16 `d`, f16 `m`, 16 bytes of nibbles as in `Q4_0`; value = q·d + m (20 bytes).
//!
//! On the device the blocks are split into structure-of-arrays form so that every read is an
//! aligned `u32`: first the scales (two f16 per word for `Q8_0`/`Q4_0`, one `d|m` pair per word
//! for `Q4_1`), then the quants (8 words a block for `Q8_0`, 4 for the 4-bit formats). The
//! values are the same bits; nothing is requantized.

use half::f16;

use crate::{DType, QK, Result, TensorError};

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantize `blocks` (host layout) of `dtype` into `out` (32 values a block).
///
/// `out.len()` must be 32 × the number of blocks in `blocks`.
pub fn dequantize(dtype: DType, blocks: &[u8], out: &mut [f32]) -> Result<()> {
    let bb = dtype.block_bytes();
    if !dtype.is_quantized()
        || !blocks.len().is_multiple_of(bb)
        || out.len() != blocks.len() / bb * QK
    {
        return Err(TensorError::DataLength {
            what: format!("dequantize {dtype:?}"),
            expected: out.len() / QK * bb,
            got: blocks.len(),
        });
    }
    for (blk, o) in blocks.chunks_exact(bb).zip(out.chunks_exact_mut(QK)) {
        dequantize_block(dtype, blk, o);
    }
    Ok(())
}

/// Dequantize one block; `blk` has exactly `dtype.block_bytes()` bytes, `out` 32 slots.
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
            for (i, &q) in blk[2..18].iter().enumerate() {
                out[i] = (f32::from(q & 0x0f) - 8.0) * d;
                out[i + 16] = (f32::from(q >> 4) - 8.0) * d;
            }
        }
        DType::Q4_1 => {
            let d = f16_at(blk, 0);
            let m = f16_at(blk, 2);
            for (i, &q) in blk[4..20].iter().enumerate() {
                out[i] = f32::from(q & 0x0f) * d + m;
                out[i + 16] = f32::from(q >> 4) * d + m;
            }
        }
        // Callers only pass quantized dtypes (checked in `dequantize`).
        _ => {}
    }
}

/// Quantize `x` (length a multiple of 32) to `dtype`'s host layout, as ggml's reference
/// quantizers do (round-to-nearest; `Q4_0` scales by the signed absolute maximum / −8).
pub fn quantize(dtype: DType, x: &[f32]) -> Result<Vec<u8>> {
    if !dtype.is_quantized() {
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
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|i| q(b[i]) | (q(b[i + 16]) << 4)));
            }
            DType::Q4_1 => {
                let min = b.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = b.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|i| q(b[i]) | (q(b[i + 16]) << 4)));
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Word layout of `n_blocks` quantized blocks on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceQuantLayout {
    /// Word offset where the quants start (the scales occupy `[0, qs_offset)`).
    pub qs_offset: usize,
    /// Total words.
    pub words: usize,
}

pub(crate) fn device_layout(dtype: DType, n_blocks: usize) -> DeviceQuantLayout {
    let (scale_words, qs_words) = match dtype {
        DType::Q8_0 => (n_blocks.div_ceil(2), 8),
        DType::Q4_0 => (n_blocks.div_ceil(2), 4),
        _ => (n_blocks, 4), // Q4_1: d and m share a word
    };
    // The quants start 16-byte aligned, so that kernels read a block's quants as vec4<u32>.
    let qs_offset = scale_words.next_multiple_of(4);
    DeviceQuantLayout {
        qs_offset,
        words: qs_offset + n_blocks * qs_words,
    }
}

fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Host (GGUF) blocks → device words. `raw.len()` is a whole number of blocks.
pub(crate) fn to_device(dtype: DType, raw: &[u8]) -> Vec<u32> {
    let bb = dtype.block_bytes();
    let nb = raw.len() / bb;
    let layout = device_layout(dtype, nb);
    let mut w = vec![0u32; layout.words];
    let qs_per = (layout.words - layout.qs_offset) / nb.max(1);
    for (i, blk) in raw.chunks_exact(bb).enumerate() {
        let qs_base = layout.qs_offset + i * qs_per;
        match dtype {
            DType::Q8_0 | DType::Q4_0 => {
                let d = u32::from(u16::from_le_bytes([blk[0], blk[1]]));
                w[i / 2] |= d << (16 * (i % 2));
                for j in 0..qs_per {
                    w[qs_base + j] = word(&blk[2 + 4 * j..]);
                }
            }
            _ => {
                w[i] = word(blk);
                for j in 0..4 {
                    w[qs_base + j] = word(&blk[4 + 4 * j..]);
                }
            }
        }
    }
    w
}

/// Device words → host (GGUF) blocks; inverse of [`to_device`].
pub(crate) fn from_device(dtype: DType, words: &[u32], n_blocks: usize) -> Vec<u8> {
    let layout = device_layout(dtype, n_blocks);
    let qs_per = (layout.words - layout.qs_offset) / n_blocks.max(1);
    let mut out = Vec::with_capacity(n_blocks * dtype.block_bytes());
    for i in 0..n_blocks {
        let qs = &words[layout.qs_offset + i * qs_per..layout.qs_offset + (i + 1) * qs_per];
        match dtype {
            DType::Q8_0 | DType::Q4_0 => {
                let d = (words[i / 2] >> (16 * (i % 2))) as u16;
                out.extend_from_slice(&d.to_le_bytes());
            }
            _ => out.extend_from_slice(&words[i].to_le_bytes()),
        }
        for q in qs {
            out.extend_from_slice(&q.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn q4_1_block_by_hand() {
        // d = 0.25 (f16 0x3400), m = -1.0 (f16 0xBC00); byte 0 = 0x3C: element 0 = 12*0.25-1 = 2,
        // element 16 = 3*0.25-1 = -0.25; other bytes 0: value = m.
        let mut blk = vec![0x00, 0x34, 0x00, 0xBC];
        let mut qs = [0u8; 16];
        qs[0] = 0x3C;
        blk.extend_from_slice(&qs);
        let mut out = [0f32; 32];
        dequantize(DType::Q4_1, &blk, &mut out).unwrap();
        assert_eq!(out[0], 2.0);
        assert_eq!(out[16], -0.25);
        assert_eq!(out[1], -1.0);
        assert_eq!(out[31], -1.0);
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
        for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let q = quantize(dt, &x).unwrap();
            let w = to_device(dt, &q);
            assert_eq!(w.len(), device_layout(dt, 3).words);
            assert_eq!(from_device(dt, &w, 3), q);
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
