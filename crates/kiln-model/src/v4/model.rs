//! A whole DeepSeek-V4 model from a Hugging Face folder (`DeepseekV4ForCausalLM`): the
//! token embedding copied into every hyper-connection stream, each layer's attention and MoE
//! between their hyper-connections, the head's collapse of the streams, the final norm and
//! the LM head. A batch of sequences a step ([`V4Model::step`]), their state in a paged
//! [`V4Cache`] where `kiln-kv`'s block tables point; or one sequence with its own
//! ([`V4Sequence`]).
//!
//! Loading (`load.rs`) reads Hugging Face folders and llama.cpp's GGUF files.

use std::path::Path;

use kiln_kv::{BlockId, BlockManager, BlockManagerConfig, KeptPool, SeqConfig, SeqId};
use kiln_tensor::{Device, Recorder, Tensor};

use super::cache::{self, PagedSeq, StateBytes, V4Cache, V4CacheConfig};
use super::load::{Files, Names, load_layer};
use super::{Attention, HyperConnection, HyperHead, Moe, V4Ropes};
use crate::model::LogitsAt;
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
    /// Bytes of weights on the device, as stored.
    weight_bytes: u64,
    /// What it was loaded on (a tensor names only its storage: host memory or a GPU).
    device: Device,
}

/// One sequence's part of a [`V4Model::step`].
#[derive(Debug, Clone, Copy)]
pub struct V4Input<'a> {
    /// The tokens computed this step.
    pub tokens: &'a [u32],
    /// Tokens computed before them.
    pub start: usize,
    /// Its main-pool blocks in logical order ([`BlockId::TRIMMED`] where it gave one back),
    /// covering the step's positions and the window before them.
    pub main: &'a [BlockId],
    /// Its kept-pool blocks in logical order, covering the step's positions.
    pub kept: &'a [BlockId],
}

/// One sequence on its own: a [`V4Cache`] of its own and the `kiln-kv` block manager that
/// hands out its blocks, as a server's step loop hands out a batch's. Its main pool holds the
/// window and the longest chunk; its kept pool every position up to its capacity.
#[derive(Debug)]
pub struct V4Sequence {
    kv: BlockManager,
    cache: V4Cache,
}

/// The one sequence a [`V4Sequence`]'s block manager holds.
const ONE: SeqId = SeqId(0);

impl V4Sequence {
    /// Room for `capacity` tokens run in chunks of at most `chunk`.
    pub fn new(model: &V4Model, capacity: usize, chunk: usize) -> Result<Self> {
        let c = &model.config;
        let block = cache::block_size(c);
        let window = cache::main_window(c);
        // The window's blocks, a block it may start inside, and the chunk's, which may
        // straddle one more.
        let main = window.div_ceil(block) + chunk.div_ceil(block) + 2;
        let kept = capacity.div_ceil(block);
        let kv = BlockManager::new(BlockManagerConfig {
            block_size: block as u32,
            watermark: 0.0,
            enable_prefix_caching: false,
            kept: Some(KeptPool {
                num_blocks: kept as u32,
                window,
            }),
            ..BlockManagerConfig::new(main as u32)
        })?;
        let cache = V4Cache::new(
            model.device(),
            c,
            V4CacheConfig {
                main_blocks: main,
                kept_blocks: kept,
            },
        )?;
        Ok(Self { kv, cache })
    }

