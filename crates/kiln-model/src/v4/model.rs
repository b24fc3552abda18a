//! A whole DeepSeek-V4 model from a Hugging Face folder (`DeepseekV4ForCausalLM`): the
//! token embedding copied into every hyper-connection stream, each layer's attention and MoE
//! between their hyper-connections, the head's collapse of the streams, the final norm and
//! the LM head. One sequence at a time, its per-layer state in a [`V4Sequence`].
//!
//! Loading (`load.rs`) reads Hugging Face folders and llama.cpp's GGUF files.

use std::path::Path;

use kiln_tensor::{Device, Recorder, Tensor};

use super::load::{Files, Names, load_layer};
use super::{Attention, AttentionState, HyperConnection, HyperHead, Moe, StateBytes, V4Ropes};
use crate::{DeepseekV4Config, ModelError, Result};

/// One decoder layer.
#[derive(Debug, Clone)]
pub(super) struct Layer {
    pub(super) attn_hc: HyperConnection,
    pub(super) attn_norm: Tensor,
    pub(super) attn: Attention,
    pub(super) ffn_hc: HyperConnection,
    pub(super) ffn_norm: Tensor,
    pub(super) moe: Moe,
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

impl V4Model {
    /// The model at `path` on `device`, with RoPE tables for positions below
    /// `max_positions`: a Hugging Face folder (`config.json` and its safetensors) or a GGUF
    /// file as llama.cpp's converter writes DeepSeek-V4 (`deepseek4`).
    pub fn load(path: &Path, device: &Device, max_positions: usize) -> Result<Self> {
        let src = Files::open(path)?;
        let config = src.config()?;
        let names = Names { src: &src, device };
        let c = &config;
        let embed = names.tensor("embed.weight", &[c.vocab, c.hidden])?;
        let layers = (0..c.layers)
            .map(|i| load_layer(&names, c, i))
            .collect::<Result<Vec<_>>>()?;
        let (h, n) = (c.hidden, c.hc.streams);
        let head_hc = HyperHead::new(
            src.describe(),
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
            norm: names.f32("norm.weight", &[h])?,
            // A tied head reads the embedding's own storage.
            head: match c.tie_embeddings {
                true => embed.clone(),
                false => names.tensor("head.weight", &[c.vocab, h])?,
            },
            embed,
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
    /// (read back after the recorder's submit). On an error `seq` is as it was.
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
        // Every layer's state moves on as the layer runs: work on a copy (tensors are shared,
        // not copied) and keep it only once every layer has run.
        let mut states = seq.layers.clone();
        states.resize_with(c.layers, AttentionState::default);
        let positions: Vec<u32> = (seq.next..end as u32).collect();
        let at = self.ropes.positions(&positions)?;
        let n = c.hc.streams;
        // Every stream starts as the token's embedding.
        let each: Vec<u32> = ids
            .iter()
            .flat_map(|&id| std::iter::repeat_n(id, n))
            .collect();
        let mut streams = rec
            .embedding(&self.embed, &each)?
            .reshape(&[ids.len(), n, c.hidden])?;
        for (layer, state) in self.layers.iter().zip(&mut states) {
            let (x, w) = layer.attn_hc.collapse(rec, &streams)?;
            let x = rec.rms_norm(&x, &layer.attn_norm, c.rms_eps)?;
            let y = layer.attn.forward(rec, &x, &at, state, &self.ropes)?;
            streams = layer.attn_hc.expand(rec, &streams, &y, &w)?;
            let (x, w) = layer.ffn_hc.collapse(rec, &streams)?;
            let x = rec.rms_norm(&x, &layer.ffn_norm, c.rms_eps)?;
            let y = layer.moe.forward(rec, &x, ids)?;
            streams = layer.ffn_hc.expand(rec, &streams, &y, &w)?;
        }
        let x = self.head_hc.collapse(rec, &streams)?;
        let x = rec.rms_norm(&x, &self.norm, c.rms_eps)?;
        let logits = rec.matmul(&x, &self.head, None)?;
        seq.layers = states;
        seq.next = end as u32;
        Ok(logits)
    }

    /// The `new` tokens after `prompt`, each the argmax of the logits before it.
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
            let id = best
                .to_u32_vec()?
                .get(last)
                .copied()
                .ok_or_else(|| ModelError::Format {
                    file: "DeepSeek-V4 greedy step".into(),
                    problem: format!("no argmax for logits row {last}"),
                })?;
            out.push(id);
            next = vec![id];
        }
        Ok(out)
    }
}
