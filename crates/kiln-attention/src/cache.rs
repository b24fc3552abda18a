//! The per-layer K/V pools and the launches over them: write, copy, attention.
//!
//! Each layer has a K pool and a V pool shaped `[blocks, block_size, kv_heads, head_dim]` in
//! F16 (default), F32, INT8 with one f32 scale per (slot, kv head), or INT4 (eight to a word)
//! with one f16 scale and one f16 zero point per (slot, kv head), packed in one word, its keys
//! stored less their head's centres ([`KvCache::set_key_centres`]). A step first writes the
//! new tokens' K/V rows into their slots ([`KvCache::write`]), then runs paged attention for
//! every query token of the batch in one launch ([`KvCache::attention`]); both read the same
//! [`AttnBatch`] (block tables, positions, slot mapping), uploaded once per step and shared by
//! all layers.
//!
//! On the CPU backend the pools are host `f32` vectors holding exactly the values the device
//! format would hold (rounded to f16, or quantized to INT8 or INT4 and back), so both backends compute
//! the same attention.

use bytemuck::{Pod, Zeroable};
use kiln_kv::{BlockCopy, BlockId, KvDtype};
use kiln_tensor::{Access, DType, Device, KernelDef, Recorder, Tensor};

mod attend;
mod centres;
mod write;

use crate::stored::{CENTRED_PAIRS, KeyCentre};
use crate::{KvDeviceError, Result};
use centres::centre_tensor;
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
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnConfig {
    /// Query heads (a multiple of the cache's kv heads: GQA/MQA).
    pub heads: usize,
    /// Softmax scale, usually 1/sqrt(head_dim).
    pub scale: f32,
    /// Sliding window in tokens (Mistral), or `None` for full attention.
    pub window: Option<usize>,
}

/// A step's attention metadata, validated against the cache and uploaded once.
#[derive(Debug)]
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
    device: Option<[Tensor; 3]>,
}

impl AttnBatch {
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

/// A K or V pool in host memory: on the native backend's f16 cache the f16s themselves (half
/// the bytes a decode step reads); otherwise f32 values exactly as the cache's format holds
/// them (the reference's pools, and the native backend's other formats).
#[derive(Debug, Clone)]
pub(crate) enum HostPool {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
}

impl HostPool {
    fn new(device: &Device, dtype: KvDtype, elems: usize) -> Self {
        match (device, dtype) {
            (Device::Cpu(_), KvDtype::F16) => HostPool::F16(vec![half::f16::ZERO; elems]),
            _ => HostPool::F32(vec![0f32; elems]),
        }
    }

    fn copy_within(&mut self, src: std::ops::Range<usize>, dst: usize) {
        match self {
            HostPool::F32(p) => p.copy_within(src, dst),
            HostPool::F16(p) => p.copy_within(src, dst),
        }
    }

    /// The pool's values as f32.
    fn to_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            HostPool::F32(p) => std::borrow::Cow::Borrowed(p),
            HostPool::F16(p) => std::borrow::Cow::Owned(p.iter().map(|v| v.to_f32()).collect()),
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
                    .map(|_| [0, 1].map(|_| HostPool::new(device, cfg.dtype, elems)))
                    .collect(),
            ),
            Device::Wgpu(_) => {
                let pool = |what| -> Result<Tensor> {
                    let t = match cfg.dtype {
                        KvDtype::F32 => Tensor::zeros(device, DType::F32, &[elems]),
                        KvDtype::F16 => Tensor::zeros(device, DType::U32, &[elems / 2]),
                        KvDtype::Int8 => Tensor::zeros(device, DType::U32, &[elems / 4]),
                        KvDtype::Int4 => Tensor::zeros(device, DType::U32, &[elems / 8]),
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
        Ok(Self {
            cfg,
            device: device.clone(),
            cpu_adapter: device.cpu_shaped_kernels(),
            shared_broadcast: {
                let i = device.info();
                i.subgroups && i.subgroup_size.0 as usize >= SHARED_LANES
            },
            store,
            centres: vec![KeyCentre::default(); cfg.layers * cfg.kv_heads * CENTRED_PAIRS],
        })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.cfg
    }

    /// Validate a step's sequences against the cache and upload their metadata.
    /// Sequences are laid out in order along the token dimension of Q, K and V.
    pub fn batch(&self, seqs: &[SeqBatch<'_>]) -> Result<AttnBatch> {
        let bs = self.cfg.block_size;
        let (mut info, mut tables, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        let mut groups = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
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
        let device = match &self.device {
            Device::Reference => None,
            d => Some([
                {
                    let mut words = info.clone();
                    words.extend(groups.iter().flatten());
                    Tensor::from_u32(d, &[words.len()], &words)?
                },
                Tensor::from_u32(d, &[tables.len()], &tables)?,
                Tensor::from_u32(d, &[tokens], &slots)?,
            ]),
        };
        Ok(AttnBatch {
            tokens,
            info,
            tables,
            slots,
            groups,
            device,
        })
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
        let per_block = self.cfg.block_size * self.cfg.kv_heads * self.cfg.head_dim;
        match &mut self.store {
            Store::Cpu(layers) => {
                for pools in layers.iter_mut() {
                    for pool in pools.iter_mut() {
                        for &(s, d) in &pairs {
                            let (s, d) = (s as usize * per_block, d as usize * per_block);
                            pool.copy_within(s..s + per_block, d);
                        }
                    }
                }
                Ok(())
            }
            Store::Gpu(layers) => {
                let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
                let pairs_t = Tensor::from_u32(&self.device, &[flat.len()], &flat)?;
                let words = match self.cfg.dtype {
                    KvDtype::F32 => per_block,
                    KvDtype::F16 => per_block / 2,
                    KvDtype::Int8 => per_block / 4,
                    KvDtype::Int4 => per_block / 8,
                };
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
