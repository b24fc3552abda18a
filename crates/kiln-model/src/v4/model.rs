//! A whole DeepSeek-V4 model from a Hugging Face folder (`DeepseekV4ForCausalLM`): the
//! token embedding copied into every hyper-connection stream, each layer's attention and MoE
//! between their hyper-connections, the head's collapse of the streams, the final norm and
//! the LM head. One sequence at a time, its per-layer state in a [`V4Sequence`].
//!
//! Checkpoint names: DeepSeek's as published (`embed.weight`, `layers.{i}.attn.kv_norm.weight`,
//! `hc_head_fn`, ...) or as transformers saves them (`model.` before them,
//! `model.embed_tokens.weight`, `model.layers.{i}.attn.norm.weight`, `model.hc_head.hc_fn`).

use std::path::Path;

use kiln_tensor::{Device, Recorder, Tensor};

use super::{
    Attention, AttentionShape, AttentionState, AttentionWeights, Compression, Compressor,
    CompressorWeights, Csa, ExpertChoice, HyperConnection, HyperHead, Indexer, IndexerWeights, Moe,
    MoeShape, MoeWeights, StateBytes, V4Ropes,
};
use crate::safetensors::{FLOATS, StDtype, decode_ids};
use crate::weights::stack;
use crate::{DeepseekV4Config, HfSource, LoadOptions, ModelError, Result, V4Attention};

/// One decoder layer.
#[derive(Debug, Clone)]
struct Layer {
    attn_hc: HyperConnection,
    attn_norm: Tensor,
    attn: Attention,
    ffn_hc: HyperConnection,
    ffn_norm: Tensor,
    moe: Moe,
}

/// A DeepSeek-V4 model on a device.
#[derive(Debug, Clone)]
pub struct V4Model {
    config: DeepseekV4Config,
    embed: Tensor,
    layers: Vec<Layer>,
    head_hc: HyperHead,
    norm: Tensor,
    head: Tensor,
    ropes: V4Ropes,
    max_positions: usize,
}

/// One sequence's state: every layer's attention state and the next position.
#[derive(Debug, Clone, Default)]
pub struct V4Sequence {
    layers: Vec<AttentionState>,
    next: u32,
}

impl V4Sequence {
    /// Tokens run so far.
    pub fn len(&self) -> usize {
        self.next as usize
    }

    pub fn is_empty(&self) -> bool {
        self.next == 0
    }

    /// Bytes its state holds, by cache, over every layer.
    pub fn bytes(&self) -> StateBytes {
        let mut b = StateBytes::default();
        for l in &self.layers {
            b += l.bytes();
        }
        b
    }
}

/// Reads tensors by their DeepSeek names, whichever way the folder spells them.
struct Names<'a> {
    src: &'a HfSource,
    device: &'a Device,
}

impl Names<'_> {
    /// The folder's name for DeepSeek's `name`.
    fn resolve(&self, name: &str) -> String {
        let saved = match name {
            "embed.weight" => "model.embed_tokens.weight".to_string(),
            "head.weight" => "head.weight".to_string(),
            n if n.starts_with("hc_head_") => format!("model.hc_head.hc_{}", &n[8..]),
            n => format!("model.{}", n.replace(".attn.kv_norm.", ".attn.norm.")),
        };
        if self.src.index.contains_key(name) || !self.src.index.contains_key(&saved) {
            name.to_string()
        } else {
            saved
        }
    }

    /// A float tensor of `shape`, as stored (or as the load options cast it).
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let n = self.resolve(name);
        let (dtype, bytes, file) = self.src.checked_bytes(&n, shape, FLOATS)?;
        self.src
            .upload(self.device, dtype, shape, &bytes, (file, &n))
    }

    /// A float tensor of `shape` in F32 whatever it is stored as (norms, biases, mHC's and
    /// the compressors' small tensors, which transformers keeps in f32).
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let n = self.resolve(name);
        let (dtype, bytes, file) = self.src.checked_bytes(&n, shape, FLOATS)?;
        let t = self
            .src
            .upload(&Device::Reference, dtype, shape, &bytes, (file, &n))?;
        Ok(Tensor::from_f32(self.device, shape, &t.to_f32_vec()?)?)
    }

    /// Several tensors' rows stacked into one of `shape` (each expert's `[w1; w3]`, every
    /// expert's projection), in the dtype they are stored in (as the load options cast it).
    fn stacked(&self, names: &[String], each: &[usize], shape: &[usize]) -> Result<Tensor> {
        let parts = names.iter().map(|name| {
            let n = self.resolve(name);
            let (dtype, bytes, file) = self.src.checked_bytes(&n, each, FLOATS)?;
            let t = self
                .src
                .upload(&Device::Reference, dtype, each, &bytes, (file, &n))?;
            Ok((n, t))
        });
        let what = names.first().map_or("", String::as_str);
        stack(self.device, &self.src.describe, what, parts, shape)
    }

    /// An index table of `shape` (I64 or I32).
    fn ids(&self, name: &str, shape: &[usize]) -> Result<Vec<u32>> {
        let n = self.resolve(name);
        let (dtype, bytes, file) =
            self.src
                .checked_bytes(&n, shape, &[StDtype::I64, StDtype::I32])?;
        decode_ids((file, &n), dtype, &bytes)
    }
}

