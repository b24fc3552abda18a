//! The K/V values each pool format holds, computed on the host: the reference stores rows
//! through [`store_row`] (the values, as f32) and the native backend through the same
//! quantizers ([`quantize_i8`], [`quantize_i4_row`]: the format's bytes), so both attend over
//! exactly what the device kernels reconstruct, and
//! the INT4 format's rotation and quantizer are defined here (mirrored by `kv_write.wgsl`,
//! `hadamard.wgsl` and the attention kernels), as is the centring of its keys
//! ([`KeyCentre`], mirrored by `centre.wgsl`).

use kiln_kv::KvDtype;
use kiln_tensor::RopeConfig;

/// Channel pairs per (layer, kv head) whose mean an INT4 cache takes out of its keys.
pub const CENTRED_PAIRS: usize = 8;

/// One rotated pair of key channels an INT4 cache centres. A model's keys share a large
/// mean in a few channels *before* RoPE (after it, that mean turns with the position, so no
/// fixed offset removes it); per-token INT4 spends its 15 steps on it. The cache stores
/// `k − R(p)·mean` for the key at position `p` (`R(p)`: this pair's rotation by
/// `p · freq`, as RoPE turns it) and attention adds `q · R(p)·mean` back to the score, so
/// attention is unchanged and the steps span how keys vary. Pass-through channels (past the
/// rotary dimensions) are pairs with `freq` 0.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KeyCentre {
    /// The pair's channels (RoPE's partners).
    pub lo: u16,
    pub hi: u16,
    /// Radians per position (RoPE's inverse frequency of the pair; 0 if not rotated).
    pub freq: f32,
    /// The pair's mean before RoPE: channels `lo`, `hi`.
    pub mean: [f32; 2],
}

impl KeyCentre {
    /// `R(pos)·mean` as (value at `lo`, value at `hi`): RoPE's rotation of the mean, with the
    /// angle rounded to f32 as RoPE rounds it (then evaluated in f64).
    pub(crate) fn at(&self, pos: u32) -> [f32; 2] {
        let (c, s) = RopeConfig::cos_sin(&[self.freq], pos, 0);
        let [a, b] = self.mean;
        [a * c - b * s, b * c + a * s]
    }
}

/// The [`CENTRED_PAIRS`] centres of one layer's keys per kv head (`[kv_heads, CENTRED_PAIRS]`,
/// the pairs with the largest mean first, unused entries zero), from its post-RoPE keys
/// `keys [n, kv_heads, head_dim]` at `positions` (as an F32 cache holds them): each key is
/// turned back by RoPE's rotation at its position and the pre-RoPE rows averaged.
pub fn key_centres(
    rope: &RopeConfig,
    keys: &[f32],
    positions: &[u32],
    kv_heads: usize,
) -> Vec<KeyCentre> {
    let d = rope.head_dim;
    let (rot, inv) = (rope.rotary_dim, rope.inv_freq());
    let mut pairs: Vec<(usize, usize, f32)> = (0..rot / 2)
        .map(|j| {
            let (lo, hi) = rope.pair(j);
            (lo, hi, inv[j])
        })
        .collect();
    let kept = rope.unrotated();
    pairs.extend(
        kept.clone()
            .step_by(2)
            .filter(|c| c + 1 < kept.end)
            .map(|c| (c, c + 1, 0.0)),
    );
    let mut out = vec![KeyCentre::default(); kv_heads * CENTRED_PAIRS];
    let n = positions.len().min(keys.len() / (kv_heads * d).max(1));
    if n == 0 {
        return out;
    }
    for h in 0..kv_heads {
        let mut means: Vec<KeyCentre> = pairs
            .iter()
            .map(|&(lo, hi, freq)| {
                let mut sum = [0f64; 2];
                for (t, &pos) in positions[..n].iter().enumerate() {
                    let row = &keys[(t * kv_heads + h) * d..][..d];
                    // RoPE's inverse: the rotation by -angle.
                    let turn = KeyCentre {
                        lo: 0,
                        hi: 0,
                        freq: -freq,
                        mean: [row[lo], row[hi]],
                    };
                    let pre = turn.at(pos);
                    sum[0] += f64::from(pre[0]);
                    sum[1] += f64::from(pre[1]);
                }
                KeyCentre {
                    lo: lo as u16,
                    hi: hi as u16,
                    freq,
                    mean: sum.map(|x| (x / n as f64) as f32),
                }
            })
            .collect();
        let size = |c: &KeyCentre| c.mean[0] * c.mean[0] + c.mean[1] * c.mean[1];
        means.sort_by(|a, b| size(b).total_cmp(&size(a)));
        for (o, c) in out[h * CENTRED_PAIRS..].iter_mut().zip(means) {
            *o = c;
        }
    }
    out
}

