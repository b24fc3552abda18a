//! `matmul`: Y[m, n] = X[m, k] · W[n, k]ᵀ (+ bias), W in F32/F16/Q8_0/Q4_0/Q4_1.
//!
//! Up to [`MATVEC_MAX_M`] rows of X take the matrix-vector kernel (decode: every weight read
//! once, eight threads a row); more take the 32×32 tiled kernel (prefill). A weight split into
//! several chunks (bigger than one binding) is launched chunk by chunk into column ranges of Y.

use bytemuck::{Pod, Zeroable};

use super::{R2W, dot, host_f32, host_row, require_dtype, weight_defines};
use crate::gpu::{Access, KernelDef};
use crate::tensor::Storage;
use crate::{DType, Recorder, Result, Tensor, TensorError};

/// Rows of X up to which the matrix-vector kernel is used.
pub const MATVEC_MAX_M: usize = 8;

const VEC_SRC: &str = concat!(
    include_str!("../../wgsl/weights.wgsl"),
    include_str!("../../wgsl/matmul_vec.wgsl")
);
const TILED_SRC: &str = concat!(
    include_str!("../../wgsl/weights.wgsl"),
    include_str!("../../wgsl/matmul_tiled.wgsl")
);
const WITH_BIAS: &[Access] = &[Access::Read, Access::Read, Access::ReadWrite, Access::Read];

static MATMUL_VEC: KernelDef = KernelDef {
    name: "matmul_vec",
    source: VEC_SRC,
    bindings: R2W,
};
static MATMUL_VEC_BIAS: KernelDef = KernelDef {
    name: "matmul_vec",
    source: VEC_SRC,
    bindings: WITH_BIAS,
};
static MATMUL_TILED: KernelDef = KernelDef {
    name: "matmul_tiled",
    source: TILED_SRC,
    bindings: R2W,
};
static MATMUL_TILED_BIAS: KernelDef = KernelDef {
    name: "matmul_tiled",
    source: TILED_SRC,
    bindings: WITH_BIAS,
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    _pad: [u32; 2],
}

const WEIGHT_DTYPES: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
];

impl Recorder {
    /// Y = X · Wᵀ (+ bias). X is F32 `[.., k]`, W is `[n, k]`, bias F32 `[n]`; Y is
    /// `[.., n]` F32.
    pub fn matmul(&mut self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        const OP: &str = "matmul";
        require_dtype(OP, "the input", x, &[DType::F32])?;
        require_dtype(OP, "the weight", w, WEIGHT_DTYPES)?;
        let mut ts = vec![x, w];
        ts.extend(bias);
        self.check_device(OP, &ts)?;
        let k = x.cols();
        if w.shape().len() != 2 || w.cols() != k {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "input {:?} needs a weight [n, {k}], got {:?}",
                    x.shape(),
                    w.shape()
                ),
            });
        }
        let (m, n) = (x.rows(), w.rows());
        if let Some(b) = bias {
            require_dtype(OP, "the bias", b, &[DType::F32])?;
            if b.elem_count() != n {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!("bias {:?} for {n} outputs", b.shape()),
                });
            }
        }
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        if m == 0 || n == 0 || k == 0 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("empty operand: m={m} n={n} k={k}"),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let b = bias.map(host_f32).transpose()?;
            return Ok(Tensor::cpu_f32(shape, matmul_ref(host_f32(x)?, m, w, b)?));
        };
        let y = Tensor::gpu_output(&ctx, DType::F32, shape, OP)?;
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: OP });
        };
        let vec = m <= MATVEC_MAX_M;
        let mut defines = weight_defines(w.dtype(), 2);
        defines.push(("BIAS", u32::from(bias.is_some()).to_string()));
        if vec {
            defines.push(("MV_M", m.to_string()));
            defines.push(("K8", u32::from(k.is_multiple_of(8)).to_string()));
        }
        let kernel = match (vec, bias.is_some()) {
            (true, false) => &MATMUL_VEC,
            (true, true) => &MATMUL_VEC_BIAS,
            (false, false) => &MATMUL_TILED,
            (false, true) => &MATMUL_TILED_BIAS,
        };
        for (ci, c) in chunks.iter().enumerate() {
            let params = Params {
                m: m as u32,
                k: k as u32,
                rows: c.rows as u32,
                n_total: n as u32,
                n_offset: c.row0 as u32,
                qs: c.qs_offset,
                _pad: [0; 2],
            };
            let mut bind = vec![(x.clone(), 0), (w.clone(), ci), (y.clone(), 0)];
            if let Some(b) = bias {
                bind.push((b.clone(), 0));
            }
            let groups = if vec {
                c.rows.div_ceil(8)
            } else {
                m.div_ceil(32) * c.rows.div_ceil(32)
            };
            self.dispatch(kernel, &defines, &params, bind, groups as u32)?;
        }
        Ok(y)
    }
}

/// CPU reference: each weight row is dequantized once, then dotted with every row of X.
pub(crate) fn matmul_ref(
    x: &[f32],
    m: usize,
    w: &Tensor,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let (n, k) = (w.rows(), w.cols());
    let mut y = vec![0f32; m * n];
    let mut row = vec![0f32; k];
    for j in 0..n {
        host_row(w, j, &mut row)?;
        let b = bias.map_or(0.0, |b| b[j]);
        for i in 0..m {
            y[i * n + j] = dot(&x[i * k..(i + 1) * k], &row) + b;
        }
    }
    Ok(y)
}
