//! One row per element type: every fact about a format that more than one part of the crate
//! reads (its GGUF type id, block geometry, where its scales sit, its device layout, the WGSL
//! readers' switches, how the native CPU backend decodes it into integers) is written once,
//! here, as ggml's `type_traits` table does. kiln-gguf, which depends on no other crate of the
//! workspace (DESIGN §2), keeps the GGUF reader's own table of ggml block sizes; kiln-model's
//! tests hold the two equal.

use super::layout::{Arr, Piece, k_bit, k_two_bit, k4_nibble, q6_low};
use crate::{DType, QK, QK_K};

/// The facts of one element type.
#[derive(Debug)]
pub(crate) struct Format {
    /// The ggml type id a GGUF file stores it under (`None` for kiln's own formats and the
    /// index types).
    pub ggml: Option<u32>,
    /// Elements per storage block: 1 for plain types, 32 or 256 for quantized ones.
    pub block_elems: usize,
    /// Bytes per block in the host (GGUF, or kiln's `Q4_Z`/`Q8_Z`) layout.
    pub block_bytes: usize,
    /// Byte offsets of the f16 scale fields in one host block (`d`, and `m`/`dmin`/`z`).
    pub scale_offsets: &'static [usize],
    /// Device layout: head words per pair of blocks, quant words per block.
    pub device_words: (usize, usize),
    /// Where a block's GGUF bytes go on the device (`layout::to_device`, and back).
    pub pieces: &'static [Piece],
    /// How the native CPU backend reads a block (quantized formats only).
    pub ints: Option<Ints>,
    /// How the WGSL weight readers are specialised for it.
    pub wgsl: Wgsl,
    /// What a block must hold beyond finite f16 scales (`scale_offsets`), checked at upload.
    pub check: Option<BlockCheck>,
}

/// A format's own check of one host block: what is wrong with it, if anything.
pub(crate) type BlockCheck = fn(blk: &[u8]) -> Option<super::BadBlock>;

/// The switches `weights.wgsl` and `matmul_rows.wgsl` take for a format (what
/// `ops::weight_defines` emits).
#[derive(Debug)]
pub(crate) struct Wgsl {
    /// The format's own switch (`W_Q4_1`).
    pub define: &'static str,
    /// Decoded four elements at a time under per-group scales (`W_SUB`).
    pub sub: bool,
    /// `Q4_K`/`Q5_K`'s packed 6-bit scales and mins (`W_Q45_K`).
    pub scale_mins: bool,
    /// A zero point (`W_ZP`).
    pub zero_point: bool,
    /// Nibbles under a `d|m` or `d|z` head word a block (`W_Q4_DM`).
    pub dm_word: bool,
    /// One head word a block (`HEAD1`).
    pub head1: bool,
    /// How `matmul_rows.wgsl` sums a block (`QSUM`, `NIB`).
    pub sums: BlockSums,
    /// 16-byte reads `matmul_rows.wgsl` makes a block (`RD3`, `RD4` from three and four).
    pub reads: usize,
}

/// Whether `matmul_rows.wgsl` sums a block as d·Σ q·x + m·Σ x (`QSUM`: `Q8_0` and the 4-bit
/// formats with one scale and offset a 32-element block and no high bits), with its quants as
/// nibbles (`NIB`). The form saves work per weight element and adds some per block of X; at 16
/// rows of X it measured no slower than the plain form on lavapipe, so it is taken at every
/// size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockSums {
    /// Element by element.
    Plain,
    /// d·Σ q·x over bytes.
    Bytes,
    /// d·Σ q·x + m·Σ x over nibbles.
    Nibbles,
}

impl BlockSums {
    /// Whether a block is summed as d·Σ q·x (`QSUM`).
    pub(crate) fn summed(self) -> bool {
        self != BlockSums::Plain
    }
}

impl Wgsl {
    /// A float format's (or an index type's) switches: its own only.
    const fn float(define: &'static str) -> Wgsl {
        Wgsl {
            define,
            sub: false,
            scale_mins: false,
            zero_point: false,
            dm_word: false,
            head1: false,
            sums: BlockSums::Plain,
            reads: 0,
        }
    }