impl V4Model {
    /// The model in `dir` (`config.json` and its safetensors) on `device`, with RoPE tables
    /// for positions below `max_positions`.
    pub fn load(dir: &Path, device: &Device, max_positions: usize) -> Result<Self> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config = DeepseekV4Config::from_hf_json(&config_path.display().to_string(), &text)?;
        let src = HfSource::open(dir, LoadOptions::default())?;
        let names = Names { src: &src, device };
        let c = &config;
        let embed = names.tensor("embed.weight", &[c.vocab, c.hidden])?;
        let layers = (0..c.layers)
            .map(|i| load_layer(&names, c, i))
            .collect::<Result<Vec<_>>>()?;
        let (h, n) = (c.hidden, c.hc.streams);
        let file = src.describe.clone();
        let head_hc = HyperHead::new(
            &file,
            ["hc_head_fn", "hc_head_base", "hc_head_scale"],
            [
                names.f32("hc_head_fn", &[n, n * h])?,
                names.f32("hc_head_base", &[n])?,
                names.f32("hc_head_scale", &[1])?,
            ],
            c.hc,
            c.rms_eps,
        )?;
        Ok(Self {
            embed,
            norm: names.f32("norm.weight", &[h])?,
            head: names.tensor("head.weight", &[c.vocab, h])?,
            head_hc,
            layers,
            ropes: V4Ropes::new(device, c, max_positions)?,
            max_positions,
            config,
        })
    }

    pub fn config(&self) -> &DeepseekV4Config {
        &self.config
    }

    /// Layer `layer`'s attention.
    pub fn attention(&self, layer: usize) -> Option<&Attention> {
        self.layers.get(layer).map(|l| &l.attn)
    }

    /// Layer `layer`'s mixture of experts.
    pub fn moe(&self, layer: usize) -> Option<&Moe> {
        self.layers.get(layer).map(|l| &l.moe)
    }

    /// The rotary tables the layers use.
    pub fn ropes(&self) -> &V4Ropes {
        &self.ropes
    }

    /// Runs the next tokens `ids` of `seq` and returns their logits, F32 `[tokens, vocab]`
    /// (read back after the recorder's submit).
    pub fn forward(&self, rec: &mut Recorder, ids: &[u32], seq: &mut V4Sequence) -> Result<Tensor> {
        let c = &self.config;
        let end = seq.next as usize + ids.len();
        if ids.is_empty() || end > self.max_positions {
            return Err(ModelError::Format {
                file: "DeepSeek-V4 forward".into(),
                problem: format!(
                    "{} tokens after {} run: past the {} positions the model was loaded for",
                    ids.len(),
                    seq.next,
                    self.max_positions
                ),
            });
        }
        seq.layers.resize_with(c.layers, AttentionState::default);
        let positions: Vec<u32> = (seq.next..end as u32).collect();
        let n = c.hc.streams;
        // Every stream starts as the token's embedding.
        let each: Vec<u32> = ids
            .iter()
            .flat_map(|&id| std::iter::repeat_n(id, n))
            .collect();
        let mut streams = rec
            .embedding(&self.embed, &each)?
            .reshape(&[ids.len(), n, c.hidden])?;
        for (layer, state) in self.layers.iter().zip(&mut seq.layers) {
            let (x, w) = layer.attn_hc.collapse(rec, &streams)?;
            let x = rec.rms_norm(&x, &layer.attn_norm, c.rms_eps)?;
            let y = layer
                .attn
                .forward(rec, &x, &positions, state, &self.ropes)?;
            streams = layer.attn_hc.expand(rec, &streams, &y, &w)?;
            let (x, w) = layer.ffn_hc.collapse(rec, &streams)?;
            let x = rec.rms_norm(&x, &layer.ffn_norm, c.rms_eps)?;
            let y = layer.moe.forward(rec, &x, ids)?;
            streams = layer.ffn_hc.expand(rec, &streams, &y, &w)?;
        }
        let x = self.head_hc.collapse(rec, &streams)?;
        let x = rec.rms_norm(&x, &self.norm, c.rms_eps)?;
        seq.next = end as u32;
        Ok(rec.matmul(&x, &self.head, None)?)
    }

    /// `prompt` and then `new` tokens, each the argmax of the logits before it.
    pub fn generate_greedy(&self, device: &Device, prompt: &[u32], new: usize) -> Result<Vec<u32>> {
        let mut seq = V4Sequence::default();
        let mut out = Vec::with_capacity(new);
        let mut next: Vec<u32> = prompt.to_vec();
        for _ in 0..new {
            let mut rec = Recorder::new(device);
            let logits = self.forward(&mut rec, &next, &mut seq)?;
            let last = logits.rows() - 1;
            let best = rec.argmax(&logits)?;
            rec.submit()?;
            let id = best.to_u32_vec()?[last];
            out.push(id);
            next = vec![id];
        }
        Ok(out)
    }
}

