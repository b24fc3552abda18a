//! A DeepSeek-V4 attention layer (`DeepseekV4Attention`): the low-rank query with its
//! per-head unweighted norm, the one K=V head, the layer's compression (none, HCA, or CSA
//! with its indexer), the attention core over the window and the entries
//! (`kiln_attention::compressed_attention`), RoPE turned back on the output, and the grouped
//! low-rank output projection.

use kiln_attention::{CompressedKv, EntryChoice, compressed_attention};
use kiln_tensor::{Device, MappedRows, Recorder, RopePositions, RopeTable, Routes, RowMap, Tensor};

use super::compress::tensor_bytes;
use super::{Compressor, CompressorState, Indexer, IndexerState};
use crate::{DeepseekV4Config, ModelError, Result};

/// An attention layer's own weights (the checkpoint's `attn.` names).
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// `wq_a` `[q_lora_rank, hidden]` and its norm `q_norm` (F32 `[q_lora_rank]`).
    pub q_a: Tensor,
    pub q_norm: Tensor,
    /// `wq_b` `[heads·head_dim, q_lora_rank]`.
    pub q_b: Tensor,
    /// `wkv` `[head_dim, hidden]` and its norm `kv_norm` (F32 `[head_dim]`).
    pub kv: Tensor,
    pub kv_norm: Tensor,
    /// `wo_a` `[groups·o_lora_rank, heads·head_dim / groups]`: group g's block is rows
    /// `g·o_lora_rank ..`.
    pub o_a: Tensor,
    /// `wo_b` `[hidden, groups·o_lora_rank]`.
    pub o_b: Tensor,
    /// `attn_sink`, F32 `[heads]`.
    pub sinks: Tensor,
}

/// What a layer compresses its KV into besides the window.
#[derive(Debug, Clone)]
pub enum Compression {
    /// The window only (`sliding_attention`).
    None,
    /// Every visible entry (`heavily_compressed_attention`).
    Hca(Box<Compressor>),
    /// The indexer's picks of the entries (`compressed_sparse_attention`).
    Csa(Box<Csa>),
}

/// A CSA layer's compressor and indexer.
#[derive(Debug, Clone)]
pub struct Csa {
    pub compressor: Compressor,
    pub indexer: Indexer,
}

/// The rotary embeddings a V4 model's layers use: the sliding layers' (`main`) and the
/// compressed layers' at the head's width and at the indexer's.
#[derive(Debug, Clone)]
pub struct V4Ropes {
    pub main: RopeTable,
    pub compress: RopeTable,
    pub index: RopeTable,
}

impl V4Ropes {
    /// One step's token positions on every table, validated and uploaded once for all
    /// layers.
    pub fn positions(&self, positions: &[u32]) -> Result<StepPositions> {
        Ok(StepPositions {
            main: self.main.positions(positions)?,
            compress: self.compress.positions(positions)?,
            index: self.index.positions(positions)?,
        })
    }

    /// The tables for positions below `max_positions`.
    pub fn new(device: &Device, config: &DeepseekV4Config, max_positions: usize) -> Result<Self> {
        let table = |cfg| RopeTable::new(device, cfg, max_positions);
        Ok(Self {
            main: table(config.main_rope(config.head_dim))?,
            compress: table(config.compressed_rope(config.head_dim))?,
            index: table(config.compressed_rope(config.indexer.head_dim))?,
        })
    }
}

/// One step's token positions on each of [`V4Ropes`]' tables.
#[derive(Debug, Clone)]
pub struct StepPositions {
    pub main: RopePositions,
    pub compress: RopePositions,
    pub index: RopePositions,
}

/// The sizes of an attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub window: u32,
    pub eps: f32,
}

#[derive(Debug, Clone)]
pub struct Attention {
    w: AttentionWeights,
    compression: Compression,
    shape: AttentionShape,
    /// Ones `[head_dim]`: the query's per-head norm is unweighted.
    ones: Tensor,
}

/// What one sequence's attention layer carries between steps.
#[derive(Debug, Clone, Default)]
pub struct AttentionState {
    /// The raw K=V rows of the last `window - 1` tokens, from position `first`.
    raw: Option<Tensor>,
    first: u32,
    compressor: CompressorState,
    indexer: IndexerState,
    /// Every compressed entry so far.
    entries: Option<Tensor>,
}

