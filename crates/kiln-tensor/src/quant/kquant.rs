//! CPU dequantization of the 5-bit formats and the K-quants from their GGUF bytes, with the
//! float operations in the order `gguf.quants` (and ggml's `dequantize_row_*`) use, so that the
//! results are bit-identical to theirs.

use super::f16_at;
use crate::DType;

/// 6-bit scale and min `j` (0..8) of a `Q4_K`/`Q5_K` super-block's 12 packed bytes.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// 6-bit scale `i` (0..16) of a `Q3_K` super-block's 12 packed bytes, minus 32.
pub(crate) fn scale_q3k(i: usize, s: &[u8]) -> i32 {
    let low = (s[i % 8] >> (4 * (i / 8))) & 0x0f;
    let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

/// Dequantize one block of a 5-bit or K-quant format; `out` has `dtype.block_elems()` slots.
pub(crate) fn dequantize_block(dtype: DType, blk: &[u8], out: &mut [f32]) {
    match dtype {
        DType::Q5_0 | DType::Q5_1 => {
            let d = f16_at(blk, 0);
            let (m, qh_at) = if dtype == DType::Q5_1 {
                (f16_at(blk, 2), 4)
            } else {
                (0.0, 2)
            };
            let qh =
                u32::from_le_bytes([blk[qh_at], blk[qh_at + 1], blk[qh_at + 2], blk[qh_at + 3]]);
            let qs = &blk[qh_at + 4..qh_at + 20];
            for j in 0..16 {
                let lo = u32::from(qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
                let hi = u32::from(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                if dtype == DType::Q5_1 {
                    out[j] = d * lo as f32 + m;
                    out[j + 16] = d * hi as f32 + m;
                } else {
                    out[j] = d * (lo as i32 - 16) as f32;
                    out[j + 16] = d * (hi as i32 - 16) as f32;
                }
            }
        }
        DType::Q2_K => {
            let (scales, qs) = (&blk[0..16], &blk[16..80]);
            let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
            for (e, o) in out.iter_mut().enumerate() {
                let (s, l) = (e / 32, e % 32);
                let sc = scales[e / 16];
                let dl = d * f32::from(sc & 0x0f);
                let ml = dmin * f32::from(sc >> 4);
                let q = (qs[32 * (s / 4) + l] >> (2 * (s % 4))) & 3;
                *o = dl * f32::from(q) - ml;
            }
        }
        DType::Q3_K => {
            let (hmask, qs, scales) = (&blk[0..32], &blk[32..96], &blk[96..108]);
            let d = f16_at(blk, 108);
            for (e, o) in out.iter_mut().enumerate() {
                let (s, l) = (e / 32, e % 32);
                let dl = d * scale_q3k(e / 16, scales) as f32;
                let low = i32::from((qs[32 * (s / 4) + l] >> (2 * (s % 4))) & 3);
                let high = i32::from((hmask[l] >> s) & 1);
                // The high bit set means no offset; clear means −4.
                *o = dl * (low - 4 * (1 - high)) as f32;
            }
        }
        DType::Q4_K | DType::Q5_K => {
            let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
            let scales = &blk[4..16];
            let (qh, qs) = if dtype == DType::Q5_K {
                (&blk[16..48], &blk[48..176])
            } else {
                (&blk[0..0], &blk[16..144])
            };
            for (e, o) in out.iter_mut().enumerate() {
                let (s, l) = (e / 32, e % 32);
                let (sc, m) = scale_min_k4(s, scales);
                let d1 = d * f32::from(sc);
                let m1 = dmin * f32::from(m);
                let mut q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f;
                if !qh.is_empty() {
                    q |= ((qh[l] >> s) & 1) << 4;
                }
                *o = d1 * f32::from(q) - m1;
            }
        }
        DType::Q6_K => {
            let (ql, qh, scales) = (&blk[0..128], &blk[128..192], &blk[192..208]);
            let d = f16_at(blk, 208);
            for (e, o) in out.iter_mut().enumerate() {
                let (s, l) = (e / 32, e % 32);
                let (n, qq) = (s / 4, s % 4);
                let lo = (ql[64 * n + 32 * (qq % 2) + l] >> (4 * (qq / 2))) & 0x0f;
                let hi = (qh[32 * n + l] >> (2 * qq)) & 3;
                let q = i32::from(lo | (hi << 4)) - 32;
                let dl = d * f32::from(scales[e / 16] as i8);
                *o = dl * q as f32;
            }
        }
        // Callers pass only the formats above.
        _ => {}
    }
}
