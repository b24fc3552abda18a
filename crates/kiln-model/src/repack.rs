//! Quantized checkpoint layouts → kiln's 32-element blocks, on the host.
//!
//! Each format ([`gptq`], [`awq`], [`compressed_tensors`]) is unpacked to one neutral form,
//! [`Unpacked`]: unsigned integer quants per (output row, input column), and a scale and an
//! integer zero per (output row, group). [`Unpacked::to_blocks`] then writes each row as blocks
//! of 32 columns of one group, value = (q − zero)·scale: `Q4_0` / `Q8_0` where every zero is
//! the midpoint (8, 128), `Q4_Z` / `Q8_Z` otherwise. Same integers, same f16 scales: the
//! dequantized values are the checkpoint's exactly.
//!
//! Groups given by a `g_idx` that is not `column / group_size` (GPTQ's act-order) are made
//! contiguous by sorting the columns by group; the permutation is returned, and the model
//! gathers its input's columns in that order before the matmul.

use kiln_tensor::{DType, QK};

/// Why a tensor set cannot be repacked (the caller adds the file and tensor name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RepackError {
    /// Which tensor of the set (`qzeros`, `g_idx`, ...).
    pub tensor: &'static str,
    pub problem: String,
}

fn bad(tensor: &'static str, problem: impl Into<String>) -> RepackError {
    RepackError {
        tensor,
        problem: problem.into(),
    }
}

type Result<T> = std::result::Result<T, RepackError>;

/// A quantized `[rows, cols]` weight (kiln's orientation: output rows, input columns).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Unpacked {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    /// `[rows, cols]`, each below `2^bits`.
    pub q: Vec<u8>,
    pub groups: usize,
    /// `[rows, groups]` f16 bits.
    pub scales: Vec<u16>,
    /// `[rows, groups]`, each below `2^bits`.
    pub zeros: Vec<u8>,
    /// Each column's group.
    pub group_of: Vec<u32>,
}

/// Blocks ready to upload, and the input order they expect.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Repacked {
    pub dtype: DType,
    /// Host-layout blocks of `dtype`, row-major.
    pub bytes: Vec<u8>,
    /// Block column `j` holds input column `perm[j]`; `None`: the natural order.
    pub perm: Option<Vec<u32>>,
}

/// The quantized values of a packed tensor: 32-bit words holding `32 / bits` fields each,
/// field `j` at bits `j·bits ..`.
fn field(word: i32, j: usize, bits: u32) -> u8 {
    (((word as u32) >> (j as u32 * bits)) & ((1u32 << bits) - 1)) as u8
}

/// `column / group_size` for every column (`None`: one group a row).
fn natural_groups(cols: usize, group_size: Option<usize>) -> Vec<u32> {
    let gs = group_size.unwrap_or(cols).max(1);
    (0..cols).map(|c| (c / gs) as u32).collect()
}

/// Each column's group: `g_idx` when given (checked against `groups`), else the natural one.
fn groups_of(
    cols: usize,
    groups: usize,
    group_size: Option<usize>,
    g_idx: Option<&[i32]>,
    name: &'static str,
) -> Result<Vec<u32>> {
    let Some(g) = g_idx else {
        let v = natural_groups(cols, group_size);
        if v.last().is_some_and(|&l| l as usize >= groups) {
            return Err(bad(
                name,
                format!(
                    "{cols} columns in groups of {group_size:?} need more than {groups} groups"
                ),
            ));
        }
        return Ok(v);
    };
    if g.len() != cols {
        return Err(bad(
            name,
            format!("{} entries for {cols} input columns", g.len()),
        ));
    }
    g.iter()
        .enumerate()
        .map(|(c, &x)| {
            u32::try_from(x)
                .ok()
                .filter(|&x| (x as usize) < groups)
                .ok_or_else(|| bad(name, format!("column {c}: group {x} is not in 0..{groups}")))
        })
        .collect()
}

fn check_len(name: &'static str, got: usize, shape: [usize; 2]) -> Result<()> {
    if got == shape[0] * shape[1] {
        Ok(())
    } else {
        Err(bad(name, format!("{got} values, not {shape:?}")))
    }
}

