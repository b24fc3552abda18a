//! DeepSeek-V4's compressed attention ops: [`Recorder::compress_pool`] pools each window of
//! `ratio` tokens' projected KV into one entry, weighted per channel by a softmax over the
//! window's gate logits (the CSA and HCA compressors); [`Recorder::indexer_topk`] scores a
//! query against every compressed indexer key it may see and keeps the best `k` (the
//! lightning indexer).
//!
//! Both are plain functions of their inputs: what a sequence carries between steps (the rows
//! of a window not yet full, the previous window's first half) is the caller's, handed back
//! as leading rows.

use bytemuck::{Pod, Zeroable};

use super::{R2W, R3W, one_binding, require_dtype};
use crate::gpu::{Access, KernelDef};
use crate::{DType, MappedRows, Recorder, Result, Tensor, TensorError};

const SRC: &str = include_str!("../../wgsl/compress.wgsl");
static POOL: KernelDef = KernelDef {
    name: "compress_pool",
    source: SRC,
    bindings: R3W,
};
static SCORE: KernelDef = KernelDef {
    name: "indexer_score",
    source: SRC,
    bindings: &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
    ],
};
static TOPK: KernelDef = KernelDef {
    name: "indexer_topk",
    source: SRC,
    bindings: R2W,
};

/// [`Recorder::indexer_topk`]'s mark for a pick slot left empty (fewer entries visible than
/// `k`).
pub const NO_ENTRY: u32 = u32::MAX;

/// How a compressor's windows are laid over its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolWindows {
    /// Entry `w` pools rows `w·ratio ..` through all their channels (HCA).
    Disjoint,
    /// Each row holds two halves, `[a | b]`. Entry `w` pools `2·ratio` slots: the previous
    /// window's rows through their `a` halves and window `w`'s through their `b` halves
    /// (CSA and its indexer). With `previous`, the first `ratio` rows are the window before
    /// entry 0 (read only through `a`); without, entry 0 has no previous window.
    Overlapping { previous: bool },
}

impl PoolWindows {
    /// Rows before the first window's own.
    fn lead(self, ratio: usize) -> usize {
        match self {
            PoolWindows::Overlapping { previous: true } => ratio,
            _ => 0,
        }
    }

