//! The compressors and the lightning indexer.

use kiln_tensor::{
    DType, MappedRows, NO_ENTRY, PoolWindows, Recorder, RopePositions, RopeTable, Tensor,
};

use super::cache::{CompressorPools, PagedSeq, main_slots, rows_of};
use crate::{ModelError, Result};

/// A compressor's weights, as the checkpoint names them in transformers' form
/// (DeepSeek's in brackets).
#[derive(Debug, Clone)]
pub struct CompressorWeights {
    /// `kv_proj` (`wkv`), `[halves·width, hidden]`.
    pub kv: Tensor,
    /// `gate_proj` (`wgate`), `[halves·width, hidden]`.
    pub gate: Tensor,
    /// `position_bias` (`ape`), F32 `[ratio, halves·width]`.
    pub ape: Tensor,
    /// `kv_norm` (`norm`), F32 `[width]`.
    pub norm: Tensor,
}

/// One compressor (`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor`, or the indexer's
/// own): each window of `ratio` tokens becomes one entry, `RMSNorm(Σ softmax(gate + ape) ·
/// kv)`, rotated (the trailing rotary channels) at the window's first position.
#[derive(Debug, Clone)]
pub struct Compressor {
    w: CompressorWeights,
    ratio: usize,
    overlapping: bool,
    width: usize,
    eps: f32,
}

impl Compressor {
    /// `overlapping`: CSA's windows of `2·ratio` slots, stride `ratio` (rows `[a | b]`);
    /// else HCA's disjoint ones. Names in errors are `prefix` + the transformers name.
    pub fn new(
        file: &str,
        prefix: &str,
        w: CompressorWeights,
        ratio: usize,
        overlapping: bool,
        eps: f32,
    ) -> Result<Self> {
        let halves = if overlapping { 2 } else { 1 };
        let width = w.norm.elem_count();
        let bad = |name: &str, t: &Tensor, want: String| ModelError::Tensor {
            file: file.into(),
            tensor: format!("{prefix}{name}"),
            problem: format!("shape {:?}, expected {want}", t.shape()),
        };
        let rows = halves * width;
        for (name, t) in [("kv_proj.weight", &w.kv), ("gate_proj.weight", &w.gate)] {
            if t.rows() != rows || t.shape().len() != 2 {
                return Err(bad(name, t, format!("[{rows}, hidden]")));
            }
        }
        if w.gate.cols() != w.kv.cols() {
            return Err(bad(
                "gate_proj.weight",
                &w.gate,
                format!("[{rows}, {}]", w.kv.cols()),
            ));
        }
        if ratio == 0 || w.ape.shape() != [ratio, rows] || w.ape.dtype() != DType::F32 {
            return Err(bad(
                "position_bias",
                &w.ape,
                format!("F32 [{ratio}, {rows}]"),
            ));
        }
        if w.norm.dtype() != DType::F32 || width == 0 {
            return Err(bad("kv_norm.weight", &w.norm, "F32 [width]".into()));
        }
        Ok(Self {
            w,
            ratio,
            overlapping,
            width,
            eps,
        })
    }

    /// Width of an entry.
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn ratio(&self) -> usize {
        self.ratio
    }

    fn windows(&self, previous: bool) -> PoolWindows {
        if self.overlapping {
            PoolWindows::Overlapping { previous }
        } else {
            PoolWindows::Disjoint
        }
    }

    /// Runs the compressor over the step's attention inputs `x` (`[tokens, hidden]`, the
    /// rows of `seqs`): each token's projected kv and gate rows go to its main slot, and each
    /// window a sequence completes becomes an entry in its kept slot, pooled from the main
    /// slots of the window's tokens (and, overlapping, the previous window's). `rope` is the
    /// compressed layers' rotary embedding at this width
    /// ([`DeepseekV4Config::compressed_rope`](crate::DeepseekV4Config::compressed_rope)).
    pub fn step(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        seqs: &[PagedSeq<'_>],
        pools: &mut CompressorPools,
        rope: &RopeTable,
    ) -> Result<()> {
        let kv = rec.matmul(x, &self.w.kv, None)?;
        let gate = rec.matmul(x, &self.w.gate, None)?;
        let slots = main_slots(seqs)?;
        rec.write_rows(&mut pools.kv, &slots, &kv)?;
        rec.write_rows(&mut pools.gate, &slots, &gate)?;
        let r = self.ratio;
        for s in seqs {
            // Entries made before this step, and after it.
            let (done, end) = (s.start / r, s.end() / r);
            if end == done {
                continue;
            }
            let previous = self.overlapping && done > 0;
            let from = if previous { done - 1 } else { done } * r;
            let rows = (from..end * r)
                .map(|p| s.main_slot(p))
                .collect::<Result<Vec<_>>>()?;
            let kv = rec.embedding(&pools.kv, &rows)?;
            let gate = rec.embedding(&pools.gate, &rows)?;
            let pooled = rec.compress_pool(&kv, &gate, &self.w.ape, r, self.windows(previous))?;
            let normed = rec.rms_norm(&pooled, &self.w.norm, self.eps)?;
            let n = end - done;
            let positions: Vec<u32> = (done..end).map(|w| (w * r) as u32).collect();
            let turned = rec.rope(
                &normed.reshape(&[n, 1, self.width])?,
                &rope.positions(&positions)?,
            )?;
            let dst = (done..end)
                .map(|e| s.entry_slot(e, r))
                .collect::<Result<Vec<_>>>()?;
            rec.write_rows(&mut pools.entries, &dst, &turned.reshape(&[n, self.width])?)?;
        }
        Ok(())
    }
}

/// The lightning indexer's weights besides its compressor (transformers' names; DeepSeek's
/// in brackets).
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    /// `q_b_proj` (`indexer.wq_b`), `[heads·dim, q_lora_rank]`.
    pub q: Tensor,
    /// `scorer.weights_proj` (`indexer.weights_proj`), `[heads, hidden]`.
    pub head_weights: Tensor,
}