/// GPTQ (GPTQModel, AutoGPTQ): `qweight [cols·bits/32, rows]` packed along the input
/// dimension, `qzeros [groups, rows·bits/32]` along the output one, `scales [groups, rows]`,
/// `g_idx [cols]`. `zeros_minus_one`: the `gptq` (v1) format, whose zero words were written
/// as `packed(zeros) − 0x11111111` (4-bit; `0x01010101` 8-bit) in wrapping 32-bit arithmetic,
/// so adding it back word-wise restores zeros of 0 too (a per-field `+1` would not).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gptq(
    rows: usize,
    cols: usize,
    bits: u32,
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[u16],
    g_idx: Option<&[i32]>,
    group_size: Option<usize>,
    zeros_minus_one: bool,
) -> Result<Unpacked> {
    let pack = (32 / bits) as usize;
    if !rows.is_multiple_of(pack) || !cols.is_multiple_of(pack) {
        return Err(bad(
            "qweight",
            format!("[{rows}, {cols}] is not a whole number of {pack}-value words"),
        ));
    }
    check_len("qweight", qweight.len(), [cols / pack, rows])?;
    let groups = scales.len() / rows.max(1);
    check_len("scales", scales.len(), [groups, rows])?;
    check_len("qzeros", qzeros.len(), [groups, rows / pack])?;
    let group_of = groups_of(cols, groups, group_size, g_idx, "g_idx")?;
    let one: u32 = if bits == 4 { 0x1111_1111 } else { 0x0101_0101 };
    let mut q = vec![0u8; rows * cols];
    for (k, words) in qweight.chunks_exact(rows).enumerate() {
        for (r, &w) in words.iter().enumerate() {
            for j in 0..pack {
                q[r * cols + k * pack + j] = field(w, j, bits);
            }
        }
    }
    let mut s = vec![0u16; rows * groups];
    let mut z = vec![0u8; rows * groups];
    for g in 0..groups {
        for r in 0..rows {
            s[r * groups + g] = scales[g * rows + r];
            let mut w = qzeros[g * (rows / pack) + r / pack];
            if zeros_minus_one {
                w = (w as u32).wrapping_add(one) as i32;
            }
            z[r * groups + g] = field(w, r % pack, bits);
        }
    }
    Ok(Unpacked {
        rows,
        cols,
        bits,
        q,
        groups,
        scales: s,
        zeros: z,
        group_of,
    })
}

/// Where AutoAWQ's GEMM packing puts column `c % 8` of a word: its field
/// `[0, 4, 1, 5, 2, 6, 3, 7][c % 8]` (the inverse of its pack order 0, 2, 4, 6, 1, 3, 5, 7).
const AWQ_FIELD: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// AutoAWQ GEMM: `qweight [cols, rows/8]` and `qzeros [groups, rows/8]` packed along the
/// output dimension in AWQ's interleaved order, `scales [groups, rows]`; 4-bit only.
pub(crate) fn awq(
    rows: usize,
    cols: usize,
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[u16],
    group_size: Option<usize>,
) -> Result<Unpacked> {
    if !rows.is_multiple_of(8) {
        return Err(bad(
            "qweight",
            format!("{rows} output rows are not a whole number of 8-value words"),
        ));
    }
    let wpr = rows / 8;
    check_len("qweight", qweight.len(), [cols, wpr])?;
    let groups = scales.len() / rows.max(1);
    check_len("scales", scales.len(), [groups, rows])?;
    check_len("qzeros", qzeros.len(), [groups, wpr])?;
    let group_of = groups_of(cols, groups, group_size, None, "scales")?;
    let unpack = |words: &[i32], r: usize| field(words[r / 8], AWQ_FIELD[r % 8], 4);
    let mut q = vec![0u8; rows * cols];
    for (c, words) in qweight.chunks_exact(wpr.max(1)).enumerate() {
        for r in 0..rows {
            q[r * cols + c] = unpack(words, r);
        }
    }
    let mut s = vec![0u16; rows * groups];
    let mut z = vec![0u8; rows * groups];
    for (g, words) in qzeros.chunks_exact(wpr.max(1)).enumerate() {
        for r in 0..rows {
            s[r * groups + g] = scales[g * rows + r];
            z[r * groups + g] = unpack(words, r);
        }
    }
    Ok(Unpacked {
        rows,
        cols,
        bits: 4,
        q,
        groups,
        scales: s,
        zeros: z,
        group_of,
    })
}