/// RoPE's (cos, sin) of each key centre's frequency at each position written so far, kept
/// by a native INT4 cache: its scores add each key's centres back, rotated to the key's
/// position, from these (looked up, not evaluated per key and query), the very values
/// [`KeyCentre::at`] took out when the key was stored.
#[derive(Debug, Clone, Default)]
pub(crate) struct CentreTurns {
    /// The distinct frequencies of the centres that move a key (a non-zero mean).
    freqs: Vec<f32>,
    /// Each centre's entry in `freqs` (none: its mean is zero, it adds nothing).
    of: Vec<Option<usize>>,
    /// Positions covered (`0..covered`), whether or not a centre needs them.
    covered: usize,
    /// `[covered, freqs]`.
    table: Vec<[f32; 2]>,
}

impl CentreTurns {
    /// The turns of `centres`, none covered yet.
    pub(crate) fn new(centres: &[KeyCentre]) -> Self {
        let mut freqs: Vec<f32> = Vec::new();
        let of = centres
            .iter()
            .map(|c| {
                (c.mean != [0.0; 2]).then(|| {
                    freqs
                        .iter()
                        .position(|f| f.to_bits() == c.freq.to_bits())
                        .unwrap_or_else(|| {
                            freqs.push(c.freq);
                            freqs.len() - 1
                        })
                })
            })
            .collect();
        Self {
            freqs,
            of,
            covered: 0,
            table: Vec::new(),
        }
    }

    /// Cover positions `0..n`.
    pub(crate) fn cover(&mut self, n: usize) {
        for pos in self.covered..n {
            let pos = pos as u32;
            let turns = self.freqs.iter().map(|&f| {
                let (c, s) = RopeConfig::cos_sin(&[f], pos, 0);
                [c, s]
            });
            self.table.extend(turns);
        }
        self.covered = self.covered.max(n);
    }

    /// Whether position `pos` is covered (or no centre needs it).
    pub(crate) fn covers(&self, pos: usize) -> bool {
        self.freqs.is_empty() || pos < self.covered
    }

    /// Whether centre `i` moves a key (its mean is not zero).
    pub(crate) fn moves(&self, i: usize) -> bool {
        self.of[i].is_some()
    }

    /// Centre `i`'s frequency's (cos, sin) at `pos` (covered), or none if it adds nothing.
    pub(crate) fn at(&self, i: usize, pos: usize) -> Option<[f32; 2]> {
        self.of[i].map(|f| self.table[pos * self.freqs.len() + f])
    }
}

/// Add `sign` × the head's centres at `pos` to a key row (−1 before storing, +1 after).
pub(crate) fn shift_row(centres: &[KeyCentre], pos: u32, sign: f32, row: &mut [f32]) {
    for c in centres {
        let [a, b] = c.at(pos);
        row[usize::from(c.lo)] += sign * a;
        row[usize::from(c.hi)] += sign * b;
    }
}

/// Store a row on the host exactly as the device format would hold it, as f32 values.
pub(crate) fn store_row(dtype: KvDtype, src: &[f32], dst: &mut [f32]) {
    match dtype {
        KvDtype::F32 => dst.copy_from_slice(src),
        KvDtype::F16 => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = half::f16::from_f32(*s).to_f32();
            }
        }
        KvDtype::Int8 => {
            let mut q = [0i8; MAX_ROW];
            let scale = quantize_i8(src, &mut q[..src.len()]);
            for (d, &q) in dst.iter_mut().zip(&q) {
                *d = f32::from(q) * scale;
            }
        }
        KvDtype::Int4 => {
            // Quantized in the rotated basis, stored back in the model's: the host attention
            // then reads exactly what the kernels reconstruct (H is its own inverse).
            let mut levels = [0u8; MAX_ROW];
            let [scale, zero] = quantize_i4_row(src, dst, &mut levels[..src.len()]);
            for (d, &l) in dst.iter_mut().zip(&levels) {
                *d = int4_value(l, scale, zero);
            }
            hadamard(dst);
        }
    }
}

/// The longest row [`store_row`] takes (the cache's largest head).
const MAX_ROW: usize = crate::MAX_HEAD_DIM;

/// An INT8 row: each value rounded (to nearest, ties to even) in steps of the row's largest
/// magnitude / 127, into `q`; returns that step (the row's scale).
pub(crate) fn quantize_i8(src: &[f32], q: &mut [i8]) -> f32 {
    let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (q, s) in q.iter_mut().zip(src) {
        *q = round_even(s * inv) as i8;
    }
    scale
}

/// An INT4 row: `src` rotated ([`hadamard`]) into `rotated`, then each rotated value's level
/// (0..=15, one a byte) into `levels`; returns the row's scale and zero point as stored (f16
/// values).
pub(crate) fn quantize_i4_row(src: &[f32], rotated: &mut [f32], levels: &mut [u8]) -> [f32; 2] {
    rotated.copy_from_slice(src);
    hadamard(rotated);
    let [scale, zero] = int4_params(rotated);
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (l, &x) in levels.iter_mut().zip(&*rotated) {
        *l = int4_level(x, zero, inv) as u8;
    }
    [scale, zero]
}