    /// A quantized format's switches beside its own: none but its reads.
    const fn quant(define: &'static str, reads: usize) -> Wgsl {
        Wgsl {
            reads,
            ..Wgsl::float(define)
        }
    }
}

/// A block format seen by an integer dot product: each 32-element group of a block holds
/// integer quants `q` (as `i8`) and, per half of 16 elements, a scale `a` and an offset `b`
/// with value = a·q + b. [`Ints::span`] says whether the halves may differ.
#[derive(Debug)]
pub(crate) struct Ints {
    /// 16 where scales change every 16 elements (`Q2_K`, `Q3_K`, `Q6_K`), else 32.
    pub span: usize,
    /// Whether `b` can be non-zero (a min or a zero point).
    pub offset: bool,
    /// Whether every quant is ≥ 0 (a SIMD kernel then multiplies them as unsigned bytes).
    pub unsigned: bool,
    /// The 32 quants of group `g` of a block.
    pub quants: fn(blk: &[u8], g: usize, q: &mut [i8; 32]),
    /// `[a0, a1, b0, b1]` of group `g` of a block (the two halves; equal where `span` is 32).
    pub scales: fn(blk: &[u8], g: usize) -> [f32; 4],
}

/// A row's geometry and WGSL switches, with its ggml type id (`None` for kiln's own formats
/// and the index types); no scales, device pieces or integer reading until the row says
/// otherwise.
const fn row(ggml: Option<u32>, [block_elems, block_bytes]: [usize; 2], wgsl: Wgsl) -> Format {
    Format {
        ggml,
        block_elems,
        block_bytes,
        scale_offsets: &[],
        device_words: (0, 0),
        pieces: &[],
        ints: None,
        wgsl,
        check: None,
    }
}

impl DType {
    /// This dtype's row of the format table.
    pub(crate) const fn format(self) -> &'static Format {
        match self {
            DType::F32 => &F32,
            // Index types: no weight reader takes them (the ops' dtype checks refuse them).
            DType::U32 | DType::I32 => &WORD,
            DType::F16 => &F16,
            DType::BF16 => &BF16,
            DType::Q8_0 => &Q8_0,
            DType::Q4_0 => &Q4_0,
            DType::Q4_1 => &Q4_1,
            DType::Q5_0 => &Q5_0,
            DType::Q5_1 => &Q5_1,
            DType::Q2_K => &Q2_K,
            DType::Q3_K => &Q3_K,
            DType::Q4_K => &Q4_K,
            DType::Q5_K => &Q5_K,
            DType::Q6_K => &Q6_K,
            DType::Q4_Z => &Q4_Z,
            DType::Q8_Z => &Q8_Z,
            DType::MXFP4 => &MXFP4,
            DType::FP8 => &FP8,
        }
    }
}

static F32: Format = row(Some(0), [1, 4], Wgsl::float("W_F32"));
static WORD: Format = row(None, [1, 4], Wgsl::float("W_F32"));
static F16: Format = row(Some(1), [1, 2], Wgsl::float("W_F16"));
static BF16: Format = row(Some(30), [1, 2], Wgsl::float("W_BF16"));

/// `Ints::scales` of each format, by name, so that a kernel specialised for one format calls
/// its own directly (and inlines it). Each reads the block's f16 fields through `half` (the
/// f16 at a byte offset, widened): [`scale_at`](super::scale_at) in the table, an F16C instruction in the x86
/// kernels; both are exact, so the results are the same.
pub(crate) mod scales {
    use super::both;
    use crate::quant::kquant::{scale_min_k4, scale_q3k};

    /// The f16 at a byte offset of a block, widened to f32 exactly.
    pub(crate) trait Half: Fn(&[u8], usize) -> f32 + Copy {}
    impl<H: Fn(&[u8], usize) -> f32 + Copy> Half for H {}

