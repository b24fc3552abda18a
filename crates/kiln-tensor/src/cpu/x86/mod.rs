//! x86-64 kernels: each format's 32-element group decoded into one register of `i8`, its
//! exact integer dot with X's group taken, then the float steps `dot::rows_portable`
//! defines.
//!
//! Two levels share the tile kernel's body (the `tile_kernel!` macro): AVX2 (`vpmaddubsw` +
//! `vpmaddwd`, eight rows of X a register) and AVX-512 VNNI (`vpdpbusd`, sixteen). Both
//! give the same integer sums, so the same results. Both levels also use F16C (the blocks'
//! f16 scales, widened exactly as `scale_at` does). The bodies are safe Rust: intrinsics are
//! safe inside a function with the matching `target_feature`, and loads go through
//! `bytemuck` from slices.

use std::arch::x86_64::*;
use std::cell::RefCell;

mod vector;
pub(super) use vector::*;

use super::QuantX;

use super::act::{CHUNKS, TILE};
use super::dot::{Rows, group_scales, offset_term};
use crate::DType;
use crate::quant::{Format, Ints};

/// Format ids of the const-generic kernels (enums cannot be const parameters).
pub(super) mod fid {
    // Kept in step with `dtype_of` and `dispatch::rows`.
    pub const Q8_0: u8 = 0;
    pub const Q4_0: u8 = 1;
    pub const Q4_1: u8 = 2;
    pub const Q5_0: u8 = 3;
    pub const Q5_1: u8 = 4;
    pub const Q2_K: u8 = 5;
    pub const Q3_K: u8 = 6;
    pub const Q4_K: u8 = 7;
    pub const Q5_K: u8 = 8;
    pub const Q6_K: u8 = 9;
    pub const Q4_Z: u8 = 10;
    pub const Q8_Z: u8 = 11;
}

const fn dtype_of(f: u8) -> DType {
    match f {
        fid::Q8_0 => DType::Q8_0,
        fid::Q4_0 => DType::Q4_0,
        fid::Q4_1 => DType::Q4_1,
        fid::Q5_0 => DType::Q5_0,
        fid::Q5_1 => DType::Q5_1,
        fid::Q2_K => DType::Q2_K,
        fid::Q3_K => DType::Q3_K,
        fid::Q4_K => DType::Q4_K,
        fid::Q5_K => DType::Q5_K,
        fid::Q6_K => DType::Q6_K,
        fid::Q4_Z => DType::Q4_Z,
        _ => DType::Q8_Z,
    }
}

const fn format_of(f: u8) -> &'static Format {
    dtype_of(f).format()
}

const fn ints(f: u8) -> &'static Ints {
    match &format_of(f).ints {
        Some(i) => i,
        None => unreachable!(),
    }
}

/// 32-element groups a block of format `f` (8 for the K-quants' super-blocks).
const fn groups_per_block(f: u8) -> usize {
    format_of(f).block_elems / 32
}

/// Whether format `f`'s scales change every 16 elements (its halves may differ).
const fn halves_differ(f: u8) -> bool {
    ints(f).span == 16
}

#[inline(always)]
fn ints_of<const F: u8>() -> &'static Ints {
    const { ints(F) }
}

/// The f16 at byte `at` of a block, widened (exact, as the table's `scale_at`).
#[inline]
#[target_feature(enable = "f16c")]
fn half_at(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

/// `Ints::scales` of format `F`, called directly so that it inlines, its f16 fields read by
/// F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn scales<const F: u8>(blk: &[u8], g: usize) -> [f32; 4] {
    use crate::quant::scales as s;
    let h = |b: &[u8], at: usize| half_at(b, at);
    match F {
        fid::Q8_0 => s::q8_0(blk, g, h),
        fid::Q4_0 => s::q4_0(blk, g, h),
        fid::Q4_1 => s::q4_1(blk, g, h),
        fid::Q5_0 => s::q5_0(blk, g, h),
        fid::Q5_1 => s::q5_1(blk, g, h),
        fid::Q2_K => s::q2_k(blk, g, h),
        fid::Q3_K => s::q3_k(blk, g, h),
        fid::Q4_K => s::q4_k(blk, g, h),
        fid::Q5_K => s::q5_k(blk, g, h),
        fid::Q6_K => s::q6_k(blk, g, h),
        fid::Q4_Z => s::q4_z(blk, g, h),
        _ => s::q8_z(blk, g, h),
    }
}

