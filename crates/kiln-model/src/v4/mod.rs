//! DeepSeek-V4, part by part: the compressors that pool every `ratio` tokens' KV into one
//! entry (CSA's overlapping windows, HCA's disjoint ones), the lightning indexer that picks
//! the entries a CSA query reads, the attention layer over the window and the entries, the
//! hyper-connections (mHC) around each sublayer, and the mixture of experts (scored or
//! hash-routed, with a shared expert).
//! Each follows the transformers module named on it (`models/deepseek_v4/
//! modeling_deepseek_v4.py`) and is tested against that module's output
//! (`tests/deepseek_v4_parts.rs`).
//!
//! What a sequence carries between steps lies in a paged [`V4Cache`] (`cache.rs`): the
//! window's rows and the compressors' in main blocks, the entries and indexer keys in kept
//! blocks, where `kiln-kv`'s block tables point.

mod attention;
mod cache;
mod compress;
mod hyper;
mod load;
mod model;
mod moe;

pub use attention::{
    Attention, AttentionShape, AttentionWeights, Compression, Csa, StepPositions, V4Ropes,
};
pub use cache::{
    CompressorPools, LayerPools, PagedSeq, StateBytes, V4Cache, V4CacheConfig, block_bytes,
    block_size, main_window,
};
pub use compress::{Compressor, CompressorWeights, Indexer, IndexerWeights};
pub use hyper::{HyperConnection, HyperHead};
pub(crate) use load::detect;
pub use model::{V4Input, V4Model, V4Sequence};
pub use moe::{ExpertChoice, GateUp, Moe, MoeShape, MoeWeights};
