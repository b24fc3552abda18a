//! The integer dot product matrix-vector kernel (`--kernels experimental`): X's rows
//! quantized to 8-bit blocks of 32 (`quantize_q8.wgsl`), then `matmul_vec_dp4a.wgsl`'s
//! `dot4I8Packed` over Q8_0 or Q4_0 weights, as llama.cpp does on GPUs with integer dot
//! products. It takes decode's matmuls of those weights (with a bias at most; a norm, GLU or
//! residual around it runs as its own op) where the device runs experimental kernels.

use bytemuck::{Pod, Zeroable};

use super::{flag, number, weight_defines};
use crate::gpu::{Access, KernelDef};
use crate::tensor::Storage;
use crate::{DType, MatvecShape, Recorder, Result, Tensor, TensorError};

const R: Access = Access::Read;
const W: Access = Access::ReadWrite;

pub(crate) const QUANTIZE_SRC: &str = include_str!("../../wgsl/quantize_q8.wgsl");
pub(crate) const DP4A_SRC: &str = include_str!("../../wgsl/matmul_vec_dp4a.wgsl");

static QUANTIZE_Q8: KernelDef = KernelDef {
    name: "quantize_q8",
    source: QUANTIZE_SRC,
    bindings: &[R, W],
};
static MATMUL_VEC_DP4A: KernelDef = KernelDef {
    name: "matmul_vec_dp4a",
    source: DP4A_SRC,
    bindings: &[R, R, W],
};
static MATMUL_VEC_DP4A_BIAS: KernelDef = KernelDef {
    name: "matmul_vec_dp4a",
    source: DP4A_SRC,
    bindings: &[R, R, W, R],
};

/// Words `quantize_q8.wgsl` writes a block of 32: eight of values, d, the sum.
pub(crate) const Q8_BLOCK_WORDS: usize = 10;

/// The weight formats the kernel reads.
pub(crate) fn dp4a_reads(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0)
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct QuantParams {
    rows: u32,
    k: u32,
    _pad: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Dp4aParams {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    _pad: [u32; 2],
}

impl Recorder {
    /// Y = X · Wᵀ (+ bias) through the integer dot product kernel, `w` in a format
    /// [`dp4a_reads`]: X quantized once, then every chunk of `w`.
    pub(super) fn matmul_dp4a(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<()> {
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: "matmul" });
        };
        let (m, k) = (x.rows(), x.cols());
        let blocks = m * (k / 32);
        let xq = self.output(DType::U32, &[blocks, Q8_BLOCK_WORDS], "quantize_q8")?;
        let q = QuantParams {
            rows: m as u32,
            k: k as u32,
            _pad: [0; 2],
        };
        let none: [(&str, &str); 0] = [];
        self.dispatch(
            &QUANTIZE_Q8,
            &none,
            &q,
            vec![(x.clone(), 0), (xq.clone(), 0)],
            blocks.div_ceil(64) as u32,
        )?;
        let mut defines = weight_defines(w.dtype(), 2);
        defines.push(("MV_M", number(m)));
        defines.push(("BIAS", flag(bias.is_some())));
        let shared = defines.len();
        for (ci, c) in chunks.iter().enumerate() {
            let shape = self.gpu().map_or(MatvecShape::choose(false, c.rows), |g| {
                g.matvec_shape(c.rows)
            });
            defines.truncate(shared);
            defines.push(("TPR", number(shape.threads_per_row as usize)));
            let params = Dp4aParams {
                m: m as u32,
                k: k as u32,
                rows: c.rows as u32,
                n_total: y.cols() as u32,
                n_offset: c.row0 as u32,
                qs: c.qs_offset,
                _pad: [0; 2],
            };
            let mut bind = vec![(xq.clone(), 0), (w.clone(), ci), (y.clone(), 0)];
            let kernel = match bias {
                Some(b) => {
                    bind.push((b.clone(), 0));
                    &MATMUL_VEC_DP4A_BIAS
                }
                None => &MATMUL_VEC_DP4A,
            };
            let per_group = 64 / shape.threads_per_row as usize;
            self.dispatch(
                kernel,
                &defines,
                &params,
                bind,
                c.rows.div_ceil(per_group) as u32,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::spirv_check::{self, Needs, OP_SDOT};

    /// Every variant compiles to SPIR-V that SPIRV-Tools' validator accepts: with the
    /// device's integer dot products `dot4I8Packed` is `OpSDot`, without them naga writes it
    /// out in shifts and multiplies.
    #[test]
    fn every_variant_compiles_to_valid_spirv_with_and_without_integer_dot_products() {
        for int_dot in [true, false] {
            let needs = Needs {
                f16: false,
                subgroups: false,
                coop: false,
                int_dot,
            };
            let none: [(&str, &str); 0] = [];
            let words = spirv_check::to_spirv(QUANTIZE_SRC, &none, needs)
                .unwrap_or_else(|e| panic!("quantize_q8: {e}"));
            spirv_check::spirv_val(&words, "quantize_q8").unwrap_or_else(|e| panic!("{e}"));
            for dtype in [DType::Q8_0, DType::Q4_0] {
                for (m, tpr, bias) in [(1usize, 32usize, false), (4, 8, true), (8, 64, false)] {
                    let mut defines = weight_defines(dtype, 2);
                    defines.push(("MV_M", number(m)));
                    defines.push(("BIAS", flag(bias)));
                    defines.push(("TPR", number(tpr)));
                    let what = format!("matmul_vec_dp4a {dtype:?} m={m} tpr={tpr} bias={bias}");
                    let words = spirv_check::to_spirv(DP4A_SRC, &defines, needs)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(
                        spirv_check::has_op(&words, OP_SDOT),
                        int_dot,
                        "{what}: OpSDot where the device has integer dot products"
                    );
                    spirv_check::spirv_val(&words, &what).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }
}