/// compressed-tensors' zero points: absent (symmetric: the midpoint), packed 32-bit words
/// along the output dimension (`[ceil(rows·bits/32), groups]`, as `pack-quantized` writes
/// asymmetric ones), or one signed byte each (`[rows, groups]`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum CtZeros<'a> {
    Symmetric,
    Packed(&'a [i32]),
    Bytes(&'a [i8]),
}

/// compressed-tensors `pack-quantized`: `weight_packed [rows, cols·bits/32]` of values stored
/// `+ 2^(bits−1)` (unsigned), `weight_scale [rows, groups]`, zero points as [`CtZeros`] (also
/// signed, stored with the same offset), optional `weight_g_idx [cols]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn compressed_tensors(
    rows: usize,
    cols: usize,
    bits: u32,
    packed: &[i32],
    scales: &[u16],
    zeros: CtZeros<'_>,
    g_idx: Option<&[i32]>,
    group_size: Option<usize>,
) -> Result<Unpacked> {
    let pack = (32 / bits) as usize;
    if !cols.is_multiple_of(pack) {
        return Err(bad(
            "weight_packed",
            format!("{cols} input columns are not a whole number of {pack}-value words"),
        ));
    }
    let wpr = cols / pack;
    check_len("weight_packed", packed.len(), [rows, wpr])?;
    let groups = scales.len() / rows.max(1);
    check_len("weight_scale", scales.len(), [rows, groups])?;
    let group_of = groups_of(cols, groups, group_size, g_idx, "weight_g_idx")?;
    let mut q = vec![0u8; rows * cols];
    for (r, words) in packed.chunks_exact(wpr.max(1)).enumerate() {
        for (k, &w) in words.iter().enumerate() {
            for j in 0..pack {
                q[r * cols + k * pack + j] = field(w, j, bits);
            }
        }
    }
    let mid = 1u8 << (bits - 1);
    let z = match zeros {
        CtZeros::Symmetric => vec![mid; rows * groups],
        CtZeros::Packed(words) => {
            check_len(
                "weight_zero_point",
                words.len(),
                [rows.div_ceil(pack), groups],
            )?;
            (0..rows * groups)
                .map(|i| {
                    let (r, g) = (i / groups, i % groups);
                    field(words[(r / pack) * groups + g], r % pack, bits)
                })
                .collect()
        }
        CtZeros::Bytes(b) => {
            check_len("weight_zero_point", b.len(), [rows, groups])?;
            let lim = i16::from(mid);
            b.iter()
                .map(|&x| {
                    let x = i16::from(x);
                    if (-lim..lim).contains(&x) {
                        Ok((x + lim) as u8)
                    } else {
                        Err(bad(
                            "weight_zero_point",
                            format!("{x} is outside the {bits}-bit range"),
                        ))
                    }
                })
                .collect::<Result<_>>()?
        }
    };
    Ok(Unpacked {
        rows,
        cols,
        bits,
        q,
        groups,
        scales: scales.to_vec(),
        zeros: z,
        group_of,
    })
}

impl Unpacked {
    /// The dequantized values `[rows, cols]` in the checkpoint's column order (tests).
    #[cfg(test)]
    pub(crate) fn dequantize(&self) -> Vec<f32> {
        (0..self.rows * self.cols)
            .map(|i| {
                let (r, c) = (i / self.cols, i % self.cols);
                let g = r * self.groups + self.group_of[c] as usize;
                let d = half::f16::from_bits(self.scales[g]).to_f32();
                (f32::from(self.q[i]) - f32::from(self.zeros[g])) * d
            })
            .collect()
    }

