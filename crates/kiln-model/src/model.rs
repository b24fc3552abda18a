//! The decoder forward pass (Llama, Mistral, Qwen2/3, Gemma 3) over a batch that mixes
//! prefill chunks and decode tokens.

use kiln_attention::{AttnBatch, AttnConfig, KvCache, QkNorm, QkPrep, QkvRows, SeqBatch};
use kiln_kv::BlockId;
use kiln_tensor::{
    Activation as Act, ColumnIndex, Device, Keep, LinearOps, Recorder, RmsNorm, RopeConfig,
    RopePositions, RopeTable, Router, Tensor,
};

use crate::config::Activation;
use crate::{ModelConfig, ModelError, Result};

mod load;

/// A projection: its weight, its bias, and the input order it expects (act-order
/// checkpoints store each weight's columns sorted by group, so its input is gathered in that
/// order first).
struct Proj {
    w: Tensor,
    bias: Option<Tensor>,
    order: Option<ColumnIndex>,
}

impl Proj {
    /// x·wᵀ, with an RMSNorm of x first and what `glu` and `residual` ask after: one launch
    /// where the device's kernel fuses them (`Recorder::linear`). An input gathered first
    /// takes the norm as its own op, before the gather.
    fn apply(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        norm: Option<RmsNorm<'_>>,
        glu: Option<Act>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let ops = LinearOps {
            norm,
            bias: self.bias.as_ref(),
            glu,
            residual,
        };
        let Some(order) = &self.order else {
            return Ok(rec.linear(x, &self.w, ops)?);
        };
        let h = match norm {
            Some(n) => rec.rms_norm(x, n.weight, n.eps)?,
            None => x.clone(),
        };
        let h = rec.gather_cols(&h, order)?;
        Ok(rec.linear(&h, &self.w, LinearOps { norm: None, ..ops })?)
    }

    /// Bytes on the device: the weight, its bias, its input order.
    fn bytes(&self) -> u64 {
        bytes_of(&self.w)
            + self.bias.as_ref().map_or(0, bytes_of)
            + self.order.as_ref().map_or(0, |o| 4 * o.len() as u64)
    }
}

/// Projections of one input (Q/K/V; gate/up): stacked into one weight where they share a
/// dtype and an input order (one launch for all), else apart (K-quant files mix dtypes).
enum Stack {
    One(Proj),
    Apart(Vec<Proj>),
}

impl Stack {
    fn bytes(&self) -> u64 {
        match self {
            Stack::One(p) => p.bytes(),
            Stack::Apart(ps) => ps.iter().map(Proj::bytes).sum(),
        }
    }
}

/// A layer's MLP.
enum Mlp {
    /// `down(act(gate(x)) · up(x))`.
    Dense { gate_up: Stack, down: Proj },
    /// A router picks experts for each token; their dense MLPs' outputs, weighted, are summed.
    Moe(Experts),
}

/// Which layers keep their experts in host memory, run by the native CPU backend, while the
/// rest of the model runs on the GPU (llama.cpp's `--cpu-moe` and `--n-cpu-moe N`). On a CPU
/// device it changes nothing: the experts are in host memory already.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CpuMoe {
    /// Every weight on the model's device.
    #[default]
    Off,
    /// Every sparse layer's experts (`--cpu-moe`).
    All,
    /// The experts of the sparse layers among the first N (`--n-cpu-moe N`).
    First(usize),
}

impl CpuMoe {
    /// Whether layer `l`'s experts stay on the CPU.
    pub fn covers(self, l: usize) -> bool {
        match self {
            CpuMoe::Off => false,
            CpuMoe::All => true,
            CpuMoe::First(n) => l < n,
        }
    }
}

/// The experts `layers` covers, on `cpu` (a native CPU device, opened as the caller's
/// `--threads` says), beside a model on a GPU.
#[derive(Debug, Clone)]
pub struct CpuExperts {
    pub layers: CpuMoe,
    pub cpu: Device,
}

/// A mixture-of-experts MLP: the router's weight (and bias) and every expert's projections
/// stacked `[experts, rows, cols]`.
struct Experts {
    router: Tensor,
    router_bias: Option<Tensor>,
    /// Where the expert weights live when not on the model's device: the native CPU
    /// backend, which then routes and runs the experts (`CpuMoe`).
    host: Option<Device>,
    /// Experts a token uses, and how their weights are chosen.
    used: usize,
    kind: Router,
    /// Each expert's `[gate; up]` (one launch for both), or gate and up apart where their
    /// dtypes differ.
    gate_up: ExpertStack,
    down: RoutedProj,
}

