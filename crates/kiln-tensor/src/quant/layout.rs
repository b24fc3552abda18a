//! The device layout of the block formats: every kernel read is an aligned `u32` (or a 16-byte
//! `vec4<u32>`), so blocks whose GGUF size is not a multiple of 16 are split at upload into a
//! head region (scales) and a quants region starting at a 16-byte boundary.
//!
//! Head words are counted per pair of blocks, so that two f16 scales share a word:
//!
//! | dtype | head words per 2 blocks | quant words per block |
//! |-------|-------------------------|-----------------------|
//! | Q8_0, Q4_0 | `d0|d1` | i8 × 32 (8) / nibbles (4) |
//! | Q4_1, Q4_Z | `d|m` / `d|z` each | nibbles (4) |
//! | Q8_Z | `d|z` each | u8 × 32 (8) |
//! | FP8 | f32 `d` each | E4M3 × 32 (8) |
//! | Q5_0 | `d`, `qh` each | nibbles (4) |
//! | Q5_1 | `d|m, qh` each | nibbles (4) |
//! | Q2_K | `d|dmin` each | GGUF scales (4), 2-bit × 8 sub-blocks (16) |
//! | Q3_K | GGUF scales (3), `d` each | high bits × 8 (8), 2-bit × 8 (16) |
//! | Q4_K | `d|dmin`, GGUF scales (3) each | nibbles × 8 (32) |
//! | Q5_K | `d|dmin`, GGUF scales (3) each | high bits × 8 (8), nibbles × 8 (32) |
//! | Q6_K | `d0|d1` | GGUF i8 scales (4), nibbles × 8 (32), 2-bit highs × 8 (16) |
//!
//! The K-quants' bits are regrouped by 32-element sub-block so that a kernel decodes one
//! sub-block from whole words, in one arrangement for every format: "nibbles" are 16 bytes
//! whose byte j holds elements j (low nibble) and j + 16 (high nibble), as in `Q4_0`;
//! "2-bit" is two words, the first for elements 0–15, the second for 16–31, element
//! 4c + t of each half at bits 8t + 2c; "high bits" is one word, bit e for element e. Same
//! bits, regrouped: `from_device` restores the GGUF bytes exactly. Q5_0 and Q3_K pad their
//! f16 `d` to a word (2 bytes a block): a kernel then reads a block's whole head in one 16-byte
//! read (measured on lavapipe: Q5_0 with `d0|d1, qh0, qh1` heads, which straddle 16-byte
//! boundaries, ran at 0.6× the speed of Q5_1).
//!
//! Each format's row of the format table lists its [`Piece`]s (what this table shows, as
//! data); `to_device` and `from_device` walk them.

use std::ops::Range;

use crate::DType;

/// Word layout of `n_blocks` quantized blocks on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceQuantLayout {
    /// Word offset where the quants start (the heads occupy `[0, qs_offset)`).
    pub qs_offset: usize,
    /// Total words.
    pub words: usize,
}

/// (head words per pair of blocks, quant words per block).
fn geometry(dtype: DType) -> (usize, usize) {
    dtype.format().device_words
}

pub(crate) fn device_layout(dtype: DType, n_blocks: usize) -> DeviceQuantLayout {
    let (h2, q) = geometry(dtype);
    // The quants start 16-byte aligned, so that kernels read them as vec4<u32>.
    let qs_offset = (n_blocks.div_ceil(2) * h2).next_multiple_of(4);
    DeviceQuantLayout {
        qs_offset,
        words: qs_offset + n_blocks * q,
    }
}

/// An upper bound of the device bytes of one block (for splitting tensors into bindings).
pub(crate) fn device_block_bytes(dtype: DType) -> usize {
    let (h2, q) = geometry(dtype);
    (h2.div_ceil(2) + q) * 4
}

