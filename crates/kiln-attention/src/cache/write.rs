//! Writing a step's K/V into the pools: [`KvCache::write`] (K and V as they are) and
//! [`KvCache::write_qkv`] (a layer's Q/K/V projections made ready for attention: per-head
//! norm, RoPE, K/V stored, Q returned). Both are one launch of `kv_write.wgsl`.

use bytemuck::{Pod, Zeroable};
use kiln_kv::KvDtype;
use kiln_tensor::{
    Access, DType, Device, KernelDef, Recorder, RopeLayout, RopePositions, RotaryChannels, Tensor,
};

use super::{
    AttnBatch, HostPool, KvCache, MAX_HEAD_DIM, Store, dtype_define, flag, invalid, variant,
};
use crate::Result;
use crate::stored::{CENTRED_PAIRS, hadamard_norm, shift_row};

// `hadamard.wgsl` (the INT4 rotation) and `centre.wgsl` (its key centres) come first.
const WRITE_SRC: &str = concat!(
    include_str!("../../wgsl/hadamard.wgsl"),
    include_str!("../../wgsl/centre.wgsl"),
    include_str!("../../wgsl/kv_write.wgsl")
);
const R: Access = Access::Read;
const W: Access = Access::ReadWrite;
/// Sources (Q, K, V), slots, batch info, RoPE table, the two norms' weights, then Q out and
/// the K and V pools.
static KV_WRITE: KernelDef = KernelDef {
    name: "kv_write",
    source: WRITE_SRC,
    bindings: &[R, R, R, R, R, R, R, R, W, W, W],
};
/// The quantized formats: also the per-(slot, head) scales (INT8) or scale|zero (INT4).
static KV_WRITE_SCALED: KernelDef = KernelDef {
    name: "kv_write",
    source: WRITE_SRC,
    bindings: &[R, R, R, R, R, R, R, R, W, W, W, W, W],
};
/// INT4: also the layer's key centres.
static KV_WRITE_I4: KernelDef = KernelDef {
    name: "kv_write",
    source: WRITE_SRC,
    bindings: &[R, R, R, R, R, R, R, R, W, W, W, W, W, R],
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct WriteParams {
    tokens: u32,
    kv_heads: u32,
    head_dim: u32,
    /// 1/sqrt(the INT4 rotation's block size), computed here so every backend scales by
    /// the same f32.
    had_norm: f32,
    heads: u32,
    q_stride: u32,
    q_col: u32,
    k_stride: u32,
    k_col: u32,
    v_stride: u32,
    v_col: u32,
    rot: u32,
    max_pos: u32,
    interleaved: u32,
    qk_norm: u32,
    eps: f32,
}

/// Where a step's Q, K and V rows are, each `[tokens, heads·head_dim]` row-major.
#[derive(Debug, Clone, Copy)]
pub enum QkvRows<'a> {
    /// One projection `[tokens, (heads + 2·kv_heads)·head_dim]`: Q, K, V side by side.
    Stacked(&'a Tensor),
    /// Q, K and V apart.
    Separate([&'a Tensor; 3]),
}

/// What happens to Q and K rows before attention (Q) and the cache (K).
#[derive(Debug, Clone, Copy)]
pub struct QkPrep<'a> {
    /// Query heads: a multiple of the cache's kv heads.
    pub heads: usize,
    /// The rotary embedding at the batch's positions.
    pub rope: &'a RopePositions,
    /// Per-head RMSNorm of Q and K first (Qwen3, Gemma 3): their weights `[head_dim]` and
    /// epsilon.
    pub norm: Option<QkNorm<'a>>,
}

/// Per-head RMSNorm weights of Q and K.
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub eps: f32,
}

/// One source of the write: a tensor, its row stride and its first column.
type Source<'a> = (&'a Tensor, usize, usize);

