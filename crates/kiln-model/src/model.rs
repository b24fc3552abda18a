//! The decoder forward pass (Llama, Mistral, Qwen2/3, Gemma 3) over a batch that mixes
//! prefill chunks and decode tokens.

use kiln_attention::{AttnConfig, KvCache, SeqBatch};
use kiln_kv::BlockId;
use kiln_tensor::{ColumnIndex, Device, Recorder, RopeConfig, RopePositions, RopeTable, Tensor};

use crate::config::{Activation, RopeParams};
use crate::weights::{Weight, WeightSource};
use crate::{ModelConfig, ModelError, Result};

/// The input orders of weights that share one input (Q/K/V; gate/up). Act-order checkpoints
/// store each weight's columns sorted by group, so its input is gathered in that order first.
enum Inputs {
    /// One order for all of them (`None`: the input as it is): one gather, fused matmuls.
    Shared(Option<ColumnIndex>),
    /// An order per weight.
    Each(Vec<Option<ColumnIndex>>),
}

impl Inputs {
    fn of(device: &Device, perms: &[&Option<Vec<u32>>]) -> Result<Self> {
        // A permutation of the input columns: as many as the weight has.
        let upload = |p: &Option<Vec<u32>>| -> Result<Option<ColumnIndex>> {
            p.as_ref()
                .map(|p| ColumnIndex::new(device, p, p.len()))
                .transpose()
                .map_err(ModelError::from)
        };
        match perms {
            [first, rest @ ..] if rest.iter().all(|p| p == first) => {
                Ok(Inputs::Shared(upload(first)?))
            }
            _ => Ok(Inputs::Each(
                perms.iter().map(|p| upload(p)).collect::<Result<_>>()?,
            )),
        }
    }

    fn indices(&self) -> impl Iterator<Item = &ColumnIndex> {
        let (shared, each) = match self {
            Inputs::Shared(p) => (p.as_ref(), &[][..]),
            Inputs::Each(v) => (None, &v[..]),
        };
        shared.into_iter().chain(each.iter().flatten())
    }

    /// The order of weight `i`.
    fn get(&self, i: usize) -> Option<&ColumnIndex> {
        match self {
            Inputs::Shared(p) => p.as_ref(),
            Inputs::Each(v) => v.get(i).and_then(Option::as_ref),
        }
    }
}

/// `x` with its columns in `order` (`None`: `x` itself).
fn gathered(rec: &mut Recorder, x: &Tensor, order: Option<&ColumnIndex>) -> Result<Tensor> {
    match order {
        None => Ok(x.clone()),
        Some(idx) => Ok(rec.gather_cols(x, idx)?),
    }
}

/// `x · wᵀ (+ bias)`, `x`'s columns gathered in `order` first.
fn project(
    rec: &mut Recorder,
    x: &Tensor,
    order: Option<&ColumnIndex>,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let x = gathered(rec, x, order)?;
    Ok(rec.matmul(&x, w, bias)?)
}

struct Layer {
    attn_norm: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qkv_in: Inputs,
    bias: Option<[Tensor; 3]>,
    /// Per-head RMSNorm of Q and K before RoPE (qwen3, gemma3).
    qk_norm: Option<[Tensor; 2]>,
    o: Tensor,
    o_in: Inputs,
    /// Norm of the attention output before the residual add (gemma3).
    post_attn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    gate: Tensor,
    up: Tensor,
    gate_up_in: Inputs,
    down: Tensor,
    down_in: Inputs,
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
    let mut v = src.load(&Device::Cpu, w, &[n])?.to_f32_vec()?;
    for x in &mut v {
        *x += cfg.norm_offset;
    }
    Ok(Tensor::from_f32(device, &[n], &v)?)
}

fn bytes_of(t: &Tensor) -> u64 {
    t.dtype().stored().bytes_for(t.elem_count()).unwrap_or(0) as u64
}

impl Model {
    /// Upload every weight the config names from `src` to `device`.
    pub fn load(device: &Device, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        Self::load_with_progress(device, cfg, src, &mut |_, _| {})
    }

