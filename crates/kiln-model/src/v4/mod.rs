//! DeepSeek-V4, part by part: the compressors that pool every `ratio` tokens' KV into one
//! entry (CSA's overlapping windows, HCA's disjoint ones), the lightning indexer that picks
//! the entries a CSA query reads, the attention layer over the window and the entries, the
//! hyper-connections (mHC) around each sublayer, and the mixture of experts (scored or
//! hash-routed, with a shared expert).
//! Each follows the transformers module named on it (`models/deepseek_v4/
//! modeling_deepseek_v4.py`) and is tested against that module's output
//! (`tests/deepseek_v4_parts.rs`).
//!
//! What a sequence carries between steps is its [`CompressorState`] and [`IndexerState`]:
//! device tensors, one set a sequence and layer. (The paged pool does not hold them yet:
//! issue 48's KV item.)

mod attention;
mod compress;
mod hyper;
mod load;
mod model;
mod moe;

pub use attention::{
    Attention, AttentionShape, AttentionState, AttentionWeights, Compression, Csa, StateBytes,
    StepPositions, V4Ropes,
};
pub use compress::{
    Compressor, CompressorState, CompressorWeights, Indexer, IndexerState, IndexerWeights,
};
pub use hyper::{HyperConnection, HyperHead};
pub use model::{V4Model, V4Sequence};
pub use moe::{ExpertChoice, GateUp, Moe, MoeShape, MoeWeights};
