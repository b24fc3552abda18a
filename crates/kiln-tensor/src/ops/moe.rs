//! Mixture-of-experts ops: [`Recorder::moe_route`] (`moe_route.rs`) picks each token's experts
//! and their weights from the router's logits and groups the batch's (token, expert) slots by
//! expert; [`Recorder::linear_routed`] (ggml's `mul_mat_id`) multiplies each slot's input row by its
//! expert's weight, one launch for all experts, each expert's weight read once for all the
//! slots routed to it; [`Recorder::moe_combine`] adds the weighted sum of a token's expert
//! outputs to the residual.
//!
//! Experts are one weight `[experts, rows, k]`: expert `e`'s matrix is rows `e·rows ..` of
//! the flattened `[experts·rows, k]`, in any weight dtype (a GPU keeps each expert within one
//! binding).

use bytemuck::{Pod, Zeroable};

use super::matmul::{Activation, MvParams, matvec_max_m};
use super::moe_route::Routes;
use super::{
    WEIGHT_DTYPES, dot, flag, host_row, number, one_binding, require_dtype, weight_defines,
};
use crate::gpu::{Access, KernelDef};
use crate::tensor::Storage;
use crate::{DType, Recorder, Result, Tensor, TensorError};

/// Experts a router may choose from (the routing kernel keeps a count per expert in
/// workgroup memory).
pub const MAX_EXPERTS: usize = 1024;
/// Experts a token may use.
pub const MAX_EXPERTS_USED: usize = 64;

pub(super) const SRC: &str = include_str!("../../wgsl/moe.wgsl");
static COMBINE: KernelDef = KernelDef {
    name: "moe_combine",
    source: SRC,
    bindings: &[Access::Read, Access::Read, Access::Read, Access::ReadWrite],
};

/// Parameters of `moe.wgsl` (routing and combining).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(super) struct Params {
    pub(super) tokens: u32,
    pub(super) experts: u32,
    pub(super) k: u32,
    /// `moe_route`: [`Router::mode`].
    pub(super) mode: u32,
    /// `moe_combine`: the row width.
    pub(super) width: u32,
    /// `moe_route`: whether the selection bias is bound; whether the experts are given.
    pub(super) bias: u32,
    pub(super) fixed: u32,
    /// `moe_route`: [`Router::SqrtSoftplus`]'s scale.
    pub(super) scale: f32,
}

