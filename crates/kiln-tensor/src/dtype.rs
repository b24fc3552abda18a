//! Element types, including the GGUF block-quantized formats.

/// Element type of a tensor.
///
/// `Q8_0`, `Q4_0` and `Q4_1` are GGUF block formats of 32 elements; their tensors stay
/// quantized on the device and are dequantized inside kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    /// Accepted at upload and converted to F32 (bf16 has f32's range, which f16 lacks).
    BF16,
    U32,
    I32,
    /// f16 scale `d` + 32 × i8; value = q·d.
    Q8_0,
    /// f16 scale `d` + 16 bytes of nibbles; value = (q − 8)·d.
    Q4_0,
    /// f16 scale `d`, f16 min `m` + 16 bytes of nibbles; value = q·d + m.
    Q4_1,
}

/// Elements per quantization block of the GGUF formats kiln supports.
pub const QK: usize = 32;

impl DType {
    /// True for the block-quantized formats.
    pub fn is_quantized(self) -> bool {
        matches!(self, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
    }

    /// Elements per storage block (1 for plain types, 32 for quantized).
    pub fn block_elems(self) -> usize {
        if self.is_quantized() { QK } else { 1 }
    }

    /// Bytes per storage block in the GGUF (host) layout.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
        }
    }

    /// Host-layout byte size of `n` elements, or `None` when `n` is not a whole number of
    /// blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let be = self.block_elems();
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes())
    }

    /// The dtype a tensor has once uploaded (BF16 becomes F32).
    pub fn stored(self) -> DType {
        if self == DType::BF16 {
            DType::F32
        } else {
            self
        }
    }
}