/// One projection of every expert, `[experts, rows, cols]`, with each expert's bias
/// `[experts, rows]` (gpt-oss).
struct RoutedProj {
    w: Tensor,
    bias: Option<Tensor>,
}

impl RoutedProj {
    fn apply(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        routes: &kiln_tensor::Routes,
        glu: Option<Act>,
    ) -> Result<Tensor> {
        Ok(rec.linear_routed(x, &self.w, self.bias.as_ref(), routes, glu)?)
    }

    fn bytes(&self) -> u64 {
        bytes_of(&self.w) + self.bias.as_ref().map_or(0, bytes_of)
    }
}

enum ExpertStack {
    One(RoutedProj),
    Apart(RoutedProj, RoutedProj),
}

impl Mlp {
    /// Bytes on the model's device and in host memory (experts kept on the CPU).
    fn bytes(&self) -> [u64; 2] {
        match self {
            Mlp::Dense { gate_up, down } => [gate_up.bytes() + down.bytes(), 0],
            Mlp::Moe(e) => {
                let gate_up = match &e.gate_up {
                    ExpertStack::One(p) => p.bytes(),
                    ExpertStack::Apart(g, u) => g.bytes() + u.bytes(),
                };
                let router = bytes_of(&e.router) + e.router_bias.as_ref().map_or(0, bytes_of);
                let experts = gate_up + e.down.bytes();
                match e.host {
                    None => [router + experts, 0],
                    Some(_) => [router, experts],
                }
            }
        }
    }
}

impl Experts {
    /// `residual + Σ weight · expert(x)` over each token's experts, `x` already normed. The
    /// router's product runs where the model does; with the experts on the host, what they
    /// read (the normed input, the router's logits, the residual) is read back there, and the
    /// sum goes back to the model's device.
    fn apply(&self, rec: &mut Recorder, x: &Tensor, act: Act, residual: &Tensor) -> Result<Tensor> {
        let logits = rec.matmul(x, &self.router, self.router_bias.as_ref())?;
        let Some(host) = &self.host else {
            let routes = rec.moe_route(&logits, self.used, self.kind)?;
            let y = self.experts(rec, x, &routes, act)?;
            return Ok(rec.moe_combine(&y, &routes, residual)?);
        };
        rec.submit()?;
        let to_host = |t: &Tensor| Tensor::from_f32(host, t.shape(), &t.to_f32_vec()?);
        let (x, logits, residual) = (to_host(x)?, to_host(&logits)?, to_host(residual)?);
        let mut hrec = Recorder::new(host);
        let routes = hrec.moe_route(&logits, self.used, self.kind)?;
        let y = self.experts(&mut hrec, &x, &routes, act)?;
        let out = hrec.moe_combine(&y, &routes, &residual)?;
        hrec.submit()?;
        Ok(Tensor::from_f32(
            rec.device(),
            out.shape(),
            out.host_f32()?,
        )?)
    }

    /// Each slot's expert output `[tokens·k, hidden]`, on the recorder's device.
    fn experts(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        routes: &kiln_tensor::Routes,
        act: Act,
    ) -> Result<Tensor> {
        let m = match &self.gate_up {
            ExpertStack::One(p) => p.apply(rec, x, routes, Some(act))?,
            ExpertStack::Apart(g, u) => {
                let g = g.apply(rec, x, routes, None)?;
                let u = u.apply(rec, x, routes, None)?;
                rec.gated_mul(&g, &u, act)?
            }
        };
        self.down.apply(rec, &m, routes, None)
    }
}

struct Layer {
    attn_norm: Tensor,
    /// Q, K, V (stacked: `[q; k; v]` rows).
    qkv: Stack,
    /// Per-head RMSNorm of Q and K before RoPE (qwen3, gemma3).
    qk_norm: Option<[Tensor; 2]>,
    o: Proj,
    /// Norm of the attention output before the residual add (gemma3).
    post_attn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    mlp: Mlp,
    /// Norm of the MLP output before the residual add (gemma3).
    post_ffn_norm: Option<Tensor>,
    /// Index of this layer's RoPE table in `Model::ropes`.
    rope: usize,
    attn: AttnConfig,
}

/// A loaded model on a device.
pub struct Model {
    cfg: ModelConfig,
    device: Device,
    embed: Tensor,
    lm_head: Option<Tensor>,
    norm: Tensor,
    layers: Vec<Layer>,
    /// One table per distinct RoPE of the layers (Gemma 3: local and global).
    ropes: Vec<RopeTable>,
    weight_bytes: u64,
    /// Bytes of experts kept in host memory (`CpuMoe`), and the layers whose they are.
    host_expert_bytes: u64,
    host_expert_layers: Vec<usize>,
    /// The last step's lists, their room kept for the next.
    lists: Keep<StepLists>,
}

