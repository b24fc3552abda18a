//! `matmul`: Y[m, n] = X[m, k] · W[n, k]ᵀ (+ bias), W in any float or GGUF block dtype
//! (`WEIGHT_DTYPES`), and [`Recorder::linear`], the matmul with what surrounds it in a
//! transformer layer fused where the device's kernel can: an RMSNorm of X's rows first, a
//! bias, a residual added, or a gated activation over a stacked `[gate; up]` weight.
//!
//! Up to [`MATVEC_MAX_M`] rows of X (4 on GPUs) take the matrix-vector kernel (decode: every
//! weight read once; `MatvecShape` says how a workgroup splits it); more take the tiled kernel
//! (prefill, batched decode: tiles of 16, 32 or 64 rows of X by 64 of W; on GPUs, k split
//! between several workgroups a tile where the tiles are too few to fill the device), with
//! the fused parts as separate ops. CPU-type adapters take `matmul_rows.wgsl` for block
//! dtypes, with everything fused (`matmul_rows.rs`). With `--kernels experimental`, Q8_0 and Q4_0 weights at
//! decode take the integer dot product kernel (`matmul_dp4a.rs`) and tiled products the
//! cooperative-matrix one where the adapter has it. A weight split into several chunks (bigger than one binding) is launched
//! chunk by chunk into column ranges of Y.

use bytemuck::{Pod, Zeroable};

use super::elementwise::glu_ref;
use super::matmul_dp4a::dp4a_reads;
use super::matmul_rows::rows_group;
use super::rows::rms_norm_ref;
use super::{Define, WEIGHT_DTYPES, dot, flag, host_row, number, require_dtype, weight_defines};
use crate::gpu::{Access, KernelDef};
use crate::tensor::{Shape, Storage};
use crate::{DType, MatvecShape, Recorder, Result, Tensor, TensorError};

/// Rows of X up to which the matrix-vector kernel is used (on CPU-type adapters).
pub const MATVEC_MAX_M: usize = 8;

/// Rows of X up to which a device takes the matrix-vector kernel: [`MATVEC_MAX_M`] on
/// CPU-type adapters; 4 on GPUs, where its time grows with every row (NVIDIA H200, a 7B MLP
/// weight in Q4_1: 105, 199 and 382 us at 2, 4 and 8 rows) while the tiled kernel's 16-row tile
/// costs the same for 1 to 16 (220 us at 9 and at 16).
pub(super) fn matvec_max_m(cpu_shaped: bool) -> usize {
    if cpu_shaped { MATVEC_MAX_M } else { 4 }
}

const VEC_SRC: &str = concat!(
    include_str!("../../wgsl/weights.wgsl"),
    include_str!("../../wgsl/glu.wgsl"),
    include_str!("../../wgsl/matmul_vec.wgsl")
);
pub(super) const U: Access = Access::Uniform;
const R: Access = Access::Read;
const W: Access = Access::ReadWrite;

