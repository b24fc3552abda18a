//! Elementwise ops: `add` (residuals), the gated activations `silu_mul` (SwiGLU) and
//! `gelu_tanh_mul` (GeGLU) over two tensors or `glu` over the halves of one, and the scalar
//! ops `scale` and `softcap`; `concat_rows` (one tensor's rows after another's).

use bytemuck::{Pod, Zeroable};

use super::matmul::Activation;
use super::{Define, R1W, R2W, flag, require_dtype, require_same_shape};
use crate::gpu::KernelDef;
use crate::tensor::Shape;
use crate::{DType, Recorder, Result, Tensor, TensorError};

const SRC: &str = concat!(
    include_str!("../../wgsl/glu.wgsl"),
    include_str!("../../wgsl/elementwise.wgsl")
);
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
static GELU_TANH_MUL: KernelDef = KernelDef {
    name: "gelu_tanh_mul",
    source: SRC,
    bindings: R2W,
};
static SCALE: KernelDef = KernelDef {
    name: "scale",
    source: SRC,
    bindings: R1W,
};
static SOFTCAP: KernelDef = KernelDef {
    name: "softcap",
    source: SRC,
    bindings: R1W,
};
static GLU_MUL: KernelDef = KernelDef {
    name: "glu_mul",
    source: SRC,
    bindings: R2W,
};
static CONCAT: KernelDef = KernelDef {
    name: "concat_rows",
    source: SRC,
    bindings: R2W,
};
static GLU: KernelDef = KernelDef {
    name: "glu",
    source: SRC,
    bindings: R1W,
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n: u32,
    /// The scalar of `scale` and `softcap`.
    s: f32,
    /// `glu`: the width of each half.
    cols: u32,
    _pad: u32,
}