impl KvCache {
    /// Write the K and V rows `[tokens, kv_heads, head_dim]` of the batch's query tokens into
    /// their slots of `layer`.
    pub fn write(
        &mut self,
        rec: &mut Recorder,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        batch: &AttnBatch,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let (kvh, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        self.check_rows("K", k, batch.tokens, kvh)?;
        self.check_rows("V", v, batch.tokens, kvh)?;
        self.written = true;
        if let Store::Cpu(_) = &self.store {
            return self.write_host(layer, k.host_f32()?, v.host_f32()?, batch);
        }
        let row = kvh * hd;
        self.launch_write(
            rec,
            layer,
            [(k, row, 0), (k, row, 0), (v, row, 0)],
            0,
            None,
            batch,
        )?;
        Ok(())
    }

    /// A layer's projections made ready for attention in one launch: Q and K rows RMS-normed
    /// per head (when asked) and rotated by RoPE at the batch's positions, K and V written
    /// into their slots of `layer`; returns Q `[tokens, heads, head_dim]`.
    pub fn write_qkv(
        &mut self,
        rec: &mut Recorder,
        layer: usize,
        qkv: QkvRows<'_>,
        prep: &QkPrep<'_>,
        batch: &AttnBatch,
    ) -> Result<Tensor> {
        self.check_layer(layer)?;
        let (kvh, hd, t) = (self.cfg.kv_heads, self.cfg.head_dim, batch.tokens);
        let heads = prep.heads;
        if heads == 0 || !heads.is_multiple_of(kvh) {
            return invalid(format!(
                "{heads} query heads are not a multiple of {kvh} kv heads"
            ));
        }
        let (qw, kw) = (heads * hd, kvh * hd);
        let sources: [Source<'_>; 3] = match qkv {
            QkvRows::Stacked(s) => {
                let width = qw + 2 * kw;
                check_source("QKV", s, t, width)?;
                [(s, width, 0), (s, width, qw), (s, width, qw + kw)]
            }
            QkvRows::Separate([q, k, v]) => {
                check_source("Q", q, t, qw)?;
                check_source("K", k, t, kw)?;
                check_source("V", v, t, kw)?;
                [(q, qw, 0), (k, kw, 0), (v, kw, 0)]
            }
        };
        let rope = prep.rope;
        let cfg = rope.table().config();
        if cfg.head_dim != hd {
            return invalid(format!(
                "RoPE of head_dim {} for a cache of head_dim {hd}",
                cfg.head_dim
            ));
        }
        if cfg.rotated != RotaryChannels::Leading {
            return invalid(format!(
                "the fused KV write turns a head's leading channels, not {:?}",
                cfg.rotated
            ));
        }
        if rope.len() != t || !rope.positions().iter().copied().eq(batch.positions()) {
            return invalid("the RoPE positions are not the batch's".into());
        }
        if let Some(n) = prep.norm {
            for (what, w) in [("Q", n.q), ("K", n.k)] {
                if w.dtype() != DType::F32 || w.elem_count() != hd {
                    return invalid(format!(
                        "{what} norm weights must be F32 [{hd}], got {:?} {:?}",
                        w.dtype(),
                        w.shape()
                    ));
                }
            }
        }
        self.written = true;
        if let Store::Cpu(_) = &self.store {
            // The plain ops, then the host write: what the kernel computes in one launch.
            // A source's rows of `n` heads: itself when nothing else shares its rows.
            let take = |(src, stride, col): Source<'_>, n: usize| -> Result<Tensor> {
                let width = n * hd;
                if stride == width {
                    return Ok(src.reshape(&[t * n, hd])?);
                }
                let all = src.host_f32()?;
                Tensor::from_f32_with(&Device::Reference, &[t * n, hd], |rows| {
                    for (i, r) in rows.chunks_exact_mut(width).enumerate() {
                        r.copy_from_slice(&all[i * stride + col..][..width]);
                    }
                    Ok(())
                })
            };
            let (mut q, mut k) = (take(sources[0], heads)?, take(sources[1], kvh)?);
            let v = take(sources[2], kvh)?;
            if let Some(n) = prep.norm {
                q = rec.rms_norm(&q, n.q, n.eps)?;
                k = rec.rms_norm(&k, n.k, n.eps)?;
            }
            let q = rec.rope(&q.reshape(&[t, heads, hd])?, rope)?;
            let k = rec.rope(&k.reshape(&[t, kvh, hd])?, rope)?;
            self.write_host(layer, k.host_f32()?, v.host_f32()?, batch)?;
            return Ok(q);
        }
        let q = rec.output(DType::F32, &[t, heads, hd], "kv_write")?;
        self.launch_write(rec, layer, sources, heads, Some((prep, &q)), batch)?;
        Ok(q)
    }

