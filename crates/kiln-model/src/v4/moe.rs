//! DeepSeek-V4's mixture of experts (`DeepseekV4SparseMoeBlock`): a router scoring every
//! expert `sqrt(softplus(logit))`, choosing by score plus a selection bias (top-k layers) or
//! by token id (the first, hash-routed layers: `tid2eid`), the routed experts and one shared
//! expert, both with the clamped SwiGLU.

use kiln_tensor::{Activation, Choice, ClampLimit, LinearOps, Recorder, Router, Routes, Tensor};

use crate::{ModelError, Result};

/// How a layer chooses each token's experts.
#[derive(Debug, Clone)]
pub enum ExpertChoice {
    /// The best scores plus `bias` (`ffn.gate.bias`, F32 `[experts]`).
    Scored { bias: Tensor },
    /// `tid2eid`: token `id`'s experts are `table[id·k .. (id + 1)·k]`.
    Hashed { table: Vec<u32> },
}

/// A gated MLP's gate (`w1`) and up (`w3`) projections: stacked `[w1; w3]` (one product for
/// both), or apart (a GGUF keeps them apart, and may store them in different formats).
#[derive(Debug, Clone)]
pub enum GateUp {
    Stacked(Tensor),
    Apart { gate: Tensor, up: Tensor },
}

/// A V4 MoE layer's weights.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `ffn.gate.weight` `[experts, hidden]`.
    pub router: Tensor,
    pub choice: ExpertChoice,
    /// Every expert's gate and up: `[experts, 2·ffn, hidden]` stacked, `[experts, ffn,
    /// hidden]` each apart.
    pub gate_up: GateUp,
    /// Every expert's `w2`, `[experts, hidden, ffn]`.
    pub down: Tensor,
    /// The shared expert's gate and up (`[2·ffn, hidden]` stacked) and `w2` `[hidden, ffn]`.
    pub shared_gate_up: GateUp,
    pub shared_down: Tensor,
}

/// The sizes and constants of a V4 MoE layer.
#[derive(Debug, Clone, Copy)]
pub struct MoeShape {
    pub experts: usize,
    /// Experts a token uses.
    pub used: usize,
    /// `routed_scaling_factor`.
    pub scale: f32,
    /// `swiglu_limit`.
    pub limit: f32,
}

#[derive(Debug, Clone)]
pub struct Moe {
    w: MoeWeights,
    shape: MoeShape,
    act: Activation,
    /// Where the weights came from, and their names' prefix (for errors).
    file: String,
    prefix: String,
}

impl Moe {
    pub fn new(file: &str, prefix: &str, w: MoeWeights, shape: MoeShape) -> Result<Self> {
        let bad = |name: &str, problem: String| ModelError::Tensor {
            file: file.into(),
            tensor: format!("{prefix}{name}"),
            problem,
        };
        let MoeShape { experts, used, .. } = shape;
        if w.router.rows() != experts || used == 0 || used > experts {
            return Err(bad(
                "gate.weight",
                format!(
                    "shape {:?}, {used} of {experts} experts used",
                    w.router.shape()
                ),
            ));
        }
        match &w.choice {
            ExpertChoice::Scored { bias } if bias.elem_count() != experts => {
                return Err(bad(
                    "gate.bias",
                    format!("shape {:?}, expected [{experts}]", bias.shape()),
                ));
            }
            ExpertChoice::Hashed { table } => {
                if !table.len().is_multiple_of(used) || table.is_empty() {
                    return Err(bad(
                        "gate.tid2eid",
                        format!("{} entries are not rows of {used}", table.len()),
                    ));
                }
                if let Some(&e) = table.iter().find(|&&e| e as usize >= experts) {
                    return Err(bad("gate.tid2eid", format!("expert {e} of {experts}")));
                }
            }
            ExpertChoice::Scored { .. } => {}
        }
        let limit = ClampLimit::new(shape.limit).ok_or_else(|| {
            bad(
                "",
                format!("swiglu_limit {} is not a positive bound", shape.limit),
            )
        })?;
        Ok(Self {
            w,
            shape,
            act: Activation::SiluClamped { limit },
            file: file.into(),
            prefix: prefix.into(),
        })
    }

    /// The layer's output `[tokens, hidden]` for its normed input `x` and the tokens' ids.
    pub fn forward(&self, rec: &mut Recorder, x: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let logits = rec.matmul(x, &self.w.router, None)?;
        let routes = self.route(rec, &logits, ids)?;
        let h = match &self.w.gate_up {
            GateUp::Stacked(w) => rec.linear_routed(x, w, None, &routes, Some(self.act))?,
            GateUp::Apart { gate, up } => {
                let g = rec.linear_routed(x, gate, None, &routes, None)?;
                let u = rec.linear_routed(x, up, None, &routes, None)?;
                rec.gated_mul(&g, &u, self.act)?
            }
        };
        let y = rec.linear_routed(&h, &self.w.down, None, &routes, None)?;
        let shared = match &self.w.shared_gate_up {
            GateUp::Stacked(w) => rec.linear(
                x,
                w,
                LinearOps {
                    glu: Some(self.act),
                    ..LinearOps::default()
                },
            )?,
            GateUp::Apart { gate, up } => {
                let g = rec.matmul(x, gate, None)?;
                let u = rec.matmul(x, up, None)?;
                rec.gated_mul(&g, &u, self.act)?
            }
        };
        let shared = rec.matmul(&shared, &self.w.shared_down, None)?;
        Ok(rec.moe_combine(&y, &routes, &shared)?)
    }

    fn route(&self, rec: &mut Recorder, logits: &Tensor, ids: &[u32]) -> Result<Routes> {
        let router = Router::SqrtSoftplus {
            scale: self.shape.scale,
        };
        let k = self.shape.used;
        let routes = match &self.w.choice {
            ExpertChoice::Scored { bias } => {
                rec.moe_route_by(logits, k, router, Choice::Best { bias: Some(bias) })?
            }
            ExpertChoice::Hashed { table } => {
                let vocab = table.len() / k;
                let mut fixed = Vec::with_capacity(ids.len() * k);
                for &id in ids {
                    let row = table
                        .get(id as usize * k..(id as usize + 1) * k)
                        .ok_or_else(|| ModelError::Tensor {
                            file: self.file.clone(),
                            tensor: format!("{}gate.tid2eid", self.prefix),
                            problem: format!("token id {id} past its {vocab} rows"),
                        })?;
                    fixed.extend_from_slice(row);
                }
                rec.moe_route_by(logits, k, router, Choice::Fixed(&fixed))?
            }
        };
        Ok(routes)
    }
}
