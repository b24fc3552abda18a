//! Loading a [`Model`]: every weight the config names, projections of one input stacked into
//! one weight where they can be.

use kiln_attention::AttnConfig;
use kiln_tensor::{ColumnIndex, Device, RopeTable, Tensor};

use super::{
    CpuExperts, ExpertStack, Experts, Layer, Mlp, Model, Proj, RoutedProj, Stack, bytes_of,
};
use crate::config::{MoeConfig, RopeParams};
use crate::weights::{ExpertProj, Weight, WeightSource};
use crate::{ModelConfig, ModelError, Result};

/// An RMSNorm weight as F32, with the config's `norm_offset` added (Gemma's `1 + w`).
fn load_norm(
    device: &Device,
    src: &dyn WeightSource,
    cfg: &ModelConfig,
    w: Weight,
    n: usize,
) -> Result<Tensor> {
    if cfg.norm_offset == 0.0 {
        return src.load_f32(device, w, &[n]);
    }
    let mut v = src.load(&Device::Reference, w, &[n])?.to_f32_vec()?;
    for x in &mut v {
        *x += cfg.norm_offset;
    }
    Ok(Tensor::from_f32(device, &[n], &v)?)
}

/// A permutation of a layer input's columns, on the device.
fn order(device: &Device, perm: Option<&Vec<u32>>) -> Result<Option<ColumnIndex>> {
    perm.map(|p| ColumnIndex::new(device, p, p.len()))
        .transpose()
        .map_err(ModelError::from)
}

/// Projections of one input, each `(weight, its bias, [out, in])`: read on the host, then
/// uploaded as one stacked weight (rows in the order given, biases alike) when they share a
/// dtype and an input order, else one by one. A stack is the same bytes as its parts, so the
/// device holds no more than before; the host holds the parts and the stack of one layer.
fn load_stack(
    device: &Device,
    src: &dyn WeightSource,
    parts: &[(Weight, Option<Weight>, [usize; 2])],
) -> Result<Stack> {
    let mut host = Vec::with_capacity(parts.len());
    for &(w, bias, shape) in parts {
        let lin = src.load_linear(&Device::Reference, w, &shape)?;
        let bias = match bias {
            Some(b) => Some(
                src.load_f32(&Device::Reference, b, &[shape[0]])?
                    .to_f32_vec()?,
            ),
            None => None,
        };
        host.push((lin, bias, shape));
    }
    let (first, _, _) = &host[0];
    let stackable = host.len() > 1
        && host.iter().all(|(l, _, _)| {
            l.weight.dtype() == first.weight.dtype() && l.input_perm == first.input_perm
        });
    let upload = |t: &Tensor, shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::from_bytes(
            device,
            t.dtype(),
            shape,
            &t.to_bytes()?,
        )?)
    };
    if !stackable {
        return Ok(Stack::Apart(
            host.iter()
                .map(|(l, b, shape)| {
                    Ok(Proj {
                        w: upload(&l.weight, shape)?,
                        bias: b
                            .as_ref()
                            .map(|b| Tensor::from_f32(device, &[b.len()], b))
                            .transpose()?,
                        order: order(device, l.input_perm.as_ref())?,
                    })
                })
                .collect::<Result<_>>()?,
        ));
    }
    let rows: usize = host.iter().map(|(_, _, s)| s[0]).sum();
    let cols = parts[0].2[1];
    let mut bytes = Vec::new();
    for (l, _, _) in &host {
        bytes.extend_from_slice(&l.weight.to_bytes()?);
    }
    let w = Tensor::from_bytes(device, first.weight.dtype(), &[rows, cols], &bytes)?;
    drop(bytes);
    let bias = if host.iter().all(|(_, b, _)| b.is_some()) {
        let all: Vec<f32> = host
            .iter()
            .flat_map(|(_, b, _)| b.iter().flatten().copied())
            .collect();
        Some(Tensor::from_f32(device, &[rows], &all)?)
    } else {
        None
    };
    Ok(Stack::One(Proj {
        w,
        bias,
        order: order(device, first.input_perm.as_ref())?,
    }))
}

/// One projection, uploaded as the source gives it, with its bias where it has one.
fn load_proj(
    device: &Device,
    src: &dyn WeightSource,
    w: Weight,
    bias: Option<Weight>,
    shape: [usize; 2],
) -> Result<Proj> {
    let lin = src.load_linear(device, w, &shape)?;
    Ok(Proj {
        order: order(device, lin.input_perm.as_ref())?,
        w: lin.weight,
        bias: bias
            .map(|b| src.load_f32(device, b, &[shape[0]]))
            .transpose()?,
    })
}