#[target_feature(enable = "avx2")]
fn load32(b: &[u8]) -> __m256i {
    bytemuck::pod_read_unaligned(&b[..32])
}

#[target_feature(enable = "avx2")]
fn load16(b: &[u8]) -> __m128i {
    bytemuck::pod_read_unaligned(&b[..16])
}

/// Bytes shifted right by `n` bits, masked to `mask` (within each byte).
#[target_feature(enable = "avx2")]
fn field(v: __m256i, n: u32, mask: i8) -> __m256i {
    let s = _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    _mm256_and_si256(s, _mm256_set1_epi8(mask))
}

/// 16 nibble bytes as 32 elements: byte j gives element j (low) and j + 16 (high).
#[target_feature(enable = "avx2")]
fn nibbles(b: &[u8]) -> __m256i {
    let v = load16(b);
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(v, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
    _mm256_set_m128i(hi, lo)
}

/// Byte j = `bit` where bit j of `bits` is set, else 0.
#[target_feature(enable = "avx2")]
fn spread_bits(bits: u32, bit: i8) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    let which = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(v, which);
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(bit))
}

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The 32 quants of group `g` of a block, as `Ints::quants` of the format defines them.
#[target_feature(enable = "avx2")]
fn quants<const F: u8>(blk: &[u8], g: usize) -> __m256i {
    let g32 = g as u32;
    match F {
        fid::Q8_0 => load32(&blk[2..]),
        fid::Q4_0 => _mm256_sub_epi8(nibbles(&blk[2..]), _mm256_set1_epi8(8)),
        fid::Q4_1 | fid::Q4_Z => nibbles(&blk[4..]),
        fid::Q5_0 => {
            let q = _mm256_or_si256(nibbles(&blk[6..]), spread_bits(word(blk, 2), 0x10));
            _mm256_sub_epi8(q, _mm256_set1_epi8(16))
        }
        fid::Q5_1 => _mm256_or_si256(nibbles(&blk[8..]), spread_bits(word(blk, 4), 0x10)),
        fid::Q8_Z => _mm256_xor_si256(load32(&blk[4..]), _mm256_set1_epi8(-128)),
        fid::Q2_K => field(load32(&blk[16 + 32 * (g / 4)..]), 2 * (g32 % 4), 3),
        fid::Q3_K => {
            let low = field(load32(&blk[32 + 32 * (g / 4)..]), 2 * (g32 % 4), 3);
            let high = field(load32(blk), g32, 1);
            let q = _mm256_add_epi8(low, _mm256_slli_epi16::<2>(high));
            _mm256_sub_epi8(q, _mm256_set1_epi8(4))
        }
        fid::Q4_K => field(load32(&blk[16 + 32 * (g / 2)..]), 4 * (g32 % 2), 0x0f),
        fid::Q5_K => {
            let lo = field(load32(&blk[48 + 32 * (g / 2)..]), 4 * (g32 % 2), 0x0f);
            let hi = field(load32(&blk[16..]), g32, 1);
            _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
        }
        _ => {
            // Q6_K
            let (n, qq) = (g / 4, g32 % 4);
            let lo = field(load32(&blk[64 * n + 32 * (g % 2)..]), 4 * (qq / 2), 0x0f);
            let hi = field(load32(&blk[128 + 32 * n..]), 2 * qq, 3);
            let q = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi));
            _mm256_sub_epi8(q, _mm256_set1_epi8(32))
        }
    }
}

/// Quants `q` of format `F` as `vpdpbusd`'s unsigned operand: `q + 128` where they may be
/// negative (the sums then start at −128 · Σx to undo it).
#[inline]
#[target_feature(enable = "avx2")]
fn as_unsigned<const F: u8>(q: __m256i) -> __m256i {
    if const { ints(F).unsigned } {
        q
    } else {
        _mm256_xor_si256(q, _mm256_set1_epi8(-128))
    }
}