    /// Input channels per output channel.
    fn halves(self) -> usize {
        match self {
            PoolWindows::Disjoint => 1,
            PoolWindows::Overlapping { .. } => 2,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PoolParams {
    windows: u32,
    width: u32,
    cols: u32,
    ratio: u32,
    lead: u32,
    overlap: u32,
    _pad: [u32; 6],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct TopkParams {
    /// Query tokens of this group.
    tokens: u32,
    heads: u32,
    dim: u32,
    entries: u32,
    k: u32,
    scale: f32,
    /// The group's first query token.
    first: u32,
    /// Rows a block of the keys' pool (0: consecutive keys), and where its table starts in
    /// the index buffer (after the visible counts).
    key_block: u32,
    key_table: u32,
    _pad: [u32; 3],
}

/// Query tokens scored at a time: as many as leave their scores (`entries` f32 a query) in
/// one binding of `max_binding` bytes, at least one.
fn score_group(tokens: usize, entries: usize, max_binding: u64) -> usize {
    let row = (entries.max(1) * 4) as u64;
    ((max_binding / row) as usize).clamp(1, tokens.max(1))
}

impl Recorder {
    /// One entry per window: channel `c` of entry `w` is `Σ_slot softmax(gate + ape)·kv` over
    /// the window's slots (see [`PoolWindows`]), the softmax per channel. `kv` and `gate` are
    /// F32 `[rows, cols]`; `ape`, the per-slot bias, F32 `[ratio, cols]`. Rows past the lead
    /// and the last whole window (a window not yet full) are not read. The result is F32
    /// `[windows, cols / halves]`.
    pub fn compress_pool(
        &mut self,
        kv: &Tensor,
        gate: &Tensor,
        ape: &Tensor,
        ratio: usize,
        windows: PoolWindows,
    ) -> Result<Tensor> {
        const OP: &str = "compress_pool";
        for (what, t) in [("the kv rows", kv), ("the gate rows", gate), ("ape", ape)] {
            require_dtype(OP, what, t, &[DType::F32])?;
        }
        self.check_device(OP, &[kv, gate, ape])?;
        one_binding(OP, &[kv, gate, ape])?;
        let (rows, cols) = (kv.rows(), kv.cols());
        let lead = windows.lead(ratio);
        let shape_err = |detail: String| TensorError::Shape { op: OP, detail };
        if gate.shape() != kv.shape() || ape.shape() != [ratio, cols] {
            return Err(shape_err(format!(
                "kv {:?}, gate {:?} and ape {:?} for ratio {ratio}",
                kv.shape(),
                gate.shape(),
                ape.shape()
            )));
        }
        if ratio == 0 || cols % windows.halves() != 0 {
            return Err(shape_err(format!(
                "ratio {ratio} over rows of {cols} ({windows:?}: {} halves)",
                windows.halves()
            )));
        }
        let n = rows.saturating_sub(lead) / ratio;
        let width = cols / windows.halves();
        if n == 0 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("no window of {ratio} in {rows} rows after {lead} lead rows"),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let (kv, gate, ape) = (kv.host_f32()?, gate.host_f32()?, ape.host_f32()?);
            return Tensor::host_f32_with(&[n, width], |out| {
                compress_pool_ref(kv, gate, ape, cols, ratio, windows, out);
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, &[n, width], OP)?;
        let params = PoolParams {
            windows: n as u32,
            width: width as u32,
            cols: cols as u32,
            ratio: ratio as u32,
            lead: lead as u32,
            overlap: u32::from(windows != PoolWindows::Disjoint),
            _pad: [0; 6],
        };
        self.dispatch(
            &POOL,
            &[("POOL", "1"), ("SCORE", "0"), ("TOPK", "0")],
            &params,
            vec![
                (kv.clone(), 0),
                (gate.clone(), 0),
                (ape.clone(), 0),
                (out.clone(), 0),
            ],
            (n * width).div_ceil(64) as u32,
        )?;
        Ok(out)
    }

    /// The lightning indexer's picks: for query token `t`, the `k` entries `s < visible[t]`
    /// of the largest `scale · Σ_h w[t,h] · ReLU(q[t,h]·keys[s])`, ties to the lower entry,
    /// listed by rising entry; slots past the visible count hold [`NO_ENTRY`]. `q` is F32
    /// `[tokens, heads, dim]`, `w` F32 `[tokens, heads]`, `keys` F32 `[entries, dim]`; the
    /// result is U32 `[tokens, k]`.
    pub fn indexer_topk(
        &mut self,
        q: &Tensor,
        w: &Tensor,
        key_rows: MappedRows<'_>,
        visible: &[u32],
        k: usize,
        scale: f32,
    ) -> Result<Tensor> {
        const OP: &str = "indexer_topk";
        let keys = key_rows.rows;
        for (what, t) in [
            ("the queries", q),
            ("the head weights", w),
            ("the keys", keys),
        ] {
            require_dtype(OP, what, t, &[DType::F32])?;
        }
        self.check_device(OP, &[q, w, keys])?;
        one_binding(OP, &[q, w, keys])?;
        if let Some(i) = key_rows.missing() {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!(
                    "key {i} of {} has no row of {:?} ({})",
                    key_rows.count,
                    keys.shape(),
                    key_rows.map.describe()
                ),
            });
        }
        let [tokens, heads, dim] = *q.shape() else {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!("queries must be [tokens, heads, dim], got {:?}", q.shape()),
            });
        };
        let entries = key_rows.count as usize;
        if w.shape() != [tokens, heads] || keys.cols() != dim || visible.len() != tokens {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "queries {:?}, head weights {:?}, keys {:?}, {} visible counts",
                    q.shape(),
                    w.shape(),
                    keys.shape(),
                    visible.len()
                ),
            });
        }
        if let Some(&v) = visible.iter().find(|&&v| v as usize > entries) {
            return Err(TensorError::OutOfRange {
                op: OP,
                what: "visible entries",
                index: v as usize,
                limit: entries + 1,
            });
        }
        if tokens == 0 || k == 0 || !scale.is_finite() {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("{tokens} queries, k {k}, scale {scale}"),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let (q, w, keys) = (q.host_f32()?, w.host_f32()?, keys.host_f32()?);
            let shape = IndexerShape { heads, dim, k };
            // Every key was checked to have its row.
            let key = |s: usize| {
                let r = key_rows.map.row(0, s as u32).unwrap_or(0);
                &keys[r * dim..(r + 1) * dim]
            };
            return Ok(Tensor::host_u32_with(&[tokens, k], |out| {
                indexer_topk_ref(q, w, key, visible, shape, scale, out)
            }));
        };
        let device = self.device().clone();
        // One index buffer: the visible counts, then the keys' table.
        let mut index = visible.to_vec();
        let (key_block, key_table) = key_rows.map.append_table(&mut index);
        let visible = Tensor::from_u32(&device, &[index.len()], &index)?;
        let out = Tensor::gpu_output(&ctx, DType::U32, &[tokens, k], OP)?;
        // The scores of a group of queries at a time, so that they fit one binding however
        // many entries there are (a long context's CSA layers).
        let group = score_group(tokens, entries, ctx.max_binding());
        // One score buffer, each group's scores over the last's (the launches run in order).
        let scores = Tensor::gpu_output(&ctx, DType::F32, &[group, entries.max(1)], OP)?;
        for first in (0..tokens).step_by(group) {
            let n = group.min(tokens - first);
            let params = TopkParams {
                tokens: n as u32,
                heads: heads as u32,
                dim: dim as u32,
                entries: entries as u32,
                k: k as u32,
                scale,
                first: first as u32,
                key_block,
                key_table,
                _pad: [0; 3],
            };
            self.dispatch(
                &SCORE,
                &[("POOL", "0"), ("SCORE", "1"), ("TOPK", "0")],
                &params,
                vec![
                    (q.clone(), 0),
                    (w.clone(), 0),
                    (keys.clone(), 0),
                    (visible.clone(), 0),
                    (scores.clone(), 0),
                ],
                (n * entries).div_ceil(64) as u32,
            )?;
            self.dispatch(
                &TOPK,
                &[("POOL", "0"), ("SCORE", "0"), ("TOPK", "1")],
                &params,
                vec![(visible.clone(), 0), (scores.clone(), 0), (out.clone(), 0)],
                n as u32,
            )?;
        }
        Ok(out)
    }
}