/// The value an INT4 level stands for (in the rotated basis), as `CpuContext::widen_u4`
/// computes it for the native backend's rows.
fn int4_value(level: u8, scale: f32, zero: f32) -> f32 {
    f32::from(level) * scale + zero
}

/// The Walsh–Hadamard rotation INT4 rows are quantized in, applied in place: orthonormal and
/// symmetric (its own inverse), on blocks of the largest power of two (at most 256) dividing
/// the row. K rows have a few large channels and per-token quantization spends its 15 steps
/// on them; rotated, every channel carries a share of them. Attention is unchanged by a
/// rotation applied to Q and K alike (q·k = Hq·Hk) and to V and the output (H Σ p·Hv = Σ p·v).
pub(crate) fn hadamard(x: &mut [f32]) {
    let n = hadamard_block(x.len());
    if n < 2 {
        return;
    }
    let norm = hadamard_norm(x.len());
    for block in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (block[j], block[j + h]);
                    block[j] = a + b;
                    block[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in block.iter_mut() {
            *v *= norm;
        }
    }
}

/// The rotation's block size for rows of `len`: the largest power of two dividing it, at most
/// 256.
fn hadamard_block(len: usize) -> usize {
    if len == 0 {
        return 0;
    }
    (1usize << len.trailing_zeros()).min(256)
}

/// The rotation's scale for rows of `len`: 1/sqrt(its block size).
pub(crate) fn hadamard_norm(len: usize) -> f32 {
    1.0 / (hadamard_block(len).max(1) as f32).sqrt()
}

/// `x` rounded to the nearest integer, ties to even: `f32::round_ties_even`, which on
/// x86-64 without SSE4.1 (the baseline kiln builds for) is a call into libm for every value
/// the quantizers round. Below 2^22 in magnitude, adding 1.5 · 2^23 lands where the float
/// steps are whole numbers, so the sum is rounded to one (to nearest, ties to even) and
/// taking it away again is exact. (A result of zero may lose its sign, which no level or
/// quant keeps.)
fn round_even(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    if x.abs() < 4_194_304.0 {
        (x + SHIFT) - SHIFT
    } else {
        x.round_ties_even()
    }
}

/// The quantization level of `x` (0..=15) against a row's scale inverse and zero point.
fn int4_level(x: f32, zero: f32, inv: f32) -> f32 {
    round_even((x - zero) * inv).clamp(0.0, 15.0)
}

/// Range shrink factors the INT4 quantizer tries per row (around the row's midpoint),
/// keeping the one with the least squared error: clipping the extremes of a rotated row buys
/// finer steps for the rest.
const INT4_CLIPS: [f32; 6] = [1.0, 0.95, 0.9, 0.85, 0.8, 0.75];

/// The INT4 scale and zero point of a (rotated) head row as stored (f16): for each of
/// [`INT4_CLIPS`], the row's range shrunk by it around its midpoint, in 15 steps from its
/// low end; the first with the least squared error wins. Quantizing against the stored
/// (f16-rounded, clamped to f16's finite range) values keeps the error what the kernels
/// reconstruct.
fn int4_params(src: &[f32]) -> [f32; 2] {
    if src.is_empty() {
        return [0.0, 0.0];
    }
    let (lo, hi) = src
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let f16 = |x: f32| half::f16::from_f32(x.clamp(-F16_MAX, F16_MAX)).to_f32();
    let (mid, half_range) = (0.5 * (lo + hi), 0.5 * (hi - lo));
    let mut best = (f32::INFINITY, [0.0, 0.0]);
    for clip in INT4_CLIPS {
        let low = mid - half_range * clip;
        let (scale, zero) = (f16(2.0 * half_range * clip / 15.0), f16(low));
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let err: f32 = src
            .iter()
            .map(|&x| {
                let e = int4_level(x, zero, inv) * scale + zero - x;
                e * e
            })
            .sum();
        if err < best.0 {
            best = (err, [scale, zero]);
        }
    }
    best.1
}

const F16_MAX: f32 = 65504.0;

#[cfg(test)]
mod tests {
    use super::round_even;

    /// Halves of both parities, values a step off them, the edges of the shortcut and
    /// beyond, and non-finite values round as `round_ties_even` does.
    #[test]
    fn round_even_is_round_ties_even() {
        let mut xs = vec![
            0.0f32, -0.0, 1e-30, 0.49999997, 0.5, 1.5, 2.5, -2.5, -3.5, 126.5,
        ];
        xs.extend([127.49, 4_194_303.5, 4_194_304.0, 4_194_305.0, 1e9, f32::MAX]);
        xs.extend([f32::INFINITY, f32::NEG_INFINITY]);
        for i in 0..100_000 {
            xs.push((i as f32 - 50_000.0) * 0.0625);
            xs.push(f32::from_bits(0x3f00_0000 + i * 97));
        }
        for x in xs {
            let (got, want) = (round_even(x), x.round_ties_even());
            assert!(got == want, "{x}: {got} not {want}");
        }
        assert!(round_even(f32::NAN).is_nan());
    }
}