/// The fused kernels' definitions, `[epilogue][norm]`: epilogues none, bias, residual,
/// gated (the bias and residual bind one more buffer), each without and with the norm
/// (which binds its weights last).
pub(super) const fn family(
    names: [[&'static str; 2]; 4],
    source: &'static str,
    x: Access,
    g: Access,
) -> [[KernelDef; 2]; 4] {
    const fn def(name: &'static str, source: &'static str, b: &'static [Access]) -> KernelDef {
        KernelDef {
            name,
            source,
            bindings: b,
        }
    }
    let (plain, epi, norm, epi_norm): (&[Access], &[Access], &[Access], &[Access]) = match (x, g) {
        (Access::Uniform, _) => (&[U, R, W], &[U, R, W, R], &[U, R, W, U], &[U, R, W, R, U]),
        _ => (&[R, R, W], &[R, R, W, R], &[R, R, W, R], &[R, R, W, R, R]),
    };
    [
        [
            def(names[0][0], source, plain),
            def(names[0][1], source, norm),
        ],
        [
            def(names[1][0], source, epi),
            def(names[1][1], source, epi_norm),
        ],
        [
            def(names[2][0], source, epi),
            def(names[2][1], source, epi_norm),
        ],
        [
            def(names[3][0], source, plain),
            def(names[3][1], source, norm),
        ],
    ]
}

static MATMUL_VEC: [[KernelDef; 2]; 4] = family(
    [
        ["matmul_vec", "matmul_vec_norm"],
        ["matmul_vec", "matmul_vec_norm"],
        ["matmul_vec_add", "matmul_vec_add_norm"],
        ["matmul_vec_gated", "matmul_vec_gated_norm"],
    ],
    VEC_SRC,
    R,
    R,
);
/// The activation of a gated MLP: `act(X·Gᵀ) · (X·Uᵀ)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// silu(g) = g·sigmoid(g): SwiGLU (Llama, Mistral, Qwen2).
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`): GeGLU (Gemma).
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU, of gate and up together: (clamp(up, −7, 7) + 1) ·
    /// g·σ(1.702·g) with g = min(gate, 7).
    SwigluOai,
    /// DeepSeek-V4's clamped SwiGLU: silu(min(gate, L)) · clamp(up, −L, L).
    SiluClamped { limit: ClampLimit },
}

/// A clamp bound, held by its f32 bits so that an [`Activation`] stays `Eq` and `Hash` (it
/// names a kernel specialisation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClampLimit(u32);

impl ClampLimit {
    /// A positive, finite bound; `None` otherwise.
    pub const fn new(limit: f32) -> Option<Self> {
        if limit.is_finite() && limit > 0.0 {
            Some(Self(limit.to_bits()))
        } else {
            None
        }
    }

    pub fn get(self) -> f32 {
        f32::from_bits(self.0)
    }
}

impl Activation {
    /// The switches `glu.wgsl` takes for it (`GELU`, `OAI`, `CLAMP` with the bound as a WGSL
    /// literal; none is SiLU).
    pub(crate) fn defines(act: Option<Activation>) -> [Define; 3] {
        let clamp = match act {
            // Display gives the shortest decimal that reads back as the same f32.
            Some(Activation::SiluClamped { limit }) => format!("{}f", limit.get()).into(),
            _ => flag(false),
        };
        [
            ("GELU", flag(act == Some(Activation::GeluTanh))),
            ("OAI", flag(act == Some(Activation::SwigluOai))),
            ("CLAMP", clamp),
        ]
    }
}

/// An RMSNorm of X's rows ahead of a matmul: x / sqrt(mean(x²) + eps) · weight. Fused, it is
/// applied as the matmul reads X (never folded into a quantized weight).
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm<'a> {
    /// F32 `[k]`.
    pub weight: &'a Tensor,
    pub eps: f32,
}

/// What [`Recorder::linear`] computes around X·Wᵀ, in this order: the norm of X, the
/// product, the bias, the gated activation, the residual.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinearOps<'a> {
    pub norm: Option<RmsNorm<'a>>,
    /// F32 `[n]` (not with `glu`).
    pub bias: Option<&'a Tensor>,
    /// W is the stack `[gate; up]` of `2·f` rows: Y = act(X·gateᵀ) · (X·upᵀ), `f` wide.
    pub glu: Option<Activation>,
    /// Y = residual + …, F32 of Y's shape.
    pub residual: Option<&'a Tensor>,
}

/// What the fused kernels do after the dot products.
#[derive(Clone, Copy)]
pub(super) enum Epilogue<'a> {
    None,
    Bias(&'a Tensor),
    Residual(&'a Tensor),
    Gated(Activation),
}

impl Epilogue<'_> {
    fn of<'a>(ops: &LinearOps<'a>) -> Epilogue<'a> {
        match (ops.bias, ops.residual, ops.glu) {
            (Some(b), None, None) => Epilogue::Bias(b),
            (None, Some(r), None) => Epilogue::Residual(r),
            (None, None, Some(a)) => Epilogue::Gated(a),
            _ => Epilogue::None,
        }
    }

    /// Index into the kernel families.
    pub(super) fn index(self) -> usize {
        match self {
            Epilogue::None => 0,
            Epilogue::Bias(_) => 1,
            Epilogue::Residual(_) => 2,
            Epilogue::Gated(_) => 3,
        }
    }

    fn switch(self) -> Option<&'static str> {
        match self {
            Epilogue::None => None,
            Epilogue::Bias(_) => Some("BIAS"),
            Epilogue::Residual(_) => Some("RES"),
            Epilogue::Gated(_) => Some("GATED"),
        }
    }
}

/// Parameters of `matmul_vec.wgsl` (the last ones only under `ROUTED`).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(super) struct MvParams {
    pub(super) m: u32,
    pub(super) k: u32,
    pub(super) rows: u32,
    pub(super) n_total: u32,
    pub(super) n_offset: u32,
    pub(super) qs: u32,
    pub(super) n1: u32,
    pub(super) eps: f32,
    /// Workgroups an expert.
    pub(super) tiles: u32,
    /// The first expert in this binding of the weight, and how many it holds.
    pub(super) e0: u32,
    pub(super) n_exp: u32,
    /// Slots a row of X (1: a row per slot; k: a row per token).
    pub(super) x_step: u32,
    /// Rows of W an expert.
    pub(super) w_stride: u32,
    /// Where the slot list starts in the routing's groups.
    pub(super) list: u32,
    pub(super) _pad: [u32; 2],
}

/// `matmul_vec.wgsl` under `ROUTED`: X, W, Y, then the routing's groups.
pub(super) static MATVEC_ROUTED: KernelDef = KernelDef {
    name: "matmul_vec_routed",
    source: VEC_SRC,
    bindings: &[R, R, W, R],
};

/// [`MATVEC_ROUTED`] with the experts' biases after the groups.
pub(super) static MATVEC_ROUTED_BIAS: KernelDef = KernelDef {
    name: "matmul_vec_routed",
    source: VEC_SRC,
    bindings: &[R, R, W, R, R],
};

/// A linear op's operands, checked.
struct Checked {
    m: usize,
    k: usize,
    /// Rows of W.
    n: usize,
    shape: Shape,
}

impl Recorder {
    /// Y = X · Wᵀ (+ bias). X is F32 `[.., k]`, W is `[n, k]`, bias F32 `[n]`; Y is
    /// `[.., n]` F32.
    pub fn matmul(&mut self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear(
            x,
            w,
            LinearOps {
                bias,
                ..LinearOps::default()
            },
        )
    }

    /// Y = residual + X · Wᵀ (`residual` `[.., n]` F32).
    pub fn matmul_add(&mut self, x: &Tensor, w: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.linear(
            x,
            w,
            LinearOps {
                residual: Some(residual),
                ..LinearOps::default()
            },
        )
    }

    /// act(X · Gᵀ) · (X · Uᵀ) for separate gate and up weights (two matmuls and a
    /// `silu_mul` or `gelu_tanh_mul`); a stacked `[gate; up]` weight takes one launch through
    /// [`Recorder::linear`] with `glu`.
    pub fn matmul_gated(
        &mut self,
        x: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        let g = self.matmul(x, gate, None)?;
        let u = self.matmul(x, up, None)?;
        self.gated_mul(&g, &u, act)
    }

    /// X · Wᵀ with what `ops` adds around it, in one launch where the device's kernel fuses
    /// it (matrix-vector and CPU-adapter kernels), else as the plain ops in sequence.
    pub fn linear(&mut self, x: &Tensor, w: &Tensor, ops: LinearOps<'_>) -> Result<Tensor> {
        const OP: &str = "matmul";
        let c = self.check_linear(x, w, &ops)?;
        let Some(ctx) = self.gpu().cloned() else {
            return linear_host(x, w, &ops, &c, self.device().native().map(|c| &**c));
        };
        let epi = Epilogue::of(&ops);
        let max_vec = matvec_max_m(ctx.cpu_shaped_kernels());
        // The kernels fuse one epilogue (and the norm).
        let epilogues = [
            ops.bias.is_some(),
            ops.residual.is_some(),
            ops.glu.is_some(),
        ];
        let fusable = epilogues.iter().filter(|&&e| e).count() <= 1;
        // A GLU pairs row r with row f + r, which must be in the same binding.
        let pairs_ok = ops.glu.is_none() || w.chunk_count() == 1;
        // The integer dot product kernel fuses nothing: the ops around it run in sequence.
        let dp4a = ctx.dp4a() && dp4a_reads(w.dtype()) && c.m <= max_vec;
        if fusable && pairs_ok && !dp4a {
            if let Some(group) = rows_group(&ctx, w, c.m, c.k) {
                let y = Tensor::gpu_output(&ctx, DType::F32, &c.shape, OP)?;
                self.matmul_rows(x, w, &y, epi, ops.norm, group)?;
                return Ok(y);
            }
            if c.m <= max_vec {
                let y = Tensor::gpu_output(&ctx, DType::F32, &c.shape, OP)?;
                self.matmul_vec(x, w, &y, epi, ops.norm)?;
                return Ok(y);
            }
        }
        // The plain ops in sequence.
        let normed;
        let x = match ops.norm {
            Some(n) => {
                normed = self.rms_norm(x, n.weight, n.eps)?;
                &normed
            }
            None => x,
        };
        let mut shape = Shape::from(x.shape());
        if let Some(last) = shape.last_mut() {
            *last = c.n;
        }
        let y = Tensor::gpu_output(&ctx, DType::F32, &shape, OP)?;
        if dp4a {
            self.matmul_dp4a(x, w, &y, ops.bias)?;
        } else if c.m <= max_vec {
            let bias_epi = ops.bias.map_or(Epilogue::None, Epilogue::Bias);
            self.matmul_vec(x, w, &y, bias_epi, None)?;
        } else {
            self.matmul_tiled(x, w, &y, ops.bias)?;
        }
        let y = match ops.glu {
            Some(act) => self.glu(&y, act)?,
            None => y,
        };
        match ops.residual {
            Some(r) => self.add(r, &y),
            None => Ok(y),
        }
    }

    /// Validates a linear op's operands.
    fn check_linear(&self, x: &Tensor, w: &Tensor, ops: &LinearOps<'_>) -> Result<Checked> {
        const OP: &str = "matmul";
        require_dtype(OP, "the input", x, &[DType::F32])?;
        require_dtype(OP, "the weight", w, WEIGHT_DTYPES)?;
        let operands = [
            Some(x),
            Some(w),
            ops.bias,
            ops.residual,
            ops.norm.map(|n| n.weight),
        ];
        for t in operands.into_iter().flatten() {
            self.check_device(OP, &[t])?;
        }
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
        if m == 0 || n == 0 || k == 0 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("empty operand: m={m} n={n} k={k}"),
            });
        }
        let n_out = match ops.glu {
            Some(_) if !n.is_multiple_of(2) => {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!("a gated weight stacks [gate; up]: {n} rows are odd"),
                });
            }
            Some(_) if ops.bias.is_some() => {
                return Err(TensorError::Invalid {
                    op: OP,
                    detail: "a bias with a gated activation".into(),
                });
            }
            Some(_) => n / 2,
            None => n,
        };
        if let Some(b) = ops.bias {
            require_dtype(OP, "the bias", b, &[DType::F32])?;
            if b.elem_count() != n {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!("bias {:?} for {n} outputs", b.shape()),
                });
            }
        }
        let mut shape = Shape::from(x.shape());
        if let Some(last) = shape.last_mut() {
            *last = n_out;
        }
        if let Some(r) = ops.residual {
            require_dtype(OP, "the residual", r, &[DType::F32])?;
            if r.shape() != shape.as_slice() {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!("residual {:?} for a product {shape:?}", r.shape()),
                });
            }
        }
        if let Some(norm) = ops.norm {
            require_dtype(OP, "the norm's weight", norm.weight, &[DType::F32])?;
            if norm.weight.elem_count() != k {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!(
                        "norm weight {:?} for input {:?}",
                        norm.weight.shape(),
                        x.shape()
                    ),
                });
            }
            if !(norm.eps.is_finite() && norm.eps >= 0.0) {
                return Err(TensorError::Invalid {
                    op: OP,
                    detail: format!("eps must be finite and >= 0, got {}", norm.eps),
                });
            }
        }
        Ok(Checked { m, k, n, shape })
    }

    /// The matrix-vector kernel over every chunk of `w`, with the epilogue and norm fused.
    fn matmul_vec(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        epi: Epilogue<'_>,
        norm: Option<RmsNorm<'_>>,
    ) -> Result<()> {
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: "matmul" });
        };
        let (m, k) = (x.rows(), x.cols());
        let gated = matches!(epi, Epilogue::Gated(_));
        let n_total = y.cols();
        let mut defines = weight_defines(w.dtype(), 2);
        epilogue_defines(&mut defines, epi, norm.is_some());
        defines.push(("MV_M", number(m)));
        defines.push(("K8", flag(k.is_multiple_of(8))));
        defines.push(("ROUTED", flag(false)));
        let kernel = &MATMUL_VEC[epi.index()][usize::from(norm.is_some())];
        let shared = defines.len();
        for (ci, c) in chunks.iter().enumerate() {
            let rows = if gated { c.rows / 2 } else { c.rows };
            let shape = self
                .gpu()
                .map_or(MatvecShape::choose(false, rows), |g| g.matvec_shape(rows));
            defines.truncate(shared);
            defines.push(("TPR", number(shape.threads_per_row as usize)));
            defines.push(("RPL", number(shape.rows_per_thread as usize)));
            let params = MvParams {
                m: m as u32,
                k: k as u32,
                rows: rows as u32,
                n_total: n_total as u32,
                n_offset: c.row0 as u32,
                qs: c.qs_offset,
                n1: rows as u32,
                eps: norm.map_or(0.0, |n| n.eps),
                ..MvParams::zeroed()
            };
            let mut bind = vec![(x.clone(), 0), (w.clone(), ci), (y.clone(), 0)];
            match epi {
                Epilogue::Bias(t) | Epilogue::Residual(t) => bind.push((t.clone(), 0)),
                Epilogue::None | Epilogue::Gated(_) => {}
            }
            if let Some(n) = norm {
                bind.push((n.weight.clone(), 0));
            }
            self.dispatch(
                kernel,
                &defines,
                &params,
                bind,
                rows.div_ceil(shape.rows_per_workgroup() as usize) as u32,
            )?;
        }
        Ok(())
    }
}

/// The epilogue's switches (`BIAS`, `RES`, `GATED`, the activation's) and the norm's (`NORM`, and
/// `G_BINDING`, its weights' binding: after the epilogue's operand).
pub(super) fn epilogue_defines(d: &mut Vec<Define>, epi: Epilogue<'_>, norm: bool) {
    for f in ["BIAS", "RES", "GATED"] {
        d.push((f, flag(epi.switch() == Some(f))));
    }
    let act = match epi {
        Epilogue::Gated(a) => Some(a),
        _ => None,
    };
    d.extend(Activation::defines(act));
    d.push(("NORM", flag(norm)));
    let operand = matches!(epi, Epilogue::Bias(_) | Epilogue::Residual(_));
    d.push(("G_BINDING", number(if operand { 5 } else { 4 })));
}

/// [`Recorder::linear`] on the CPU backends: the norm, the matmul (the reference's, each
/// weight row dequantized once, or the native backend's), the bias, the GLU, the residual,
/// exactly as the plain ops compute them.
fn linear_host(
    x: &Tensor,
    w: &Tensor,
    ops: &LinearOps<'_>,
    c: &Checked,
    native: Option<&crate::cpu::CpuContext>,
) -> Result<Tensor> {
    let b = ops.bias.map(Tensor::host_f32).transpose()?;
    if let Some(cpu) = native {
        let fused = crate::cpu::Fused {
            norm: match ops.norm {
                Some(n) => Some((n.weight.host_f32()?, n.eps)),
                None => None,
            },
            bias: b,
            glu: ops.glu,
            residual: ops.residual.map(Tensor::host_f32).transpose()?,
        };
        let x = x.host_f32()?;
        return Tensor::host_f32_with(&c.shape, |y| {
            crate::cpu::linear_native(cpu, x, c.m, w, &fused, y)
        });
    }
    let mut normed = Vec::new();
    let xs = match ops.norm {
        Some(n) => {
            normed.resize(x.elem_count(), 0.0);
            rms_norm_ref(x.host_f32()?, n.weight.host_f32()?, n.eps, &mut normed);
            &normed[..]
        }
        None => x.host_f32()?,
    };
    let products = matmul_ref(xs, c.m, w, b)?;
    let residual = ops.residual.map(Tensor::host_f32).transpose()?;
    Tensor::host_f32_with(&c.shape, |y| {
        match ops.glu {
            Some(act) => glu_ref(&products, c.n / 2, act, y),
            None => y.copy_from_slice(&products),
        }
        if let Some(r) = residual {
            y.iter_mut().zip(r).for_each(|(v, r)| *v += r);
        }
        Ok(())
    })
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
