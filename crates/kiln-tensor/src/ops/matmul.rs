//! `matmul`: Y[m, n] = X[m, k] · W[n, k]ᵀ (+ bias), W in any float or GGUF block dtype
//! (`WEIGHT_DTYPES`).
//!
//! Up to [`MATVEC_MAX_M`] rows of X take the matrix-vector kernel (decode: every weight read
//! once, eight threads a row); more take the 32×32 tiled kernel (prefill). A weight split into
//! several chunks (bigger than one binding) is launched chunk by chunk into column ranges of Y.

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use super::{R2W, WEIGHT_DTYPES, dot, host_f32, host_row, require_dtype, weight_defines};
use crate::gpu::{Access, GpuContext, KernelDef};
use crate::recorder::Bind;
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
const ROWS_SRC: &str = include_str!("../../wgsl/matmul_rows.wgsl");
const ROWS: &[Access] = &[Access::Uniform, Access::Read, Access::ReadWrite];
/// Bindings with one epilogue operand (bias, residual or the gated MLP's up weight).
const ROWS_EPI: &[Access] = &[
    Access::Uniform,
    Access::Read,
    Access::ReadWrite,
    Access::Read,
];
static MATMUL_ROWS: KernelDef = KernelDef {
    name: "matmul_rows",
    source: ROWS_SRC,
    bindings: ROWS,
};
static MATMUL_ROWS_BIAS: KernelDef = KernelDef {
    name: "matmul_rows",
    source: ROWS_SRC,
    bindings: ROWS_EPI,
};
static MATMUL_ROWS_RES: KernelDef = KernelDef {
    name: "matmul_rows_add",
    source: ROWS_SRC,
    bindings: ROWS_EPI,
};
static MATMUL_ROWS_GATED: KernelDef = KernelDef {
    name: "matmul_rows_gated",
    source: ROWS_SRC,
    bindings: ROWS_EPI,
};
static MATMUL_ROWS_QKV: KernelDef = KernelDef {
    name: "matmul_rows_qkv",
    source: ROWS_SRC,
    bindings: &[
        Access::Uniform,
        Access::Read,
        Access::ReadWrite,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::ReadWrite,
    ],
};

