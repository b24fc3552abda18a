//! DeepSeek-V4's paged state, laid out as `kiln-kv`'s kept pool hands out blocks
//! ([`kiln_kv::KeptPool`]): every block of `block` tokens of a sequence has a block of each
//! pool.
//!
//! - **Main pool**, per layer: each token's raw K=V row and its compressors' projected kv and
//!   gate rows, one slot a token. A sequence holds these blocks only while the window still
//!   reads them ([`main_window`]): the attention's raw rows, and the rows a compressor's next
//!   entry pools.
//! - **Kept pool**, per layer: the compressed entries and the indexer's keys made from the
//!   block's tokens, `block / ratio` of each a block. Kept for as long as the sequence lives
//!   (and after, in the prefix cache).
//!
//! Nothing else is carried between steps: a compressor's open window is the main slots of
//! its tokens, so a chunk boundary anywhere reads the same rows as one long prefill.

use std::ops::AddAssign;

use kiln_kv::BlockId;
use kiln_tensor::{DType, Device, Recorder, RowMap, Tensor};

use crate::{DeepseekV4Config, ModelError, Result, V4Attention};

/// Tokens a block: 16, or the least multiple of every compression ratio above it, so that a
/// block's entries are made of its own tokens (V4's ratios 4 and 128 give 128).
pub fn block_size(config: &DeepseekV4Config) -> usize {
    config.attention.iter().fold(16, |b, a| match *a {
        V4Attention::Sliding => b,
        V4Attention::Csa { ratio } | V4Attention::Hca { ratio } => lcm(b, ratio as usize),
    })
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

/// The main pool's window: the tokens before and at a query whose rows a step still reads.
/// A query reads the raw rows of the last `window`; an HCA compressor's next entry reads
/// its open window (less than `ratio` tokens); a CSA one's also the previous window (less
/// than `2 · ratio`).
pub fn main_window(config: &DeepseekV4Config) -> usize {
    config
        .attention
        .iter()
        .map(|a| match *a {
            V4Attention::Sliding => 0,
            V4Attention::Csa { ratio } => 2 * ratio as usize,
            V4Attention::Hca { ratio } => ratio as usize,
        })
        .fold(config.window, usize::max)
}

/// The blocks each pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct V4CacheConfig {
    pub main_blocks: usize,
    pub kept_blocks: usize,
}

/// One sequence's part of a step: its rows of the step's tokens and its block tables.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    /// Its first row among the step's tokens.
    pub row: usize,
    /// Its first position: tokens computed before this step.
    pub start: usize,
    /// Tokens it computes this step.
    pub len: usize,
    /// Its main-pool blocks in logical order (`u32::MAX` where it gave one back).
    pub main: &'a [u32],
    /// Its kept-pool blocks in logical order.
    pub kept: &'a [u32],
    /// Tokens a block.
    pub block: usize,
}

impl<'a> PagedSeq<'a> {
    /// Positions after this step.
    pub fn end(&self) -> usize {
        self.start + self.len
    }

    /// Its tokens' positions.
    pub fn positions(&self) -> Vec<u32> {
        (self.start as u32..self.end() as u32).collect()
    }

    /// Its rows among the step's tokens.
    pub fn rows(&self) -> Vec<u32> {
        (self.row as u32..(self.row + self.len) as u32).collect()
    }

    /// The main slot of position `p`.
    pub fn main_slot(&self, p: usize) -> Result<u32> {
        match self.main.get(p / self.block) {
            Some(&b) if b != BlockId::TRIMMED.0 => {
                Ok(b * self.block as u32 + (p % self.block) as u32)
            }
            found => Err(self.missing(format!(
                "position {p}: its main block {} is {}",
                p / self.block,
                if found.is_some() {
                    "given back"
                } else {
                    "not in the table"
                }
            ))),
        }
    }

    /// The kept slot of entry `e` of a compressor pooling every `ratio` tokens.
    pub fn entry_slot(&self, e: usize, ratio: usize) -> Result<u32> {
        let per = self.block / ratio;
        let logical = e / per;
        match self.kept.get(logical) {
            Some(&b) => Ok(b * per as u32 + (e % per) as u32),
            None => Err(self.missing(format!(
                "entry {e} (every {ratio} tokens): kept block {logical} is not in the table"
            ))),
        }
    }

    /// Where its raw rows lie in the main pool.
    pub fn main_map(&self) -> RowMap<'a> {
        RowMap::Paged {
            table: self.main,
            block: self.block as u32,
        }
    }

    /// Where the entries of a compressor pooling every `ratio` tokens lie in the kept pool.
    pub fn entry_map(&self, ratio: usize) -> RowMap<'a> {
        RowMap::Paged {
            table: self.kept,
            block: (self.block / ratio) as u32,
        }
    }

    fn missing(&self, what: String) -> ModelError {
        ModelError::Batch(format!(
            "a sequence at positions {}..{}: {what}",
            self.start,
            self.end()
        ))
    }
}