fn load_layer(names: &Names<'_>, c: &DeepseekV4Config, i: usize) -> Result<Layer> {
    let p = format!("layers.{i}.");
    let file = names.src.describe.clone();
    let (h, n) = (c.hidden, c.hc.streams);
    let mix = (2 + n) * n;
    let hc = |which: &str| -> Result<HyperConnection> {
        let [f, b, s] = [
            format!("{p}hc_{which}_fn"),
            format!("{p}hc_{which}_base"),
            format!("{p}hc_{which}_scale"),
        ];
        HyperConnection::new(
            &file,
            [&f, &b, &s],
            [
                names.f32(&f, &[mix, n * h])?,
                names.f32(&b, &[mix])?,
                names.f32(&s, &[3])?,
            ],
            c.hc,
            c.rms_eps,
        )
    };
    Ok(Layer {
        attn_hc: hc("attn")?,
        attn_norm: names.f32(&format!("{p}attn_norm.weight"), &[h])?,
        attn: load_attention(names, c, i)?,
        ffn_hc: hc("ffn")?,
        ffn_norm: names.f32(&format!("{p}ffn_norm.weight"), &[h])?,
        moe: load_moe(names, c, i)?,
    })
}

fn load_compressor(
    names: &Names<'_>,
    c: &DeepseekV4Config,
    p: &str,
    width: usize,
    ratio: usize,
    overlapping: bool,
) -> Result<Compressor> {
    let rows = if overlapping { 2 * width } else { width };
    let w = CompressorWeights {
        kv: names.f32(&format!("{p}wkv.weight"), &[rows, c.hidden])?,
        gate: names.f32(&format!("{p}wgate.weight"), &[rows, c.hidden])?,
        ape: names.f32(&format!("{p}ape"), &[ratio, rows])?,
        norm: names.f32(&format!("{p}norm.weight"), &[width])?,
    };
    Compressor::new(&names.src.describe, p, w, ratio, overlapping, c.rms_eps)
}

