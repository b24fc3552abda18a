//! Mixture-of-experts ops: [`Recorder::moe_route`] picks each token's experts and their
//! weights from the router's logits and groups the batch's (token, expert) slots by expert;
//! [`Recorder::linear_routed`] (ggml's `mul_mat_id`) multiplies each slot's input row by its
//! expert's weight, one launch for all experts, each expert's weight read once for all the
//! slots routed to it; [`Recorder::moe_combine`] adds the weighted sum of a token's expert
//! outputs to the residual.
//!
//! Experts are one weight `[experts, rows, k]`: expert `e`'s matrix is rows `e·rows ..` of
//! the flattened `[experts·rows, k]`, in any weight dtype (a GPU keeps each expert within one
//! binding).

use bytemuck::{Pod, Zeroable};

use super::matmul::{Activation, MvParams, matvec_max_m};
use super::{
    WEIGHT_DTYPES, check_indices, dot, flag, host_row, number, one_binding, require_dtype,
    weight_defines,
};
use crate::gpu::{Access, KernelDef};
use crate::tensor::Storage;
use crate::{DType, Device, Recorder, Result, Tensor, TensorError};

/// Experts a router may choose from (the routing kernel keeps a count per expert in
/// workgroup memory).
pub const MAX_EXPERTS: usize = 1024;
/// Experts a token may use.
pub const MAX_EXPERTS_USED: usize = 64;

const SRC: &str = include_str!("../../wgsl/moe.wgsl");
static ROUTE: KernelDef = KernelDef {
    name: "moe_route",
    source: SRC,
    bindings: &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
        Access::ReadWrite,
        Access::ReadWrite,
    ],
};
static COMBINE: KernelDef = KernelDef {
    name: "moe_combine",
    source: SRC,
    bindings: &[Access::Read, Access::Read, Access::Read, Access::ReadWrite],
};

/// How a router turns a token's logits over the experts into the experts it uses and their
/// weights. Every router picks the `k` largest scores (ties to the lower expert index); the
/// score is the logit, or for [`Router::SqrtSoftplus`] `sqrt(softplus(logit))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Router {
    /// Softmax over all experts, then the top k; with `renorm` their weights are divided by
    /// their sum (Mixtral; Qwen3-MoE's `norm_topk_prob`), else kept as the softmax gave them.
    SoftmaxTopK { renorm: bool },
    /// The top k logits, then a softmax over those k (GPT-OSS).
    TopKSoftmax,
    /// DeepSeek-V4's: scores `sqrt(softplus(logit))`; the picks' scores divided by their
    /// sum (plus 1e-20), times `scale` (`routed_scaling_factor`).
    SqrtSoftplus { scale: f32 },
}

/// Where a token's experts come from.
#[derive(Debug, Clone, Copy)]
pub enum Choice<'a> {
    /// The `k` best scores, each plus `bias[e]` (F32 `[experts]`) where given: a bias that
    /// only selects (DeepSeek's `e_score_correction_bias`), never weights.
    Best { bias: Option<&'a Tensor> },
    /// Fixed by the model, `k` a token on the host (DeepSeek-V4's hash-routed layers, by
    /// token id); the router still weights them.
    Fixed(&'a [u32]),
}

impl Router {
    fn mode(self) -> u32 {
        match self {
            Router::SoftmaxTopK { renorm: false } => 0,
            Router::SoftmaxTopK { renorm: true } => 1,
            Router::SqrtSoftplus { .. } => 3,
            Router::TopKSoftmax => 2,
        }
    }
}

/// A batch's routing: which experts each token uses, with what weight, and the slots
/// (`token · k + j`, token's `j`-th choice) grouped by expert.
#[derive(Debug, Clone)]
pub struct Routes {
    tokens: usize,
    experts: usize,
    k: usize,
    /// U32 `[tokens, k]`: the chosen experts, in the order chosen (by falling score where the
    /// router chose them).
    ids: Tensor,
    /// F32 `[tokens, k]`: their weights.
    weights: Tensor,
    /// U32 `[experts + 1 + tokens·k]`: where each expert's slots start in the list (and the
    /// end), then the slots in expert order.
    groups: Tensor,
}

impl Routes {
    /// Routes the model fixes rather than a router picks (DeepSeek-V4's hash-routed layers
    /// by token id; its grouped output projection, each row one group): token `t`'s `k`
    /// experts are `ids[t·k .. (t + 1)·k]`, with `weights` (F32 `[tokens, k]`, on `device`).
    pub fn fixed(
        device: &Device,
        ids: &[u32],
        k: usize,
        experts: usize,
        weights: Tensor,
    ) -> Result<Self> {
        const OP: &str = "Routes::fixed";
        if k == 0
            || k > MAX_EXPERTS_USED
            || ids.is_empty()
            || !ids.len().is_multiple_of(k)
            || experts > MAX_EXPERTS
        {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!(
                    "{} ids in rows of {k} (at most {MAX_EXPERTS_USED}), over {experts} experts \
                     (at most {MAX_EXPERTS})",
                    ids.len()
                ),
            });
        }
        check_indices(OP, "expert", ids, experts)?;
        let tokens = ids.len() / k;
        require_dtype(OP, "the weights", &weights, &[DType::F32])?;
        if weights.shape() != [tokens, k] {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!("weights {:?} for {tokens} rows of {k}", weights.shape()),
            });
        }
        let mut groups = vec![0u32; experts + 1 + ids.len()];
        group_slots(ids, experts, &mut groups);
        Ok(Self {
            tokens,
            experts,
            k,
            ids: Tensor::from_u32(device, &[tokens, k], ids)?,
            weights,
            groups: Tensor::from_u32(device, &[groups.len()], &groups)?,
        })
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Experts each token uses.
    pub fn k(&self) -> usize {
        self.k
    }

    /// U32 `[tokens, k]`: each token's experts, in the order chosen.
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// F32 `[tokens, k]`: their weights.
    pub fn weights(&self) -> &Tensor {
        &self.weights
    }
}

