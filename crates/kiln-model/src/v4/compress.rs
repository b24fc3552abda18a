//! The compressors and the lightning indexer.

use kiln_tensor::{
    DType, MappedRows, NO_ENTRY, PoolWindows, Recorder, RopePositions, RopeTable, Tensor,
};

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

/// What one sequence's compressor carries between steps: the projected rows of the window
/// not yet full, and, for overlapping windows, the last full window's before them.
#[derive(Debug, Clone, Default)]
pub struct CompressorState {
    kv: Option<Tensor>,
    gate: Option<Tensor>,
    /// Whether the kept rows start with the last full window.
    previous: bool,
    /// Entries made so far: the next window starts at token `entries · ratio`.
    entries: usize,
}

impl CompressorState {
    /// Entries made so far.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Bytes held: the rows carried to the next step.
    pub fn bytes(&self) -> u64 {
        [&self.kv, &self.gate]
            .into_iter()
            .flatten()
            .map(tensor_bytes)
            .sum()
    }
}

/// A tensor's bytes on its device.
pub(crate) fn tensor_bytes(t: &Tensor) -> u64 {
    t.dtype().bytes_for(t.elem_count()).unwrap_or(0) as u64
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

    /// The entries that the next tokens' attention inputs `x` (`[tokens, hidden]`) complete,
    /// `[entries, width]`, in order (none while a window stays open); `state` moves on past
    /// `x`. `rope` is the compressed layers' rotary embedding at this width
    /// ([`DeepseekV4Config::compressed_rope`](crate::DeepseekV4Config::compressed_rope)).
    pub fn step(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        state: &mut CompressorState,
        rope: &RopeTable,
    ) -> Result<Option<Tensor>> {
        let kv = rec.matmul(x, &self.w.kv, None)?;
        let gate = rec.matmul(x, &self.w.gate, None)?;
        let (kv, gate) = match (&state.kv, &state.gate) {
            (Some(k), Some(g)) => (rec.concat_rows(k, &kv)?, rec.concat_rows(g, &gate)?),
            _ => (kv, gate),
        };
        let lead = if state.previous { self.ratio } else { 0 };
        let rows = kv.rows();
        let n = rows.saturating_sub(lead) / self.ratio;
        if n == 0 {
            state.kv = Some(kv);
            state.gate = Some(gate);
            return Ok(None);
        }
        let pooled = rec.compress_pool(
            &kv,
            &gate,
            &self.w.ape,
            self.ratio,
            self.windows(state.previous),
        )?;
        let normed = rec.rms_norm(&pooled, &self.w.norm, self.eps)?;
        let positions: Vec<u32> = (state.entries..state.entries + n)
            .map(|w| (w * self.ratio) as u32)
            .collect();
        let turned = rec.rope(
            &normed.reshape(&[n, 1, self.width])?,
            &rope.positions(&positions)?,
        )?;
        // Kept: the rows of the window not yet full, after the last full window's where the
        // next entry reads it.
        let done = lead + n * self.ratio;
        let keep_from = if self.overlapping {
            done - self.ratio
        } else {
            done
        };
        let keep: Vec<u32> = (keep_from as u32..rows as u32).collect();
        (state.kv, state.gate) = if keep.is_empty() {
            (None, None)
        } else {
            (
                Some(rec.embedding(&kv, &keep)?),
                Some(rec.embedding(&gate, &keep)?),
            )
        };
        state.previous = self.overlapping;
        state.entries += n;
        Ok(Some(turned.reshape(&[n, self.width])?))
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

/// What one sequence's indexer carries between steps: its compressor's state and every key
/// made so far.
#[derive(Debug, Clone, Default)]
pub struct IndexerState {
    compressor: CompressorState,
    keys: Option<Tensor>,
}

impl IndexerState {
    /// Bytes held: the keys, and the compressor's carried rows.
    pub fn bytes(&self) -> u64 {
        self.compressor.bytes() + self.keys.as_ref().map_or(0, tensor_bytes)
    }

    /// Bytes of the compressor's carried rows alone.
    pub fn pending_bytes(&self) -> u64 {
        self.compressor.bytes()
    }
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

    /// For each of the next tokens (attention inputs `x` `[tokens, hidden]`, query low-rank
    /// activations `qr` `[tokens, q_lora_rank]`, at absolute positions `at` on `rope`'s
    /// table), the entries its
    /// attention reads: U32 `[tokens, topk]`, rising, [`NO_ENTRY`] where fewer are visible.
    /// Entry `s` is visible to the token at `p` once its window is complete: `s < (p + 1) /
    /// ratio`.
    pub fn step(
        &self,
        rec: &mut Recorder,
        x: &Tensor,
        qr: &Tensor,
        at: &RopePositions,
        state: &mut IndexerState,
        rope: &RopeTable,
    ) -> Result<Tensor> {
        let positions = at.positions();
        let tokens = x.rows();
        let dim = self.compressor.width();
        if let Some(new) = self.compressor.step(rec, x, &mut state.compressor, rope)? {
            state.keys = Some(match &state.keys {
                Some(k) => rec.concat_rows(k, &new)?,
                None => new,
            });
        }
        let Some(keys) = &state.keys else {
            let none = vec![NO_ENTRY; tokens * self.topk];
            return Ok(Tensor::from_u32(&x.device(), &[tokens, self.topk], &none)?);
        };
        let ratio = self.compressor.ratio() as u32;
        let visible: Vec<u32> = positions
            .iter()
            .map(|&p| ((p + 1) / ratio).min(keys.rows() as u32))
            .collect();
        let q = rec.matmul(qr, &self.w.q, None)?;
        let q = rec.rope(&q.reshape(&[tokens, self.heads, dim])?, at)?;
        let w = rec.matmul(x, &self.w.head_weights, None)?;
        let scale = 1.0 / ((dim * self.heads) as f32).sqrt();
        let keys = MappedRows::consecutive(keys);
        Ok(rec.indexer_topk(&q, &w, keys, &visible, self.topk, scale)?)
    }
}