fn load_attention(names: &Names<'_>, c: &DeepseekV4Config, i: usize) -> Result<Attention> {
    let p = format!("layers.{i}.attn.");
    let (h, d, heads, q) = (c.hidden, c.head_dim, c.heads, c.q_lora_rank);
    let (g, r) = (c.o_groups, c.o_lora_rank);
    let t = |n: &str, shape: &[usize]| names.tensor(&format!("{p}{n}"), shape);
    let f = |n: &str, shape: &[usize]| names.f32(&format!("{p}{n}"), shape);
    let w = AttentionWeights {
        q_a: t("wq_a.weight", &[q, h])?,
        q_norm: f("q_norm.weight", &[q])?,
        q_b: t("wq_b.weight", &[heads * d, q])?,
        kv: t("wkv.weight", &[d, h])?,
        kv_norm: f("kv_norm.weight", &[d])?,
        o_a: t("wo_a.weight", &[g * r, heads * d / g.max(1)])?,
        o_b: t("wo_b.weight", &[h, g * r])?,
        sinks: f("attn_sink", &[heads])?,
    };
    let compression = match c.attention[i] {
        V4Attention::Sliding => Compression::None,
        V4Attention::Hca { ratio } => Compression::Hca(Box::new(load_compressor(
            names,
            c,
            &format!("{p}compressor."),
            d,
            ratio as usize,
            false,
        )?)),
        V4Attention::Csa { ratio } => {
            let ratio = ratio as usize;
            let ix = &c.indexer;
            let ip = format!("{p}indexer.");
            let indexer = Indexer::new(
                &names.src.describe,
                &ip,
                load_compressor(
                    names,
                    c,
                    &format!("{ip}compressor."),
                    ix.head_dim,
                    ratio,
                    true,
                )?,
                IndexerWeights {
                    q: t("indexer.wq_b.weight", &[ix.heads * ix.head_dim, q])?,
                    head_weights: f("indexer.weights_proj.weight", &[ix.heads, h])?,
                },
                ix.heads,
                ix.topk,
            )?;
            Compression::Csa(Box::new(Csa {
                compressor: load_compressor(names, c, &format!("{p}compressor."), d, ratio, true)?,
                indexer,
            }))
        }
    };
    let shape = AttentionShape {
        heads,
        head_dim: d,
        groups: g,
        window: c.window as u32,
        eps: c.rms_eps,
    };
    Attention::new(&names.src.describe, &p, w, compression, shape)
}

fn load_moe(names: &Names<'_>, c: &DeepseekV4Config, i: usize) -> Result<Moe> {
    let p = format!("layers.{i}.ffn.");
    let (e, h, f) = (c.moe.experts, c.hidden, c.moe.expert_ffn);
    let expert = |x: usize, w: &str| format!("{p}experts.{x}.{w}.weight");
    let gate_up: Vec<String> = (0..e)
        .flat_map(|x| [expert(x, "w1"), expert(x, "w3")])
        .collect();
    let down: Vec<String> = (0..e).map(|x| expert(x, "w2")).collect();
    let shared = |w: &str| format!("{p}shared_experts.{w}.weight");
    let choice = if i < c.moe.hash_layers {
        ExpertChoice::Hashed {
            table: names.ids(&format!("{p}gate.tid2eid"), &[c.vocab, c.moe.used])?,
        }
    } else {
        ExpertChoice::Scored {
            bias: names.f32(&format!("{p}gate.bias"), &[e])?,
        }
    };
    let w = MoeWeights {
        router: names.f32(&format!("{p}gate.weight"), &[e, h])?,
        choice,
        gate_up: names.stacked(&gate_up, &[f, h], &[e, 2 * f, h])?,
        down: names.stacked(&down, &[h, f], &[e, h, f])?,
        shared_gate_up: names.stacked(&[shared("w1"), shared("w3")], &[f, h], &[2 * f, h])?,
        shared_down: names.tensor(&shared("w2"), &[h, f])?,
    };
    let shape = MoeShape {
        experts: e,
        used: c.moe.used,
        scale: c.moe.routed_scale,
        limit: c.moe.swiglu_limit,
    };
    Moe::new(&names.src.describe, &p, w, shape)
}