    /// (a, b) of group g of a `Q4_K`/`Q5_K` block: d·sc and −dmin·m.
    #[inline(always)]
    fn k4(blk: &[u8], g: usize, half: impl Half) -> [f32; 4] {
        let (d, dmin) = (half(blk, 0), half(blk, 2));
        let (sc, m) = scale_min_k4(g, &blk[4..16]);
        both(d * f32::from(sc), -(dmin * f32::from(m)))
    }

    #[inline(always)]
    pub(crate) fn q8_0(blk: &[u8], _g: usize, half: impl Half) -> [f32; 4] {
        both(half(blk, 0), 0.0)
    }

    #[inline(always)]
    pub(crate) fn q4_0(blk: &[u8], _g: usize, half: impl Half) -> [f32; 4] {
        both(half(blk, 0), 0.0)
    }

    #[inline(always)]
    pub(crate) fn q4_1(blk: &[u8], _g: usize, half: impl Half) -> [f32; 4] {
        both(half(blk, 0), half(blk, 2))
    }

    #[inline(always)]
    pub(crate) fn q5_0(blk: &[u8], _g: usize, half: impl Half) -> [f32; 4] {
        both(half(blk, 0), 0.0)
    }

    #[inline(always)]
    pub(crate) fn q5_1(blk: &[u8], _g: usize, half: impl Half) -> [f32; 4] {
        both(half(blk, 0), half(blk, 2))
    }

    #[inline(always)]
    pub(crate) fn q4_z(blk: &[u8], _g: usize, half: impl Half) -> [f32; 4] {
        let (d, z) = (half(blk, 0), half(blk, 2));
        both(d, -(z * d))
    }

    #[inline(always)]
    pub(crate) fn q8_z(blk: &[u8], _g: usize, half: impl Half) -> [f32; 4] {
        let (d, z) = (half(blk, 0), half(blk, 2));
        both(d, (128.0 - z) * d)
    }

    /// MXFP4: the E8M0 exponent's half (the quants are E2M1 values doubled), no offset.
    #[inline(always)]
    pub(crate) fn mxfp4(blk: &[u8], _g: usize, _half: impl Half) -> [f32; 4] {
        both(crate::quant::e8m0_half(blk[0]), 0.0)
    }

    #[inline(always)]
    pub(crate) fn q2_k(blk: &[u8], g: usize, half: impl Half) -> [f32; 4] {
        let (d, dmin) = (half(blk, 80), half(blk, 82));
        let (s0, s1) = (blk[2 * g], blk[2 * g + 1]);
        [
            d * f32::from(s0 & 0x0f),
            d * f32::from(s1 & 0x0f),
            -(dmin * f32::from(s0 >> 4)),
            -(dmin * f32::from(s1 >> 4)),
        ]
    }

    #[inline(always)]
    pub(crate) fn q3_k(blk: &[u8], g: usize, half: impl Half) -> [f32; 4] {
        let d = half(blk, 108);
        let s = &blk[96..108];
        [
            d * scale_q3k(2 * g, s) as f32,
            d * scale_q3k(2 * g + 1, s) as f32,
            0.0,
            0.0,
        ]
    }

    #[inline(always)]
    pub(crate) fn q4_k(blk: &[u8], g: usize, half: impl Half) -> [f32; 4] {
        k4(blk, g, half)
    }

    #[inline(always)]
    pub(crate) fn q5_k(blk: &[u8], g: usize, half: impl Half) -> [f32; 4] {
        k4(blk, g, half)
    }

    #[inline(always)]
    pub(crate) fn q6_k(blk: &[u8], g: usize, half: impl Half) -> [f32; 4] {
        let d = half(blk, 208);
        [
            d * f32::from(blk[192 + 2 * g] as i8),
            d * f32::from(blk[192 + 2 * g + 1] as i8),
            0.0,
            0.0,
        ]
    }
}

