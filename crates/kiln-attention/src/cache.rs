//! The per-layer K/V pools and the launches over them: write, copy, attention.
//!
//! Each layer has a K pool and a V pool shaped `[blocks, block_size, kv_heads, head_dim]` in
//! F16 (default), F32, INT8 with one f32 scale per (slot, kv head), or INT4 (eight to a word)
//! with one f16 scale and one f16 zero point per (slot, kv head), packed in one word, its keys
//! stored less their head's centres ([`KvCache::set_key_centres`]). A step first writes the
//! new tokens' K/V rows into their slots ([`KvCache::write`]), then runs paged attention for
//! every query token of the batch in one launch ([`KvCache::attention`]); both read the same
//! [`AttnBatch`] (block tables, positions, slot mapping), built once per step (and uploaded
//! once, for a GPU cache) and shared by all layers.
//!
//! On the native CPU backend the pools are host vectors of each format's own bytes (as many
//! as the GPU's, and as `kiln-kv`'s plan counts); on the reference they are `f32` vectors
//! holding exactly the values the device format would hold (rounded to f16, or quantized to
//! INT8 or INT4 and back), so every backend computes the same attention.

use std::borrow::Borrow;

use bytemuck::{Pod, Zeroable};
use kiln_kv::{BlockCopy, BlockId, KvDtype};
use kiln_tensor::{Access, DType, Device, Keep, KernelDef, Recorder, Tensor};

mod attend;
mod centres;
mod write;

use crate::native::CallLists;
use crate::stored::{
    CENTRED_PAIRS, CentreTurns, KeyCentre, quantize_i4_row, quantize_i8, store_row,
};
use crate::{KvDeviceError, Result};
use centres::centre_tensor;
use half::slice::HalfFloatSliceExt;
pub use write::{QkNorm, QkPrep, QkvRows};

fn invalid<T>(msg: String) -> Result<T> {
    Err(KvDeviceError::Invalid(msg))
}

/// The shape of a paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

impl KvCacheConfig {
    fn slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqBatch<'a> {
    /// Physical blocks, in logical order, covering at least `context_len` tokens (a
    /// sliding-window sequence's [`BlockId::TRIMMED`] entries are never read).
    pub block_table: &'a [BlockId],
    /// Query tokens of this sequence in the step (prompt chunk, or 1 for decode).
    pub query_len: usize,
    /// Tokens in the cache once this step's tokens are written (cached prefix + `query_len`).
    pub context_len: usize,
}

/// Attention hyper-parameters of a layer.
#[derive(Debug, Clone)]
pub struct AttnConfig {
    /// Query heads (a multiple of the cache's kv heads: GQA/MQA).
    pub heads: usize,
    /// Softmax scale, usually 1/sqrt(head_dim).
    pub scale: f32,
    /// Sliding window in tokens (Mistral), or `None` for full attention.
    pub window: Option<usize>,
    /// Attention sinks (GPT-OSS): F32 `[heads]`, on the cache's device. Head h's sink is a
    /// logit (compared with the scaled scores as it is) that joins every query's softmax
    /// with no value row, so it takes a share of the weight and adds nothing to the output.
    pub sinks: Option<Tensor>,
}

/// A step's attention metadata, validated against the cache (and uploaded once, for a GPU
/// cache). The default is empty, for [`KvCache::batch_into`] to fill.
#[derive(Debug, Default)]
pub struct AttnBatch {
    pub(crate) tokens: usize,
    /// Per query token: (offset of its block table in `tables`, absolute position).
    pub(crate) info: Vec<u32>,
    pub(crate) tables: Vec<u32>,
    /// Per query token: the slot its K/V row is written to.
    slots: Vec<u32>,
    /// Query groups of the rows kernel's shared form: (first token, tokens), each run of at
    /// most [`SHARED_LANES`] consecutive query tokens of one sequence. On the device they
    /// follow `info` in its buffer.
    groups: Vec<[u32; 2]>,
    /// `info` (with `groups`), `tables` and `slots` uploaded: a GPU cache's only (the host
    /// pools read the lists).
    device: Option<[Tensor; 3]>,
}

