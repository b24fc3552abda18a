//! DeepSeek-V4's attention core (transformers' `DeepseekV4Attention.forward` with
//! `eager_attention_forward`; llama.cpp's `build_attention_impl`): every query head reads one
//! shared K=V head, over the raw rows of the last `window` tokens (its own included) and the
//! compressed entries it may use: all visible ones (HCA) or the lightning indexer's picks
//! (CSA). A learned sink per head joins the softmax as one more logit with no value.
//!
//! One sequence a call; the caller turns the output back by the query's RoPE. Its rows and
//! entries lie consecutively in their tensors, or in pools through block tables (the paged
//! cache: [`RowMap::Paged`]).

use bytemuck::{Pod, Zeroable};
use kiln_tensor::{Access, DType, KernelDef, MappedRows, NO_ENTRY, Recorder, RowMap, Tensor};

use crate::{KvDeviceError, Result};

static ATTN: KernelDef = KernelDef {
    name: "compressed_attention",
    source: include_str!("../wgsl/compressed_attention.wgsl"),
    bindings: &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
    ],
};

/// The largest head the kernel holds (64 invocations × 16 channels; V4's is 512).
pub const MAX_COMPRESSED_HEAD_DIM: usize = 1024;

/// Which compressed entries a query reads.
#[derive(Debug, Clone, Copy)]
pub enum EntryChoice<'a> {
    /// Every entry whose window is complete at the query: `e < (position + 1) / ratio`
    /// (HCA).
    Visible { ratio: u32 },
    /// The indexer's picks, U32 `[tokens, k]`, [`NO_ENTRY`] for none (CSA).
    Picked(&'a Tensor),
}

/// The keys (= values) one sequence's queries read.
#[derive(Debug, Clone, Copy)]
pub struct CompressedKv<'a> {
    /// Raw rows F32 `[rows, head_dim]` of the sequence's tokens from position `first` (the
    /// queries' own included), as `raw_map` says.
    pub raw: &'a Tensor,
    pub raw_map: RowMap<'a>,
    pub first: u32,
    /// A query at `p` reads the raw rows of positions `p - window + 1 ..= p`.
    pub window: u32,
    /// The compressed entries, if any yet.
    pub entries: Option<MappedRows<'a>>,
    pub choice: EntryChoice<'a>,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    tokens: u32,
    heads: u32,
    dim: u32,
    first: u32,
    window: u32,
    entries: u32,
    /// 0: every visible entry (`ratio`); else the picks a token.
    picks: u32,
    ratio: u32,
    scale: f32,
    /// Rows a block of the raw pool (0: consecutive rows) and where its table starts in the
    /// index buffer (after the positions).
    raw_block: u32,
    raw_table: u32,
    /// The same for the entries.
    entry_block: u32,
    entry_table: u32,
    _pad: [u32; 3],
}

/// Attention of `q` (F32 `[tokens, heads, head_dim]`, at `positions`) over `kv`, with each
/// head's `sinks` (F32 `[heads]`) and scores scaled by `scale`: F32 `[tokens, heads,
/// head_dim]`.
pub fn compressed_attention(
    rec: &mut Recorder,
    q: &Tensor,
    positions: &[u32],
    kv: CompressedKv<'_>,
    sinks: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let invalid = |m: String| Err(KvDeviceError::Invalid(format!("compressed attention: {m}")));
    let [tokens, heads, dim] = *q.shape() else {
        return invalid(format!(
            "queries {:?}, expected [tokens, heads, head_dim]",
            q.shape()
        ));
    };
    let entries = kv.entries.map_or(0, |e| e.count);
    if positions.len() != tokens
        || tokens == 0
        || kv.raw.cols() != dim
        || dim > MAX_COMPRESSED_HEAD_DIM
    {
        return invalid(format!(
            "queries {:?} at {} positions over raw rows {:?} (head_dim at most \
             {MAX_COMPRESSED_HEAD_DIM})",
            q.shape(),
            positions.len(),
            kv.raw.shape()
        ));
    }
    if let Some(&p) = positions.iter().find(|&&p| p < kv.first) {
        return invalid(format!(
            "a query at {p}, before the raw rows' first position {}",
            kv.first
        ));
    }
    // Every raw row a query reads, and every entry, must have a row of its tensor.
    let read = positions.iter().flat_map(|&p| {
        let lo = (p + 1).saturating_sub(kv.window).max(kv.first);
        lo..=p
    });
    if let Some(j) = kv.raw_map.missing(kv.first, kv.raw.rows(), read) {
        return invalid(format!(
            "position {j} has no raw row of {:?} from {} ({})",
            kv.raw.shape(),
            kv.first,
            kv.raw_map.describe()
        ));
    }
    if let Some(e) = kv.entries
        && let Some(i) = e.missing()
    {
        return invalid(format!(
            "entry {i} of {} has no row of {:?} ({})",
            e.count,
            e.rows.shape(),
            e.map.describe()
        ));
    }
    if kv.entries.is_some_and(|e| e.rows.cols() != dim) || sinks.elem_count() != heads {
        return invalid(format!(
            "entries {:?} and sinks {:?} for {heads} heads of {dim}",
            kv.entries.map(|e| e.rows.shape()),
            sinks.shape()
        ));
    }
    let f32s = [
        Some(q),
        Some(kv.raw),
        kv.entries.map(|e| e.rows),
        Some(sinks),
    ];
    if let Some(t) = f32s.into_iter().flatten().find(|t| t.dtype() != DType::F32) {
        return invalid(format!(
            "{:?} {:?}: the inputs are F32",
            t.dtype(),
            t.shape()
        ));
    }
    let (picks, ratio) = match kv.choice {
        EntryChoice::Visible { ratio } if ratio > 0 => (None, ratio),
        EntryChoice::Picked(p) if p.rows() == tokens && p.cols() > 0 && p.dtype() == DType::U32 => {
            (Some(p), 0)
        }
        other => return invalid(format!("entry choice {other:?} for {tokens} queries")),
    };
    let device = rec.device().clone();
    if device.is_cpu() {
        let picks = picks.map(Tensor::to_u32_vec).transpose()?;
        let choice = match &picks {
            Some(p) => HostChoice::Picked(p, p.len() / tokens),
            None => HostChoice::Visible(ratio),
        };
        // The host backends' tensors are read in place.
        let entries = kv.entries.map(|e| e.rows.host_f32()).transpose()?;
        let out = attend_ref(
            q.host_f32()?,
            positions,
            HostKv {
                raw: kv.raw.host_f32()?,
                raw_map: kv.raw_map,
                first: kv.first,
                window: kv.window,
                entries: entries.unwrap_or(&[]),
                entry_map: kv.entries.map_or(RowMap::Consecutive, |e| e.map),
                count: entries_count(kv.entries),
                choice,
            },
            sinks.host_f32()?,
            [heads, dim],
            scale,
        );
        return Ok(Tensor::from_f32(&device, q.shape(), &out)?);
    }
    // One index buffer: the positions, then the raw rows' table, then the entries'.
    let mut index = positions.to_vec();
    let (raw_block, raw_table) = kv.raw_map.append_table(&mut index);
    let entry_map = kv.entries.map_or(RowMap::Consecutive, |e| e.map);
    let (entry_block, entry_table) = entry_map.append_table(&mut index);
    let index = Tensor::from_u32(&device, &[index.len()], &index)?;
    let out = rec.output(DType::F32, q.shape(), "compressed attention output")?;
    let params = Params {
        tokens: tokens as u32,
        heads: heads as u32,
        dim: dim as u32,
        first: kv.first,
        window: kv.window,
        entries,
        picks: picks.map_or(0, |p| p.cols() as u32),
        ratio,
        scale,
        raw_block,
        raw_table,
        entry_block,
        entry_table,
        _pad: [0; 3],
    };
    // Bindings with nothing to read are bound to a tensor at hand; the kernel never reads them.
    let entry_t = kv.entries.map_or(kv.raw, |e| e.rows);
    let picks_t = picks.unwrap_or(&index);
    rec.launch(
        &ATTN,
        &[],
        &params,
        &[q, &index, kv.raw, entry_t, picks_t, sinks, &out],
        (tokens * heads) as u32,
    )?;
    Ok(out)
}