/// The f16 at byte `at` of a block, widened. Exact for every finite f16, which every scale
/// is: `check_blocks` refuses a block with a non-finite one before it becomes a tensor.
/// Written out (rather than `half`'s conversion, which checks the CPU for F16C each call) so
/// that the kernels inline it.
#[inline(always)]
fn scale_at(b: &[u8], at: usize) -> f32 {
    let h = u32::from(u16::from_le_bytes([b[at], b[at + 1]]));
    // The exponent and mantissa moved into place and rebiased by 2^112 (127 - 15): exact for
    // normal and subnormal halves alike.
    let mag = f32::from_bits((h & 0x7fff) << 13) * f32::from_bits(0x7780_0000);
    f32::from_bits(mag.to_bits() | ((h & 0x8000) << 16))
}

/// GGUF bytes `host` into a block's head, `dev` bytes in.
const fn head(host: std::ops::Range<usize>, dev: usize) -> Piece {
    Piece::Head { host, dev }
}

/// GGUF bytes `host` into a block's quants, `dev` bytes in.
const fn quants(host: std::ops::Range<usize>, dev: usize) -> Piece {
    Piece::Quants { host, dev }
}

/// A K-quant field regrouped by sub-block (see [`Piece::Field`]).
const fn field(
    host: std::ops::Range<usize>,
    bits: super::layout::FieldAt,
    mask: u8,
    arr: Arr,
    dev: usize,
) -> Piece {
    Piece::Field {
        host,
        bits,
        mask,
        arr,
        dev,
    }
}

/// Same (a, b) for both halves.
fn both(a: f32, b: f32) -> [f32; 4] {
    [a, a, b, b]
}

/// Element j and j + 16 of 16 nibble bytes (byte j: j low, j + 16 high), minus `zero`.
fn nibble_quants(qs: &[u8], zero: i8, q: &mut [i8; 32]) {
    for (j, &b) in qs[..16].iter().enumerate() {
        q[j] = (b & 0x0f) as i8 - zero;
        q[j + 16] = (b >> 4) as i8 - zero;
    }
}

/// Bit 4 of element j from a `Q5_0`/`Q5_1` block's `qh` word.
fn q5_high(blk: &[u8], at: usize, q: &mut [i8; 32]) {
    let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) << 4) as i8;
    }
}

static Q8_0: Format = Format {
    scale_offsets: &[0],
    device_words: (1, 8),
    pieces: &[head(0..2, 0), quants(2..34, 0)],
    ints: Some(Ints {
        span: 32,
        offset: false,
        unsigned: false,
        quants: |blk, _, q| {
            for (v, &b) in q.iter_mut().zip(&blk[2..34]) {
                *v = b as i8;
            }
        },
        scales: |b, g| scales::q8_0(b, g, scale_at),
    }),
    ..row(
        Some(8),
        [QK, 34],
        Wgsl {
            head1: true,
            sums: BlockSums::Bytes,
            ..Wgsl::quant("W_Q8_0", 3)
        },
    )
};

static Q4_0: Format = Format {
    scale_offsets: &[0],
    device_words: (1, 4),
    pieces: &[head(0..2, 0), quants(2..18, 0)],
    ints: Some(Ints {
        span: 32,
        offset: false,
        unsigned: false,
        quants: |blk, _, q| nibble_quants(&blk[2..], 8, q),
        scales: |b, g| scales::q4_0(b, g, scale_at),
    }),
    ..row(
        Some(2),
        [QK, 18],
        Wgsl {
            head1: true,
            sums: BlockSums::Nibbles,
            ..Wgsl::quant("W_Q4_0", 2)
        },
    )
};

static Q4_1: Format = Format {
    scale_offsets: &[0, 2],
    device_words: (2, 4),
    pieces: &[head(0..4, 0), quants(4..20, 0)],
    ints: Some(Ints {
        span: 32,
        offset: true,
        unsigned: true,
        quants: |blk, _, q| nibble_quants(&blk[4..], 0, q),
        scales: |b, g| scales::q4_1(b, g, scale_at),
    }),
    ..row(
        Some(3),
        [QK, 20],
        Wgsl {
            dm_word: true,
            head1: true,
            sums: BlockSums::Nibbles,
            ..Wgsl::quant("W_Q4_1", 2)
        },
    )
};