impl Recorder {
    /// Y = X·W_eᵀ for every slot, `e` the slot's expert: `w` is `[experts, n, k]`; `x` holds
    /// one row per token (each of its slots reads it) or one per slot; Y is F32
    /// `[tokens·k, n]` (`n/2` wide with `glu`, each expert's matrix then the stack
    /// `[gate; up]`). `bias`, F32 `[experts, n]`, adds expert e's row to its products before
    /// the GLU (GPT-OSS). One launch a binding of `w` for all experts.
    pub fn linear_routed(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        routes: &Routes,
        glu: Option<Activation>,
    ) -> Result<Tensor> {
        const OP: &str = "linear_routed";
        require_dtype(OP, "the input", x, &[DType::F32])?;
        require_dtype(OP, "the experts' weight", w, WEIGHT_DTYPES)?;
        self.check_device(OP, &[x, w, &routes.ids])?;
        if let Some(b) = bias {
            require_dtype(OP, "the experts' bias", b, &[DType::F32])?;
            self.check_device(OP, &[b])?;
            if b.shape() != [routes.experts, w.shape().get(1).copied().unwrap_or(0)] {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!(
                        "experts' bias {:?} for the experts' weight {:?}",
                        b.shape(),
                        w.shape()
                    ),
                });
            }
            one_binding(OP, &[b])?;
        }
        let k = x.cols();
        let slots = routes.tokens * routes.k;
        let &[experts, n, wk] = w.shape() else {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!("experts' weight {:?} is not [experts, n, k]", w.shape()),
            });
        };
        if experts != routes.experts || wk != k || n == 0 {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "experts' weight {:?} for {} experts and input {:?}",
                    w.shape(),
                    routes.experts,
                    x.shape()
                ),
            });
        }
        let per_slot = match x.rows() {
            r if r == slots => routes.k > 1,
            r if r == routes.tokens => false,
            r => {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!(
                        "{r} input rows for {} tokens of {} slots each",
                        routes.tokens, routes.k
                    ),
                });
            }
        };
        let x_step = if per_slot { 1 } else { routes.k };
        let n_out = match glu {
            Some(_) if !n.is_multiple_of(2) => {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!("a gated expert stacks [gate; up]: {n} rows are odd"),
                });
            }
            Some(_) => n / 2,
            None => n,
        };
        let Some(ctx) = self.gpu().cloned() else {
            let ids = routes.ids.host_u32()?;
            let xs = x.host_f32()?;
            let bias = bias.map(Tensor::host_f32).transpose()?;
            let x = RoutedX {
                x: xs,
                step: x_step,
            };
            if let Some(cpu) = self.device().native() {
                let groups = routes.groups.host_u32()?;
                return Tensor::host_f32_with(&[slots, n_out], |y| {
                    crate::cpu::linear_routed_native(cpu, x, w, bias, groups, experts, glu, y)
                });
            }
            return Tensor::host_f32_with(&[slots, n_out], |y| routed_ref(x, w, bias, ids, glu, y));
        };
        one_binding(OP, &[x])?;
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: OP });
        };
        let y = Tensor::gpu_output(&ctx, DType::F32, &[slots, n_out], OP)?;
        let cpu_shaped = ctx.cpu_shaped_kernels();
        let mv_m = matvec_max_m(cpu_shaped);
        let shape = ctx.matvec_shape(n_out);
        let mut defines = weight_defines(w.dtype(), 2);
        defines.push(("BIAS", flag(bias.is_some())));
        for f in ["RES", "NORM"] {
            defines.push((f, flag(false)));
        }
        defines.push(("GATED", flag(glu.is_some())));
        defines.extend(Activation::defines(glu));
        defines.push(("G_BINDING", number(5)));
        defines.push(("ROUTED", flag(true)));
        defines.push(("MV_M", number(mv_m)));
        defines.push(("K8", flag(k.is_multiple_of(8))));
        defines.push(("TPR", number(shape.threads_per_row as usize)));
        defines.push(("RPL", number(shape.rows_per_thread as usize)));
        let tiles = n_out.div_ceil(shape.rows_per_workgroup() as usize);
        // Every binding holds whole experts: checked before anything is recorded.
        if let Some(c) = chunks
            .iter()
            .find(|c| !c.row0.is_multiple_of(n) || !c.rows.is_multiple_of(n))
        {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!(
                    "an expert's {n} rows straddle two bindings (rows {}..{})",
                    c.row0,
                    c.row0 + c.rows
                ),
            });
        }
        for (ci, c) in chunks.iter().enumerate() {
            let n_exp = c.rows / n;
            let params = MvParams {
                m: mv_m as u32,
                k: k as u32,
                rows: n_out as u32,
                n_total: n_out as u32,
                n_offset: 0,
                qs: c.qs_offset,
                n1: n_out as u32,
                eps: 0.0,
                tiles: tiles as u32,
                e0: (c.row0 / n) as u32,
                n_exp: n_exp as u32,
                x_step: x_step as u32,
                w_stride: n as u32,
                list: (experts + 1) as u32,
                _pad: [0; 2],
            };
            let mut bind = vec![
                (x.clone(), 0),
                (w.clone(), ci),
                (y.clone(), 0),
                (routes.groups.clone(), 0),
            ];
            bind.extend(bias.map(|b| (b.clone(), 0)));
            let def = match bias {
                None => &super::matmul::MATVEC_ROUTED,
                Some(_) => &super::matmul::MATVEC_ROUTED_BIAS,
            };
            self.dispatch(def, &defines, &params, bind, (tiles * n_exp) as u32)?;
        }
        Ok(y)
    }

    /// `residual + Σ_j weight[t, j] · y[t·k + j]` for each token `t`: the experts' outputs
    /// (`y`, F32 `[tokens·k, n]`) summed into the residual (F32 `[tokens, n]`).
    pub fn moe_combine(
        &mut self,
        y: &Tensor,
        routes: &Routes,
        residual: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "moe_combine";
        require_dtype(OP, "the experts' outputs", y, &[DType::F32])?;
        require_dtype(OP, "the residual", residual, &[DType::F32])?;
        self.check_device(OP, &[y, residual, &routes.weights])?;
        let (tokens, k) = (routes.tokens, routes.k);
        let n = residual.cols();
        if residual.rows() != tokens || y.rows() != tokens * k || y.cols() != n {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "outputs {:?} and residual {:?} for {tokens} tokens of {k} experts",
                    y.shape(),
                    residual.shape()
                ),
            });
        }
        one_binding(OP, &[y, residual])?;
        let Some(ctx) = self.gpu().cloned() else {
            let (ys, w, r) = (
                y.host_f32()?,
                routes.weights.host_f32()?,
                residual.host_f32()?,
            );
            return Tensor::host_f32_with(residual.shape(), |out| {
                combine_ref(ys, w, r, k, n, out);
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, residual.shape(), OP)?;
        let params = Params {
            tokens: tokens as u32,
            experts: routes.experts as u32,
            k: k as u32,
            mode: 0,
            width: n as u32,
            bias: 0,
            fixed: 0,
            scale: 1.0,
        };
        self.dispatch(
            &COMBINE,
            &[
                ("ROUTE", flag(false)),
                ("EXPERTS", number(routes.experts)),
                ("TOPK", number(k)),
            ],
            &params,
            vec![
                (y.clone(), 0),
                (routes.weights.clone(), 0),
                (residual.clone(), 0),
                (out.clone(), 0),
            ],
            (tokens * n).div_ceil(64) as u32,
        )?;
        Ok(out)
    }
}

