//! x86-64 kernels: each format's 32-element group decoded into one register of `i8`, then
//! dotted with X's group, in the lanes and order `dot::rows_portable` defines.
//!
//! Two levels share one body (the `kernel!` macro): AVX2 (`vpmaddubsw` + `vpmaddwd`) and
//! AVX-512 VNNI on 256-bit registers (`vpdpbusd`). Both give the same integer lane sums, so
//! the same results. Both levels also use F16C (the blocks' f16 scales, widened exactly as
//! `scale_at` does). The bodies are safe Rust: intrinsics are safe inside a function with
//! the matching `target_feature`, and loads go through `bytemuck` from slices.

use std::arch::x86_64::*;

mod vector;
pub(super) use vector::*;

use super::QuantX;

use super::act::TILE;
use super::dot::{Rows, group_scales, lane_sum as lane_sum_of, offset_term};
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

/// q as unsigned bytes and x with q's signs moved onto it (|q| · sign(x, q) = q·x), unless
/// format `F`'s quants are never negative.
#[inline]
#[target_feature(enable = "avx2")]
fn unsigned<const F: u8>(q: __m256i, x: __m256i) -> (__m256i, __m256i) {
    if const { ints(F).unsigned } {
        (q, x)
    } else {
        (_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q))
    }
}

/// Eight lanes of four-element sums of q·x (AVX2): u8·i8 pairs, then quads.
#[inline]
#[target_feature(enable = "avx2")]
fn lanes_avx2<const F: u8>(q: __m256i, x: __m256i) -> __m256i {
    let (u, v) = unsigned::<F>(q, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1))
}

/// The same lanes with one `vpdpbusd`.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
fn lanes_vnni<const F: u8>(q: __m256i, x: __m256i) -> __m256i {
    let (u, v) = unsigned::<F>(q, x);
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v)
}

/// acc + [s0 ×4, s1 ×4] · lanes (s0 = s1 where format `F`'s halves share their scale, one
/// broadcast then).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn step<const F: u8>(acc: __m256, lanes: __m256i, s0: f32, s1: f32) -> __m256 {
    let sc = if const { halves_differ(F) } {
        _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0))
    } else {
        _mm256_set1_ps(s0)
    };
    _mm256_add_ps(acc, _mm256_mul_ps(sc, _mm256_cvtepi32_ps(lanes)))
}

/// `dot::lane_sum`'s order.
#[target_feature(enable = "avx2")]
fn lane_sum(a: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<1>(t, t)))
}

/// Quants `q` of format `F` as `vpdpbusd`'s unsigned operand: `q + 128` where they may be
/// negative.
#[inline]
#[target_feature(enable = "avx2")]
fn as_unsigned<const F: u8>(q: __m256i) -> __m256i {
    if const { ints(F).unsigned } {
        q
    } else {
        _mm256_xor_si256(q, _mm256_set1_epi8(-128))
    }
}

/// Where the lanes of two groups of X (`neg`'s first two slots) start against format `F`'s
/// quants as [`as_unsigned`] gives them: at zero, or at −128 · Σx to undo the `+ 128`.
#[inline]
#[target_feature(enable = "avx512f")]
fn lane_starts<const F: u8>(neg: &[[i32; 8]]) -> __m512i {
    if const { ints(F).unsigned } {
        _mm512_setzero_si512()
    } else {
        bytemuck::cast([neg[0], neg[1]])
    }
}

/// A block's worth of a tile's slots: quants, scales, half sums, lane starts.
type XBlock<'a> = (&'a [u8], &'a [f32], &'a [[i32; 2]], &'a [[i32; 8]]);

/// One tile of X as the tile kernels read it: its group slots.
struct TileX<'a> {
    q: &'a [u8],
    neg: &'a [[i32; 8]],
    d: &'a [f32],
    sums: &'a [[i32; 2]],
    /// Rows of the tile: slots a group.
    width: usize,
    /// The first of the tile's rows that the kernel takes.
    first: usize,
}

impl TileX<'_> {
    /// The slot of group `g` (counted within a block of W) of the first row the kernel
    /// takes, past the block's first slot.
    #[inline(always)]
    fn at(&self, g: usize) -> usize {
        g * self.width + self.first
    }

    /// The tile's slots by block of W (`gpb` groups a block).
    #[inline(always)]
    fn blocks(&self, gpb: usize) -> impl Iterator<Item = XBlock<'_>> {
        let slots = gpb * self.width;
        let xs = self
            .q
            .chunks_exact(32 * slots)
            .zip(self.d.chunks_exact(slots));
        let xs = xs.zip(
            self.sums
                .chunks_exact(slots)
                .zip(self.neg.chunks_exact(slots)),
        );
        xs.map(|((q, d), (sums, neg))| (q, d, sums, neg))
    }
}