static Q5_0: Format = Format {
    scale_offsets: &[0],
    device_words: (4, 4),
    pieces: &[head(0..2, 0), head(2..6, 4), quants(6..22, 0)],
    ints: Some(Ints {
        span: 32,
        offset: false,
        unsigned: false,
        quants: |blk, _, q| {
            nibble_quants(&blk[6..], 0, q);
            q5_high(blk, 2, q);
            for v in q.iter_mut() {
                *v -= 16;
            }
        },
        scales: |b, g| scales::q5_0(b, g, scale_at),
    }),
    ..row(
        Some(6),
        [QK, 22],
        Wgsl {
            sub: true,
            ..Wgsl::quant("W_Q5_0", 2)
        },
    )
};

static Q5_1: Format = Format {
    scale_offsets: &[0, 2],
    device_words: (4, 4),
    pieces: &[head(0..8, 0), quants(8..24, 0)],
    ints: Some(Ints {
        span: 32,
        offset: true,
        unsigned: true,
        quants: |blk, _, q| {
            nibble_quants(&blk[8..], 0, q);
            q5_high(blk, 4, q);
        },
        scales: |b, g| scales::q5_1(b, g, scale_at),
    }),
    ..row(
        Some(7),
        [QK, 24],
        Wgsl {
            sub: true,
            ..Wgsl::quant("W_Q5_1", 2)
        },
    )
};

/// value = (q − z)·d = d·q − z·d.
static Q4_Z: Format = Format {
    scale_offsets: &[0, 2],
    device_words: (2, 4),
    pieces: &[head(0..4, 0), quants(4..20, 0)],
    ints: Some(Ints {
        span: 32,
        offset: true,
        unsigned: true,
        quants: |blk, _, q| nibble_quants(&blk[4..], 0, q),
        scales: |b, g| scales::q4_z(b, g, scale_at),
    }),
    ..row(
        None,
        [QK, 20],
        Wgsl {
            sub: true,
            zero_point: true,
            dm_word: true,
            head1: true,
            sums: BlockSums::Nibbles,
            ..Wgsl::quant("W_Q4_Z", 2)
        },
    )
};

/// value = (q − z)·d = d·(q − 128) + (128 − z)·d, so that the quants fit an `i8`.
static Q8_Z: Format = Format {
    scale_offsets: &[0, 2],
    device_words: (2, 8),
    pieces: &[head(0..4, 0), quants(4..36, 0)],
    ints: Some(Ints {
        span: 32,
        offset: true,
        unsigned: false,
        quants: |blk, _, q| {
            for (v, &b) in q.iter_mut().zip(&blk[4..36]) {
                *v = (b ^ 0x80) as i8;
            }
        },
        scales: |b, g| scales::q8_z(b, g, scale_at),
    }),
    ..row(
        None,
        [QK, 36],
        Wgsl {
            sub: true,
            zero_point: true,
            head1: true,
            ..Wgsl::quant("W_Q8_Z", 3)
        },
    )
};

/// 2-bit field of element l of group g in a K-quant's 64 bytes of 2-bit quants.
fn two_bits(qs: &[u8], g: usize, l: usize) -> i8 {
    ((qs[32 * (g / 4) + l] >> (2 * (g % 4))) & 3) as i8
}

static Q2_K: Format = Format {
    scale_offsets: &[80, 82],
    device_words: (2, 20),
    pieces: &[
        head(80..84, 0),
        quants(0..16, 0),
        field(16..80, k_two_bit, 3, Arr::TwoBits, 16),
    ],
    ints: Some(Ints {
        span: 16,
        offset: true,
        unsigned: true,
        quants: |blk, g, q| {
            for (l, v) in q.iter_mut().enumerate() {
                *v = two_bits(&blk[16..80], g, l);
            }
        },
        scales: |b, g| scales::q2_k(b, g, scale_at),
    }),
    ..row(
        Some(10),
        [QK_K, 84],
        Wgsl {
            sub: true,
            ..Wgsl::quant("W_Q2_K", 3)
        },
    )
};