/// How [`route_row`] picks: the best scores (each plus the selection bias), or given.
#[derive(Clone, Copy)]
enum Pick<'a> {
    Best(Option<&'a [f32]>),
    Fixed(&'a [u32]),
}

/// `softplus(x) = ln(1 + e^x)`, as torch computes it (x itself above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// A token's `k` experts (`ids.len()`) by falling score (ties to the lower index) and their
/// weights, as `router` says: the CPU reference, which the routing kernel follows step by
/// step.
fn route_row(logits: &[f32], router: Router, pick: Pick<'_>, ids: &mut [u32], w: &mut [f32]) {
    let score = |e: usize| match router {
        Router::SqrtSoftplus { .. } => softplus(logits[e]).sqrt(),
        _ => logits[e],
    };
    match pick {
        Pick::Fixed(given) => {
            for (j, &e) in given.iter().enumerate() {
                ids[j] = e;
                w[j] = score(e as usize);
            }
        }
        Pick::Best(bias) => {
            let select = |e: usize| score(e) + bias.map_or(0.0, |b| b[e]);
            // Each pick is the largest selection value below the previous pick in the order
            // (value descending, index ascending).
            let mut prev: Option<(f32, usize)> = None;
            for j in 0..ids.len() {
                let mut best: Option<(f32, usize)> = None;
                for e in 0..logits.len() {
                    let v = select(e);
                    let below = prev.is_none_or(|(pv, pe)| v < pv || (v == pv && e > pe));
                    if below && best.is_none_or(|(bv, _)| v > bv) {
                        best = Some((v, e));
                    }
                }
                let (v, e) = best.unwrap_or((f32::NEG_INFINITY, 0));
                ids[j] = e as u32;
                w[j] = score(e);
                prev = Some((v, e));
            }
        }
    }
    // The first pick's score: the largest where the router picked them.
    let max = w[0];
    match router {
        Router::SqrtSoftplus { scale } => {
            let total: f32 = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|v| *v = *v / total * scale);
        }
        Router::SoftmaxTopK { renorm } => {
            let total: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
            for v in w.iter_mut() {
                *v = (*v - max).exp() / total;
            }
            if renorm {
                let s: f32 = w.iter().sum();
                w.iter_mut().for_each(|v| *v /= s);
            }
        }
        Router::TopKSoftmax => {
            for v in w.iter_mut() {
                *v = (*v - max).exp();
            }
            let s: f32 = w.iter().sum();
            w.iter_mut().for_each(|v| *v /= s);
        }
    }
}