/// Eight lanes of four-element sums of q·x (AVX2): |q| as unsigned bytes against x with q's
/// signs moved onto it (|q| · sign(x, q) = q·x), pairs by `vpmaddubsw`, then quads.
#[inline]
#[target_feature(enable = "avx2")]
fn lanes_avx2<const F: u8>(q: __m256i, x: __m256i) -> __m256i {
    let (u, v) = if const { ints(F).unsigned } {
        (q, x)
    } else {
        (_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q))
    };
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1))
}

/// The four lanes of `v` summed (integers: any order is exact).
#[inline]
#[target_feature(enable = "avx2")]
fn sum4(v: __m128i) -> i32 {
    let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0x4e>(v));
    _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32::<0xb1>(v)))
}

/// `dot::group_dots` from eight lanes of four-element sums.
#[inline]
#[target_feature(enable = "avx2")]
fn group_dots<const F: u8>(lanes: __m256i) -> (i32, i32) {
    let (lo, hi) = (
        _mm256_castsi256_si128(lanes),
        _mm256_extracti128_si256::<1>(lanes),
    );
    if const { halves_differ(F) } {
        (sum4(lo), sum4(hi))
    } else {
        (sum4(_mm_add_epi32(lo, hi)), 0)
    }
}

/// One row of W against the one row of X (`x.m == 1`, its groups contiguous), as
/// `dot::rows_portable`: each group's integer dots, then the scalar float steps.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn one_row<const F: u8>(row: &[u8], block_bytes: usize, x: &QuantX, o: &mut f32) {
    let ints = ints_of::<F>();
    let gpb = const { groups_per_block(F) };
    let xq: &[u8] = bytemuck::cast_slice(&x.q);
    let (mut a0, mut a1, mut b) = (0f32, 0f32, 0f32);
    for (bi, blk) in row.chunks_exact(block_bytes).enumerate() {
        for gg in 0..gpb {
            let g = bi * gpb + gg;
            let (t0, t1) =
                group_dots::<F>(lanes_avx2::<F>(quants::<F>(blk, gg), load32(&xq[32 * g..])));
            let s = scales::<F>(blk, gg);
            let (s0, s1) = group_scales(&s, x.d[g]);
            a0 += s0 * t0 as f32;
            if const { halves_differ(F) } {
                a1 += s1 * t1 as f32;
            }
            offset_term(ints, &s, x.d[g], x.sums(g), &mut b);
        }
    }
    *o = (a0 + a1) + b;
}

/// Every row of W against one row of X (AVX2): a row at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn one_avx2<const F: u8>(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
    for (row, o) in rows.w.chunks_exact(rows.row_bytes).zip(out.iter_mut()) {
        one_row::<F>(row, rows.block_bytes, x, o);
    }
}

/// Rows of W four at a time that decode's matvec asks the cache for ahead of reading them.
const QUADS_AHEAD: usize = 2;

/// Asks for the cache lines of `len` bytes at `p` (a hint: it never faults, so `p` may lie
/// past the weights' end).
#[inline]
#[target_feature(enable = "sse")]
fn prefetch(p: *const u8, len: usize) {
    for off in (0..len).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast());
    }
}