/// The lightning indexer (`DeepseekV4Indexer`): its own overlapping compressor makes a key
/// every `ratio` tokens; each query scores the keys it may see,
/// `Σ_h w_h · ReLU(q_h · key) / sqrt(dim · heads)`, and keeps the best `topk`.
#[derive(Debug, Clone)]
pub struct Indexer {
    compressor: Compressor,
    w: IndexerWeights,
    heads: usize,
    topk: usize,
}

impl Indexer {
    pub fn new(
        file: &str,
        prefix: &str,
        compressor: Compressor,
        w: IndexerWeights,
        heads: usize,
        topk: usize,
    ) -> Result<Self> {
        let dim = compressor.width();
        if heads == 0 || w.q.rows() != heads * dim {
            return Err(ModelError::Tensor {
                file: file.into(),
                tensor: format!("{prefix}q_b_proj.weight"),
                problem: format!(
                    "shape {:?}, expected [{} = {heads} heads × {dim}, q_lora_rank]",
                    w.q.shape(),
                    heads * dim
                ),
            });
        }
        if w.head_weights.rows() != heads || w.head_weights.cols() != compressor.w.kv.cols() {
            return Err(ModelError::Tensor {
                file: file.into(),
                tensor: format!("{prefix}scorer.weights_proj.weight"),
                problem: format!(
                    "shape {:?}, expected [{heads}, {}]",
                    w.head_weights.shape(),
                    compressor.w.kv.cols()
                ),
            });
        }
        Ok(Self {
            compressor,
            w,
            heads,
            topk,
        })
    }

    /// Runs the indexer's compressor over the step's attention inputs `x` (`[tokens,
    /// hidden]`, the rows of `seqs`; its keys into `pools`), then picks, for each token of
    /// each sequence (query low-rank activations `qr` `[tokens, q_lora_rank]`, at the
    /// positions `at` on `rope`'s table), the entries its attention reads: U32 `[tokens,
    /// topk]` a sequence, rising, [`NO_ENTRY`] where fewer are visible. Entry `s` is visible
    /// to the token at `p` once its window is complete: `s < (p + 1) / ratio`.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        qr: &Tensor,
        at: &RopePositions,
        seqs: &[PagedSeq<'_>],
        pools: &mut CompressorPools,
        rope: &RopeTable,
    ) -> Result<Vec<Tensor>> {
        self.compressor.step(rec, x, seqs, pools, rope)?;
        let tokens = x.rows();
        let dim = self.compressor.width();
        let r = self.compressor.ratio();
        // The queries and head weights, once any sequence has keys to score.
        let scored = match seqs.iter().any(|s| s.end() >= r) {
            false => None,
            true => {
                let q = rec.matmul(qr, &self.w.q, None)?;
                let q = rec.rope(&q.reshape(&[tokens, self.heads, dim])?, at)?;
                Some((q, rec.matmul(x, &self.w.head_weights, None)?))
            }
        };
        let scale = 1.0 / ((dim * self.heads) as f32).sqrt();
        let mut picks = Vec::with_capacity(seqs.len());
        for s in seqs {
            let count = s.end() / r;
            let Some((q, w)) = scored.as_ref().filter(|_| count > 0) else {
                let none = vec![NO_ENTRY; s.len * self.topk];
                picks.push(Tensor::from_u32(&x.device(), &[s.len, self.topk], &none)?);
                continue;
            };
            let visible: Vec<u32> = (s.start..s.end()).map(|p| ((p + 1) / r) as u32).collect();
            let keys = MappedRows {
                rows: &pools.entries,
                count: count as u32,
                map: s.entry_map(r),
            };
            let (q, w) = (rows_of(rec, q, s)?, rows_of(rec, w, s)?);
            picks.push(rec.indexer_topk(&q, &w, keys, &visible, self.topk, scale)?);
        }
        Ok(picks)
    }
}