    /// Tokens run so far.
    pub fn len(&self) -> usize {
        // Before its first tokens the manager holds no sequence.
        self.kv.computed_len(ONE).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes its blocks hold, by cache, over every layer.
    pub fn bytes(&self) -> StateBytes {
        let held = |t: &[BlockId]| t.iter().filter(|b| !b.is_trimmed()).count();
        match (self.kv.block_table(ONE), self.kv.kept_table(ONE)) {
            (Ok(main), Ok(kept)) => self.cache.bytes(held(main), held(kept)),
            _ => StateBytes::default(),
        }
    }

    /// Gives back what a failed step took past its first `before` tokens.
    fn undo(&mut self, before: usize) -> Result<()> {
        if before > 0 {
            return Ok(self.kv.truncate(ONE, before)?);
        }
        if self.kv.contains(ONE) {
            self.kv.free(ONE)?;
        }
        Ok(())
    }

    /// Takes the blocks for `ids`, the next tokens, and returns their first position.
    fn reserve(&mut self, ids: &[u32]) -> Result<usize> {
        if !self.kv.contains(ONE) {
            self.kv.allocate(ONE, ids, SeqConfig::default())?;
            self.kv.reserve(ONE, ids.len())?;
            return Ok(0);
        }
        let start = self.kv.computed_len(ONE)?;
        self.kv.append_slots(ONE, ids.len())?;
        Ok(start)
    }
}

impl V4Model {
    /// The model at `path` on `device`, with RoPE tables for positions below
    /// `max_positions`: a Hugging Face folder (`config.json` and its safetensors) or a GGUF
    /// file as llama.cpp's converter writes DeepSeek-V4 (`deepseek4`).
    pub fn load(path: &Path, device: &Device, max_positions: usize) -> Result<Self> {
        let src = Files::open(path)?;
        let config = src.config()?;
        let names = Names {
            src: &src,
            device,
            bytes: Default::default(),
        };
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
            weight_bytes: names.bytes.get(),
            device: device.clone(),
            config,
        })
    }

    pub fn config(&self) -> &DeepseekV4Config {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Positions the model was loaded for (its rotary tables').
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Bytes of weights on the device, as stored (FP8 and FP4 stay packed).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
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
    /// (read back after the recorder's submit). On an error `seq` holds what it held.
    pub fn forward(&self, rec: &mut Recorder, ids: &[u32], seq: &mut V4Sequence) -> Result<Tensor> {
        let before = seq.len();
        let run = seq.reserve(ids).and_then(|start| {
            let input = V4Input {
                tokens: ids,
                start,
                main: seq.kv.block_table(ONE)?,
                kept: seq.kv.kept_table(ONE)?,
            };
            self.step(rec, &mut seq.cache, &[input], LogitsAt::All)
        });
        match run {
            Ok(logits) => {
                seq.kv.commit(ONE, ids)?;
                Ok(logits)
            }
            Err(e) => {
                seq.undo(before)?;
                Err(e)
            }
        }
    }

    /// One forward step for `seqs` (laid out in order along the token dimension): their
    /// state into `cache`, where their block tables point, and their logits at the positions
    /// `at` asks for, F32 `[rows, vocab]`.
    pub fn step(
        &self,
        rec: &mut Recorder,
        cache: &mut V4Cache,
        seqs: &[V4Input<'_>],
        at: LogitsAt<'_>,
    ) -> Result<Tensor> {
        let c = &self.config;
        if cache.layers() != c.layers {
            return Err(ModelError::Batch(format!(
                "a cache of {} layers for a model of {}",
                cache.layers(),
                c.layers
            )));
        }
        let tables: Vec<[Vec<u32>; 2]> = seqs
            .iter()
            .map(|s| [s.main, s.kept].map(|t| t.iter().map(|b| b.0).collect()))
            .collect();
        let (mut ids, mut positions, mut paged, mut last) = (vec![], vec![], vec![], vec![]);
        for (i, (s, [main, kept])) in seqs.iter().zip(&tables).enumerate() {
            let end = s.start + s.tokens.len();
            if s.tokens.is_empty() || end > self.max_positions {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: {} tokens after {}: past the {} positions the model was \
                     loaded for",
                    s.tokens.len(),
                    s.start,
                    self.max_positions
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= c.vocab) {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: token id {bad} is outside the vocabulary of {}",
                    c.vocab
                )));
            }
            let tail = match at {
                LogitsAt::Last => 1,
                LogitsAt::All => s.tokens.len(),
                LogitsAt::Tail(n) => n.get(i).copied().unwrap_or(0),
            };
            if tail == 0 || tail > s.tokens.len() {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: logits for its last {tail} of {} tokens",
                    s.tokens.len()
                )));
            }
            paged.push(PagedSeq {
                row: ids.len(),
                start: s.start,
                len: s.tokens.len(),
                main,
                kept,
                block: cache.block_size(),
            });
            ids.extend_from_slice(s.tokens);
            positions.extend(s.start as u32..end as u32);
            last.extend((ids.len() - tail) as u32..ids.len() as u32);
        }
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
        for (layer, pools) in self.layers.iter().zip(cache.layers_mut()) {
            let (x, w) = layer.attn_hc.collapse(rec, &streams)?;
            let x = rec.rms_norm(&x, &layer.attn_norm, c.rms_eps)?;
            let y = layer
                .attn
                .forward(rec, &x, &at, &paged, pools, &self.ropes)?;
            streams = layer.attn_hc.expand(rec, &streams, &y, &w)?;
            let (x, w) = layer.ffn_hc.collapse(rec, &streams)?;
            let x = rec.rms_norm(&x, &layer.ffn_norm, c.rms_eps)?;
            let y = layer.moe.forward(rec, &x, &ids)?;
            streams = layer.ffn_hc.expand(rec, &streams, &y, &w)?;
        }
        // Only the rows asked for go through the head.
        if last.len() < ids.len() {
            let rows = streams.reshape(&[ids.len(), n * c.hidden])?;
            streams = rec
                .embedding(&rows, &last)?
                .reshape(&[last.len(), n, c.hidden])?;
        }
        let x = self.head_hc.collapse(rec, &streams)?;
        let x = rec.rms_norm(&x, &self.norm, c.rms_eps)?;
        Ok(rec.matmul(&x, &self.head, None)?)
    }

    /// The `new` tokens after `prompt`, each the argmax of the logits before it.
    pub fn generate_greedy(&self, device: &Device, prompt: &[u32], new: usize) -> Result<Vec<u32>> {
        let mut seq = V4Sequence::new(self, prompt.len() + new, prompt.len().max(1))?;
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