/// Byte offset of block `i`'s head (of its pair's, for the formats whose heads pair up).
fn head_at(dtype: DType, i: usize) -> usize {
    let (h2, _) = geometry(dtype);
    if h2 % 2 == 1 {
        (i / 2) * h2 * 4
    } else {
        i * (h2 / 2) * 4
    }
}

/// Elements j and j + 16 of 32 values per byte (the device's nibble arrangement).
fn put_nibbles(v: &[u8; 32], out: &mut [u8]) {
    for j in 0..16 {
        out[j] = (v[j] & 0x0f) | (v[j + 16] << 4);
    }
}
fn get_nibbles(b: &[u8], v: &mut [u8; 32]) {
    for j in 0..16 {
        v[j] = b[j] & 0x0f;
        v[j + 16] = b[j] >> 4;
    }
}
/// Byte and bit of element e (0..32) in the device's 2-bit arrangement (8 bytes).
fn two_bit_at(e: usize) -> (usize, usize) {
    let (half, e) = (e / 16, e % 16);
    (half * 4 + e % 4, 2 * (e / 4))
}
fn put_two_bits(v: &[u8; 32], out: &mut [u8]) {
    out[..8].fill(0);
    for (e, &x) in v.iter().enumerate() {
        let (byte, bit) = two_bit_at(e);
        out[byte] |= (x & 3) << bit;
    }
}
fn get_two_bits(b: &[u8], v: &mut [u8; 32]) {
    for (e, x) in v.iter_mut().enumerate() {
        let (byte, bit) = two_bit_at(e);
        *x = (b[byte] >> bit) & 3;
    }
}
fn put_bits(v: &[u8; 32], out: &mut [u8]) {
    let w = v
        .iter()
        .enumerate()
        .fold(0u32, |w, (e, &x)| w | (u32::from(x & 1) << e));
    out[..4].copy_from_slice(&w.to_le_bytes());
}
fn get_bits(b: &[u8], v: &mut [u8; 32]) {
    let w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (e, x) in v.iter_mut().enumerate() {
        *x = ((w >> e) & 1) as u8;
    }
}

/// Where element (sub-block s, index l) of a GGUF K-quant field is: (byte, shift).
pub(crate) type FieldAt = fn(usize, usize) -> (usize, u32);

/// Gather one field of sub-block `s` from GGUF bytes `src`.
fn gather(src: &[u8], s: usize, at: FieldAt, mask: u8) -> [u8; 32] {
    let mut v = [0u8; 32];
    for (l, x) in v.iter_mut().enumerate() {
        let (byte, shift) = at(s, l);
        *x = (src[byte] >> shift) & mask;
    }
    v
}
/// Scatter one field of sub-block `s` into GGUF bytes `dst` (which start zeroed).
fn scatter(dst: &mut [u8], s: usize, at: FieldAt, v: &[u8; 32]) {
    for (l, &x) in v.iter().enumerate() {
        let (byte, shift) = at(s, l);
        dst[byte] |= x << shift;
    }
}

// Where the GGUF formats keep each field (offsets within the field's own array).
pub(crate) fn k4_nibble(s: usize, l: usize) -> (usize, u32) {
    (32 * (s / 2) + l, 4 * (s % 2) as u32)
}
pub(crate) fn k_bit(s: usize, l: usize) -> (usize, u32) {
    (l, s as u32)
}
pub(crate) fn k_two_bit(s: usize, l: usize) -> (usize, u32) {
    (32 * (s / 4) + l, 2 * (s % 4) as u32)
}
pub(crate) fn q6_low(s: usize, l: usize) -> (usize, u32) {
    (64 * (s / 4) + 32 * (s % 2) + l, 4 * ((s % 4) / 2) as u32)
}

/// How the device arranges one field of a 32-element sub-block.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arr {
    Nibbles,
    TwoBits,
    Bits,
}

impl Arr {
    fn bytes(self) -> usize {
        match self {
            Arr::Nibbles => 16,
            Arr::TwoBits => 8,
            Arr::Bits => 4,
        }
    }