    /// Rows as 32-column blocks of one group each (columns sorted by group when the groups
    /// are not contiguous), in the smallest block dtype that holds them exactly.
    pub(crate) fn to_blocks(&self) -> Result<Repacked> {
        if !self.cols.is_multiple_of(QK) || self.cols == 0 {
            return Err(bad(
                "weight",
                format!("{} input columns are not a multiple of {QK}", self.cols),
            ));
        }
        let contiguous = self.group_of.is_sorted();
        let perm: Option<Vec<u32>> = (!contiguous).then(|| {
            let mut p: Vec<u32> = (0..self.cols as u32).collect();
            // Stable: columns of one group keep their order.
            p.sort_by_key(|&c| self.group_of[c as usize]);
            p
        });
        let col = |j: usize| perm.as_ref().map_or(j, |p| p[j] as usize);
        let nb = self.cols / QK;
        let mut block_group = Vec::with_capacity(nb);
        for b in 0..nb {
            let g = self.group_of[col(b * QK)];
            if let Some(j) = (b * QK..(b + 1) * QK).find(|&j| self.group_of[col(j)] != g) {
                return Err(bad(
                    "g_idx",
                    format!(
                        "groups {g} and {} share the 32-column block {b}: kiln needs every group \
                         to fill whole blocks of 32 columns",
                        self.group_of[col(j)]
                    ),
                ));
            }
            block_group.push(g as usize);
        }
        let mid = 1u8 << (self.bits - 1);
        let symmetric = self.zeros.iter().all(|&z| z == mid);
        let dtype = match (self.bits, symmetric) {
            (4, true) => DType::Q4_0,
            (4, false) => DType::Q4_Z,
            (_, true) => DType::Q8_0,
            (_, false) => DType::Q8_Z,
        };
        let mut bytes = Vec::with_capacity(self.rows * nb * dtype.block_bytes());
        for r in 0..self.rows {
            let q = &self.q[r * self.cols..(r + 1) * self.cols];
            for (b, &g) in block_group.iter().enumerate() {
                let gi = r * self.groups + g;
                bytes.extend_from_slice(&self.scales[gi].to_le_bytes());
                if !symmetric {
                    let z = half::f16::from_f32(f32::from(self.zeros[gi]));
                    bytes.extend_from_slice(&z.to_le_bytes());
                }
                let qs = |i: usize| q[col(b * QK + i)];
                match self.bits {
                    4 => bytes.extend((0..QK / 2).map(|i| qs(i) | (qs(i + QK / 2) << 4))),
                    // Q8_0 holds q − 128 as i8: the same byte with its top bit flipped.
                    _ if symmetric => bytes.extend((0..QK).map(|i| qs(i) ^ 0x80)),
                    _ => bytes.extend((0..QK).map(qs)),
                }
            }
        }
        Ok(Repacked { dtype, bytes, perm })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kiln_tensor::{Device, Tensor};

    /// A deterministic stream of small integers.
    fn lcg(seed: u32) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            s >> 8
        }
    }

    fn unpacked(rows: usize, cols: usize, bits: u32, group: usize, sym: bool) -> Unpacked {
        let mut rnd = lcg(rows as u32 * 31 + cols as u32);
        let groups = cols / group;
        let max = 1u32 << bits;
        Unpacked {
            rows,
            cols,
            bits,
            q: (0..rows * cols).map(|_| (rnd() % max) as u8).collect(),
            groups,
            scales: (0..rows * groups)
                .map(|_| half::f16::from_f32(0.001 + (rnd() % 1000) as f32 * 1e-5).to_bits())
                .collect(),
            zeros: (0..rows * groups)
                .map(|_| {
                    if sym {
                        (max / 2) as u8
                    } else {
                        (rnd() % max) as u8
                    }
                })
                .collect(),
            group_of: natural_groups(cols, Some(group)),
        }
    }

    /// kiln-tensor's own dequantization of the blocks, columns put back in checkpoint order.
    fn kiln_values(u: &Unpacked) -> (DType, Vec<f32>) {
        let r = u.to_blocks().unwrap();
        let t =
            Tensor::from_bytes(&Device::Reference, r.dtype, &[u.rows, u.cols], &r.bytes).unwrap();
        let v = t.to_f32_vec().unwrap();
        let mut out = vec![0f32; v.len()];
        for row in 0..u.rows {
            for j in 0..u.cols {
                let c = r.perm.as_ref().map_or(j, |p| p[j] as usize);
                out[row * u.cols + c] = v[row * u.cols + j];
            }
        }
        (r.dtype, out)
    }

    #[test]
    fn blocks_hold_the_values_exactly_in_the_smallest_dtype() {
        for (bits, sym, want) in [
            (4, true, DType::Q4_0),
            (4, false, DType::Q4_Z),
            (8, true, DType::Q8_0),
            (8, false, DType::Q8_Z),
        ] {
            let u = unpacked(6, 128, bits, 64, sym);
            let (dtype, got) = kiln_values(&u);
            assert_eq!(dtype, want);
            assert_eq!(got, u.dequantize(), "{bits}-bit sym={sym}");
        }
    }

    #[test]
    fn shuffled_groups_are_sorted_into_whole_blocks() {
        let mut u = unpacked(4, 128, 4, 32, false);
        // Columns dealt round-robin to 4 groups of 32: every group is scattered.
        u.group_of = (0..128).map(|c| (c % 4) as u32).collect();
        let r = u.to_blocks().unwrap();
        let p = r.perm.clone().unwrap();
        assert_eq!(&p[..3], &[0, 4, 8]);
        assert_eq!(kiln_values(&u).1, u.dequantize());
        // Groups of 16 columns cannot fill 32-column blocks.
        u.group_of = (0..128).map(|c| (c % 8) as u32).collect();
        u.groups = 8;
        u.scales.resize(4 * 8, 0x3c00);
        u.zeros.resize(4 * 8, 3);
        let e = u.to_blocks().unwrap_err();
        assert!(e.problem.contains("whole blocks"), "{e:?}");
    }

    /// Packs `u` as each format writes it (the inverse of the readers), then reads it back.
    #[test]
    fn formats_unpack_what_their_packers_write() {
        let (rows, cols) = (64, 64);
        for bits in [4u32, 8] {
            let u = unpacked(rows, cols, bits, 32, false);
            let pack = (32 / bits) as usize;
            let put = |w: &mut i32, j: usize, v: u8| *w |= (i32::from(v)) << (j as u32 * bits);
            // GPTQ: along the input dimension; zeros along the output one, stored minus one.
            let mut qw = vec![0i32; cols / pack * rows];
            for r in 0..rows {
                for c in 0..cols {
                    put(&mut qw[(c / pack) * rows + r], c % pack, u.q[r * cols + c]);
                }
            }
            let mut qz = vec![0i32; u.groups * rows / pack];
            let mut sc = vec![0u16; u.groups * rows];
            for r in 0..rows {
                for g in 0..u.groups {
                    put(
                        &mut qz[g * rows / pack + r / pack],
                        r % pack,
                        u.zeros[r * u.groups + g],
                    );
                    sc[g * rows + r] = u.scales[r * u.groups + g];
                }
            }
            let one: u32 = if bits == 4 { 0x1111_1111 } else { 0x0101_0101 };
            let qz1: Vec<i32> = qz
                .iter()
                .map(|&w| (w as u32).wrapping_sub(one) as i32)
                .collect();
            let g_idx: Vec<i32> = (0..cols as i32).map(|c| c / 32).collect();
            let got = gptq(
                rows,
                cols,
                bits,
                &qw,
                &qz1,
                &sc,
                Some(&g_idx),
                Some(32),
                true,
            )
            .unwrap();
            assert_eq!(got, u, "gptq v1 {bits}-bit");
            let got = gptq(rows, cols, bits, &qw, &qz, &sc, None, Some(32), false).unwrap();
            assert_eq!(got, u, "gptq v2 {bits}-bit");
            // compressed-tensors: along the input dimension, zeros packed along the output one.
            let mut wp = vec![0i32; rows * cols / pack];
            for r in 0..rows {
                for c in 0..cols {
                    put(
                        &mut wp[r * cols / pack + c / pack],
                        c % pack,
                        u.q[r * cols + c],
                    );
                }
            }
            let mut zp = vec![0i32; rows / pack * u.groups];
            for r in 0..rows {
                for g in 0..u.groups {
                    put(
                        &mut zp[(r / pack) * u.groups + g],
                        r % pack,
                        u.zeros[r * u.groups + g],
                    );
                }
            }
            let ct = |z| compressed_tensors(rows, cols, bits, &wp, &u.scales, z, None, Some(32));
            assert_eq!(ct(CtZeros::Packed(&zp)).unwrap(), u, "ct {bits}-bit");
            let mid = 1i16 << (bits - 1);
            let zb: Vec<i8> = u
                .zeros
                .iter()
                .map(|&z| (i16::from(z) - mid) as i8)
                .collect();
            assert_eq!(ct(CtZeros::Bytes(&zb)).unwrap(), u, "ct bytes {bits}-bit");
            if bits == 4 {
                // AWQ: along the output dimension in the order 0, 2, 4, 6, 1, 3, 5, 7.
                let order = [0usize, 2, 4, 6, 1, 3, 5, 7];
                let mut aw = vec![0i32; cols * rows / 8];
                let mut az = vec![0i32; u.groups * rows / 8];
                for c in 0..cols {
                    for w in 0..rows / 8 {
                        for (j, &o) in order.iter().enumerate() {
                            put(&mut aw[c * rows / 8 + w], j, u.q[(w * 8 + o) * cols + c]);
                        }
                    }
                }
                for g in 0..u.groups {
                    for w in 0..rows / 8 {
                        for (j, &o) in order.iter().enumerate() {
                            put(
                                &mut az[g * rows / 8 + w],
                                j,
                                u.zeros[(w * 8 + o) * u.groups + g],
                            );
                        }
                    }
                }
                assert_eq!(awq(rows, cols, &aw, &az, &sc, Some(32)).unwrap(), u, "awq");
            }
        }
    }

    #[test]
    fn bad_shapes_and_groups_name_the_tensor() {
        let e = gptq(8, 64, 4, &[0; 7], &[0; 1], &[0; 8], None, None, true).unwrap_err();
        assert_eq!(e.tensor, "qweight");
        let e = gptq(
            8,
            64,
            4,
            &[0; 64],
            &[0; 1],
            &[0; 8],
            Some(&[5; 64]),
            None,
            true,
        )
        .unwrap_err();
        assert_eq!(e.tensor, "g_idx");
        assert!(e.problem.contains("group 5"), "{e:?}");
    }
}