    /// The host write of the CPU backend: each row as the pool's format stores it.
    fn write_host(
        &mut self,
        layer: usize,
        kv: &[f32],
        vv: &[f32],
        batch: &AttnBatch,
    ) -> Result<()> {
        let (kvh, hd, dtype) = (self.cfg.kv_heads, self.cfg.head_dim, self.cfg.dtype);
        let Store::Cpu(layers) = &mut self.store else {
            return invalid("host write on a device cache".into());
        };
        let [kp, vp] = &mut layers[layer];
        if let HostPool::I4 { .. } = kp {
            // Attention adds the centres back from their turns at the keys' positions.
            self.turns
                .cover(batch.positions().max().map_or(0, |p| p as usize + 1));
        }
        let centres = &self.centres[layer * kvh * CENTRED_PAIRS..][..kvh * CENTRED_PAIRS];
        // A row's room (head_dim is at most MAX_HEAD_DIM): no allocation a write.
        let (mut centred, mut scratch) = ([0f32; MAX_HEAD_DIM], [0f32; MAX_HEAD_DIM]);
        let centred = &mut centred[..hd];
        for (t, &slot) in batch.slots.iter().enumerate() {
            let pos = batch.info[2 * t + 1];
            for h in 0..kvh {
                let src = (t * kvh + h) * hd;
                let r = slot as usize * kvh + h;
                let key = &kv[src..src + hd];
                if dtype == KvDtype::Int4 {
                    // Stored less the centres, read back with them (what the kernels'
                    // scores add back; an f32 pool holds the keys as read).
                    let c = &centres[h * CENTRED_PAIRS..][..CENTRED_PAIRS];
                    centred.copy_from_slice(key);
                    shift_row(c, pos, -1.0, centred);
                    kp.store(dtype, r, centred, &mut scratch);
                    if let HostPool::F32(k) = kp {
                        shift_row(c, pos, 1.0, &mut k[r * hd..][..hd]);
                    }
                } else {
                    kp.store(dtype, r, key, &mut scratch);
                }
                vp.store(dtype, r, &vv[src..src + hd], &mut scratch);
            }
        }
        Ok(())
    }

    /// One launch of `kv_write.wgsl`: `heads` query rows (with `prep` and Q's output) and
    /// every kv head row of the batch's tokens.
    fn launch_write(
        &self,
        rec: &mut Recorder,
        layer: usize,
        [q, k, v]: [Source<'_>; 3],
        heads: usize,
        prep: Option<(&QkPrep<'_>, &Tensor)>,
        batch: &AttnBatch,
    ) -> Result<()> {
        let Store::Gpu(layers) = &self.store else {
            return invalid("device write on a host cache".into());
        };
        let l = &layers[layer];
        let Some([info, _, slots]) = &batch.device else {
            return invalid("batch was built for another device".into());
        };
        let (kvh, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        let rope = prep.map(|(p, _)| p.rope.table());
        let norm = prep.and_then(|(p, _)| p.norm);
        let cfg = rope.map(|r| *r.config());
        let params = WriteParams {
            tokens: batch.tokens as u32,
            kv_heads: kvh as u32,
            head_dim: hd as u32,
            had_norm: hadamard_norm(hd),
            heads: heads as u32,
            q_stride: q.1 as u32,
            q_col: q.2 as u32,
            k_stride: k.1 as u32,
            k_col: k.2 as u32,
            v_stride: v.1 as u32,
            v_col: v.2 as u32,
            rot: cfg.map_or(0, |c| c.rotary_dim as u32),
            max_pos: rope.map_or(0, |r| r.max_positions() as u32),
            interleaved: u32::from(cfg.is_some_and(|c| c.layout == RopeLayout::Interleaved)),
            qk_norm: u32::from(norm.is_some()),
            eps: norm.map_or(0.0, |n| n.eps),
        };
        // Unused bindings take any buffer of the right kind: K's source, a one-value output.
        let spare;
        let q_out = match prep {
            Some((_, q_out)) => q_out,
            None => {
                spare = rec.output(DType::F32, &[1], "kv_write")?;
                &spare
            }
        };
        let table = rope.map_or(k.0, |r| r.tensor());
        let (qn, kn) = norm.map_or((k.0, k.0), |n| (n.q, n.k));
        let mut bufs = vec![q.0, k.0, v.0, slots, info, table, qn, kn, q_out, &l.k, &l.v];
        bufs.extend(l.extras());
        let def = variant(
            [&KV_WRITE, &KV_WRITE_SCALED, &KV_WRITE_I4],
            l.extras().len(),
        );
        // GPUs take a workgroup a head row (its form `PAR`), CPU-type adapters an invocation.
        let rows = batch.tokens * (heads + kvh);
        let par = !self.cpu_adapter;
        let scaled = matches!(self.cfg.dtype, KvDtype::Int8 | KvDtype::Int4);
        let defines = [
            dtype_define(self.cfg.dtype),
            ("PAR", flag(par)),
            ("KV_SCALED", flag(scaled)),
        ];
        let groups = if par { rows } else { rows.div_ceil(64) };
        rec.launch(def, &defines, &params, &bufs, groups as u32)?;
        Ok(())
    }
}

/// A source of `tokens` rows of `width` F32 values.
fn check_source(what: &str, t: &Tensor, tokens: usize, width: usize) -> Result<()> {
    if t.dtype() != DType::F32 || t.elem_count() != tokens * width || t.cols() != width {
        return invalid(format!(
            "{what} must be F32 [{tokens}, {width}], got {:?} {:?}",
            t.dtype(),
            t.shape()
        ));
    }
    Ok(())
}
