//! Row-wise ops, one workgroup per row: `rms_norm`, `softmax`, `argmax`.

use bytemuck::{Pod, Zeroable};

use super::{R1W, R2W, require_dtype, subgroup_defines};
use crate::gpu::KernelDef;
use crate::{DType, Recorder, Result, Tensor, TensorError};

const SRC: &str = concat!(
    include_str!("../../wgsl/reduce.wgsl"),
    include_str!("../../wgsl/rows.wgsl")
);
static RMS_NORM: KernelDef = KernelDef {
    name: "rms_norm",
    source: SRC,
    bindings: R2W,
};
static SOFTMAX: KernelDef = KernelDef {
    name: "softmax",
    source: SRC,
    bindings: R1W,
};
static ARGMAX: KernelDef = KernelDef {
    name: "argmax",
    source: SRC,
    bindings: R1W,
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

impl Recorder {
    fn rows_launch(
        &mut self,
        kernel: &KernelDef,
        switch: &'static str,
        x: &Tensor,
        extra: Option<&Tensor>,
        out: &Tensor,
        eps: f32,
    ) -> Result<()> {
        let sub = self.device().info().subgroups;
        let mut defines = subgroup_defines(sub, 64);
        defines.push((switch, "1".into()));
        let params = Params {
            rows: x.rows() as u32,
            cols: x.cols() as u32,
            eps,
            _pad: 0,
        };
        let mut bind = vec![(x.clone(), 0)];
        bind.extend(extra.map(|t| (t.clone(), 0)));
        bind.push((out.clone(), 0));
        self.dispatch(kernel, &defines, &params, bind, x.rows() as u32)
    }

    fn rows_check(&self, op: &'static str, x: &Tensor) -> Result<()> {
        require_dtype(op, "the input", x, &[DType::F32])?;
        self.check_device(op, &[x])?;
        if x.elem_count() == 0 {
            return Err(TensorError::Invalid {
                op,
                detail: format!("empty input {:?}", x.shape()),
            });
        }
        Ok(())
    }

    /// RMSNorm over the last dimension: x / sqrt(mean(x²) + eps) · weight.
    pub fn rms_norm(&mut self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        self.rows_check(OP, x)?;
        require_dtype(OP, "the weight", weight, &[DType::F32])?;
        self.check_device(OP, &[weight])?;
        if weight.elem_count() != x.cols() {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!("weight {:?} for input {:?}", weight.shape(), x.shape()),
            });
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("eps must be finite and >= 0, got {eps}"),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let (xs, w) = (x.host_f32()?, weight.host_f32()?);
            return Tensor::host_f32_with(x.shape(), |out| {
                rms_norm_ref(xs, w, eps, out);
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, x.shape(), OP)?;
        self.rows_launch(&RMS_NORM, "RMS_NORM", x, Some(weight), &out, eps)?;
        Ok(out)
    }

    /// Numerically stable softmax over the last dimension.
    pub fn softmax(&mut self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "softmax";
        self.rows_check(OP, x)?;
        let Some(ctx) = self.gpu().cloned() else {
            let xs = x.host_f32()?;
            return Tensor::host_f32_with(x.shape(), |out| {
                softmax_ref(xs, x.cols(), out);
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, x.shape(), OP)?;
        self.rows_launch(&SOFTMAX, "SOFTMAX", x, None, &out, 0.0)?;
        Ok(out)
    }

    /// Index of the largest value of each row (the first on ties) as U32 `[rows]`: greedy
    /// sampling without reading the logits back.
    pub fn argmax(&mut self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "argmax";
        self.rows_check(OP, x)?;
        let rows = &x.shape()[..x.shape().len().saturating_sub(1)];
        let shape = if rows.is_empty() { &[1][..] } else { rows };
        let Some(ctx) = self.gpu().cloned() else {
            let xs = x.host_f32()?;
            return Ok(Tensor::host_u32_with(shape, |out| {
                argmax_ref(xs, x.cols(), out)
            }));
        };
        let out = Tensor::gpu_output(&ctx, DType::U32, shape, OP)?;
        self.rows_launch(&ARGMAX, "ARGMAX", x, None, &out, 0.0)?;
        Ok(out)
    }
}

/// CPU reference (sum of squares in f64, as a reference should be exact-ish).
pub(crate) fn rms_norm_ref(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        rms_norm_row(row, w, eps, o);
    }
}

/// One row of [`rms_norm_ref`] into `out` (as wide as `w`).
pub(crate) fn rms_norm_row(row: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let scale = (1.0 / (ss / w.len() as f64 + f64::from(eps)).sqrt()) as f32;
    for ((o, v), g) in out.iter_mut().zip(row).zip(w) {
        *o = v * scale * g;
    }
}

/// CPU reference.
pub(crate) fn softmax_ref(x: &[f32], cols: usize, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        let s: f64 = row.iter().map(|&v| f64::from((v - m).exp())).sum();
        for (o, &v) in o.iter_mut().zip(row) {
            *o = ((v - m).exp() as f64 / s) as f32;
        }
    }
}

/// CPU reference: first index of the maximum of each row, into `out` (one a row).
pub(crate) fn argmax_ref(x: &[f32], cols: usize, out: &mut [u32]) {
    for (row, o) in x.chunks_exact(cols).zip(out) {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = i;
            }
        }
        *o = best as u32;
    }
}