/// What the CPU-adapter kernel does with its dot products before writing them.
#[derive(Clone, Copy)]
enum Epilogue<'a> {
    None,
    Bias(&'a Tensor),
    /// Y = residual + X·Wᵀ.
    Residual(&'a Tensor),
    /// Y = act(X·Wᵀ) · (X·W2ᵀ), the tensor being W2.
    Gated(&'a Tensor, Activation),
    /// Rows of [W; W2; W3] into Y, Y2, Y3: (W2, W3, Y2, Y3).
    Qkv([&'a Tensor; 4]),
}

/// The activation of a gated MLP: `act(X·Gᵀ) · (X·Uᵀ)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// silu(g) = g·sigmoid(g): SwiGLU (Llama, Mistral, Qwen2).
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`): GeGLU (Gemma).
    GeluTanh,
}

/// Parameters of `matmul_rows.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RowsParams {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    x_row0: u32,
    qs2: u32,
    qs3: u32,
    n1: u32,
    n2: u32,
    _pad: u32,
}
/// Rows of X one launch of the CPU-adapter kernel takes at most.
const ROWS_MAX_M: usize = 16;
/// Invocations per workgroup of the CPU-adapter kernel: few, so that small matrices still
/// split into enough workgroups for every worker thread.
const ROWS_WG: usize = 16;
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
        if let Some(group) = rows_group(&ctx, w, m, k) {
            let epi = bias.map_or(Epilogue::None, Epilogue::Bias);
            self.matmul_rows(x, w, &y, epi, group)?;
            return Ok(y);
        }
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

/// Rows of X per launch of the CPU-adapter kernel (`matmul_rows.wgsl`), or `None` when that
/// kernel does not apply: a GPU adapter, a float weight, or X rows that do not fit a uniform
/// binding at an aligned offset.
fn rows_group(ctx: &GpuContext, w: &Tensor, m: usize, k: usize) -> Option<usize> {
    if !ctx.cpu_shaped_kernels() || !w.dtype().is_quantized() || !k.is_multiple_of(32) {
        return None;
    }
    let row_bytes = (k * 4) as u64;
    let fit = (ctx.max_uniform_binding() / row_bytes) as usize;
    let group = fit.min(ROWS_MAX_M);
    if group == 0 {
        return None;
    }
    // Later launches bind X at an offset of whole groups, which must be aligned.
    if m > group && !(group as u64 * row_bytes).is_multiple_of(ctx.uniform_align()) {
        return None;
    }
    Some(group)
}

/// Rows of W each invocation of the CPU-adapter kernel computes: each block of X it reads
/// serves all of them (measured on lavapipe: 8 beat 2, 4 and 16 for one row of X and for 16).
const ROWS_R: usize = 8;

impl Recorder {
    /// Y = residual + X · Wᵀ: a matmul whose result is added to `residual` (`[.., n]` F32),
    /// in one launch where the device's kernel can (CPU-type adapters), else a matmul and an
    /// add.
    pub fn matmul_add(&mut self, x: &Tensor, w: &Tensor, residual: &Tensor) -> Result<Tensor> {
        if let Some((ctx, group)) = self.rows_fusable(x, w) {
            super::require_dtype("matmul_add", "the residual", residual, &[DType::F32])?;
            let mut shape = x.shape().to_vec();
            if let Some(last) = shape.last_mut() {
                *last = w.rows();
            }
            if residual.shape() != shape.as_slice() {
                return Err(TensorError::Shape {
                    op: "matmul_add",
                    detail: format!("residual {:?} for a product {shape:?}", residual.shape()),
                });
            }
            self.check_device("matmul_add", &[residual])?;
            let y = Tensor::gpu_output(&ctx, DType::F32, shape, "matmul_add")?;
            self.matmul_rows(x, w, &y, Epilogue::Residual(residual), group)?;
            return Ok(y);
        }
        let p = self.matmul(x, w, None)?;
        self.add(residual, &p)
    }

    /// silu(X · Gᵀ) · (X · Uᵀ), the gate and up projections of a SwiGLU MLP: see
    /// [`Recorder::matmul_gated`].
    pub fn matmul_swiglu(&mut self, x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        self.matmul_gated(x, gate, up, Activation::Silu)
    }

    /// gelu_tanh(X · Gᵀ) · (X · Uᵀ), the gate and up projections of a GeGLU MLP (Gemma): see
    /// [`Recorder::matmul_gated`].
    pub fn matmul_geglu(&mut self, x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        self.matmul_gated(x, gate, up, Activation::GeluTanh)
    }

    /// act(X · Gᵀ) · (X · Uᵀ), the gate and up projections of a gated MLP, in one launch
    /// where the device's kernel can (CPU-type adapters), else two matmuls and a `silu_mul`
    /// or `gelu_tanh_mul`. G and U have the same shape and dtype.
    pub fn matmul_gated(
        &mut self,
        x: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        const OP: &str = "matmul_gated";
        if gate.shape() == up.shape()
            && gate.dtype() == up.dtype()
            && gate.chunk_count() == up.chunk_count()
            && let Some((ctx, group)) = self.rows_fusable(x, gate)
        {
            self.check_device(OP, &[up])?;
            let mut shape = x.shape().to_vec();
            if let Some(last) = shape.last_mut() {
                *last = gate.rows();
            }
            let y = Tensor::gpu_output(&ctx, DType::F32, shape, OP)?;
            self.matmul_rows(x, gate, &y, Epilogue::Gated(up, act), group)?;
            return Ok(y);
        }
        let g = self.matmul(x, gate, None)?;
        let u = self.matmul(x, up, None)?;
        match act {
            Activation::Silu => self.silu_mul(&g, &u),
            Activation::GeluTanh => self.gelu_tanh_mul(&g, &u),
        }
    }

    /// The Q, K and V projections of X (weights `[nq, k]`, `[nkv, k]`, `[nkv, k]`, optional
    /// biases): one launch where the device's kernel can (CPU-type adapters, one dtype, no
    /// bias), else three matmuls.
    pub fn matmul_qkv(
        &mut self,
        x: &Tensor,
        w: [&Tensor; 3],
        bias: Option<[&Tensor; 3]>,
    ) -> Result<[Tensor; 3]> {
        let [wq, wk, wv] = w;
        let fusable = bias.is_none()
            && wk.dtype() == wq.dtype()
            && wv.dtype() == wq.dtype()
            && wk.shape() == wv.shape()
            && wk.shape().len() == 2
            && wk.cols() == x.cols()
            && [wq, wk, wv].iter().all(|t| t.chunk_count() == 1);
        if fusable && let Some((ctx, group)) = self.rows_fusable(x, wq) {
            self.check_device("matmul_qkv", &[wk, wv])?;
            let out = |n: usize| {
                let mut shape = x.shape().to_vec();
                if let Some(last) = shape.last_mut() {
                    *last = n;
                }
                Tensor::gpu_output(&ctx, DType::F32, shape, "matmul_qkv")
            };
            let (q, k, v) = (out(wq.rows())?, out(wk.rows())?, out(wv.rows())?);
            self.matmul_rows(x, wq, &q, Epilogue::Qkv([wk, wv, &k, &v]), group)?;
            return Ok([q, k, v]);
        }
        let [bq, bk, bv] = bias.map_or([None; 3], |b| b.map(Some));
        Ok([
            self.matmul(x, wq, bq)?,
            self.matmul(x, wk, bk)?,
            self.matmul(x, wv, bv)?,
        ])
    }

    /// The context and rows per launch when `x · wᵀ` can take the CPU-adapter kernel (after
    /// the checks `matmul` makes); `None` sends the caller to the general path, which
    /// validates.
    fn rows_fusable(&self, x: &Tensor, w: &Tensor) -> Option<(Arc<GpuContext>, usize)> {
        let ctx = self.gpu()?.clone();
        if x.dtype() != DType::F32
            || w.shape().len() != 2
            || w.cols() != x.cols()
            || x.rows() == 0
            || w.rows() == 0
            || self.check_device("matmul", &[x, w]).is_err()
        {
            return None;
        }
        let group = rows_group(&ctx, w, x.rows(), x.cols())?;
        Some((ctx, group))
    }

    /// Launch `matmul_rows.wgsl` over `x`'s rows in groups of `group`, writing `y`.
    fn matmul_rows(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        epi: Epilogue<'_>,
        group: usize,
    ) -> Result<()> {
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: "matmul" });
        };
        let (m, k, n) = (x.rows(), x.cols(), w.rows());
        let row_bytes = (k * 4) as u64;
        let (kernel, flag) = match epi {
            Epilogue::None => (&MATMUL_ROWS, None),
            Epilogue::Bias(_) => (&MATMUL_ROWS_BIAS, Some("BIAS")),
            Epilogue::Residual(_) => (&MATMUL_ROWS_RES, Some("RES")),
            Epilogue::Gated(..) => (&MATMUL_ROWS_GATED, Some("GATED")),
            Epilogue::Qkv(_) => (&MATMUL_ROWS_QKV, Some("QKV")),
        };
        // Row split and quants offsets of the stacked QKV weights (single chunks each).
        let (qkv_rows, qs2, qs3) = match epi {
            Epilogue::Qkv([wk, wv, _, _]) => (
                Some((n, wk.rows())),
                first_chunk_qs(wk)?,
                first_chunk_qs(wv)?,
            ),
            _ => (None, 0, 0),
        };
        let gated = matches!(epi, Epilogue::Gated(..));
        let gelu = matches!(epi, Epilogue::Gated(_, Activation::GeluTanh));
        let sg_x = rows_x_broadcast(self.gpu().map(|c| c.info()));
        for (ci, c) in chunks.iter().enumerate() {
            let mut i0 = 0;
            while i0 < m {
                let mg = group.min(m - i0);
                let r = ROWS_R;
                let mut defines = weight_defines(w.dtype(), 2);
                for f in ["BIAS", "RES", "GATED", "QKV"] {
                    defines.push((f, u32::from(flag == Some(f)).to_string()));
                }
                defines.push(("GELU", u32::from(gelu).to_string()));
                defines.push(("W2", u32::from(gated || qkv_rows.is_some()).to_string()));
                defines.push(("MV_M", mg.to_string()));
                defines.push(("R", r.to_string()));
                defines.push(("WG", ROWS_WG.to_string()));
                defines.push(("XV", (mg * k / 4).to_string()));
                defines.extend(rows_accumulators(mg, r, gated));
                defines.extend(sg_x.iter().cloned());
                let (n1, n2) = qkv_rows.unwrap_or((0, 0));
                let params = RowsParams {
                    m: mg as u32,
                    k: k as u32,
                    rows: (c.rows + 2 * n2) as u32,
                    n_total: n as u32,
                    n_offset: c.row0 as u32,
                    qs: c.qs_offset,
                    x_row0: i0 as u32,
                    qs2: if gated { c.qs_offset } else { qs2 },
                    qs3,
                    n1: n1 as u32,
                    n2: n2 as u32,
                    _pad: 0,
                };
                let mut bind = vec![
                    Bind {
                        tensor: x.clone(),
                        chunk: 0,
                        range: Some((i0 as u64 * row_bytes, mg as u64 * row_bytes)),
                    },
                    (w.clone(), ci).into(),
                    (y.clone(), 0).into(),
                ];
                match epi {
                    Epilogue::None => {}
                    Epilogue::Bias(t) | Epilogue::Residual(t) => bind.push((t.clone(), 0).into()),
                    Epilogue::Gated(t, _) => bind.push((t.clone(), ci).into()),
                    Epilogue::Qkv(ts) => bind.extend(ts.iter().map(|t| ((*t).clone(), 0).into())),
                }
                let groups = (c.rows + 2 * n2).div_ceil(ROWS_WG * r) as u32;
                self.dispatch_binds(kernel, &defines, &params, bind, groups)?;
                i0 += mg;
            }
        }
        Ok(())
    }
}

/// Defines of the X reads of `matmul_rows.wgsl`: by subgroup broadcast where every subgroup
/// has at least the 8 lanes one block of X needs.
fn rows_x_broadcast(info: Option<&crate::DeviceInfo>) -> Vec<(&'static str, String)> {
    let sg = info.is_some_and(|i| i.subgroups && i.subgroup_size.0 >= 8);
    if sg {
        vec![
            ("SG_X", "1".into()),
            (
                "SG_ARG",
                "@builtin(subgroup_invocation_id) sg_lane: u32,".into(),
            ),
            ("SG_LANE", "sg_lane".into()),
        ]
    } else {
        vec![
            ("SG_X", "0".into()),
            ("SG_ARG", String::new()),
            ("SG_LANE", "0u".into()),
        ]
    }
}

/// Quants offset of a single-chunk weight.
fn first_chunk_qs(w: &Tensor) -> Result<u32> {
    match w.storage() {
        Storage::Gpu { chunks, .. } if chunks.len() == 1 => Ok(chunks[0].qs_offset),
        _ => Err(TensorError::Invalid {
            op: "matmul_qkv",
            detail: "fused QKV weights must each be one device binding".into(),
        }),
    }
}

/// The accumulator code of `matmul_rows.wgsl` for `m` rows of X and `r` rows of W an
/// invocation (and as many for W2 when gated), written out statement by statement: the
/// R weight blocks are decoded once and each X block is read once per block and used for
/// all of them.
fn rows_accumulators(m: usize, r: usize, gated: bool) -> [(&'static str, String); 3] {
    let mut decl = String::new();
    let mut body = String::new();
    let mut store = String::new();
    for rr in 0..r {
        body.push_str(&format!(
            "let w{rr} = load_row(min(r0 + {rr}u, last), blk, nb);\n"
        ));
        if gated {
            body.push_str(&format!(
                "let g{rr} = load_blk2(min(r0 + {rr}u, last) * nb + blk);\n"
            ));
        }
    }
    for i in 0..m {
        body.push_str(&format!("{{ let x = xblk({i}u * kv + xb, lane);\n"));
        for rr in 0..r {
            decl.push_str(&format!("var a{i}_{rr} = 0.0;\n"));
            body.push_str(&format!("a{i}_{rr} += bdot(w{rr}, x);\n"));
            if gated {
                decl.push_str(&format!("var u{i}_{rr} = 0.0;\n"));
                body.push_str(&format!("u{i}_{rr} += bdot(g{rr}, x);\n"));
                store.push_str(&format!("store({i}u, r0 + {rr}u, a{i}_{rr}, u{i}_{rr});\n"));
            } else {
                store.push_str(&format!("store({i}u, r0 + {rr}u, a{i}_{rr}, 0.0);\n"));
            }
        }
        body.push_str("}\n");
    }
    [("ACC_DECL", decl), ("ACC_BODY", body), ("ACC_STORE", store)]
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