impl AttnBatch {
    /// No tokens, the lists' room kept.
    fn clear(&mut self) {
        self.tokens = 0;
        self.info.clear();
        self.tables.clear();
        self.slots.clear();
        self.groups.clear();
        self.device = None;
    }

    /// Each query token's absolute position, in order.
    pub(crate) fn positions(&self) -> impl Iterator<Item = u32> + '_ {
        self.info.iter().skip(1).step_by(2).copied()
    }

    /// Query tokens in the step.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The slot of each query token (block id × block size + offset).
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }
}

struct Layer {
    k: Tensor,
    v: Tensor,
    scales: Option<[Tensor; 2]>,
    /// INT4: the layer's key centres, `[kv_heads, CENTRED_PAIRS]` ([`centre_tensor`]).
    centres: Option<Tensor>,
}

impl Layer {
    /// What the layer's format binds after its K and V pools: the scales (INT8: scale;
    /// INT4: scale|zero), then INT4's key centres.
    fn extras(&self) -> Vec<&Tensor> {
        let mut v: Vec<&Tensor> = self.scales.iter().flatten().collect();
        v.extend(&self.centres);
        v
    }
}

/// The kernel of a family (`[plain, scaled, INT4]`) that binds `extras` buffers after the
/// pools.
fn variant(family: [&'static KernelDef; 3], extras: usize) -> &'static KernelDef {
    match extras {
        0 => family[0],
        2 => family[1],
        _ => family[2],
    }
}

enum Store {
    /// Each layer's K and V pools in host memory.
    Cpu(Vec<[HostPool; 2]>),
    Gpu(Vec<Layer>),
}

/// A K or V pool in host memory. On the native backend each format's own bytes: f32, f16,
/// INT8 with a scale per (slot, kv head) row, INT4 levels (in the rotated basis) with an f16
/// scale and zero point per row. On the reference, f32 values exactly as the cache's format
/// holds them (rounded to f16, or quantized and back), which its plain attention reads.
#[derive(Debug, Clone)]
pub(crate) enum HostPool {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    /// Each row's values, then each row's scale.
    I8 {
        q: Vec<i8>,
        scale: Vec<f32>,
    },
    /// Each row's levels, two a byte (element 2i in the low nibble, 2i + 1 in the high),
    /// then each row's scale and zero point.
    I4 {
        q: Vec<u8>,
        params: Vec<[half::f16; 2]>,
    },
}

impl HostPool {
    /// A zeroed pool of `rows` rows of `d` elements.
    fn new(device: &Device, dtype: KvDtype, rows: usize, d: usize) -> Self {
        let elems = rows * d;
        match (device, dtype) {
            (Device::Cpu(_), KvDtype::F16) => HostPool::F16(vec![half::f16::ZERO; elems]),
            (Device::Cpu(_), KvDtype::Int8) => HostPool::I8 {
                q: vec![0; elems],
                scale: vec![0.0; rows],
            },
            (Device::Cpu(_), KvDtype::Int4) => HostPool::I4 {
                q: vec![0; elems / 2],
                params: vec![[half::f16::ZERO; 2]; rows],
            },
            _ => HostPool::F32(vec![0f32; elems]),
        }
    }

    fn bytes(&self) -> usize {
        use std::mem::size_of_val;
        match self {
            HostPool::F32(p) => size_of_val(&p[..]),
            HostPool::F16(p) => size_of_val(&p[..]),
            HostPool::I8 { q, scale } => size_of_val(&q[..]) + size_of_val(&scale[..]),
            HostPool::I4 { q, params } => size_of_val(&q[..]) + size_of_val(&params[..]),
        }
    }

    /// Copy rows `src` to the rows from `dst` on (rows of `d` elements).
    fn copy_rows(&mut self, src: std::ops::Range<usize>, dst: usize, d: usize) {
        let elems = |r: std::ops::Range<usize>, per: usize| r.start * per..r.end * per;
        match self {
            HostPool::F32(p) => p.copy_within(elems(src, d), dst * d),
            HostPool::F16(p) => p.copy_within(elems(src, d), dst * d),
            HostPool::I8 { q, scale } => {
                q.copy_within(elems(src.clone(), d), dst * d);
                scale.copy_within(src, dst);
            }
            HostPool::I4 { q, params } => {
                q.copy_within(elems(src.clone(), d / 2), dst * d / 2);
                params.copy_within(src, dst);
            }
        }
    }

    /// Store `src` as row `r` in the pool's form of `dtype` (`scratch`: a row's room).
    fn store(&mut self, dtype: KvDtype, r: usize, src: &[f32], scratch: &mut [f32]) {
        let d = src.len();
        match self {
            HostPool::F32(p) => store_row(dtype, src, &mut p[r * d..][..d]),
            HostPool::F16(p) => p[r * d..][..d].convert_from_f32_slice(src),
            HostPool::I8 { q, scale } => scale[r] = quantize_i8(src, &mut q[r * d..][..d]),
            HostPool::I4 { q, params } => {
                let mut levels = [0u8; MAX_HEAD_DIM];
                let [scale, zero] = quantize_i4_row(src, &mut scratch[..d], &mut levels[..d]);
                params[r] = [scale, zero].map(half::f16::from_f32);
                for (b, l) in q[r * d / 2..][..d / 2]
                    .iter_mut()
                    .zip(levels.chunks_exact(2))
                {
                    *b = l[0] | (l[1] << 4);
                }
            }
        }
    }
}

/// Per-layer K/V block pools on a device.
pub struct KvCache {
    cfg: KvCacheConfig,
    device: Device,
    /// The device is a CPU-type wgpu adapter (picks the attention kernel).
    cpu_adapter: bool,
    /// Every subgroup has the lanes the rows kernel's shared form broadcasts across.
    shared_broadcast: bool,
    store: Store,
    /// `[layers, kv_heads, CENTRED_PAIRS]`: what an INT4 pool takes out of its keys (zero
    /// until [`KvCache::set_key_centres`]).
    centres: Vec<KeyCentre>,
    /// The centres' turns at the positions written (read by native INT4 attention).
    turns: CentreTurns,
    /// A key has been written (the centres can no longer change).
    written: bool,
    /// Native attention's lists, kept from call to call.
    call: Keep<CallLists>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvCache({:?} on {:?})", self.cfg, self.device)
    }
}

const R: Access = Access::Read;
const W: Access = Access::ReadWrite;
static KV_COPY: KernelDef = KernelDef {
    name: "kv_copy",
    source: include_str!("../wgsl/kv_copy.wgsl"),
    bindings: &[R, W],
};
/// Largest head_dim the attention kernel handles (its query row lives in workgroup memory).
pub const MAX_HEAD_DIM: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct CopyParams {
    pairs: u32,
    words: u32,
    _pad: [u32; 2],
}

/// Query tokens of one sequence a workgroup of the rows kernel's shared form takes (its
/// workgroup size, and the lanes a subgroup must have for its broadcast reads).
const SHARED_LANES: usize = 8;

/// A switch's define value.
fn flag(on: bool) -> String {
    if on { "1" } else { "0" }.to_string()
}

fn dtype_define(d: KvDtype) -> (&'static str, String) {
    let name = match d {
        KvDtype::F32 => "KV_F32",
        KvDtype::F16 => "KV_F16",
        KvDtype::Int8 => "KV_I8",
        KvDtype::Int4 => "KV_I4",
    };
    (name, "1".to_string())
}

impl KvCache {
    /// Allocate zeroed pools for every layer.
    pub fn new(device: &Device, cfg: KvCacheConfig) -> Result<Self> {
        if cfg.layers == 0 || cfg.kv_heads == 0 || cfg.block_size == 0 || cfg.num_blocks == 0 {
            return invalid(format!("every dimension must be non-zero: {cfg:?}"));
        }
        // A head row fills whole pool words: four f32 lanes, two f16, four i8, eight i4.
        let multiple = match cfg.dtype {
            KvDtype::Int4 => 8,
            _ => 4,
        };
        if cfg.head_dim == 0
            || cfg.head_dim > MAX_HEAD_DIM
            || !cfg.head_dim.is_multiple_of(multiple)
        {
            return invalid(format!(
                "head_dim {} must be a multiple of {multiple} in {multiple}..={MAX_HEAD_DIM} for a {} cache",
                cfg.head_dim, cfg.dtype
            ));
        }
        if cfg.slots() >= BlockId::TRIMMED.0 as usize / 2 {
            return invalid(format!(
                "{} slots exceed the 32-bit slot index",
                cfg.slots()
            ));
        }
        let elems = cfg.slots() * cfg.kv_heads * cfg.head_dim;
        let store = match device {
            Device::Reference | Device::Cpu(_) => Store::Cpu(
                (0..cfg.layers)
                    .map(|_| {
                        let rows = cfg.slots() * cfg.kv_heads;
                        [0, 1].map(|_| HostPool::new(device, cfg.dtype, rows, cfg.head_dim))
                    })
                    .collect(),
            ),
            Device::Wgpu(_) => {
                let pool = |what| -> Result<Tensor> {
                    let t = match cfg.dtype {
                        KvDtype::F32 => Tensor::zeros(device, DType::F32, &[elems]),
                        // Packed into words.
                        d => {
                            let words = elems * d.element_bits() as usize / 32;
                            Tensor::zeros(device, DType::U32, &[words])
                        }
                    };
                    t.map_err(|source| KvDeviceError::Pool {
                        what,
                        blocks: cfg.num_blocks,
                        source,
                    })
                };
                let mut layers = Vec::with_capacity(cfg.layers);
                for _ in 0..cfg.layers {
                    // One word per (slot, head): the INT8 f32 scale, the INT4 f16 scale|zero.
                    let n = cfg.slots() * cfg.kv_heads;
                    let scales = match cfg.dtype {
                        KvDtype::Int8 => Some([
                            Tensor::zeros(device, DType::F32, &[n])?,
                            Tensor::zeros(device, DType::F32, &[n])?,
                        ]),
                        KvDtype::Int4 => Some([
                            Tensor::zeros(device, DType::U32, &[n])?,
                            Tensor::zeros(device, DType::U32, &[n])?,
                        ]),
                        KvDtype::F16 | KvDtype::F32 => None,
                    };
                    let centres = match cfg.dtype {
                        KvDtype::Int4 => Some(centre_tensor(
                            device,
                            &vec![KeyCentre::default(); cfg.kv_heads * CENTRED_PAIRS],
                        )?),
                        _ => None,
                    };
                    layers.push(Layer {
                        k: pool("K")?,
                        v: pool("V")?,
                        scales,
                        centres,
                    });
                }
                Store::Gpu(layers)
            }
        };
        let centres = vec![KeyCentre::default(); cfg.layers * cfg.kv_heads * CENTRED_PAIRS];
        Ok(Self {
            cfg,
            device: device.clone(),
            cpu_adapter: device.cpu_shaped_kernels(),
            shared_broadcast: {
                let i = device.info();
                i.subgroups && i.subgroup_size.0 as usize >= SHARED_LANES
            },
            store,
            centres: centres.clone(),
            turns: CentreTurns::new(&centres),
            written: false,
            call: Keep::default(),
        })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.cfg
    }

    /// Bytes the pools hold, scales included. On the native backend and the GPU each format's
    /// own bytes (what `kiln-kv`'s plan counts per token); the reference holds every format
    /// as f32 values.
    pub fn pool_bytes(&self) -> usize {
        let tensor = |t: &Tensor| t.dtype().bytes_for(t.elem_count()).unwrap_or(0);
        match &self.store {
            Store::Cpu(layers) => layers.iter().flatten().map(HostPool::bytes).sum(),
            Store::Gpu(layers) => layers
                .iter()
                .map(|l| {
                    let scales = l.scales.iter().flatten();
                    tensor(&l.k) + tensor(&l.v) + scales.map(tensor).sum::<usize>()
                })
                .sum(),
        }
    }

    /// Validate a step's sequences against the cache (and upload their metadata, for a GPU
    /// cache). Sequences are laid out in order along the token dimension of Q, K and V.
    pub fn batch(&self, seqs: &[SeqBatch<'_>]) -> Result<AttnBatch> {
        let mut batch = AttnBatch::default();
        self.batch_into(seqs, &mut batch)?;
        Ok(batch)
    }

    /// [`KvCache::batch`] into `batch`, its lists reused (a step after the first allocates
    /// none on a host cache). After an error `batch` is empty.
    pub fn batch_into<'a>(
        &self,
        seqs: impl IntoIterator<Item = impl Borrow<SeqBatch<'a>>>,
        batch: &mut AttnBatch,
    ) -> Result<()> {
        batch.clear();
        let r = self.fill_batch(seqs, batch);
        if r.is_err() {
            batch.clear();
        }
        r
    }

    /// [`KvCache::batch_into`] into an empty `batch`.
    fn fill_batch<'a>(
        &self,
        seqs: impl IntoIterator<Item = impl Borrow<SeqBatch<'a>>>,
        batch: &mut AttnBatch,
    ) -> Result<()> {
        let bs = self.cfg.block_size;
        let AttnBatch {
            info,
            tables,
            slots,
            groups,
            ..
        } = batch;
        for (i, s) in seqs.into_iter().enumerate() {
            let s = s.borrow();
            if s.query_len == 0 || s.query_len > s.context_len {
                return invalid(format!(
                    "sequence {i}: query_len {} must be in 1..=context_len {}",
                    s.query_len, s.context_len
                ));
            }
            let need = s.context_len.div_ceil(bs);
            if s.block_table.len() < need {
                return invalid(format!(
                    "sequence {i}: {} blocks cover fewer than its {} tokens",
                    s.block_table.len(),
                    s.context_len
                ));
            }
            if let Some(b) = s.block_table[..need]
                .iter()
                .find(|b| !b.is_trimmed() && b.0 as usize >= self.cfg.num_blocks)
            {
                return invalid(format!(
                    "sequence {i}: {b} is outside the pool of {}",
                    self.cfg.num_blocks
                ));
            }
            let offset = tables.len() as u32;
            tables.extend(s.block_table[..need].iter().map(|b| b.0));
            let first = slots.len();
            groups.extend((0..s.query_len).step_by(SHARED_LANES).map(|g| {
                [
                    (first + g) as u32,
                    (s.query_len - g).min(SHARED_LANES) as u32,
                ]
            }));
            for pos in s.context_len - s.query_len..s.context_len {
                let block = s.block_table[pos / bs];
                if block.is_trimmed() {
                    return invalid(format!(
                        "sequence {i}: position {pos} falls in a freed block"
                    ));
                }
                info.extend([offset, pos as u32]);
                slots.push(block.0 * bs as u32 + (pos % bs) as u32);
            }
        }
        if slots.is_empty() {
            return invalid("a batch needs at least one sequence".into());
        }
        let tokens = slots.len();
        // The host pools read the lists themselves; a GPU's kernels read them uploaded.
        batch.device = match (&self.store, &self.device) {
            (Store::Cpu(_), _) => None,
            (Store::Gpu(_), d) => Some([
                {
                    let mut words = info.clone();
                    words.extend(groups.iter().flatten());
                    Tensor::from_u32(d, &[words.len()], &words)?
                },
                Tensor::from_u32(d, &[tables.len()], tables)?,
                Tensor::from_u32(d, &[tokens], slots)?,
            ]),
        };
        batch.tokens = tokens;
        Ok(())
    }

    fn check_rows(&self, what: &str, t: &Tensor, tokens: usize, heads: usize) -> Result<()> {
        if t.dtype() != DType::F32 || t.shape() != [tokens, heads, self.cfg.head_dim] {
            return invalid(format!(
                "{what} must be F32 [{tokens}, {heads}, {}], got {:?} {:?}",
                self.cfg.head_dim,
                t.dtype(),
                t.shape()
            ));
        }
        Ok(())
    }

    /// The sinks of `attn`, if any, are F32 `[heads]` (the launch checks their device).
    fn check_sinks(&self, attn: &AttnConfig) -> Result<()> {
        let Some(s) = &attn.sinks else {
            return Ok(());
        };
        if s.dtype() != DType::F32 || s.shape() != [attn.heads] {
            return invalid(format!(
                "attention sinks must be F32 [{}] (one per query head), got {:?} {:?}",
                attn.heads,
                s.dtype(),
                s.shape()
            ));
        }
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.cfg.layers {
            return invalid(format!("layer {layer} of {}", self.cfg.layers));
        }
        Ok(())
    }

    /// Copy whole blocks `src → dst` in every layer's pools (copy-on-write after a fork, as
    /// the block manager asks). A destination must not also be a source in the same call.
    pub fn copy_blocks(&mut self, rec: &mut Recorder, copies: &[BlockCopy]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let pairs: Vec<(u32, u32)> = copies.iter().map(|c| (c.src.0, c.dst.0)).collect();
        let nb = self.cfg.num_blocks as u32;
        if let Some(p) = pairs.iter().find(|(s, d)| *s >= nb || *d >= nb || s == d) {
            return invalid(format!(
                "block copy {p:?}: ids must be distinct and below {nb}"
            ));
        }
        if pairs.iter().any(|(_, d)| pairs.iter().any(|(s, _)| s == d)) {
            return invalid("a block copy destination is also a source".into());
        }
        let rows = self.cfg.block_size * self.cfg.kv_heads;
        let per_block = rows * self.cfg.head_dim;
        match &mut self.store {
            Store::Cpu(layers) => {
                for pools in layers.iter_mut() {
                    for pool in pools.iter_mut() {
                        for &(s, d) in &pairs {
                            let (s, d) = (s as usize * rows, d as usize * rows);
                            pool.copy_rows(s..s + rows, d, self.cfg.head_dim);
                        }
                    }
                }
                Ok(())
            }
            Store::Gpu(layers) => {
                let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
                let pairs_t = Tensor::from_u32(&self.device, &[flat.len()], &flat)?;
                let words = per_block * self.cfg.dtype.element_bits() as usize / 32;
                let scale_words = self.cfg.block_size * self.cfg.kv_heads;
                for l in layers.iter() {
                    let mut pools = vec![(&l.k, words), (&l.v, words)];
                    if let Some([ks, vs]) = &l.scales {
                        pools.extend([(ks, scale_words), (vs, scale_words)]);
                    }
                    for (pool, w) in pools {
                        let params = CopyParams {
                            pairs: pairs.len() as u32,
                            words: w as u32,
                            _pad: [0; 2],
                        };
                        rec.launch(
                            &KV_COPY,
                            &[],
                            &params,
                            &[&pairs_t, pool],
                            (pairs.len() * w).div_ceil(64) as u32,
                        )?;
                    }
                }
                Ok(())
            }
        }
    }
}