/// `out[t] = residual[t] + Σ_j w[t, j] · y[t·k + j]`, the terms in slot order.
pub(crate) fn combine_ref(
    y: &[f32],
    w: &[f32],
    residual: &[f32],
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    for (t, (o, r)) in out
        .chunks_exact_mut(n)
        .zip(residual.chunks_exact(n))
        .enumerate()
    {
        for (c, (o, &r)) in o.iter_mut().zip(r).enumerate() {
            let mut s = 0f32;
            for j in 0..k {
                s += w[t * k + j] * y[(t * k + j) * n + c];
            }
            *o = r + s;
        }
    }
}

/// The input of a routed product on the host: X's rows, and the slots a row (`step`: the
/// routing's k where each token's row serves all its slots, else 1).
#[derive(Clone, Copy)]
pub(crate) struct RoutedX<'a> {
    pub x: &'a [f32],
    pub step: usize,
}

/// The routed matmul's CPU reference: every slot's row dotted with each of its expert's rows,
/// each weight row dequantized for it, plus the expert's `bias` row, then the GLU.
fn routed_ref(
    x: RoutedX<'_>,
    w: &Tensor,
    bias: Option<&[f32]>,
    ids: &[u32],
    glu: Option<Activation>,
    y: &mut [f32],
) -> Result<()> {
    let (n, k) = (w.shape()[1], w.shape()[2]);
    let mut row = vec![0f32; k];
    let mut products = vec![0f32; n];
    let width = y.len() / ids.len().max(1);
    for (s, &e) in ids.iter().enumerate() {
        let r = s / x.step;
        let xr = &x.x[r * k..(r + 1) * k];
        for (j, p) in products.iter_mut().enumerate() {
            host_row(w, e as usize * n + j, &mut row)?;
            *p = dot(xr, &row);
        }
        if let Some(b) = bias {
            let b = &b[e as usize * n..(e as usize + 1) * n];
            products.iter_mut().zip(b).for_each(|(p, b)| *p += b);
        }
        let out = &mut y[s * width..(s + 1) * width];
        match glu {
            Some(act) => super::elementwise::glu_ref(&products, n / 2, act, out),
            None => out.copy_from_slice(&products),
        }
    }
    Ok(())
}

/// The slots of expert `e` from a routing's groups (`[experts + 1 + slots]`).
pub(crate) fn expert_slots(groups: &[u32], experts: usize, e: usize) -> &[u32] {
    let (offsets, list) = groups.split_at(experts + 1);
    &list[offsets[e] as usize..offsets[e + 1] as usize]
}