/// Every row of W against one row of X (decode, AVX-512), four rows of W at a time: two a
/// 512-bit register (the low 256 bits one row's eight lanes, the high the other's), both
/// against X's group broadcast, the lanes of the four rows then summed by halves into one
/// register ([`quad_dots`]) and scaled there. Each row's integer dots and float steps are
/// `dot::rows_portable`'s; the last rows (fewer than four) by [`one_row`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn one_quads<const F: u8>(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
    let ints = ints_of::<F>();
    let gpb = const { groups_per_block(F) };
    let bb = rows.block_bytes;
    let xq: &[u8] = bytemuck::cast_slice(&x.q);
    let mut quads = rows.w.chunks_exact(4 * rows.row_bytes);
    let mut outs = out.chunks_exact_mut(4);
    let ahead = 4 * QUADS_AHEAD * rows.row_bytes;
    for (w4, o) in (&mut quads).zip(&mut outs) {
        prefetch(w4.as_ptr().wrapping_add(ahead), w4.len());
        let row = |i: usize| &w4[i * rows.row_bytes..][..rows.row_bytes];
        let r = [row(0), row(1), row(2), row(3)];
        let mut acc = _mm512_setzero_ps();
        let mut off = [0f32; 4];
        for bi in 0..rows.row_bytes / bb {
            let at = bi * bb;
            let blk = [
                &r[0][at..at + bb],
                &r[1][at..at + bb],
                &r[2][at..at + bb],
                &r[3][at..at + bb],
            ];
            for gg in 0..gpb {
                let g = bi * gpb + gg;
                let xz = _mm512_broadcast_i64x4(load32(&xq[32 * g..]));
                let start = quad_start::<F>(x.sums(g));
                let ab = pair_dots::<F>(blk[0], blk[1], gg, start, xz);
                let cd = pair_dots::<F>(blk[2], blk[3], gg, start, xz);
                let t = quad_dots::<F>(ab, cd);
                let s = [
                    scales::<F>(blk[0], gg),
                    scales::<F>(blk[1], gg),
                    scales::<F>(blk[2], gg),
                    scales::<F>(blk[3], gg),
                ];
                let sc = quad_scales::<F>(&s);
                let sc = _mm512_mul_ps(sc, _mm512_set1_ps(x.d[g]));
                acc = _mm512_add_ps(acc, _mm512_mul_ps(sc, _mm512_cvtepi32_ps(t)));
                if ints.offset {
                    for (s, off) in s.iter().zip(off.iter_mut()) {
                        offset_term(ints, s, x.d[g], x.sums(g), off);
                    }
                }
            }
        }
        let a: [f32; 16] = bytemuck::cast(acc);
        o[0] = (a[0] + a[4]) + off[0];
        o[1] = (a[8] + a[12]) + off[1];
        o[2] = (a[1] + a[5]) + off[2];
        o[3] = (a[9] + a[13]) + off[3];
    }
    let last = quads.remainder();
    for (row, o) in last.chunks_exact(rows.row_bytes).zip(outs.into_remainder()) {
        one_row::<F>(row, bb, x, o);
    }
}

/// Where the lanes of a row's group start (both rows of a pair): at −128 · the halves'
/// sums of X (lanes 0 and 4 of each row's eight) where format `F`'s quants were made
/// unsigned, else at zero.
#[inline]
#[target_feature(enable = "avx512f")]
fn quad_start<const F: u8>([lo, hi]: [i32; 2]) -> __m512i {
    if const { ints(F).unsigned } {
        _mm512_setzero_si512()
    } else if const { halves_differ(F) } {
        _mm512_or_si512(
            _mm512_maskz_set1_epi32(0x0101, -128 * lo),
            _mm512_maskz_set1_epi32(0x1010, -128 * hi),
        )
    } else {
        _mm512_maskz_set1_epi32(0x0101, -128 * (lo + hi))
    }
}

/// The lanes of group `g` of two blocks of W (`a` the low 256 bits, `b` the high) against
/// X's group `xz` (broadcast to both halves), from `start`.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn pair_dots<const F: u8>(a: &[u8], b: &[u8], g: usize, start: __m512i, xz: __m512i) -> __m512i {
    let qa = as_unsigned::<F>(quants::<F>(a, g));
    let qb = as_unsigned::<F>(quants::<F>(b, g));
    let ab = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qb);
    _mm512_dpbusd_epi32(start, ab, xz)
}