    /// [`Model::load`], calling `progress(layers_loaded, layers)` after each layer (for a
    /// progress bar on large files).
    pub fn load_with_progress(
        device: &Device,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
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
            let bias = if cfg.qkv_bias {
                Some([
                    src.load_f32(device, Weight::QBias(l), &[qd])?,
                    src.load_f32(device, Weight::KBias(l), &[kvd])?,
                    src.load_f32(device, Weight::VBias(l), &[kvd])?,
                ])
            } else {
                None
            };
            let qk_norm = if cfg.qk_norm {
                Some([norm_of(Weight::QNorm(l), d)?, norm_of(Weight::KNorm(l), d)?])
            } else {
                None
            };
            let (post_attn_norm, ffn_norm, post_ffn_norm) = if cfg.sandwich_norms {
                (
                    Some(norm_of(Weight::PostAttnNorm(l), h)?),
                    norm_of(Weight::PreFfnNorm(l), h)?,
                    Some(norm_of(Weight::PostFfnNorm(l), h)?),
                )
            } else {
                (None, norm_of(Weight::FfnNorm(l), h)?, None)
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
            let lin = |w: Weight, shape: &[usize]| src.load_linear(device, w, shape);
            let (q, k, v) = (
                lin(Weight::Q(l), &[qd, h])?,
                lin(Weight::K(l), &[kvd, h])?,
                lin(Weight::V(l), &[kvd, h])?,
            );
            let o = lin(Weight::O(l), &[h, qd])?;
            let (gate, up) = (
                lin(Weight::Gate(l), &[cfg.ffn, h])?,
                lin(Weight::Up(l), &[cfg.ffn, h])?,
            );
            let down = lin(Weight::Down(l), &[h, cfg.ffn])?;
            layers.push(Layer {
                attn_norm: norm_of(Weight::AttnNorm(l), h)?,
                qkv_in: Inputs::of(device, &[&q.input_perm, &k.input_perm, &v.input_perm])?,
                q: q.weight,
                k: k.weight,
                v: v.weight,
                bias,
                qk_norm,
                o_in: Inputs::of(device, &[&o.input_perm])?,
                o: o.weight,
                post_attn_norm,
                ffn_norm,
                gate_up_in: Inputs::of(device, &[&gate.input_perm, &up.input_perm])?,
                gate: gate.weight,
                up: up.weight,
                down_in: Inputs::of(device, &[&down.input_perm])?,
                down: down.weight,
                post_ffn_norm,
                rope,
                attn: AttnConfig {
                    heads: cfg.heads,
                    scale: cfg.attn_scale,
                    window: la.window,
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
        for l in &layers {
            for t in [
                &l.attn_norm,
                &l.q,
                &l.k,
                &l.v,
                &l.o,
                &l.ffn_norm,
                &l.gate,
                &l.up,
                &l.down,
            ] {
                weight_bytes += bytes_of(t);
            }
            weight_bytes += l.bias.iter().flatten().map(bytes_of).sum::<u64>();
            weight_bytes += [&l.qkv_in, &l.o_in, &l.gate_up_in, &l.down_in]
                .into_iter()
                .flat_map(Inputs::indices)
                .map(|i| 4 * i.len() as u64)
                .sum::<u64>();
            weight_bytes += l.qk_norm.iter().flatten().map(bytes_of).sum::<u64>();
            weight_bytes += [&l.post_attn_norm, &l.post_ffn_norm]
                .into_iter()
                .flatten()
                .map(bytes_of)
                .sum::<u64>();
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
        })
    }

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

    /// Record one forward step for `seqs` (laid out in order along the token dimension):
    /// writes their K/V into `cache` and returns logits at the positions `at` asks for. Nothing
    /// runs on a GPU until the recorder is submitted.
    pub fn forward(
        &self,
        rec: &mut Recorder,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        at: LogitsAt<'_>,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut last = Vec::with_capacity(seqs.len());
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
        let sb: Vec<SeqBatch<'_>> = seqs
            .iter()
            .map(|s| SeqBatch {
                block_table: s.block_table,
                query_len: s.tokens.len(),
                context_len: s.context_len,
            })
            .collect();
        let batch = cache.batch(&sb)?;
        // Uploaded once per table, used by Q and K of every layer that rotates with it.
        let positions: Vec<RopePositions> = self
            .ropes
            .iter()
            .map(|r| r.positions(&positions))
            .collect::<std::result::Result<_, _>>()?;
        let t = ids.len();
        let (d, heads, kvh) = (cfg.head_dim, cfg.heads, cfg.kv_heads);
        let mut x = rec.embedding(&self.embed, &ids)?;
        if let Some(s) = cfg.embed_scale {
            x = rec.scale(&x, s)?;
        }
        for (li, l) in self.layers.iter().enumerate() {
            let h = rec.rms_norm(&x, &l.attn_norm, cfg.rms_eps)?;
            let bias = l.bias.as_ref().map(|[q, k, v]| [q, k, v]);
            let [mut q, mut k, v] = match &l.qkv_in {
                Inputs::Shared(order) => {
                    let h = gathered(rec, &h, order.as_ref())?;
                    rec.matmul_qkv(&h, [&l.q, &l.k, &l.v], bias)?
                }
                each => {
                    let b = |i: usize| bias.map(|b| b[i]);
                    [
                        project(rec, &h, each.get(0), &l.q, b(0))?,
                        project(rec, &h, each.get(1), &l.k, b(1))?,
                        project(rec, &h, each.get(2), &l.v, b(2))?,
                    ]
                }
            };
            if let Some([qn, kn]) = &l.qk_norm {
                q = rec.rms_norm(&q.reshape(&[t * heads, d])?, qn, cfg.rms_eps)?;
                k = rec.rms_norm(&k.reshape(&[t * kvh, d])?, kn, cfg.rms_eps)?;
            }
            let q = q.reshape(&[t, heads, d])?;
            let k = k.reshape(&[t, kvh, d])?;
            let v = v.reshape(&[t, kvh, d])?;
            let pos = positions.get(l.rope).ok_or_else(|| {
                ModelError::Batch(format!("layer {li}: no RoPE table {}", l.rope))
            })?;
            let q = rec.rope(&q, pos)?;
            let k = rec.rope(&k, pos)?;
            cache.write(rec, li, &k, &v, &batch)?;
            let a = cache
                .attention(rec, li, &q, &batch, &l.attn)?
                .reshape(&[t, heads * d])?;
            let a = gathered(rec, &a, l.o_in.get(0))?;
            x = match &l.post_attn_norm {
                None => rec.matmul_add(&a, &l.o, &x)?,
                Some(n) => {
                    let o = rec.matmul(&a, &l.o, None)?;
                    let o = rec.rms_norm(&o, n, cfg.rms_eps)?;
                    rec.add(&x, &o)?
                }
            };
            let h = rec.rms_norm(&x, &l.ffn_norm, cfg.rms_eps)?;
            let m = match (&l.gate_up_in, cfg.activation) {
                (Inputs::Shared(order), act) => {
                    let h = gathered(rec, &h, order.as_ref())?;
                    match act {
                        Activation::Silu => rec.matmul_swiglu(&h, &l.gate, &l.up)?,
                        Activation::GeluTanh => rec.matmul_geglu(&h, &l.gate, &l.up)?,
                    }
                }
                (each, act) => {
                    let g = project(rec, &h, each.get(0), &l.gate, None)?;
                    let u = project(rec, &h, each.get(1), &l.up, None)?;
                    match act {
                        Activation::Silu => rec.silu_mul(&g, &u)?,
                        Activation::GeluTanh => rec.gelu_tanh_mul(&g, &u)?,
                    }
                }
            };
            let m = gathered(rec, &m, l.down_in.get(0))?;
            x = match &l.post_ffn_norm {
                None => rec.matmul_add(&m, &l.down, &x)?,
                Some(n) => {
                    let m = rec.matmul(&m, &l.down, None)?;
                    let m = rec.rms_norm(&m, n, cfg.rms_eps)?;
                    rec.add(&x, &m)?
                }
            };
        }
        let x = rec.rms_norm(&x, &self.norm, cfg.rms_eps)?;
        // The LM head only for the rows that need logits.
        let x = match at {
            LogitsAt::All => x,
            LogitsAt::Last | LogitsAt::Tail(_) => rec.embedding(&x, &last)?,
        };
        let logits = rec.matmul(&x, self.lm_head.as_ref().unwrap_or(&self.embed), None)?;
        match cfg.final_logit_softcap {
            Some(cap) => Ok(rec.softcap(&logits, cap)?),
            None => Ok(logits),
        }
    }
}
