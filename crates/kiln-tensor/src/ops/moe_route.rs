//! Mixture-of-experts routing: [`Recorder::moe_route`] (and [`Recorder::moe_route_by`]) picks
//! each token's experts and their weights from the router's logits, as a [`Router`] says and
//! a [`Choice`] allows, and groups the batch's (token, expert) slots by expert into
//! [`Routes`], which `linear_routed` and `moe_combine` (`moe.rs`) read.

use super::moe::{MAX_EXPERTS, MAX_EXPERTS_USED, Params, SRC};
use super::{check_indices, flag, number, one_binding, require_dtype};
use crate::gpu::{Access, KernelDef};
use crate::{DType, Device, Recorder, Result, Tensor, TensorError};

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
    pub(super) tokens: usize,
    pub(super) experts: usize,
    pub(super) k: usize,
    /// U32 `[tokens, k]`: the chosen experts, in the order chosen (by falling score where the
    /// router chose them).
    pub(super) ids: Tensor,
    /// F32 `[tokens, k]`: their weights.
    pub(super) weights: Tensor,
    /// U32 `[experts + 1 + tokens·k]`: where each expert's slots start in the list (and the
    /// end), then the slots in expert order.
    pub(super) groups: Tensor,
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
}