/// The scales of four rows' group in the lanes [`quad_dots`] leaves their dots in, zero in
/// the others.
#[inline]
#[target_feature(enable = "avx512f")]
fn quad_scales<const F: u8>(s: &[[f32; 4]; 4]) -> __m512 {
    if const { halves_differ(F) } {
        let v = _mm256_setr_ps(
            s[0][0], s[2][0], s[0][1], s[2][1], s[1][0], s[3][0], s[1][1], s[3][1],
        );
        let at = _mm512_setr_epi32(0, 1, 0, 0, 2, 3, 0, 0, 4, 5, 0, 0, 6, 7, 0, 0);
        _mm512_maskz_permutexvar_ps(0x3333, at, _mm512_castps256_ps512(v))
    } else {
        let v = _mm_setr_ps(s[0][0], s[2][0], s[1][0], s[3][0]);
        let at = _mm512_setr_epi32(0, 1, 0, 0, 0, 0, 0, 0, 2, 3, 0, 0, 0, 0, 0, 0);
        _mm512_maskz_permutexvar_ps(0x0303, at, _mm512_castps128_ps512(v))
    }
}

/// The group dots of four rows of W from their lanes, `ab` rows 0 and 1, `cd` rows 2 and 3
/// (each row's eight lanes in one half): row 0's at lanes 0 and 4 (the halves' dots, or the
/// group's at 0 where format `F`'s scales span 32 elements), row 2's at 1 and 5, row 1's at
/// 8 and 12, row 3's at 9 and 13.
#[inline]
#[target_feature(enable = "avx512f")]
fn quad_dots<const F: u8>(ab: __m512i, cd: __m512i) -> __m512i {
    // Within each 128 bits: [ab0 + ab2, cd0 + cd2, ab1 + ab3, cd1 + cd3].
    let u = _mm512_add_epi32(_mm512_unpacklo_epi32(ab, cd), _mm512_unpackhi_epi32(ab, cd));
    // Lanes 0 and 1 of each 128 bits: the sums of its four lanes of `ab`, of `cd`.
    let s = _mm512_add_epi32(u, _mm512_shuffle_epi32::<0x4e>(u));
    if const { halves_differ(F) } {
        s
    } else {
        // Each row's two halves added.
        _mm512_add_epi32(s, _mm512_shuffle_i32x4::<0xb1>(s, s))
    }
}

/// Rows of W a tile kernel takes at once.
const R: usize = 4;

thread_local! {
    /// The rows of W a tile kernel works on, decoded once for all of X's tiles: quants
    /// (32 bytes a row's group, group-major: `[group][row]`) and scales.
    static DECODED: RefCell<(Vec<u8>, Vec<[f32; 4]>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Up to [`R`] rows of W (`w`, whole rows) decoded into `wq` and `ws`, the quants as
/// [`as_unsigned`] makes them where `UNSIGNED`, else as the format defines them.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn decode<const F: u8, const UNSIGNED: bool>(
    w: &[u8],
    rows: &Rows<'_>,
    wq: &mut [u8],
    ws: &mut [[f32; 4]],
) {
    let gpb = const { groups_per_block(F) };
    for (r, row) in w.chunks_exact(rows.row_bytes).enumerate() {
        for (bi, blk) in row.chunks_exact(rows.block_bytes).enumerate() {
            for gg in 0..gpb {
                let at = (bi * gpb + gg) * R + r;
                let q = quants::<F>(blk, gg);
                let q = if UNSIGNED { as_unsigned::<F>(q) } else { q };
                let bytes: [u8; 32] = bytemuck::cast(q);
                wq[32 * at..32 * at + 32].copy_from_slice(&bytes);
                ws[at] = scales::<F>(blk, gg);
            }
        }
    }
}

/// One tile of X as a tile kernel reads it: its slots.
struct XTile<'a> {
    q: &'a [u8],
    d: &'a [f32],
    lo: &'a [i32],
    hi: &'a [i32],
}

/// Eight or sixteen consecutive slot values of a tile from `at`, as one register.
#[inline(always)]
fn lanes<T: bytemuck::Pod, V: bytemuck::Pod>(v: &[T], at: usize) -> V {
    let n = std::mem::size_of::<V>() / std::mem::size_of::<T>();
    bytemuck::pod_read_unaligned(bytemuck::cast_slice(&v[at..at + n]))
}

