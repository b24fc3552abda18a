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

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use bytemuck::{Pod, Zeroable};
use kiln_kv::{BlockCopy, BlockId, KvDtype};
use kiln_tensor::{Access, DType, Device, KernelDef, Recorder, Tensor};

mod centres;
mod write;

use crate::reference;
use crate::stored::{CENTRED_PAIRS, KeyCentre, hadamard_norm};
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
    Cpu(Vec<[Vec<f32>; 2]>),
    Gpu(Vec<Layer>),
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

// `hadamard.wgsl` (the INT4 rotation) and `centre.wgsl` (its key centres) are prepended to
// the kernels that write or read K/V.
const ATTN_SRC: &str = concat!(
    include_str!("../wgsl/hadamard.wgsl"),
    include_str!("../wgsl/centre.wgsl"),
    include_str!("../wgsl/paged_attention.wgsl")
);
const R: Access = Access::Read;
const W: Access = Access::ReadWrite;
static KV_COPY: KernelDef = KernelDef {
    name: "kv_copy",
    source: include_str!("../wgsl/kv_copy.wgsl"),
    bindings: &[R, W],
};
static ATTN: KernelDef = KernelDef {
    name: "paged_attention",
    source: ATTN_SRC,
    bindings: &[R, R, R, W, R, R],
};
static ATTN_SCALED: KernelDef = KernelDef {
    name: "paged_attention",
    source: ATTN_SRC,
    bindings: &[R, R, R, W, R, R, R, R],
};
/// INT4: also the layer's key centres.
static ATTN_I4: KernelDef = KernelDef {
    name: "paged_attention",
    source: ATTN_SRC,
    bindings: &[R, R, R, W, R, R, R, R, R],
};
/// The second pass of split-key attention.
static ATTN_COMBINE: KernelDef = KernelDef {
    name: "attention_combine",
    source: include_str!("../wgsl/attention_combine.wgsl"),
    bindings: &[R, W],
};
const ATTN_ROWS_SRC: &str = concat!(
    include_str!("../wgsl/hadamard.wgsl"),
    include_str!("../wgsl/centre.wgsl"),
    include_str!("../wgsl/paged_attention_rows.wgsl")
);
static ATTN_ROWS: KernelDef = KernelDef {
    name: "paged_attention_rows",
    source: ATTN_ROWS_SRC,
    bindings: &[R, R, R, W, R, R],
};
static ATTN_ROWS_SCALED: KernelDef = KernelDef {
    name: "paged_attention_rows",
    source: ATTN_ROWS_SRC,
    bindings: &[R, R, R, W, R, R, R, R],
};
static ATTN_ROWS_I4: KernelDef = KernelDef {
    name: "paged_attention_rows",
    source: ATTN_ROWS_SRC,
    bindings: &[R, R, R, W, R, R, R, R, R],
};

/// Largest head_dim the attention kernel handles (its query row lives in workgroup memory).
pub const MAX_HEAD_DIM: usize = 256;

/// The most keys one query may read in the one-invocation-per-head kernel of CPU-type
/// adapters: llvmpipe ends a loop nest after 65,535 iterations (the key loop, with the per-key
/// work unrolled), silently, so a longer context takes the workgroup kernel.
const ROWS_MAX_KEYS: usize = 65_000;

/// The rows kernel's per-key work, unrolled over the head (`K_DOT`: the score `s` of K row
/// `row` against `qv`; `V_ACC`: `acc` rescaled by `alpha` plus `pj` × V row `row`), for
/// `per_read` elements per 16-byte read (at most 32: INT4's eight vec4s). An INT4 score also
/// gets its key's centre terms back (`centre_term` of each of the [`CENTRED_PAIRS`]). Under
/// `broadcast` (the shared form with subgroups) lane c reads the row's words c, c + 8, ...
/// and each word reaches every lane by `subgroupBroadcast`.
fn rows_unrolled(head_dim: usize, per_read: usize, broadcast: bool) -> UnrolledCode {
    // Written out once per shape: a launch's recording costs a hash lookup and copies.
    type Memo = Mutex<HashMap<(usize, usize, bool), UnrolledCode>>;
    static MEMO: OnceLock<Memo> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
    memo.entry((head_dim, per_read, broadcast))
        .or_insert_with(|| write_unrolled(head_dim, per_read, broadcast))
        .clone()
}