/// The main slots of every token of `seqs`, in row order.
pub(super) fn main_slots(seqs: &[PagedSeq<'_>]) -> Result<Vec<u32>> {
    let mut slots = Vec::with_capacity(seqs.iter().map(|s| s.len).sum());
    for s in seqs {
        for p in s.start..s.end() {
            slots.push(s.main_slot(p)?);
        }
    }
    Ok(slots)
}

/// Rows `s.rows()` of `t` (`[tokens, ...]`): `t` itself where `s` is every row.
pub(super) fn rows_of(rec: &mut Recorder, t: &Tensor, s: &PagedSeq<'_>) -> Result<Tensor> {
    let shape = t.shape().to_vec();
    if s.row == 0 && s.len == shape[0] {
        return Ok(t.clone());
    }
    let width: usize = shape[1..].iter().product();
    let picked = rec.embedding(&t.reshape(&[shape[0], width])?, &s.rows())?;
    let mut out = shape;
    out[0] = s.len;
    Ok(picked.reshape(&out)?)
}

/// A compressor's pools: its projected kv and gate rows (`[main slots, halves · width]`),
/// and its entries (`[kept blocks · block / ratio, width]`), all F32.
#[derive(Debug)]
pub struct CompressorPools {
    pub kv: Tensor,
    pub gate: Tensor,
    pub entries: Tensor,
}

impl CompressorPools {
    fn new(
        device: &Device,
        cfg: V4CacheConfig,
        block: usize,
        ratio: u32,
        width: usize,
        halves: usize,
    ) -> Result<Self> {
        let slots = cfg.main_blocks * block;
        let rows = cfg.kept_blocks * (block / ratio as usize);
        let zeros = |r, c| Tensor::zeros(device, DType::F32, &[r, c]);
        Ok(Self {
            kv: zeros(slots, halves * width)?,
            gate: zeros(slots, halves * width)?,
            entries: zeros(rows, width)?,
        })
    }
}

/// One layer's pools: the raw K=V rows (`[main slots, head_dim]`), and its compressors'.
#[derive(Debug)]
pub struct LayerPools {
    pub raw: Tensor,
    pub compressor: Option<CompressorPools>,
    pub indexer: Option<CompressorPools>,
}

/// A DeepSeek-V4 model's paged state on a device: every layer's [`LayerPools`].
#[derive(Debug)]
pub struct V4Cache {
    cfg: V4CacheConfig,
    block: usize,
    layers: Vec<LayerPools>,
    /// What a main block and a kept block hold.
    per_block: [StateBytes; 2],
}

impl V4Cache {
    /// Pools of `cfg`'s blocks for `config`'s layers on `device`, zeroed.
    pub fn new(device: &Device, config: &DeepseekV4Config, cfg: V4CacheConfig) -> Result<Self> {
        let block = block_size(config);
        let (hd, id) = (config.head_dim, config.indexer.head_dim);
        let layers = config
            .attention
            .iter()
            .map(|a| {
                let raw = Tensor::zeros(device, DType::F32, &[cfg.main_blocks * block, hd])?;
                let pools = |ratio, width, halves| {
                    CompressorPools::new(device, cfg, block, ratio, width, halves)
                };
                Ok(match *a {
                    V4Attention::Sliding => LayerPools {
                        raw,
                        compressor: None,
                        indexer: None,
                    },
                    V4Attention::Hca { ratio } => LayerPools {
                        raw,
                        compressor: Some(pools(ratio, hd, 1)?),
                        indexer: None,
                    },
                    V4Attention::Csa { ratio } => LayerPools {
                        raw,
                        compressor: Some(pools(ratio, hd, 2)?),
                        indexer: Some(pools(ratio, id, 2)?),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            block,
            layers,
            per_block: block_bytes(config),
        })
    }

    pub fn config(&self) -> V4CacheConfig {
        self.cfg
    }

    /// Tokens a block.
    pub fn block_size(&self) -> usize {
        self.block
    }

    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `layer`'s pools.
    pub fn layer_mut(&mut self, layer: usize) -> Option<&mut LayerPools> {
        self.layers.get_mut(layer)
    }

    pub(super) fn layers_mut(&mut self) -> std::slice::IterMut<'_, LayerPools> {
        self.layers.iter_mut()
    }

    /// The bytes that `main` main blocks and `kept` kept blocks hold, cache by cache, over
    /// every layer.
    pub fn bytes(&self, main: usize, kept: usize) -> StateBytes {
        let [m, k] = self.per_block;
        m.times(main as u64).plus(k.times(kept as u64))
    }
}

/// What one main block and one kept block hold, over every layer of `config`: a main block
/// each token's raw row (`head_dim`) and its compressors' kv and gate rows (CSA's twice as
/// wide: their windows overlap), a kept block `block / ratio` entries and indexer keys, all
/// F32.
pub fn block_bytes(config: &DeepseekV4Config) -> [StateBytes; 2] {
    let b = block_size(config) as u64;
    let (hd, id) = (config.head_dim as u64, config.indexer.head_dim as u64);
    let (mut main, mut kept) = (StateBytes::default(), StateBytes::default());
    for a in &config.attention {
        main.window += 4 * b * hd;
        match *a {
            V4Attention::Sliding => {}
            V4Attention::Hca { ratio } => {
                main.pending += 4 * b * 2 * hd;
                kept.entries += 4 * (b / u64::from(ratio)) * hd;
            }
            V4Attention::Csa { ratio } => {
                main.pending += 4 * b * 2 * (2 * hd + 2 * id);
                kept.entries += 4 * (b / u64::from(ratio)) * hd;
                kept.index_keys += 4 * (b / u64::from(ratio)) * id;
            }
        }
    }
    [main, kept]
}

/// Bytes of state, by cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// The raw K=V rows of the main blocks held.
    pub window: u64,
    pub entries: u64,
    pub index_keys: u64,
    /// The compressors' projected rows in the main blocks held (what their open windows
    /// pool).
    pub pending: u64,
}

impl AddAssign for StateBytes {
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

    fn times(self, n: u64) -> Self {
        Self {
            window: self.window * n,
            entries: self.entries * n,
            index_keys: self.index_keys * n,
            pending: self.pending * n,
        }
    }

    fn plus(mut self, o: Self) -> Self {
        self += o;
        self
    }
}