macro_rules! kernel {
    // `$wide`: the tile kernel of two rows of X or more (`$tile` itself, or a wider form);
    // `$one`: every row of W against one row of X.
    // `$widest`: the widest tile `$wide` takes (narrower tiles go in pieces of eight rows).
    (
        $name:ident,
        $tile:ident,
        $features:literal,
        $lanes:ident,
        $wide:ident,
        $widest:literal,
        $one:ident
    ) => {
        /// One row of W · `W` rows of one tile of X (from `x.first`), into `o`: each group
        /// of W decoded once for those rows, whose arithmetic is each the same as alone.
        #[inline]
        #[target_feature(enable = $features)]
        fn $tile<const F: u8, const W: usize>(
            row: &[u8],
            block_bytes: usize,
            x: &TileX<'_>,
            o: &mut [f32],
        ) {
            let ints = ints_of::<F>();
            let gpb = const { groups_per_block(F) };
            let mut a = [_mm256_setzero_ps(); W];
            let mut b = [0f32; W];
            for (blk, (xb, db, sb, _)) in row.chunks_exact(block_bytes).zip(x.blocks(gpb)) {
                for gg in 0..gpb {
                    let q = quants::<F>(blk, gg);
                    let s = scales::<F>(blk, gg);
                    for j in 0..W {
                        let at = x.at(gg) + j;
                        let (s0, s1) = group_scales(&s, db[at]);
                        let lanes = $lanes::<F>(q, load32(&xb[32 * at..]));
                        a[j] = step::<F>(a[j], lanes, s0, s1);
                        offset_term(ints, &s, db[at], sb[at], &mut b[j]);
                    }
                }
            }
            for j in 0..W {
                o[j] = lane_sum(a[j]) + b[j];
            }
        }

        /// `dot::rows_portable` for format `F`, a tile of X at a time.
        #[target_feature(enable = $features)]
        pub(super) fn $name<const F: u8>(rows: &Rows<'_>, x: &QuantX, out: &mut [f32]) {
            let xq: &[u8] = bytemuck::cast_slice(&x.q);
            let bb = rows.block_bytes;
            if x.m == 1 {
                let tx = TileX {
                    q: xq,
                    neg: &x.neg,
                    d: &x.d,
                    sums: &x.sums,
                    width: 1,
                    first: 0,
                };
                return $one::<F>(rows, &tx, out);
            }
            for (row, o) in rows
                .w
                .chunks_exact(rows.row_bytes)
                .zip(out.chunks_exact_mut(x.m))
            {
                for t in x.tiles() {
                    let at = x.tile_slots(&t);
                    let (width, o) = (t.len(), &mut o[t]);
                    let mut first = 0;
                    while first < width {
                        let w = if width == $widest {
                            width
                        } else {
                            (width - first).min(8)
                        };
                        let s = &TileX {
                            q: &xq[32 * at.start..32 * at.end],
                            neg: &x.neg[at.clone()],
                            d: &x.d[at.clone()],
                            sums: &x.sums[at.clone()],
                            width,
                            first,
                        };
                        let o = &mut o[first..first + w];
                        match w {
                            1 => $tile::<F, 1>(row, bb, s, o),
                            2 => $wide::<F, 2>(row, bb, s, o),
                            3 => $wide::<F, 3>(row, bb, s, o),
                            4 => $wide::<F, 4>(row, bb, s, o),
                            5 => $wide::<F, 5>(row, bb, s, o),
                            6 => $wide::<F, 6>(row, bb, s, o),
                            7 => $wide::<F, 7>(row, bb, s, o),
                            8 => $wide::<F, 8>(row, bb, s, o),
                            _ => $wide::<F, $widest>(row, bb, s, o),
                        }
                        first += w;
                    }
                }
            }
        }
    };
}

kernel!(
    rows_avx2,
    tile_avx2,
    "avx2,fma,f16c",
    lanes_avx2,
    tile_avx2,
    8,
    one_avx2
);
kernel!(
    rows_avx512,
    tile_avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    lanes_vnni,
    tile_pairs,
    16,
    one_pairs
);

