#![doc = include_str!("../README.md")]

mod cache;
mod compressed;
mod error;
mod native;
mod reference;
mod stored;

pub use cache::{
    AttnBatch, AttnConfig, KvCache, KvCacheConfig, MAX_HEAD_DIM, QkNorm, QkPrep, QkvRows, SeqBatch,
};
pub use compressed::{CompressedKv, EntryChoice, MAX_COMPRESSED_HEAD_DIM, compressed_attention};
pub use error::{KvDeviceError, Result};
pub use reference::contiguous_attention;
pub use stored::{CENTRED_PAIRS, KeyCentre, key_centres};