macro_rules! tile_kernel {
    // `$v`/`$vi`: the float and integer registers of `$width` lanes, one a row of X;
    // `$dots`: a row's group dots against the tile's chunks; the rest the intrinsics of that
    // width.
    (
        $name:ident, $rows:ident, $features:literal, $unsigned:literal, $width:literal,
        $v:ty, $vi:ty, $zero:ident, $zeroi:ident, $set1:ident, $add:ident, $mul:ident,
        $cvt:ident, $addi:ident, $dots:ident
    ) => {
        /// [`R`] decoded rows of W against `$width` rows of X (those of a tile from
        /// `x_first`): per group, each row of W's chunks broadcast against the tile's, one
        /// lane a row of X, then `dot::rows_portable`'s float steps in those lanes.
        #[inline]
        #[target_feature(enable = $features)]
        fn $name<const F: u8>(
            wq: &[u8],
            ws: &[[f32; 4]],
            x: &XTile<'_>,
            x_first: usize,
            groups: usize,
        ) -> [$v; R] {
            let ints = ints_of::<F>();
            let mut a0 = [$zero(); R];
            let mut a1 = [$zero(); R];
            let mut b = [$zero(); R];
            for g in 0..groups {
                let at = TILE * g + x_first;
                let xg = &x.q[32 * TILE * g..][..32 * TILE];
                let mut xc = [$zeroi(); CHUNKS];
                for (c, v) in xc.iter_mut().enumerate() {
                    *v = lanes(xg, 4 * (TILE * c + x_first));
                }
                let dx: $v = lanes(x.d, at);
                let (lo, hi): ($vi, $vi) = (lanes(x.lo, at), lanes(x.hi, at));
                for r in 0..R {
                    let w = &wq[32 * (g * R + r)..][..32];
                    let s = &ws[g * R + r];
                    let (t0, t1) = $dots::<F>(w, &xc, lo, hi);
                    let sc0 = $mul($set1(s[0]), dx);
                    a0[r] = $add(a0[r], $mul(sc0, $cvt(t0)));
                    if const { halves_differ(F) } {
                        let sc1 = $mul($set1(s[1]), dx);
                        a1[r] = $add(a1[r], $mul(sc1, $cvt(t1)));
                    }
                    if ints.offset {
                        if ints.span == 32 {
                            let n = $cvt($addi(lo, hi));
                            b[r] = $add(b[r], $mul($mul($set1(s[2]), dx), n));
                        } else {
                            b[r] = $add(b[r], $mul($mul($set1(s[2]), dx), $cvt(lo)));
                            b[r] = $add(b[r], $mul($mul($set1(s[3]), dx), $cvt(hi)));
                        }
                    }
                }
            }
            for r in 0..R {
                a0[r] = $add($add(a0[r], a1[r]), b[r]);
            }
            a0
        }

        /// `dot::rows_portable` for format `F`: [`R`] rows of W decoded at a time, then
        /// taken against every tile of X.
        #[target_feature(enable = $features)]
        pub(super) fn $rows<const F: u8>(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
            let groups = x.groups();
            let (mut wq, mut ws) = DECODED.with(|d| d.take());
            wq.resize(32 * R * groups, 0);
            ws.resize(R * groups, [0.0; 4]);
            let xq: &[u8] = bytemuck::cast_slice(&x.q);
            let m = x.m;
            for (rb, w) in rows.w.chunks(R * rows.row_bytes).enumerate() {
                decode::<F, $unsigned>(w, rows, &mut wq, &mut ws);
                let n = w.len() / rows.row_bytes;
                for t in x.tiles() {
                    let s = x.tile_slots(t.start);
                    let tile = XTile {
                        q: &xq[32 * s.start..32 * s.end],
                        d: &x.d[s.clone()],
                        lo: &x.lo[s.clone()],
                        hi: &x.hi[s],
                    };
                    for first in (0..t.len()).step_by($width) {
                        let y = $name::<F>(&wq, &ws, &tile, first, groups);
                        let take = (t.len() - first).min($width);
                        for (r, y) in y.iter().enumerate().take(n) {
                            let y: [f32; $width] = bytemuck::cast(*y);
                            let o = (rb * R + r) * m + t.start + first;
                            out[o..o + take].copy_from_slice(&y[..take]);
                        }
                    }
                }
            }
            DECODED.with(|d| d.replace((wq, ws)));
        }
    };
}

