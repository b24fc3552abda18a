//! # kiln-attention
//!
//! Paged KV storage on a `kiln-tensor` device and the kernels over it. Each layer keeps a K
//! pool and a V pool of fixed-size blocks (`[blocks, block_size, kv_heads, head_dim]` in F16,
//! F32 or INT8 with a scale per slot and head); a step writes its new tokens' K/V into their
//! slots ([`KvCache::write`]) and runs paged attention for every query token of a mixed batch
//! (prefill chunks and decode tokens of many sequences) in one launch ([`KvCache::attention`]).
//! Which block holds which token is decided elsewhere (`kiln-kv`'s `BlockManager`): this
//! crate takes block tables as given. On the CPU backend the pools hold exactly the values the
//! device format holds, so both backends attend over the same numbers.
//!
//! ```
//! use kiln_attention::{AttnConfig, KvCache, KvCacheConfig, SeqBatch};
//! use kiln_kv::{BlockId, KvDtype};
//! use kiln_tensor::{Device, Recorder, Tensor};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::Cpu;
//! let cfg = KvCacheConfig {
//!     layers: 1, kv_heads: 1, head_dim: 4, block_size: 4, num_blocks: 2, dtype: KvDtype::F32,
//! };
//! let mut cache = KvCache::new(&dev, cfg)?;
//! // One sequence of 3 tokens stored in block 1.
//! let table = [BlockId(1)];
//! let batch = cache.batch(&[SeqBatch { block_table: &table, query_len: 3, context_len: 3 }])?;
//! assert_eq!(batch.slots(), &[4, 5, 6]);
//! let rows = Tensor::from_f32(&dev, &[3, 1, 4], &[0.5; 12])?;
//! let mut rec = Recorder::new(&dev);
//! cache.write(&mut rec, 0, &rows, &rows, &batch)?;
//! let attn = AttnConfig { heads: 1, scale: 0.5, window: None };
//! let out = cache.attention(&mut rec, 0, &rows, &batch, &attn)?;
//! rec.submit()?;
//! // Every key is equal, so each query gets back the (equal) values.
//! assert!(out.to_f32_vec()?.iter().all(|&x| (x - 0.5).abs() < 1e-6));
//! # Ok(())
//! # }
//! ```

mod cache;
mod error;
mod reference;
mod stored;

pub use cache::{AttnBatch, AttnConfig, KvCache, KvCacheConfig, MAX_HEAD_DIM, SeqBatch};
pub use error::{KvDeviceError, Result};
pub use reference::contiguous_attention;