impl Recorder {
    fn binary(
        &mut self,
        op: &'static str,
        kernel: &KernelDef,
        defines: &[Define],
        a: &Tensor,
        b: &Tensor,
        f: impl Fn(f32, f32) -> f32,
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
            let (x, y) = (a.host_f32()?, b.host_f32()?);
            return Tensor::host_f32_with(a.shape(), |out| {
                for ((o, &x), &y) in out.iter_mut().zip(x).zip(y) {
                    *o = f(x, y);
                }
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, a.shape(), op)?;
        let n = a.elem_count();
        let params = Params {
            n: n as u32,
            s: 0.0,
            cols: 0,
            _pad: 0,
        };
        self.dispatch(
            kernel,
            defines,
            &params,
            vec![(a.clone(), 0), (b.clone(), 0), (out.clone(), 0)],
            n.div_ceil(64) as u32,
        )?;
        Ok(out)
    }

    /// A unary op with scalar `s`; `f` is its CPU reference.
    fn unary(
        &mut self,
        op: &'static str,
        kernel: &KernelDef,
        switch: &'static str,
        a: &Tensor,
        s: f32,
        f: fn(f32, f32) -> f32,
    ) -> Result<Tensor> {
        require_dtype(op, "the input", a, &[DType::F32])?;
        self.check_device(op, &[a])?;
        if a.elem_count() == 0 {
            return Err(TensorError::Invalid {
                op,
                detail: "empty input".into(),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let x = a.host_f32()?;
            return Tensor::host_f32_with(a.shape(), |out| {
                for (o, &x) in out.iter_mut().zip(x) {
                    *o = f(x, s);
                }
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, a.shape(), op)?;
        let n = a.elem_count();
        let params = Params {
            n: n as u32,
            s,
            cols: 0,
            _pad: 0,
        };
        self.dispatch(
            kernel,
            &[(switch, String::from("1")), ("UNARY", String::from("1"))],
            &params,
            vec![(a.clone(), 0), (out.clone(), 0)],
            n.div_ceil(64) as u32,
        )?;
        Ok(out)
    }

    /// a + b, same shapes.
    pub fn add(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.binary("add", &ADD, &[("ADD", flag(true))], a, b, |x, y| x + y)
    }

    /// silu(gate) · up, same shapes (SwiGLU).
    pub fn silu_mul(&mut self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let d = [("SILU_MUL", flag(true))];
        self.binary("silu_mul", &SILU_MUL, &d, gate, up, silu_mul_ref)
    }

    /// gelu_tanh(gate) · up, same shapes (GeGLU with the tanh approximation of GELU, as
    /// Gemma's `gelu_pytorch_tanh`).
    pub fn gelu_tanh_mul(&mut self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let d = [("GELU_TANH_MUL", flag(true))];
        self.binary(
            "gelu_tanh_mul",
            &GELU_TANH_MUL,
            &d,
            gate,
            up,
            gelu_tanh_mul_ref,
        )
    }

    /// The gated activation `act` of separate gate and up projections, same shapes: what
    /// [`Recorder::glu`] does over a stacked `[gate | up]`.
    pub fn gated_mul(&mut self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        match act {
            Activation::Silu => self.silu_mul(gate, up),
            Activation::GeluTanh => self.gelu_tanh_mul(gate, up),
            Activation::SwigluOai | Activation::SiluClamped { .. } => {
                let [a, b, c] = Activation::defines(Some(act));
                let d = [("GLU_MUL", flag(true)), a, b, c];
                self.binary("gated_mul", &GLU_MUL, &d, gate, up, |g, u| {
                    act.apply_ref(g, u)
                })
            }
        }
    }

    /// `b`'s rows after `a`'s: F32 `[a.rows + b.rows, cols]` from two F32 tensors of `cols`
    /// columns (what a compressor carries between steps, before a step's own rows).
    pub fn concat_rows(&mut self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "concat_rows";
        require_dtype(OP, "the first input", a, &[DType::F32])?;
        require_dtype(OP, "the second input", b, &[DType::F32])?;
        self.check_device(OP, &[a, b])?;
        let cols = a.cols();
        if b.cols() != cols || a.elem_count() + b.elem_count() == 0 {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!("{:?} then {:?}", a.shape(), b.shape()),
            });
        }
        let shape = [a.rows() + b.rows(), cols];
        let Some(ctx) = self.gpu().cloned() else {
            let (x, y) = (a.host_f32()?, b.host_f32()?);
            return Tensor::host_f32_with(&shape, |out| {
                let (head, tail) = out.split_at_mut(x.len());
                head.copy_from_slice(x);
                tail.copy_from_slice(y);
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, &shape, OP)?;
        let n = out.elem_count();
        let params = Params {
            n: n as u32,
            s: 0.0,
            cols: a.elem_count() as u32,
            _pad: 0,
        };
        // An empty side is bound as the other (the kernel never reads it).
        let a_bind = if a.elem_count() == 0 { b } else { a };
        let b_bind = if b.elem_count() == 0 { a } else { b };
        self.dispatch(
            &CONCAT,
            &[("CONCAT", flag(true))],
            &params,
            vec![(a_bind.clone(), 0), (b_bind.clone(), 0), (out.clone(), 0)],
            n.div_ceil(64) as u32,
        )?;
        Ok(out)
    }

    /// x · s elementwise.
    pub fn scale(&mut self, x: &Tensor, s: f32) -> Result<Tensor> {
        self.unary("scale", &SCALE, "SCALE", x, s, |v, s| v * s)
    }

    /// cap · tanh(x / cap) elementwise (logit soft-capping); `cap` must be positive and
    /// finite.
    pub fn softcap(&mut self, x: &Tensor, cap: f32) -> Result<Tensor> {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(TensorError::Invalid {
                op: "softcap",
                detail: format!("the cap must be positive and finite, got {cap}"),
            });
        }
        self.unary("softcap", &SOFTCAP, "SOFTCAP", x, cap, |v, c| {
            c * (v / c).tanh()
        })
    }
}

impl Recorder {
    /// act(gate) · up over the halves of `y` `[.., 2·f]` (its rows are `[gate | up]`, what a
    /// matmul with a stacked `[gate; up]` weight gives); returns `[.., f]`.
    pub fn glu(&mut self, y: &Tensor, act: Activation) -> Result<Tensor> {
        const OP: &str = "glu";
        require_dtype(OP, "the input", y, &[DType::F32])?;
        self.check_device(OP, &[y])?;
        let width = y.cols();
        if y.elem_count() == 0 || !width.is_multiple_of(2) {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "input {:?} needs an even, non-empty last dimension",
                    y.shape()
                ),
            });
        }
        let f = width / 2;
        let mut shape = Shape::from(y.shape());
        if let Some(last) = shape.last_mut() {
            *last = f;
        }
        let Some(ctx) = self.gpu().cloned() else {
            let y = y.host_f32()?;
            return Tensor::host_f32_with(&shape, |out| {
                glu_ref(y, f, act, out);
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, &shape, OP)?;
        let n = y.elem_count() / 2;
        let params = Params {
            n: n as u32,
            s: 0.0,
            cols: f as u32,
            _pad: 0,
        };
        let [a, b, c] = Activation::defines(Some(act));
        self.dispatch(
            &GLU,
            &[("GLU", flag(true)), ("UNARY", flag(true)), a, b, c],
            &params,
            vec![(y.clone(), 0), (out.clone(), 0)],
            n.div_ceil(64) as u32,
        )?;
        Ok(out)
    }
}

/// CPU reference of `glu` over rows `[gate | up]` of width `2·f`, into `out` (half as long).
pub(crate) fn glu_ref(y: &[f32], f: usize, act: Activation, out: &mut [f32]) {
    for (row, o) in y.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        glu_row(row, act, o);
    }
}

/// One row of [`glu_ref`]: `row` is `[gate; up]`, `out` half as wide.
pub(crate) fn glu_row(row: &[f32], act: Activation, out: &mut [f32]) {
    let (g, u) = row.split_at(out.len());
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = act.apply_ref(g, u);
    }
}

impl Activation {
    /// The CPU reference of one element, `act(gate) · up`.
    pub(crate) fn apply_ref(self, g: f32, u: f32) -> f32 {
        match self {
            Activation::Silu => silu_mul_ref(g, u),
            Activation::GeluTanh => gelu_tanh_mul_ref(g, u),
            Activation::SwigluOai => swiglu_oai_ref(g, u),
            Activation::SiluClamped { limit } => {
                let l = limit.get();
                silu_mul_ref(g.min(l), u.clamp(-l, l))
            }
        }
    }
}

/// CPU reference of one element of `silu_mul`.
pub(crate) fn silu_mul_ref(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// CPU reference of GELU with the tanh approximation.
pub(crate) fn gelu_tanh_ref(g: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * g * (1.0 + (SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)).tanh())
}

/// CPU reference of GPT-OSS's clamped SwiGLU of one gate and up element.
pub(crate) fn swiglu_oai_ref(gate: f32, up: f32) -> f32 {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    let g = gate.min(LIMIT);
    g / (1.0 + (-ALPHA * g).exp()) * (up.clamp(-LIMIT, LIMIT) + 1.0)
}

/// CPU reference of one element of `gelu_tanh_mul`.
pub(crate) fn gelu_tanh_mul_ref(g: f32, u: f32) -> f32 {
    gelu_tanh_ref(g) * u
}