    fn put(self, v: &[u8; 32], out: &mut [u8]) {
        match self {
            Arr::Nibbles => put_nibbles(v, out),
            Arr::TwoBits => put_two_bits(v, out),
            Arr::Bits => put_bits(v, out),
        }
    }

    fn get(self, b: &[u8], v: &mut [u8; 32]) {
        match self {
            Arr::Nibbles => get_nibbles(b, v),
            Arr::TwoBits => get_two_bits(b, v),
            Arr::Bits => get_bits(b, v),
        }
    }
}

/// One part of a block's device arrangement (a format's row lists them: `Format::pieces`).
#[derive(Debug)]
pub(crate) enum Piece {
    /// GGUF bytes copied as they are into the block's head, `dev` bytes in (where two blocks
    /// share head words, the odd block's 2 bytes further).
    Head { host: Range<usize>, dev: usize },
    /// GGUF bytes copied as they are into the block's quants, `dev` bytes in.
    Quants { host: Range<usize>, dev: usize },
    /// A K-quant field regrouped by 32-element sub-block: its GGUF bytes, where element l of
    /// sub-block s sits in them (`bits`), its mask, the device arrangement, and where
    /// sub-block 0 starts in the block's quants (`dev`).
    Field {
        host: Range<usize>,
        bits: FieldAt,
        mask: u8,
        arr: Arr,
        dev: usize,
    },
}

/// The device byte where piece `p` of block `i` starts.
fn place(dtype: DType, layout: &DeviceQuantLayout, i: usize, p: &Piece) -> usize {
    let (h2, qw) = geometry(dtype);
    let quants = layout.qs_offset * 4 + i * qw * 4;
    match p {
        Piece::Head { dev, .. } => {
            let shared = if h2 % 2 == 1 { 2 * (i % 2) } else { 0 };
            head_at(dtype, i) + shared + dev
        }
        Piece::Quants { dev, .. } | Piece::Field { dev, .. } => quants + dev,
    }
}

/// Host (GGUF) blocks → device words. `raw.len()` is a whole number of blocks.
pub(crate) fn to_device(dtype: DType, raw: &[u8]) -> Vec<u32> {
    let bb = dtype.block_bytes();
    let layout = device_layout(dtype, raw.len() / bb);
    let mut words = vec![0u32; layout.words];
    let w: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
    for (i, blk) in raw.chunks_exact(bb).enumerate() {
        for p in dtype.format().pieces {
            let o = place(dtype, &layout, i, p);
            match p {
                Piece::Head { host, .. } | Piece::Quants { host, .. } => {
                    w[o..o + host.len()].copy_from_slice(&blk[host.clone()]);
                }
                Piece::Field {
                    host,
                    bits,
                    mask,
                    arr,
                    ..
                } => {
                    for s in 0..8 {
                        let at = o + s * arr.bytes();
                        let v = gather(&blk[host.clone()], s, *bits, *mask);
                        arr.put(&v, &mut w[at..at + arr.bytes()]);
                    }
                }
            }
        }
    }
    words
}

/// Device bytes → host (GGUF) blocks; inverse of [`to_device`].
pub(crate) fn from_device(dtype: DType, dev: &[u8], n_blocks: usize) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let layout = device_layout(dtype, n_blocks);
    let mut out = vec![0u8; n_blocks * bb];
    for (i, blk) in out.chunks_exact_mut(bb).enumerate() {
        for p in dtype.format().pieces {
            let o = place(dtype, &layout, i, p);
            match p {
                Piece::Head { host, .. } | Piece::Quants { host, .. } => {
                    blk[host.clone()].copy_from_slice(&dev[o..o + host.len()]);
                }
                Piece::Field {
                    host, bits, arr, ..
                } => {
                    for s in 0..8 {
                        let at = o + s * arr.bytes();
                        let mut v = [0u8; 32];
                        arr.get(&dev[at..at + arr.bytes()], &mut v);
                        scatter(&mut blk[host.clone()], s, *bits, &v);
                    }
                }
            }
        }
    }
    out
}
