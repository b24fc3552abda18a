#![doc = include_str!("../README.md")]

mod error;
mod file;
mod ggml;
mod parse;
mod value;
mod writer;

pub use error::{GgufError, Result};
pub use file::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GgufFile, MAGIC, MAX_DIMS, TensorInfo};
pub use ggml::{BlockLayout, GgmlType};
pub use value::{Metadata, MetadataArray, MetadataValue, ValueType};
pub use writer::GgufWriter;
