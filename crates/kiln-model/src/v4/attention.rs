//! A DeepSeek-V4 attention layer (`DeepseekV4Attention`): the low-rank query with its
//! per-head unweighted norm, the one K=V head, the layer's compression (none, HCA, or CSA
//! with its indexer), the attention core over the window and the entries
//! (`kiln_attention::compressed_attention`), RoPE turned back on the output, and the grouped
//! low-rank output projection.

use kiln_attention::{CompressedKv, EntryChoice, compressed_attention};
use kiln_tensor::{DType, Device, MappedRows, Recorder, RopePositions, RopeTable, Routes, Tensor};

use super::cache::{CompressorPools, LayerPools, PagedSeq, main_slots, rows_of};
use super::{Compressor, Indexer};
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

    /// The layer's output `[tokens, hidden]` for its normed input `x` `[tokens, hidden]`,
    /// the rows of `seqs` at the positions `step`: their K=V rows and compressors' state
    /// into `pools` (their main and kept slots), then each sequence's attention over its
    /// window and entries, read from `pools`.
    pub fn forward(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        step: &StepPositions,
        seqs: &[PagedSeq<'_>],
        pools: &mut LayerPools,
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
        rec.write_rows(&mut pools.raw, &main_slots(seqs)?, &kv)?;
        let picks = self.compress(rec, x, &qr, &step.index, seqs, pools, ropes)?;
        let scale = 1.0 / (d as f32).sqrt();
        let mut out: Option<Tensor> = None;
        for (s, picks) in seqs.iter().zip(&picks) {
            let (entries, choice) = match (&self.compression, &pools.compressor, picks) {
                (Compression::Csa(csa), Some(c), Some(p)) => (
                    self.entries(c, s, csa.compressor.ratio()),
                    EntryChoice::Picked(p),
                ),
                (Compression::Hca(h), Some(c), _) => (
                    self.entries(c, s, h.ratio()),
                    EntryChoice::Visible {
                        ratio: h.ratio() as u32,
                    },
                ),
                // Sliding layers have no entries; the choice is never read.
                _ => (None, EntryChoice::Visible { ratio: 1 }),
            };
            let kvs = CompressedKv {
                raw: &pools.raw,
                raw_map: s.main_map(),
                first: 0,
                window,
                entries,
                choice,
            };
            let q = rows_of(rec, &q, s)?;
            let o = compressed_attention(rec, &q, &s.positions(), kvs, &self.w.sinks, scale)?;
            let o = o.reshape(&[s.len, heads * d])?;
            // A batch's outputs go to their rows of one `[tokens, heads · head_dim]`; one
            // sequence's is that tensor.
            match (&mut out, seqs.len()) {
                (_, 1) => out = Some(o),
                (None, _) => {
                    let mut all = Tensor::zeros(rec.device(), DType::F32, &[tokens, heads * d])?;
                    rec.write_rows(&mut all, &s.rows(), &o)?;
                    out = Some(all);
                }
                (Some(all), _) => rec.write_rows(all, &s.rows(), &o)?,
            }
        }
        let out =
            out.ok_or_else(|| ModelError::Batch("an attention step of no sequences".into()))?;
        let out = rec.unrope(&out.reshape(&[tokens, heads, d])?, at)?;
        self.project(rec, &out, tokens, groups)
    }

    /// The entries made so far by `s`'s compressor pooling every `ratio` tokens, in `c`
    /// (none before the first).
    fn entries<'a>(
        &self,
        c: &'a CompressorPools,
        s: &PagedSeq<'a>,
        ratio: usize,
    ) -> Option<MappedRows<'a>> {
        let count = s.end() / ratio;
        (count > 0).then(|| MappedRows {
            rows: &c.entries,
            count: count as u32,
            map: s.entry_map(ratio),
        })
    }

    /// The layer's compressors over the step (their rows and entries into `pools`), and
    /// (CSA) the indexer's picks, a sequence.
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        qr: &Tensor,
        at: &RopePositions,
        seqs: &[PagedSeq<'_>],
        pools: &mut LayerPools,
        ropes: &V4Ropes,
    ) -> Result<Vec<Option<Tensor>>> {
        let unpooled = |what: &str| {
            ModelError::Batch(format!(
                "a {what} layer's cache has no pools for its compressor"
            ))
        };
        match &self.compression {
            Compression::None => Ok(vec![None; seqs.len()]),
            Compression::Hca(c) => {
                let p = pools.compressor.as_mut().ok_or_else(|| unpooled("HCA"))?;
                c.step(rec, x, seqs, p, &ropes.compress)?;
                Ok(vec![None; seqs.len()])
            }
            Compression::Csa(csa) => {
                let Csa {
                    compressor,
                    indexer,
                } = &**csa;
                let i = pools.indexer.as_mut().ok_or_else(|| unpooled("CSA"))?;
                let picks = indexer.step(rec, x, qr, at, seqs, i, &ropes.index)?;
                let c = pools.compressor.as_mut().ok_or_else(|| unpooled("CSA"))?;
                compressor.step(rec, x, seqs, c, &ropes.compress)?;
                Ok(picks.into_iter().map(Some).collect())
            }
        }
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