impl AttentionState {
    /// Bytes held, cache by cache: the window's raw rows, the compressed entries, the
    /// indexer's keys, and the compressors' carried rows.
    pub fn bytes(&self) -> StateBytes {
        StateBytes {
            window: self.raw.as_ref().map_or(0, tensor_bytes),
            entries: self.entries.as_ref().map_or(0, tensor_bytes),
            index_keys: self.indexer.bytes() - self.indexer_pending(),
            pending: self.compressor.bytes() + self.indexer_pending(),
        }
    }

    fn indexer_pending(&self) -> u64 {
        self.indexer.pending_bytes()
    }
}

/// The bytes one sequence's attention state holds, by cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateBytes {
    pub window: u64,
    pub entries: u64,
    pub index_keys: u64,
    /// The compressors' rows of windows not yet full (and the last full one, CSA's).
    pub pending: u64,
}

impl std::ops::AddAssign for StateBytes {
    fn add_assign(&mut self, o: Self) {
        self.window += o.window;
        self.entries += o.entries;
        self.index_keys += o.index_keys;
        self.pending += o.pending;
    }
}

impl StateBytes {
    pub fn total(&self) -> u64 {
        self.window + self.entries + self.index_keys + self.pending
    }
}

impl Attention {
    pub fn new(
        file: &str,
        prefix: &str,
        w: AttentionWeights,
        compression: Compression,
        shape: AttentionShape,
    ) -> Result<Self> {
        let AttentionShape {
            heads,
            head_dim,
            groups,
            ..
        } = shape;
        let bad = |name: &str, t: &Tensor, want: String| ModelError::Tensor {
            file: file.into(),
            tensor: format!("{prefix}{name}"),
            problem: format!("shape {:?}, expected {want}", t.shape()),
        };
        if w.q_norm.elem_count() != w.q_a.rows() {
            let want = format!("[{}] (wq_a's rows)", w.q_a.rows());
            return Err(bad("q_norm.weight", &w.q_norm, want));
        }
        if w.q_b.rows() != heads * head_dim || w.q_b.cols() != w.q_a.rows() {
            let want = format!("[{} heads·head_dim, {}]", heads * head_dim, w.q_a.rows());
            return Err(bad("wq_b.weight", &w.q_b, want));
        }
        if w.kv.rows() != head_dim || w.kv_norm.elem_count() != head_dim {
            return Err(bad("wkv.weight", &w.kv, format!("[{head_dim}, hidden]")));
        }
        if groups == 0
            || !heads.is_multiple_of(groups)
            || w.o_a.cols() * groups != heads * head_dim
            || !w.o_a.rows().is_multiple_of(groups)
        {
            let want = format!("[groups·o_lora_rank, {}]", heads * head_dim / groups.max(1));
            return Err(bad("wo_a.weight", &w.o_a, want));
        }
        if w.o_b.cols() != w.o_a.rows() {
            return Err(bad(
                "wo_b.weight",
                &w.o_b,
                format!("[hidden, {}]", w.o_a.rows()),
            ));
        }
        if w.sinks.elem_count() != heads {
            return Err(bad("attn_sink", &w.sinks, format!("[{heads}]")));
        }
        let ones = Tensor::from_f32(&w.kv.device(), &[head_dim], &vec![1.0; head_dim])?;
        Ok(Self {
            w,
            compression,
            shape,
            ones,
        })
    }

