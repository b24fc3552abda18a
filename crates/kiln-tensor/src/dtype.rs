//! Element types, including the GGUF block-quantized formats.

/// Element type of a tensor.
///
/// The `Q*` variants are block formats (layouts in `quant`): the GGUF ones, blocks of 32
/// elements for `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0` and `Q5_1`, super-blocks of 256 for the
/// K-quants `Q2_K` … `Q6_K`; kiln's zero-point formats `Q4_Z`, `Q8_Z` (32 elements); the
/// float block formats `MXFP4` (GGUF's) and `FP8` (kiln's, 32 elements).
/// Their tensors stay quantized on the device and are dequantized inside kernels.
// The K-quants keep ggml's names (`Q4_K`), which users look up in GGUF tooling.
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    /// Kept as bf16 on the device (2 bytes an element) and widened inside the kernels.
    BF16,
    U32,
    I32,
    /// f16 scale `d` + 32 × i8; value = q·d.
    Q8_0,
    /// f16 scale `d` + 16 bytes of nibbles; value = (q − 8)·d.
    Q4_0,
    /// f16 scale `d`, f16 min `m` + 16 bytes of nibbles; value = q·d + m.
    Q4_1,
    /// f16 `d`, 32 high bits, 16 bytes of nibbles; value = (q − 16)·d, q 5-bit.
    Q5_0,
    /// f16 `d`, f16 `m`, 32 high bits, 16 bytes of nibbles; value = q·d + m, q 5-bit.
    Q5_1,
    /// 16 × (4-bit scale, 4-bit min), 2-bit quants, f16 `d`, `dmin`.
    Q2_K,
    /// High-bit mask, 2-bit quants, 16 packed 6-bit scales, f16 `d`.
    Q3_K,
    /// f16 `d`, `dmin`, 8 packed 6-bit (scale, min) pairs, 4-bit quants.
    Q4_K,
    /// As `Q4_K` plus one high bit an element.
    Q5_K,
    /// 4-bit low and 2-bit high quants, 16 × i8 scales, f16 `d`.
    Q6_K,
    /// kiln's own, for the asymmetric 4-bit checkpoints (GPTQ, AWQ, compressed-tensors),
    /// repacked into it at load. 20 bytes a block: f16 scale `d`, f16 zero point `z` (both
    /// little-endian), 16 bytes whose byte j holds element j in its low nibble and j + 16 in
    /// its high one (as `Q4_0`); value = (q − z)·d.
    Q4_Z,
    /// kiln's own, for 8-bit GPTQ and compressed-tensors checkpoints. 36 bytes a block: f16
    /// `d`, f16 `z`, 32 unsigned quants (element i in byte i); value = (q − z)·d.
    Q8_Z,
    /// OCP microscaling FP4 (ggml's `MXFP4`, GPT-OSS's experts): an E8M0 exponent byte `e`
    /// and 16 bytes of E2M1 nibbles as in `Q4_0` (17 bytes a block); value = fp4(q)·2^(e−127).
    MXFP4,
    /// kiln's own, for FP8 checkpoints with block scales (DeepSeek's and transformers'
    /// `fp8` with `weight_block_size`, 128 × 128): an f32 scale `d` (little-endian) and 32
    /// OCP E4M3 codes (`float8_e4m3fn`: no infinities; its NaN codes are refused at upload),
    /// element i in byte i (36 bytes a block); value = fp8(q)·d.
    FP8,
}

/// Elements per block of the 32-element formats (`Q8_0` … `Q5_1`, `Q4_Z`, `Q8_Z`).
pub const QK: usize = 32;
/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

impl DType {
    /// Every dtype matmul weights and embedding tables may have (all kernel families).
    pub const WEIGHTS: &'static [DType] = &[
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::Q4_Z,
        DType::Q8_Z,
        DType::MXFP4,
        DType::FP8,
    ];

    /// The dtype a GGUF file's tensor of ggml type id `id` loads as, when kiln reads that type.
    pub fn of_ggml(id: u32) -> Option<DType> {
        DType::WEIGHTS
            .iter()
            .copied()
            .find(|d| d.format().ggml == Some(id))
    }

    /// The ggml type id a GGUF file stores this dtype under (`None` for kiln's own formats and
    /// the index types).
    pub fn ggml(self) -> Option<u32> {
        self.format().ggml
    }

    /// True for the block-quantized formats.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// True for the K-quants (256-element super-blocks).
    pub fn is_k_quant(self) -> bool {
        self.block_elems() == QK_K
    }

    /// Elements per storage block: 1 for plain types, 32 or 256 for quantized ones.
    pub fn block_elems(self) -> usize {
        self.format().block_elems
    }

    /// Bytes per storage block in the host (GGUF, or for `Q4_Z`/`Q8_Z` kiln's) layout.
    pub fn block_bytes(self) -> usize {
        self.format().block_bytes
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

    /// The dtype a tensor has once uploaded: every dtype is stored as itself (BF16 too, since
    /// the kernels widen it).
    pub fn stored(self) -> DType {
        self
    }
}
