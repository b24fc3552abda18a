//! ggml tensor type ids, their names and block layouts.

use std::fmt;

/// A ggml tensor type id as stored in a GGUF tensor info.
///
/// Any `u32` is representable, so a file with a type this crate does not know still parses;
/// [`GgmlType::name`] names every id ggml has assigned, and [`GgmlType::block_layout`] gives the
/// storage layout of the ones whose byte size this crate can compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub u32);

/// How a ggml type packs elements: `block_elems` elements take `block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    /// Elements per block (1 for plain scalar types).
    pub block_elems: u64,
    /// Bytes per block.
    pub block_bytes: u64,
}

impl GgmlType {
    /// 32-bit float.
    pub const F32: Self = Self(0);
    /// 16-bit IEEE float.
    pub const F16: Self = Self(1);
    /// 4-bit blocks of 32 with an f16 scale.
    pub const Q4_0: Self = Self(2);
    /// 4-bit blocks of 32 with an f16 scale and minimum.
    pub const Q4_1: Self = Self(3);
    /// 5-bit blocks of 32 with an f16 scale.
    pub const Q5_0: Self = Self(6);
    /// 5-bit blocks of 32 with an f16 scale and minimum.
    pub const Q5_1: Self = Self(7);
    /// 8-bit blocks of 32 with an f16 scale.
    pub const Q8_0: Self = Self(8);
    /// 8-bit blocks of 32 with an f16 scale and sum.
    pub const Q8_1: Self = Self(9);
    /// 2-bit super-blocks of 256 with 4-bit scales and mins.
    pub const Q2_K: Self = Self(10);
    /// 3-bit super-blocks of 256 with 6-bit scales.
    pub const Q3_K: Self = Self(11);
    /// 4-bit super-blocks of 256 with 6-bit scales and mins.
    pub const Q4_K: Self = Self(12);
    /// 5-bit super-blocks of 256 with 6-bit scales and mins.
    pub const Q5_K: Self = Self(13);
    /// 6-bit super-blocks of 256 with 8-bit scales.
    pub const Q6_K: Self = Self(14);
    /// 16-bit brain float.
    pub const BF16: Self = Self(30);
    /// OCP microscaling FP4: blocks of 32 E2M1 values with one E8M0 exponent (GPT-OSS's
    /// experts).
    pub const MXFP4: Self = Self(39);

    /// The name ggml gives this type, or `None` for an id ggml never assigned.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            4 => "Q4_2 (removed)",
            5 => "Q4_3 (removed)",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            31 => "Q4_0_4_4 (removed)",
            32 => "Q4_0_4_8 (removed)",
            33 => "Q4_0_8_8 (removed)",
            34 => "TQ1_0",
            35 => "TQ2_0",
            36 => "IQ4_NL_4_4 (removed)",
            37 => "IQ4_NL_4_8 (removed)",
            38 => "IQ4_NL_8_8 (removed)",
            39 => "MXFP4",
            _ => return None,
        })
    }

    /// Storage layout, for the types whose size this crate computes: the scalar types and the
    /// classic and k-quant block types. `None` for the others (importance-matrix quants etc.).
    pub fn block_layout(self) -> Option<BlockLayout> {
        let (block_elems, block_bytes) = match self.0 {
            0 => (1, 4),
            1 | 30 => (1, 2),
            2 => (32, 18),
            3 => (32, 20),
            6 => (32, 22),
            7 => (32, 24),
            8 => (32, 34),
            9 => (32, 36),
            10 => (256, 84),
            11 => (256, 110),
            12 => (256, 144),
            13 => (256, 176),
            14 => (256, 210),
            15 => (256, 292),
            24 => (1, 1),
            25 => (1, 2),
            26 => (1, 4),
            27 | 28 => (1, 8),
            39 => (32, 17),
            _ => return None,
        };
        Some(BlockLayout {
            block_elems,
            block_bytes,
        })
    }

    /// Bytes taken by `n_elements` elements, or `None` when the layout is unknown or
    /// `n_elements` is not a whole number of blocks.
    pub fn byte_size(self, n_elements: u64) -> Option<u64> {
        let layout = self.block_layout()?;
        if !n_elements.is_multiple_of(layout.block_elems) {
            return None;
        }
        (n_elements / layout.block_elems).checked_mul(layout.block_bytes)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown ggml type {}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_of_the_types_kiln_loads() {
        assert_eq!(GgmlType::F32.byte_size(10), Some(40));
        assert_eq!(GgmlType::F16.byte_size(10), Some(20));
        assert_eq!(GgmlType::Q8_0.byte_size(64), Some(68));
        assert_eq!(GgmlType::Q4_0.byte_size(64), Some(36));
        assert_eq!(GgmlType::Q4_1.byte_size(64), Some(40));
        assert_eq!(GgmlType::Q4_1.byte_size(33), None, "not a whole block");
        assert_eq!(GgmlType(16).byte_size(256), None, "layout not known");
    }

    #[test]
    fn names_known_and_unknown_ids() {
        assert_eq!(GgmlType::Q4_1.to_string(), "Q4_1");
        assert_eq!(GgmlType(14).to_string(), "Q6_K");
        assert_eq!(GgmlType(23).to_string(), "IQ4_XS");
        assert_eq!(GgmlType(999).to_string(), "unknown ggml type 999");
    }
}