/// Chunk `c` (quants 4c..4c + 4) of a decoded group, as one 32-bit word.
#[inline(always)]
fn chunk(w: &[u8], c: usize) -> i32 {
    i32::from_le_bytes([w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]])
}

/// −128 · `v`.
#[inline]
#[target_feature(enable = "avx512f")]
fn neg128(v: __m512i) -> __m512i {
    _mm512_slli_epi32::<7>(_mm512_sub_epi32(_mm512_setzero_si512(), v))
}

/// A decoded row of W's group against a tile's chunks (AVX-512 VNNI): each chunk broadcast,
/// one `vpdpbusd` with the tile's, from −128 · Σx where the quants were made unsigned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dots_vnni<const F: u8>(
    w: &[u8],
    xc: &[__m512i; CHUNKS],
    lo: __m512i,
    hi: __m512i,
) -> (__m512i, __m512i) {
    let unsigned = const { ints(F).unsigned };
    if const { halves_differ(F) } {
        let (mut t0, mut t1) = if unsigned {
            (_mm512_setzero_si512(), _mm512_setzero_si512())
        } else {
            (neg128(lo), neg128(hi))
        };
        for c in 0..CHUNKS / 2 {
            t0 = _mm512_dpbusd_epi32(t0, _mm512_set1_epi32(chunk(w, c)), xc[c]);
            let h = c + CHUNKS / 2;
            t1 = _mm512_dpbusd_epi32(t1, _mm512_set1_epi32(chunk(w, h)), xc[h]);
        }
        (t0, t1)
    } else {
        let mut t = if unsigned {
            _mm512_setzero_si512()
        } else {
            neg128(_mm512_add_epi32(lo, hi))
        };
        for (c, xc) in xc.iter().enumerate() {
            t = _mm512_dpbusd_epi32(t, _mm512_set1_epi32(chunk(w, c)), *xc);
        }
        (t, _mm512_setzero_si512())
    }
}

/// The same dots with AVX2's `vpmaddubsw` + `vpmaddwd`, the quants' signs moved onto X.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dots_avx2<const F: u8>(
    w: &[u8],
    xc: &[__m256i; CHUNKS],
    _lo: __m256i,
    _hi: __m256i,
) -> (__m256i, __m256i) {
    let mut t = [_mm256_setzero_si256(); 2];
    for (c, xc) in xc.iter().enumerate() {
        let h = if const { halves_differ(F) } {
            c / (CHUNKS / 2)
        } else {
            0
        };
        let wc = _mm256_set1_epi32(chunk(w, c));
        t[h] = _mm256_add_epi32(t[h], lanes_avx2::<F>(wc, *xc));
    }
    (t[0], t[1])
}

tile_kernel!(
    tile_avx512,
    tiles_avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    true,
    16,
    __m512,
    __m512i,
    _mm512_setzero_ps,
    _mm512_setzero_si512,
    _mm512_set1_ps,
    _mm512_add_ps,
    _mm512_mul_ps,
    _mm512_cvtepi32_ps,
    _mm512_add_epi32,
    dots_vnni
);
tile_kernel!(
    tile_avx2,
    tiles_avx2,
    "avx2,fma,f16c",
    false,
    8,
    __m256,
    __m256i,
    _mm256_setzero_ps,
    _mm256_setzero_si256,
    _mm256_set1_ps,
    _mm256_add_ps,
    _mm256_mul_ps,
    _mm256_cvtepi32_ps,
    _mm256_add_epi32,
    dots_avx2
);

/// `dot::rows_portable` for format `F` at the AVX-512 level.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn rows_avx512<const F: u8>(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
    if x.m == 1 {
        one_quads::<F>(rows, x, out)
    } else {
        tiles_avx512::<F>(rows, x, out)
    }
}

/// `dot::rows_portable` for format `F` at the AVX2 level.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_avx2<const F: u8>(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
    if x.m == 1 {
        one_avx2::<F>(rows, x, out)
    } else {
        tiles_avx2::<F>(rows, x, out)
    }
}