/// The slots grouped by expert, in slot order within each: offsets, then the list.
fn group_slots(ids: &[u32], experts: usize, groups: &mut [u32]) {
    let (offsets, list) = groups.split_at_mut(experts + 1);
    offsets.fill(0);
    for &e in ids {
        offsets[e as usize + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    let mut next: Vec<u32> = offsets[..experts].to_vec();
    for (s, &e) in ids.iter().enumerate() {
        list[next[e as usize] as usize] = s as u32;
        next[e as usize] += 1;
    }
}

/// Parameters of `moe.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    tokens: u32,
    experts: u32,
    k: u32,
    /// `moe_route`: [`Router::mode`].
    mode: u32,
    /// `moe_combine`: the row width.
    width: u32,
    /// `moe_route`: whether the selection bias is bound; whether the experts are given.
    bias: u32,
    fixed: u32,
    /// `moe_route`: [`Router::SqrtSoftplus`]'s scale.
    scale: f32,
}

impl Recorder {
    /// Routes each token (a row of `logits`, F32 `[tokens, experts]`) to its `k` experts.
    pub fn moe_route(&mut self, logits: &Tensor, k: usize, router: Router) -> Result<Routes> {
        self.moe_route_by(logits, k, router, Choice::Best { bias: None })
    }

    /// [`Recorder::moe_route`] with the experts chosen as `choice` says.
    pub fn moe_route_by(
        &mut self,
        logits: &Tensor,
        k: usize,
        router: Router,
        choice: Choice<'_>,
    ) -> Result<Routes> {
        const OP: &str = "moe_route";
        require_dtype(OP, "the router logits", logits, &[DType::F32])?;
        self.check_device(OP, &[logits])?;
        let (tokens, experts) = (logits.rows(), logits.cols());
        if tokens == 0 || experts == 0 || experts > MAX_EXPERTS {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("{tokens} tokens over {experts} experts (1..={MAX_EXPERTS})"),
            });
        }
        if k == 0 || k > experts || k > MAX_EXPERTS_USED {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!(
                    "{k} experts a token of {experts} (1..={})",
                    experts.min(MAX_EXPERTS_USED)
                ),
            });
        }
        let slots = tokens * k;
        one_binding(OP, &[logits])?;
        let (bias, fixed) = match choice {
            Choice::Best { bias } => (bias, None),
            Choice::Fixed(ids) => (None, Some(ids)),
        };
        // The softmax routers weight by the first pick's logit as the row's largest.
        if (bias.is_some() || fixed.is_some()) && !matches!(router, Router::SqrtSoftplus { .. }) {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("{router:?} takes its experts by their logits alone"),
            });
        }
        if let Some(b) = bias {
            require_dtype(OP, "the selection bias", b, &[DType::F32])?;
            self.check_device(OP, &[b])?;
            if b.elem_count() != experts {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!("selection bias {:?} for {experts} experts", b.shape()),
                });
            }
        }
        if let Some(ids) = fixed {
            if ids.len() != slots {
                return Err(TensorError::Shape {
                    op: OP,
                    detail: format!("{} fixed experts for {tokens} tokens of {k}", ids.len()),
                });
            }
            check_indices(OP, "expert", ids, experts)?;
        }
        let Some(ctx) = self.gpu().cloned() else {
            let l = logits.host_f32()?;
            let bias = bias.map(Tensor::host_f32).transpose()?;
            let mut w = vec![0f32; slots];
            let ids = Tensor::host_u32_with(&[tokens, k], |ids| {
                for (t, ((row, ids), w)) in l
                    .chunks_exact(experts)
                    .zip(ids.chunks_exact_mut(k))
                    .zip(w.chunks_exact_mut(k))
                    .enumerate()
                {
                    let pick = match fixed {
                        Some(f) => Pick::Fixed(&f[t * k..(t + 1) * k]),
                        None => Pick::Best(bias),
                    };
                    route_row(row, router, pick, ids, w);
                }
            });
            let groups = Tensor::host_u32_with(&[experts + 1 + slots], |g| {
                // `ids` was just filled by this backend.
                if let Ok(ids) = ids.host_u32() {
                    group_slots(ids, experts, g);
                }
            });
            let weights = Tensor::host_f32_with(&[tokens, k], |o| {
                o.copy_from_slice(&w);
                Ok::<_, TensorError>(())
            })?;
            return Ok(Routes {
                tokens,
                experts,
                k,
                ids,
                weights,
                groups,
            });
        };
        let ids = Tensor::gpu_output(&ctx, DType::U32, &[tokens, k], OP)?;
        let weights = Tensor::gpu_output(&ctx, DType::F32, &[tokens, k], OP)?;
        let groups = Tensor::gpu_output(&ctx, DType::U32, &[experts + 1 + slots], OP)?;
        let params = Params {
            tokens: tokens as u32,
            experts: experts as u32,
            k: k as u32,
            mode: router.mode(),
            width: 0,
            bias: u32::from(bias.is_some()),
            fixed: u32::from(fixed.is_some()),
            scale: match router {
                Router::SqrtSoftplus { scale } => scale,
                _ => 1.0,
            },
        };
        // Unused bindings are bound to the logits (never read).
        let bias_t = bias.cloned().unwrap_or_else(|| logits.clone());
        let fixed_t = match fixed {
            Some(f) => Tensor::from_u32(&self.device().clone(), &[slots], f)?,
            None => logits.clone(),
        };
        self.dispatch(
            &ROUTE,
            &[
                ("ROUTE", flag(true)),
                ("EXPERTS", number(experts)),
                ("TOPK", number(k)),
            ],
            &params,
            vec![
                (logits.clone(), 0),
                (bias_t, 0),
                (fixed_t, 0),
                (ids.clone(), 0),
                (weights.clone(), 0),
                (groups.clone(), 0),
            ],
            1,
        )?;
        Ok(Routes {
            tokens,
            experts,
            k,
            ids,
            weights,
            groups,
        })
    }

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