/// Every row of W against one row of X (AVX2): a row at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn one_avx2<const F: u8>(rows: &Rows<'_>, x: &TileX<'_>, out: &mut [f32]) {
    for (row, o) in rows
        .w
        .chunks_exact(rows.row_bytes)
        .zip(out.chunks_exact_mut(1))
    {
        tile_avx2::<F, 1>(row, rows.block_bytes, x, o);
    }
}

/// Pairs of rows of W that decode's matvec asks the cache for ahead of reading them.
const PAIRS_AHEAD: usize = 4;

/// Asks for the cache lines of `len` bytes at `p` (a hint: it never faults, so `p` may lie
/// past the weights' end).
#[inline]
#[target_feature(enable = "sse")]
fn prefetch(p: *const u8, len: usize) {
    for off in (0..len).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast());
    }
}

/// Every row of W against one row of X (decode), two rows of W a 512-bit register (the low
/// 256 bits the first row's lanes, the high the second's), each lane's arithmetic
/// `tile_avx512`'s; an odd last row by `tile_avx512`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn one_pairs<const F: u8>(rows: &Rows<'_>, x: &TileX<'_>, out: &mut [f32]) {
    let ints = ints_of::<F>();
    let gpb = const { groups_per_block(F) };
    let bb = rows.block_bytes;
    // Lanes 0–3 from element 0, 4–7 from 1, 8–11 from 2, 12–15 from 3.
    let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let mut pairs = rows.w.chunks_exact(2 * rows.row_bytes);
    let mut outs = out.chunks_exact_mut(2);
    let ahead = 2 * PAIRS_AHEAD * rows.row_bytes;
    for (w2, o) in (&mut pairs).zip(&mut outs) {
        prefetch(w2.as_ptr().wrapping_add(ahead), w2.len());
        let (ra, rb) = w2.split_at(rows.row_bytes);
        let mut acc = _mm512_setzero_ps();
        let (mut offa, mut offb) = (0f32, 0f32);
        let blocks = ra.chunks_exact(bb).zip(rb.chunks_exact(bb));
        let xs = x.q.chunks_exact(32 * gpb).zip(x.d.chunks_exact(gpb));
        let xs = xs.zip(x.sums.chunks_exact(gpb).zip(x.neg.chunks_exact(gpb)));
        for ((blka, blkb), ((xb, db), (sb, neg))) in blocks.zip(xs) {
            for gg in 0..gpb {
                let qa = as_unsigned::<F>(quants::<F>(blka, gg));
                let qb = as_unsigned::<F>(quants::<F>(blkb, gg));
                let qz = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qb);
                let xz = _mm512_broadcast_i64x4(load32(&xb[32 * gg..]));
                let start = lane_starts::<F>(&[neg[gg], neg[gg]]);
                let lanes = _mm512_dpbusd_epi32(start, qz, xz);
                let (sa, sb_) = (scales::<F>(blka, gg), scales::<F>(blkb, gg));
                let (a0, a1) = group_scales(&sa, db[gg]);
                let (b0, b1) = group_scales(&sb_, db[gg]);
                let four = if const { halves_differ(F) } {
                    _mm_setr_ps(a0, a1, b0, b1)
                } else {
                    _mm_setr_ps(a0, a0, b0, b0)
                };
                let sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
                acc = _mm512_add_ps(acc, _mm512_mul_ps(sc, _mm512_cvtepi32_ps(lanes)));
                offset_term(ints, &sa, db[gg], sb[gg], &mut offa);
                offset_term(ints, &sb_, db[gg], sb[gg], &mut offb);
            }
        }
        let lanes: [[f32; 8]; 2] = bytemuck::cast(acc);
        o[0] = lane_sum_of(&lanes[0]) + offa;
        o[1] = lane_sum_of(&lanes[1]) + offb;
    }
    let (last, o) = (pairs.remainder(), outs.into_remainder());
    if !last.is_empty() {
        tile_avx512::<F, 1>(last, bb, x, o);
    }
}

/// For the pair of rows starting at `j`: lanes 0–3 from `a[j]`, 4–7 from `b[j]`, 8–11 from
/// `a[j + 1]`, 12–15 from `b[j + 1]` (`_mm512_permutex2var_ps`'s indices, 16 and up naming
/// `b`).
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_index(j: usize) -> __m512i {
    let (a0, a1) = (j as i32, j as i32 + 1);
    let (b0, b1) = (a0 + 16, a1 + 16);
    _mm512_set_epi32(
        b1, b1, b1, b1, a1, a1, a1, a1, b0, b0, b0, b0, a0, a0, a0, a0,
    )
}