/// CPU reference of [`Recorder::compress_pool`], into `out` `[windows, cols / halves]`.
pub(crate) fn compress_pool_ref(
    kv: &[f32],
    gate: &[f32],
    ape: &[f32],
    cols: usize,
    ratio: usize,
    windows: PoolWindows,
    out: &mut [f32],
) {
    let lead = windows.lead(ratio);
    let width = cols / windows.halves();
    // (row, column) of each slot of entry `w`'s channel `c`. Windows start at multiples of
    // `ratio` (the lead is none or one window), so a row's slot in its window, which picks
    // its row of `ape`, is `row % ratio`.
    let slots = |w: usize, c: usize| -> Vec<(usize, usize)> {
        let own = lead + w * ratio;
        match windows {
            PoolWindows::Disjoint => (own..own + ratio).map(|r| (r, c)).collect(),
            PoolWindows::Overlapping { .. } => {
                let prev = own.checked_sub(ratio).map_or(0..0, |b| b..own);
                prev.map(|r| (r, c))
                    .chain((own..own + ratio).map(|r| (r, width + c)))
                    .collect()
            }
        }
    };
    for (w, entry) in out.chunks_exact_mut(width).enumerate() {
        for (c, o) in entry.iter_mut().enumerate() {
            let slots = slots(w, c);
            let logit =
                |&(r, col): &(usize, usize)| gate[r * cols + col] + ape[(r % ratio) * cols + col];
            let max = slots.iter().map(logit).fold(f32::NEG_INFINITY, f32::max);
            let (mut sum, mut acc) = (0f32, 0f32);
            for s in &slots {
                let e = (logit(s) - max).exp();
                sum += e;
                acc += e * kv[s.0 * cols + s.1];
            }
            *o = acc / sum;
        }
    }
}

/// The sizes [`indexer_topk_ref`] reads its flat inputs by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexerShape {
    pub heads: usize,
    pub dim: usize,
    pub k: usize,
}

/// CPU reference of [`Recorder::indexer_topk`], into `out` `[tokens, k]`.
pub(crate) fn indexer_topk_ref<'k>(
    q: &[f32],
    w: &[f32],
    key: impl Fn(usize) -> &'k [f32],
    visible: &[u32],
    shape: IndexerShape,
    scale: f32,
    out: &mut [u32],
) {
    let IndexerShape { heads, dim, k } = shape;
    for (t, (&n, picks)) in visible.iter().zip(out.chunks_exact_mut(k)).enumerate() {
        let mut scored: Vec<(usize, f32)> = (0..n as usize)
            .map(|s| {
                let key = key(s);
                let score = (0..heads).fold(0f32, |acc, h| {
                    let qh = &q[(t * heads + h) * dim..(t * heads + h + 1) * dim];
                    let d = qh.iter().zip(key).fold(0f32, |a, (x, y)| a + x * y);
                    acc + w[t * heads + h] * d.max(0.0)
                });
                (s, score * scale)
            })
            .collect();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        scored.truncate(k);
        scored.sort_by_key(|&(s, _)| s);
        picks.fill(NO_ENTRY);
        for (p, (s, _)) in picks.iter_mut().zip(scored) {
            *p = s as u32;
        }
    }
}