/// A mixture-of-experts layer's router (on `device`) and experts (on `host`, the native CPU
/// backend, where given; else on `device`): gate and up stacked per expert (`[gate_e; up_e]`,
/// one launch for both) where they share a dtype, read on the host a projection at a time.
fn load_experts(
    (device, host): (&Device, Option<&Device>),
    src: &dyn WeightSource,
    moe: &MoeConfig,
    l: usize,
    h: usize,
) -> Result<Experts> {
    let (e, f) = (moe.experts, moe.expert_ffn);
    // In f32 whatever the checkpoint or `--quantize` says, as llama.cpp keeps it: a rounded
    // router flips near-tied choices of experts.
    let router = src.load_f32(device, Weight::Router(l), &[e, h])?;
    let router_bias = moe
        .biases
        .then(|| src.load_f32(device, Weight::RouterBias(l), &[e]))
        .transpose()?;
    // Everything below lives where the experts run.
    let runs_on = host.unwrap_or(device);
    let read = |p: ExpertProj| src.load_experts(&Device::Reference, l, p, [e, f, h]);
    let bias = |p: ExpertProj, rows: usize| {
        moe.biases
            .then(|| src.load_expert_bias(l, p, [e, rows]))
            .transpose()
    };
    let (gate, up) = (read(ExpertProj::Gate)?, read(ExpertProj::Up)?);
    let (gate_b, up_b) = (bias(ExpertProj::Gate, f)?, bias(ExpertProj::Up, f)?);
    let upload_bias = |b: Option<Vec<f32>>, rows: usize| {
        b.map(|b| Tensor::from_f32(runs_on, &[e, rows], &b))
            .transpose()
    };
    let gate_up = if gate.dtype() == up.dtype() {
        let (g, u) = (gate.to_bytes()?, up.to_bytes()?);
        let per = g.len() / e;
        let mut both = Vec::with_capacity(2 * g.len());
        for x in 0..e {
            both.extend_from_slice(&g[x * per..(x + 1) * per]);
            both.extend_from_slice(&u[x * per..(x + 1) * per]);
        }
        drop((g, u));
        // Each expert's biases stacked alike: `[gate_b; up_b]`.
        let both_b = gate_b.zip(up_b).map(|(g, u)| {
            (0..e)
                .flat_map(|x| g[x * f..(x + 1) * f].iter().chain(&u[x * f..(x + 1) * f]))
                .copied()
                .collect()
        });
        ExpertStack::One(RoutedProj {
            w: Tensor::from_bytes(runs_on, gate.dtype(), &[e, 2 * f, h], &both)?,
            bias: upload_bias(both_b, 2 * f)?,
        })
    } else {
        let upload =
            |t: &Tensor| Tensor::from_bytes(runs_on, t.dtype(), &[e, f, h], &t.to_bytes()?);
        ExpertStack::Apart(
            RoutedProj {
                w: upload(&gate)?,
                bias: upload_bias(gate_b, f)?,
            },
            RoutedProj {
                w: upload(&up)?,
                bias: upload_bias(up_b, f)?,
            },
        )
    };
    Ok(Experts {
        router,
        router_bias,
        host: host.cloned(),
        used: moe.used,
        kind: moe.router,
        gate_up,
        down: RoutedProj {
            w: src.load_experts(runs_on, l, ExpertProj::Down, [e, h, f])?,
            bias: upload_bias(bias(ExpertProj::Down, h)?, h)?,
        },
    })
}

impl Model {
    /// Upload every weight the config names from `src` to `device`.
    pub fn load(device: &Device, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        Self::load_with_progress(device, cfg, src, None, &mut |_, _| {})
    }