static Q3_K: Format = Format {
    scale_offsets: &[108],
    device_words: (8, 24),
    pieces: &[
        head(96..110, 0),
        field(0..32, k_bit, 1, Arr::Bits, 0),
        field(32..96, k_two_bit, 3, Arr::TwoBits, 32),
    ],
    ints: Some(Ints {
        span: 16,
        offset: false,
        unsigned: false,
        quants: |blk, g, q| {
            for (l, v) in q.iter_mut().enumerate() {
                let high = ((blk[l] >> g) & 1) as i8;
                *v = two_bits(&blk[32..96], g, l) - 4 * (1 - high);
            }
        },
        scales: |b, g| scales::q3_k(b, g, scale_at),
    }),
    ..row(
        Some(11),
        [QK_K, 110],
        Wgsl {
            sub: true,
            ..Wgsl::quant("W_Q3_K", 3)
        },
    )
};

/// Nibble of element l of group g in a K-quant's 128 bytes of nibbles.
fn k_nibble(qs: &[u8], g: usize, l: usize) -> i8 {
    ((qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0x0f) as i8
}

static Q4_K: Format = Format {
    scale_offsets: &[0, 2],
    device_words: (8, 32),
    pieces: &[
        head(0..16, 0),
        field(16..144, k4_nibble, 15, Arr::Nibbles, 0),
    ],
    ints: Some(Ints {
        span: 32,
        offset: true,
        unsigned: true,
        quants: |blk, g, q| {
            for (l, v) in q.iter_mut().enumerate() {
                *v = k_nibble(&blk[16..144], g, l);
            }
        },
        scales: |b, g| scales::q4_k(b, g, scale_at),
    }),
    ..row(
        Some(12),
        [QK_K, 144],
        Wgsl {
            sub: true,
            scale_mins: true,
            sums: BlockSums::Nibbles,
            ..Wgsl::quant("W_Q4_K", 2)
        },
    )
};

static Q5_K: Format = Format {
    scale_offsets: &[0, 2],
    device_words: (8, 40),
    pieces: &[
        head(0..16, 0),
        field(16..48, k_bit, 1, Arr::Bits, 0),
        field(48..176, k4_nibble, 15, Arr::Nibbles, 32),
    ],
    ints: Some(Ints {
        span: 32,
        offset: true,
        unsigned: true,
        quants: |blk, g, q| {
            for (l, v) in q.iter_mut().enumerate() {
                *v = k_nibble(&blk[48..176], g, l) | ((((blk[16 + l] >> g) & 1) << 4) as i8);
            }
        },
        scales: |b, g| scales::q5_k(b, g, scale_at),
    }),
    ..row(
        Some(13),
        [QK_K, 176],
        Wgsl {
            sub: true,
            scale_mins: true,
            ..Wgsl::quant("W_Q5_K", 3)
        },
    )
};

static Q6_K: Format = Format {
    scale_offsets: &[208],
    device_words: (1, 52),
    pieces: &[
        head(208..210, 0),
        quants(192..208, 0),
        field(0..128, q6_low, 15, Arr::Nibbles, 16),
        field(128..192, k_two_bit, 3, Arr::TwoBits, 144),
    ],
    ints: Some(Ints {
        span: 16,
        offset: false,
        unsigned: false,
        quants: |blk, g, q| {
            let (n, qq) = (g / 4, g % 4);
            for (l, v) in q.iter_mut().enumerate() {
                let lo = (blk[64 * n + 32 * (qq % 2) + l] >> (4 * (qq / 2))) & 0x0f;
                let hi = (blk[128 + 32 * n + l] >> (2 * qq)) & 3;
                *v = (lo | (hi << 4)) as i8 - 32;
            }
        },
        scales: |b, g| scales::q6_k(b, g, scale_at),
    }),
    ..row(
        Some(14),
        [QK_K, 210],
        Wgsl {
            sub: true,
            ..Wgsl::quant("W_Q6_K", 4)
        },
    )
};

/// The values of group `g` of a block as [`Ints`] describes them (a·q + b in f32), for tests
/// that check a row against [`dequantize_block`].
#[cfg(test)]
pub(crate) fn group_values(dtype: DType, blk: &[u8], g: usize) -> [f32; 32] {
    let ints = dtype.format().ints.as_ref().expect("a block format");
    let mut q = [0i8; 32];
    (ints.quants)(blk, g, &mut q);
    let s = (ints.scales)(blk, g);
    std::array::from_fn(|e| {
        let h = e / 16;
        s[h] * f32::from(q[e]) + s[2 + h]
    })
}

/// E2M1 values doubled, by nibble (sign in bit 3): what an MXFP4 quant stands for, times its
/// block's halved scale.
pub(crate) const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// One E8M0 exponent byte and 16 nibble bytes (element j low, j + 16 high); on the device the
/// exponent takes the low byte of its block's half of a head word, as `Q4_0`'s f16 does.
static MXFP4: Format = Format {
    device_words: (1, 4),
    pieces: &[head(0..1, 0), quants(1..17, 0)],
    ints: Some(Ints {
        span: 32,
        offset: false,
        unsigned: false,
        quants: |blk, _, q| {
            for (j, &b) in blk[1..17].iter().enumerate() {
                q[j] = MXFP4_VALUES[usize::from(b & 0x0f)];
                q[j + 16] = MXFP4_VALUES[usize::from(b >> 4)];
            }
        },
        scales: |b, g| scales::mxfp4(b, g, scale_at),
    }),
    // `matmul_rows.wgsl` reads no MXFP4 (reads 0): CPU-type adapters take the matvec kernel.
    ..row(
        Some(39),
        [QK, 17],
        Wgsl {
            head1: true,
            sub: true,
            ..Wgsl::quant("W_MXFP4", 0)
        },
    )
};

/// An f32 scale word and 32 E4M3 code bytes, as they are on the host: the kernels decode the
/// codes to f32 exactly (no integer form: the native backend takes its float path).
static FP8: Format = Format {
    device_words: (2, 8),
    pieces: &[head(0..4, 0), quants(4..36, 0)],
    check: Some(super::check_fp8),
    ..row(
        None,
        [QK, 36],
        Wgsl {
            sub: true,
            head1: true,
            ..Wgsl::quant("W_FP8", 0)
        },
    )
};

#[cfg(test)]
mod tests {
    use super::super::dequantize_block;
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random blocks whose f16 scales are finite and small.
    fn random_block(dtype: DType, rng: &mut impl Rng) -> Vec<u8> {
        let f = dtype.format();
        let mut b: Vec<u8> = (0..f.block_bytes).map(|_| rng.random()).collect();
        for &at in f.scale_offsets {
            let v = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Each row's integer reading of a block gives the values the reference dequantizer
    /// gives (within f32 rounding: a·q + b is not always the reference's order).
    #[test]
    fn integer_groups_match_dequantize() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let integer = DType::WEIGHTS.iter().filter(|d| d.format().ints.is_some());
        for &dtype in integer {
            let be = dtype.block_elems();
            for _ in 0..20 {
                let blk = random_block(dtype, &mut rng);
                let mut want = vec![0f32; be];
                dequantize_block(dtype, &blk, &mut want);
                let ints = dtype.format().ints.as_ref().expect("a block format");
                for g in 0..be / 32 {
                    let mut q = [0i8; 32];
                    (ints.quants)(&blk, g, &mut q);
                    assert!(
                        !ints.unsigned || q.iter().all(|&v| v >= 0),
                        "{dtype:?}: {q:?}"
                    );
                    let got = group_values(dtype, &blk, g);
                    for (e, (&w, &v)) in want[32 * g..32 * g + 32].iter().zip(&got).enumerate() {
                        let tol = 1e-6 + w.abs() * 1e-5;
                        assert!(
                            (w - v).abs() <= tol,
                            "{dtype:?} group {g} element {e}: {v} vs reference {w}"
                        );
                    }
                }
            }
        }
    }
}