/// `tile_avx512` on 512-bit registers: the tile's rows of X in pairs, a pair's two groups
/// side by side in one register (the low 256 bits the first row's eight lanes, the high the
/// second's), the last row of an odd tile on 256 bits, and the scales and offset terms of
/// all the tile's rows in 256-bit registers. Signed quants are made unsigned (`q + 128`)
/// and each lane starts at X's −128 · Σx, so that a lane is one `vpdpbusd` whatever the
/// format. Every lane's integer sum, and each float operation on it, is `tile_avx512`'s,
/// so the results are too.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn tile_pairs<const F: u8, const W: usize>(
    row: &[u8],
    block_bytes: usize,
    x: &TileX<'_>,
    o: &mut [f32],
) {
    const { assert!(W >= 2 && W <= TILE) };
    let ints = ints_of::<F>();
    let gpb = const { groups_per_block(F) };
    let mut a = [_mm512_setzero_ps(); TILE / 2];
    let mut last = _mm256_setzero_ps();
    let mut b = _mm512_setzero_ps();
    for (blk, (xb, db, sb, neg)) in row.chunks_exact(block_bytes).zip(x.blocks(gpb)) {
        for gg in 0..gpb {
            let q = quants::<F>(blk, gg);
            let s = scales::<F>(blk, gg);
            let at = x.at(gg);
            let mut dx = [0f32; TILE];
            dx[..W].copy_from_slice(&db[at..at + W]);
            let dx: __m512 = bytemuck::cast(dx);
            let sc0 = _mm512_mul_ps(_mm512_set1_ps(s[0]), dx);
            let sc1 = if const { halves_differ(F) } {
                _mm512_mul_ps(_mm512_set1_ps(s[1]), dx)
            } else {
                sc0
            };
            let qz = _mm512_broadcast_i64x4(as_unsigned::<F>(q));
            for (p, acc) in a.iter_mut().enumerate().take(W / 2) {
                let xv: __m512i = bytemuck::pod_read_unaligned(&xb[32 * (at + 2 * p)..][..64]);
                let lanes = _mm512_dpbusd_epi32(lane_starts::<F>(&neg[at + 2 * p..]), qz, xv);
                let sc = _mm512_permutex2var_ps(sc0, pair_index(2 * p), sc1);
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(sc, _mm512_cvtepi32_ps(lanes)));
            }
            if W % 2 == 1 {
                let j = W - 1;
                let (s0, s1) = group_scales(&s, db[at + j]);
                let lanes = lanes_vnni::<F>(q, load32(&xb[32 * (at + j)..]));
                last = step::<F>(last, lanes, s0, s1);
            }
            if ints.offset {
                let mut sx = [[0i32; 2]; TILE];
                sx[..W].copy_from_slice(&sb[at..at + W]);
                let [s8, s16]: [__m512i; 2] = bytemuck::cast(sx);
                let halves = |v: __m512i| {
                    let lo = _mm512_cvtepi64_epi32(v);
                    let hi = _mm512_cvtepi64_epi32(_mm512_srli_epi64::<32>(v));
                    (lo, hi)
                };
                let ((lo8, hi8), (lo16, hi16)) = (halves(s8), halves(s16));
                let lo = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo8), lo16);
                let hi = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(hi8), hi16);
                let term = |acc: __m512, sc: f32, n: __m512i| {
                    let scd = _mm512_mul_ps(_mm512_set1_ps(sc), dx);
                    _mm512_add_ps(acc, _mm512_mul_ps(scd, _mm512_cvtepi32_ps(n)))
                };
                if ints.span == 32 {
                    b = term(b, s[2], _mm512_add_epi32(lo, hi));
                } else {
                    b = term(b, s[2], lo);
                    b = term(b, s[3], hi);
                }
            }
        }
    }
    let b: [f32; TILE] = bytemuck::cast(b);
    for (p, acc) in a.iter().enumerate().take(W / 2) {
        let lanes: [[f32; 8]; 2] = bytemuck::cast(*acc);
        o[2 * p] = lane_sum_of(&lanes[0]) + b[2 * p];
        o[2 * p + 1] = lane_sum_of(&lanes[1]) + b[2 * p + 1];
    }
    if W % 2 == 1 {
        o[W - 1] = lane_sum(last) + b[W - 1];
    }
}