/// A step's lists: its token ids, their positions, the rows that get logits, the attention
/// batch and the positions for each RoPE table.
#[derive(Default)]
struct StepLists {
    ids: Vec<u32>,
    positions: Vec<u32>,
    last: Vec<u32>,
    batch: AttnBatch,
    ropes: Vec<RopePositions>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Model({:?}, {} layers on {:?})",
            self.cfg.arch, self.cfg.layers, self.device
        )
    }
}

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// The tokens computed this step: a prompt chunk, or the last sampled token.
    pub tokens: &'a [u32],
    /// Its physical KV blocks, covering `context_len` tokens.
    pub block_table: &'a [BlockId],
    /// Tokens in the cache after this step (earlier tokens + `tokens.len()`).
    pub context_len: usize,
}

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsAt<'a> {
    /// The last token of each sequence: `[sequences, vocab]`.
    #[default]
    Last,
    /// Every token of the step: `[tokens, vocab]` (prompt logprobs, tests).
    All,
    /// The last `n[i]` tokens of sequence `i` (each at least 1 and at most its tokens), in
    /// order: `[Σ n, vocab]`. Speculative decoding verifies a draft with these rows.
    Tail(&'a [usize]),
}

pub(crate) fn bytes_of(t: &Tensor) -> u64 {
    t.dtype().stored().bytes_for(t.elem_count()).unwrap_or(0) as u64
}

