//! Elementwise ops: `add` (residuals) and `silu_mul` (SwiGLU).

use bytemuck::{Pod, Zeroable};

use super::{R2W, host_f32, require_dtype, require_same_shape};
use crate::gpu::KernelDef;
use crate::{DType, Recorder, Result, Tensor, TensorError};

const SRC: &str = include_str!("../../wgsl/elementwise.wgsl");
static ADD: KernelDef = KernelDef {
    name: "add",
    source: SRC,
    bindings: R2W,
};
static SILU_MUL: KernelDef = KernelDef {
    name: "silu_mul",
    source: SRC,
    bindings: R2W,
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n: u32,
    _pad: [u32; 3],
}

impl Recorder {
    fn binary(
        &mut self,
        op: &'static str,
        kernel: &KernelDef,
        switch: &'static str,
        a: &Tensor,
        b: &Tensor,
        f: fn(f32, f32) -> f32,
    ) -> Result<Tensor> {
        require_dtype(op, "the first input", a, &[DType::F32])?;
        require_dtype(op, "the second input", b, &[DType::F32])?;
        require_same_shape(op, a, b)?;
        self.check_device(op, &[a, b])?;
        if a.elem_count() == 0 {
            return Err(TensorError::Invalid {
                op,
                detail: "empty input".into(),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let v = host_f32(a)?
                .iter()
                .zip(host_f32(b)?)
                .map(|(&x, &y)| f(x, y))
                .collect();
            return Ok(Tensor::cpu_f32(a.shape().to_vec(), v));
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, a.shape().to_vec(), op)?;
        let n = a.elem_count();
        let params = Params {
            n: n as u32,
            _pad: [0; 3],
        };
        self.dispatch(
            kernel,
            &[(switch, "1".into())],
            &params,
            vec![(a.clone(), 0), (b.clone(), 0), (out.clone(), 0)],
            n.div_ceil(64) as u32,
        )?;
        Ok(out)
    }

    /// a + b, same shapes.
    pub fn add(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.binary("add", &ADD, "ADD", a, b, |x, y| x + y)
    }

    /// silu(gate) · up, same shapes (SwiGLU).
    pub fn silu_mul(&mut self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        self.binary("silu_mul", &SILU_MUL, "SILU_MUL", gate, up, silu_mul_ref)
    }
}

/// CPU reference of one element of `silu_mul`.
pub(crate) fn silu_mul_ref(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}