fn entries_count(e: Option<MappedRows<'_>>) -> usize {
    e.map_or(0, |e| e.count as usize)
}

/// [`EntryChoice`] with the picks on the host: `(picks, k)`.
#[derive(Debug, Clone, Copy)]
enum HostChoice<'a> {
    Visible(u32),
    Picked(&'a [u32], usize),
}

struct HostKv<'a> {
    raw: &'a [f32],
    raw_map: RowMap<'a>,
    first: u32,
    window: u32,
    entries: &'a [f32],
    entry_map: RowMap<'a>,
    count: usize,
    choice: HostChoice<'a>,
}

/// The reference: scores, sink and softmax in f64.
fn attend_ref<'a>(
    q: &[f32],
    positions: &[u32],
    kv: HostKv<'a>,
    sinks: &[f32],
    [heads, dim]: [usize; 2],
    scale: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; q.len()];
    // Rows were checked to exist before the call.
    let row = |data: &'a [f32], map: RowMap<'_>, first, i| {
        let r = map.row(first, i).unwrap_or(0);
        &data[r * dim..][..dim]
    };
    for (t, &p) in positions.iter().enumerate() {
        let lo = (p + 1).saturating_sub(kv.window).max(kv.first);
        let raw = (lo..=p).map(|j| row(kv.raw, kv.raw_map, kv.first, j));
        let chosen: Vec<usize> = match kv.choice {
            HostChoice::Visible(ratio) => (0..((p + 1) / ratio) as usize).collect(),
            HostChoice::Picked(picks, k) => picks[t * k..(t + 1) * k]
                .iter()
                .filter(|&&e| e != NO_ENTRY)
                .map(|&e| e as usize)
                .collect(),
        };
        let rows: Vec<&[f32]> = raw
            .chain(
                chosen
                    .iter()
                    .filter(|&&e| e < kv.count)
                    .map(|&e| row(kv.entries, kv.entry_map, 0, e as u32)),
            )
            .collect();
        for h in 0..heads {
            let qh = &q[(t * heads + h) * dim..][..dim];
            let scores: Vec<f64> = rows
                .iter()
                .map(|r| {
                    let d: f64 = qh
                        .iter()
                        .zip(*r)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    d * f64::from(scale)
                })
                .collect();
            let sink = f64::from(sinks[h]);
            let m = scores.iter().copied().fold(sink, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - m).exp()).sum::<f64>() + (sink - m).exp();
            let mut acc = vec![0f64; dim];
            for (s, r) in scores.iter().zip(&rows) {
                let w = (s - m).exp() / sum;
                for (x, v) in acc.iter_mut().zip(*r) {
                    *x += w * f64::from(*v);
                }
            }
            for (o, a) in out[(t * heads + h) * dim..][..dim].iter_mut().zip(acc) {
                *o = a as f32;
            }
        }
    }
    out
}