impl Model {
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Each layer's rotary embedding, in layer order.
    pub fn layer_ropes(&self) -> Vec<RopeConfig> {
        self.layers
            .iter()
            .map(|l| *self.ropes[l.rope].config())
            .collect()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of weights resident on the device (quantized sizes as stored).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Bytes of expert weights in host memory, run by the native CPU backend (`CpuMoe`), and
    /// the layers whose they are (none without `CpuMoe` or on a CPU device).
    pub fn host_experts(&self) -> (u64, &[usize]) {
        (self.host_expert_bytes, &self.host_expert_layers)
    }

    /// Record one forward step for `seqs` (laid out in order along the token dimension):
    /// writes their K/V into `cache` and returns logits at the positions `at` asks for. Nothing
    /// runs on a GPU until the recorder is submitted, except where a layer's experts run on
    /// the CPU (`CpuExperts`): the step so far is submitted there, to read that layer's input.
    pub fn forward(
        &self,
        rec: &mut Recorder,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        at: LogitsAt<'_>,
    ) -> Result<Tensor> {
        // On a GPU the step's uploads go back to the buffer pool as the step ends, before
        // the recorder is submitted, as every intermediate does; its lists are new each step.
        if !self.device.is_cpu() {
            return self.forward_with(rec, cache, seqs, at, &mut StepLists::default());
        }
        self.lists
            .with(|lists| self.forward_with(rec, cache, seqs, at, lists))
    }

    /// [`Model::forward`] with the step's lists in `lists`.
    fn forward_with(
        &self,
        rec: &mut Recorder,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        at: LogitsAt<'_>,
        lists: &mut StepLists,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let StepLists {
            ids,
            positions,
            last,
            batch,
            ropes,
        } = lists;
        for l in [&mut *ids, &mut *positions, &mut *last] {
            l.clear();
        }
        if let LogitsAt::Tail(n) = at
            && n.len() != seqs.len()
        {
            return Err(ModelError::Batch(format!(
                "logits asked for the tails of {} sequences in a batch of {}",
                n.len(),
                seqs.len()
            )));
        }
        for (i, s) in seqs.iter().enumerate() {
            if s.tokens.is_empty() || s.tokens.len() > s.context_len {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: {} tokens for a context of {}",
                    s.tokens.len(),
                    s.context_len
                )));
            }
            if s.context_len > cfg.max_position {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: context {} exceeds the model's {} positions",
                    s.context_len, cfg.max_position
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: token id {bad} is outside the vocabulary of {}",
                    cfg.vocab
                )));
            }
            ids.extend_from_slice(s.tokens);
            positions.extend((s.context_len - s.tokens.len()..s.context_len).map(|p| p as u32));
            let tail = match at {
                LogitsAt::Tail(n) => n[i],
                _ => 1,
            };
            if tail == 0 || tail > s.tokens.len() {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: logits for its last {tail} of {} tokens",
                    s.tokens.len()
                )));
            }
            last.extend((ids.len() - tail..ids.len()).map(|r| r as u32));
        }
        let sb = seqs.iter().map(|s| SeqBatch {
            block_table: s.block_table,
            query_len: s.tokens.len(),
            context_len: s.context_len,
        });
        cache.batch_into(sb, batch)?;
        let batch = &*batch;
        // Uploaded once per table, used by Q and K of every layer that rotates with it.
        if ropes.len() == self.ropes.len() {
            for p in ropes.iter_mut() {
                p.set(positions)?;
            }
        } else {
            *ropes = self
                .ropes
                .iter()
                .map(|r| r.positions(positions))
                .collect::<std::result::Result<_, _>>()?;
        }
        let positions = &*ropes;
        let ids = &ids[..];
        let t = ids.len();
        let (d, heads) = (cfg.head_dim, cfg.heads);
        let mut x = rec.embedding(&self.embed, ids)?;
        if let Some(s) = cfg.embed_scale {
            x = rec.scale(&x, s)?;
        }
        let eps = cfg.rms_eps;
        let act = match cfg.activation {
            Activation::Silu => Act::Silu,
            Activation::GeluTanh => Act::GeluTanh,
            Activation::SwigluOai => Act::SwigluOai,
        };
        for (li, l) in self.layers.iter().enumerate() {
            let pos = positions.get(l.rope).ok_or_else(|| {
                ModelError::Batch(format!("layer {li}: no RoPE table {}", l.rope))
            })?;
            let prep = QkPrep {
                heads,
                rope: pos,
                norm: l.qk_norm.as_ref().map(|[q, k]| QkNorm { q, k, eps }),
            };
            // Norm and projections, then per-head norm, RoPE and the K/V write.
            let norm = Some(RmsNorm {
                weight: &l.attn_norm,
                eps,
            });
            let q = match &l.qkv {
                Stack::One(p) => {
                    let qkv = p.apply(rec, &x, norm, None, None)?;
                    cache.write_qkv(rec, li, QkvRows::Stacked(&qkv), &prep, batch)?
                }
                Stack::Apart(ps) => {
                    let [q, k, v] = [&ps[0], &ps[1], &ps[2]];
                    let (q, k, v) = (
                        q.apply(rec, &x, norm, None, None)?,
                        k.apply(rec, &x, norm, None, None)?,
                        v.apply(rec, &x, norm, None, None)?,
                    );
                    cache.write_qkv(rec, li, QkvRows::Separate([&q, &k, &v]), &prep, batch)?
                }
            };
            let a = cache
                .attention(rec, li, &q, batch, &l.attn)?
                .reshape(&[t, heads * d])?;
            x = match &l.post_attn_norm {
                None => l.o.apply(rec, &a, None, None, Some(&x))?,
                Some(n) => {
                    let o = l.o.apply(rec, &a, None, None, None)?;
                    let o = rec.rms_norm(&o, n, eps)?;
                    rec.add(&x, &o)?
                }
            };
            x = match &l.mlp {
                Mlp::Dense { gate_up, down } => {
                    let norm = Some(RmsNorm {
                        weight: &l.ffn_norm,
                        eps,
                    });
                    let m = match gate_up {
                        Stack::One(p) => p.apply(rec, &x, norm, Some(act), None)?,
                        Stack::Apart(ps) => {
                            let g = ps[0].apply(rec, &x, norm, None, None)?;
                            let u = ps[1].apply(rec, &x, norm, None, None)?;
                            rec.gated_mul(&g, &u, act)?
                        }
                    };
                    match &l.post_ffn_norm {
                        None => down.apply(rec, &m, None, None, Some(&x))?,
                        Some(n) => {
                            let m = down.apply(rec, &m, None, None, None)?;
                            let m = rec.rms_norm(&m, n, eps)?;
                            rec.add(&x, &m)?
                        }
                    }
                }
                Mlp::Moe(e) => {
                    let h = rec.rms_norm(&x, &l.ffn_norm, eps)?;
                    e.apply(rec, &h, act, &x)?
                }
            };
        }
        // The LM head only for the rows that need logits (all of them in a decode step), the
        // final norm fused into it.
        let every_row = last.iter().enumerate().all(|(i, &r)| i == r as usize) && last.len() == t;
        let x = match at {
            LogitsAt::Last | LogitsAt::Tail(_) if !every_row => rec.embedding(&x, last)?,
            _ => x,
        };
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let logits = rec.linear(
            &x,
            head,
            LinearOps {
                norm: Some(RmsNorm {
                    weight: &self.norm,
                    eps,
                }),
                ..LinearOps::default()
            },
        )?;
        match cfg.final_logit_softcap {
            Some(cap) => Ok(rec.softcap(&logits, cap)?),
            None => Ok(logits),
        }
    }
}