    /// The layer's output `[tokens, hidden]` for its normed input `x` `[tokens, hidden]` at
    /// the consecutive positions `at` of one sequence; `state` moves on past them.
    pub fn forward(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        step: &StepPositions,
        state: &mut AttentionState,
        ropes: &V4Ropes,
    ) -> Result<Tensor> {
        let AttentionShape {
            heads,
            head_dim: d,
            groups,
            window,
            eps,
        } = self.shape;
        let tokens = x.rows();
        let positions = step.compress.positions();
        // This layer's rotary table: sliding layers turn by `main`, compressed ones by
        // `compress`.
        let at = match self.compression {
            Compression::None => &step.main,
            _ => &step.compress,
        };
        let qr = rec.matmul(x, &self.w.q_a, None)?;
        let qr = rec.rms_norm(&qr, &self.w.q_norm, eps)?;
        let q = rec.matmul(&qr, &self.w.q_b, None)?;
        let q = rec.rms_norm(&q.reshape(&[tokens * heads, d])?, &self.ones, eps)?;
        let q = rec.rope(&q.reshape(&[tokens, heads, d])?, at)?;
        let kv = rec.matmul(x, &self.w.kv, None)?;
        let kv = rec.rms_norm(&kv, &self.w.kv_norm, eps)?;
        let kv = rec
            .rope(&kv.reshape(&[tokens, 1, d])?, at)?
            .reshape(&[tokens, d])?;
        let raw = match &state.raw {
            Some(old) => rec.concat_rows(old, &kv)?,
            None => {
                state.first = positions.first().copied().unwrap_or(0);
                kv
            }
        };
        let (entries, picks) = self.compress(rec, x, &qr, &step.index, state, ropes)?;
        let choice = match (&self.compression, &picks) {
            (Compression::Csa(_), Some(p)) => EntryChoice::Picked(p),
            (Compression::Hca(c), _) => EntryChoice::Visible {
                ratio: c.ratio() as u32,
            },
            // Sliding layers have no entries; the choice is never read.
            _ => EntryChoice::Visible { ratio: 1 },
        };
        let kvs = CompressedKv {
            raw: &raw,
            raw_map: RowMap::Consecutive,
            first: state.first,
            window,
            entries: entries.as_ref().map(MappedRows::consecutive),
            choice,
        };
        let scale = 1.0 / (d as f32).sqrt();
        let out = compressed_attention(rec, &q, positions, kvs, &self.w.sinks, scale)?;
        let out = rec.unrope(&out, at)?;
        self.keep_window(rec, raw, state)?;
        self.project(rec, &out, tokens, groups)
    }

    /// The new compressed entries into `state`, and (CSA) the indexer's picks.
    fn compress(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        qr: &Tensor,
        at: &RopePositions,
        state: &mut AttentionState,
        ropes: &V4Ropes,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (compressor, picks) = match &self.compression {
            Compression::None => return Ok((None, None)),
            Compression::Hca(c) => (&**c, None),
            Compression::Csa(csa) => {
                let Csa {
                    compressor,
                    indexer,
                } = &**csa;
                let p = indexer.step(rec, x, qr, at, &mut state.indexer, &ropes.index)?;
                (compressor, Some(p))
            }
        };
        if let Some(new) = compressor.step(rec, x, &mut state.compressor, &ropes.compress)? {
            state.entries = Some(match &state.entries {
                Some(old) => rec.concat_rows(old, &new)?,
                None => new,
            });
        }
        Ok((state.entries.clone(), picks))
    }

    /// Keep the raw rows the next tokens' window reaches: the last `window - 1`.
    fn keep_window(
        &self,
        rec: &mut Recorder,
        raw: Tensor,
        state: &mut AttentionState,
    ) -> Result<()> {
        let keep = (self.shape.window as usize)
            .saturating_sub(1)
            .min(raw.rows());
        let from = raw.rows() - keep;
        state.first += from as u32;
        state.raw = if keep == 0 {
            None
        } else if from == 0 {
            Some(raw)
        } else {
            let ids: Vec<u32> = (from as u32..raw.rows() as u32).collect();
            Some(rec.embedding(&raw, &ids)?)
        };
        Ok(())
    }

    /// The grouped low-rank output projection: each group of heads through its own block
    /// of `wo_a` (a fixed routing of each token's group rows to that block), then `wo_b`.
    fn project(
        &self,
        rec: &mut Recorder,
        out: &Tensor,
        tokens: usize,
        groups: usize,
    ) -> Result<Tensor> {
        let rank = self.w.o_a.rows() / groups;
        let rows = out.reshape(&[tokens * groups, self.w.o_a.cols()])?;
        let ids: Vec<u32> = (0..tokens * groups).map(|i| (i % groups) as u32).collect();
        let device = out.device();
        let ones = Tensor::from_f32(&device, &[tokens * groups, 1], &vec![1.0; tokens * groups])?;
        let routes = Routes::fixed(&device, &ids, 1, groups, ones)?;
        let blocks = self.w.o_a.reshape(&[groups, rank, self.w.o_a.cols()])?;
        let low = rec.linear_routed(&rows, &blocks, None, &routes, None)?;
        Ok(rec.matmul(&low.reshape(&[tokens, groups * rank])?, &self.w.o_b, None)?)
    }
}