/// The `K_DOT` and `V_ACC` defines [`rows_unrolled`] hands to the shader's preprocessor.
type UnrolledCode = [(&'static str, String); 2];

fn write_unrolled(head_dim: usize, per_read: usize, broadcast: bool) -> UnrolledCode {
    const PARTS: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let vec4s = per_read / 4;
    let words = head_dim / per_read;
    let (mut k, mut v) = (String::new(), String::new());
    if broadcast {
        for r in 0..words.div_ceil(SHARED_LANES) {
            let at = |pool: &str| {
                format!(
                    "        let {pool}r{r} = {pool}_pool[row * NL + min(lane + {}u, NL - 1u)];\n",
                    r * SHARED_LANES
                )
            };
            k += &at("k");
            v += &at("v");
        }
    }
    for c in 0..words {
        let word = |pool: &str| {
            if broadcast {
                let (r, lane) = (c / SHARED_LANES, c % SHARED_LANES);
                format!("{pool}_dec(subgroupBroadcast({pool}r{r}, {lane}u), row)")
            } else {
                format!("{pool}_part(row, {c}u)")
            }
        };
        k += &format!("        {{\n            let k = {};\n", word("k"));
        v += &format!("        {{\n            let v = {};\n", word("v"));
        for (j, part) in PARTS.iter().enumerate().take(vec4s) {
            let i = c * vec4s + j;
            k += &format!("            s += dot(qv[{i}], k.{part});\n");
            v += &format!("            acc[{i}] = acc[{i}] * alpha + pj * v.{part};\n");
        }
        k += "        }\n";
        v += "        }\n";
    }
    if per_read == 32 {
        for i in 0..CENTRED_PAIRS {
            k += &format!("        s += centre_term(cq[{i}], j);\n");
        }
    }
    [("K_DOT", k), ("V_ACC", v)]
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct CopyParams {
    pairs: u32,
    words: u32,
    _pad: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct AttnParams {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    window: u32,
    scale: f32,
    had_norm: f32,
    groups: u32,
    /// The GPU kernel's split keys: runs per query, keys per run (1 and 0: unsplit).
    splits: u32,
    split_keys: u32,
    _pad: u32,
}

/// Split-key attention (flash-decoding) on the GPU kernel: a step whose (query token, head)
/// pairs are fewer than this many workgroups splits each query's keys into runs, one
/// workgroup each, so a decode step of a few sequences still spreads over the whole GPU.
const SPLIT_WORKGROUPS: usize = 1024;
/// Fewest keys of a run.
const SPLIT_MIN_KEYS: usize = 32;

/// `(runs, keys a run)` for `pairs` (query token, head) pairs whose queries read at most
/// `span` keys: (1, 0) where the pairs fill the GPU or the span is short.
fn key_split(pairs: usize, span: usize) -> (usize, usize) {
    let most = (SPLIT_WORKGROUPS / pairs.max(1)).max(1);
    let splits = span.div_ceil(SPLIT_MIN_KEYS).min(most);
    if splits <= 1 {
        return (1, 0);
    }
    let keys = span.div_ceil(splits);
    (span.div_ceil(keys), keys)
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
            Device::Cpu => Store::Cpu(
                (0..cfg.layers)
                    .map(|_| [vec![0f32; elems], vec![0f32; elems]])
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
            Device::Cpu => None,
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

    /// Paged attention of q `[tokens, heads, head_dim]` over `layer`'s cache; returns the
    /// attention output in the same shape. The batch's K/V must have been written first.
    pub fn attention(
        &self,
        rec: &mut Recorder,
        layer: usize,
        q: &Tensor,
        batch: &AttnBatch,
        attn: &AttnConfig,
    ) -> Result<Tensor> {
        self.check_layer(layer)?;
        let (kvh, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        if attn.heads == 0 || !attn.heads.is_multiple_of(kvh) {
            return invalid(format!(
                "{} query heads are not a multiple of {kvh} kv heads",
                attn.heads
            ));
        }
        self.check_rows("Q", q, batch.tokens, attn.heads)?;
        let window = attn.window.unwrap_or(0);
        match &self.store {
            Store::Cpu(layers) => {
                let [kp, vp] = &layers[layer];
                let out = reference::paged_attention_host(
                    &q.to_f32_vec()?,
                    kp,
                    vp,
                    batch,
                    &self.cfg,
                    attn,
                );
                Ok(Tensor::from_f32(&self.device, q.shape(), &out)?)
            }
            Store::Gpu(layers) => {
                let l = &layers[layer];
                let Some([info, tables, _]) = &batch.device else {
                    return invalid("batch was built for another device".into());
                };
                let out = rec.output(DType::F32, q.shape(), "paged_attention")?;
                let mut bufs = vec![q, info, tables, &out, &l.k, &l.v];
                bufs.extend(l.extras());
                let extras = bufs.len() - 6;
                let params = AttnParams {
                    tokens: batch.tokens as u32,
                    heads: attn.heads as u32,
                    kv_heads: kvh as u32,
                    head_dim: hd as u32,
                    block_size: self.cfg.block_size as u32,
                    window: window as u32,
                    scale: attn.scale,
                    had_norm: hadamard_norm(hd),
                    groups: batch.groups.len() as u32,
                    splits: 1,
                    split_keys: 0,
                    _pad: 0,
                };
                // CPU-type adapters take the one-invocation-per-head kernel, whose 16-byte
                // reads need the head size to be a whole number of them, while no query
                // reads more keys than its one loop may run (`ROWS_MAX_KEYS`).
                let per_read = match self.cfg.dtype {
                    KvDtype::F32 => 4,
                    KvDtype::F16 => 8,
                    KvDtype::Int8 => 16,
                    KvDtype::Int4 => 32,
                };
                let longest = batch
                    .info
                    .iter()
                    .skip(1)
                    .step_by(2)
                    .map(|&pos| pos as usize + 1)
                    .max()
                    .unwrap_or(0)
                    .min(attn.window.unwrap_or(usize::MAX));
                // Its shared form, where a step's sequences bring two query tokens or more a
                // group on average, walks a group's keys once for up to 8 tokens (a query
                // reads at most SHARED_LANES - 1 keys more).
                let shared = 2 * batch.groups.len() <= batch.tokens;
                let reach = longest + if shared { SHARED_LANES } else { 0 };
                if self.cpu_adapter && hd.is_multiple_of(per_read) && reach <= ROWS_MAX_KEYS {
                    let sg = shared && self.shared_broadcast;
                    let work = if shared {
                        batch.groups.len() * attn.heads
                    } else {
                        (batch.tokens * attn.heads).div_ceil(8)
                    };
                    let [k_dot, v_acc] = rows_unrolled(hd, per_read, sg);
                    let (sg_arg, sg_lane) = if sg {
                        ("@builtin(subgroup_invocation_id) sg_lane: u32,", "sg_lane")
                    } else {
                        ("", "0u")
                    };
                    let defines = [
                        dtype_define(self.cfg.dtype),
                        ("HEAD_DIM", hd.to_string()),
                        ("SHARED", flag(shared)),
                        ("SG", flag(sg)),
                        ("SG_ARG", sg_arg.to_string()),
                        ("SG_LANE", sg_lane.to_string()),
                        k_dot,
                        v_acc,
                    ];
                    let groups = work as u32;
                    let def = variant([&ATTN_ROWS, &ATTN_ROWS_SCALED, &ATTN_ROWS_I4], extras);
                    rec.launch(def, &defines, &params, &bufs, groups)?;
                    return Ok(out);
                }
                let pairs = batch.tokens * attn.heads;
                let defines = [dtype_define(self.cfg.dtype), ("HEAD_DIM", hd.to_string())];
                let def = variant([&ATTN, &ATTN_SCALED, &ATTN_I4], extras);
                let (splits, split_keys) = key_split(pairs, longest);
                if splits == 1 {
                    rec.launch(def, &defines, &params, &bufs, pairs as u32)?;
                    return Ok(out);
                }
                // Each run's output and (max, sum), then the runs weighed together.
                let parts = rec.output(
                    DType::F32,
                    &[pairs * splits * (hd + 2)],
                    "paged_attention_parts",
                )?;
                bufs[3] = &parts;
                let params = AttnParams {
                    splits: splits as u32,
                    split_keys: split_keys as u32,
                    ..params
                };
                rec.launch(def, &defines, &params, &bufs, (pairs * splits) as u32)?;
                rec.launch(&ATTN_COMBINE, &[], &params, &[&parts, &out], pairs as u32)?;
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::key_split;

    #[test]
    fn key_split_fills_the_gpu_only_where_the_pairs_do_not() {
        // Decode of one 7B-shaped sequence: 32 heads, 145 keys, runs of at least 32.
        assert_eq!(key_split(32, 145), (5, 29));
        // The test's 4 queries of 8 heads over 301 keys.
        assert_eq!(key_split(32, 301), (10, 31));
        // Long contexts: at most SPLIT_WORKGROUPS / pairs runs, every key in one.
        let (runs, keys) = key_split(32, 100_000);
        assert_eq!(runs, 32);
        assert!(runs * keys >= 100_000 && (runs - 1) * keys < 100_000);
        // Short spans and full steps stay whole.
        assert_eq!(key_split(32, 32), (1, 0));
        assert_eq!(key_split(2048, 4096), (1, 0));
        assert_eq!(key_split(600, 4096), (1, 0));
        assert_eq!(key_split(512, 4096), (2, 2048));
    }
}