    /// [`Model::load`], the experts of the layers `cpu_experts` covers kept in host memory on
    /// its native CPU device (where `device` is a GPU: on a CPU they are there already),
    /// calling `progress(layers_loaded, layers)` after each layer (for a progress bar on
    /// large files).
    pub fn load_with_progress(
        device: &Device,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        cpu_experts: Option<&CpuExperts>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let cpu_experts = cpu_experts.filter(|c| !device.is_cpu() && c.cpu.is_cpu());
        let mut host_expert_layers = Vec::new();
        let start = std::time::Instant::now();
        let (h, d) = (cfg.hidden, cfg.head_dim);
        let (qd, kvd) = (cfg.heads * d, cfg.kv_heads * d);
        let embed = src.load(device, Weight::Embed, &[cfg.vocab, h])?;
        let lm_head = if cfg.tie_embeddings || !src.has(Weight::LmHead) {
            None
        } else {
            Some(src.load(device, Weight::LmHead, &[cfg.vocab, h])?)
        };
        let norm_of = |w: Weight, n: usize| load_norm(device, src, &cfg, w, n);
        let norm = norm_of(Weight::FinalNorm, h)?;
        let mut rope_params: Vec<RopeParams> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let bias = |b: Weight| cfg.qkv_bias.then_some(b);
            let qkv = load_stack(
                device,
                src,
                &[
                    (Weight::Q(l), bias(Weight::QBias(l)), [qd, h]),
                    (Weight::K(l), bias(Weight::KBias(l)), [kvd, h]),
                    (Weight::V(l), bias(Weight::VBias(l)), [kvd, h]),
                ],
            )?;
            let qk_norm = if cfg.qk_norm {
                Some([norm_of(Weight::QNorm(l), d)?, norm_of(Weight::KNorm(l), d)?])
            } else {
                None
            };
            let ffn_norm = norm_of(cfg.ffn_norm_weight(l), h)?;
            let (post_attn_norm, post_ffn_norm) = if cfg.sandwich_norms {
                (
                    Some(norm_of(Weight::PostAttnNorm(l), h)?),
                    Some(norm_of(Weight::PostFfnNorm(l), h)?),
                )
            } else {
                (None, None)
            };
            let la = cfg.attention.get(l).copied().ok_or_else(|| {
                ModelError::Batch(format!("layer {l} has no attention description"))
            })?;
            let rope = match rope_params.iter().position(|p| *p == la.rope) {
                Some(i) => i,
                None => {
                    rope_params.push(la.rope);
                    rope_params.len() - 1
                }
            };
            let mlp = match &cfg.moe {
                Some(moe) if cfg.sparse_layer(l) => {
                    let here = cpu_experts.filter(|c| c.layers.covers(l)).map(|c| &c.cpu);
                    if here.is_some() {
                        host_expert_layers.push(l);
                    }
                    Mlp::Moe(load_experts((device, here), src, moe, l, h)?)
                }
                _ => Mlp::Dense {
                    gate_up: load_stack(
                        device,
                        src,
                        &[
                            (Weight::Gate(l), None, [cfg.ffn, h]),
                            (Weight::Up(l), None, [cfg.ffn, h]),
                        ],
                    )?,
                    down: load_proj(device, src, Weight::Down(l), None, [h, cfg.ffn])?,
                },
            };
            layers.push(Layer {
                attn_norm: norm_of(Weight::AttnNorm(l), h)?,
                qkv,
                qk_norm,
                o: load_proj(
                    device,
                    src,
                    Weight::O(l),
                    cfg.o_bias.then_some(Weight::OBias(l)),
                    [h, qd],
                )?,
                post_attn_norm,
                ffn_norm,
                mlp,
                post_ffn_norm,
                rope,
                attn: AttnConfig {
                    heads: cfg.heads,
                    scale: cfg.attn_scale,
                    window: la.window,
                    sinks: cfg
                        .attn_sinks
                        .then(|| src.load_f32(device, Weight::Sinks(l), &[cfg.heads]))
                        .transpose()?,
                },
            });
            progress(l + 1, cfg.layers);
        }
        let ropes = rope_params
            .iter()
            .map(|&p| RopeTable::new(device, cfg.rope(p), cfg.max_position))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut weight_bytes =
            bytes_of(&embed) + bytes_of(&norm) + lm_head.as_ref().map_or(0, bytes_of);
        let mut host_expert_bytes = 0;
        for l in &layers {
            weight_bytes += [&l.attn_norm, &l.ffn_norm]
                .into_iter()
                .chain(l.qk_norm.iter().flatten())
                .chain(l.post_attn_norm.iter())
                .chain(l.post_ffn_norm.iter())
                .chain(l.attn.sinks.iter())
                .map(bytes_of)
                .sum::<u64>();
            let [on_device, on_host] = l.mlp.bytes();
            weight_bytes += l.qkv.bytes() + l.o.bytes() + on_device;
            host_expert_bytes += on_host;
        }
        tracing::info!(
            "loaded {} bytes of weights from {} in {:?}",
            weight_bytes,
            src.describe(),
            start.elapsed()
        );
        Ok(Self {
            cfg,
            device: device.clone(),
            embed,
            lm_head,
            norm,
            layers,
            ropes,
            weight_bytes,
            host_expert_bytes,
            host_expert_layers,
            lists: Default::default(),
        })
    }
}
