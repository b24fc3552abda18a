//! Reads GGUF, the single-file model container of llama.cpp: header (versions 2 and 3), typed
//! key/value metadata (every value type, arrays of arrays included), tensor infos with their
//! ggml type, and where each tensor's data lies in the file (`general.alignment` respected).
//!
//! Parsing never trusts a count or length in the file: each one is bounded by the bytes left
//! before anything is allocated, and every error names the file, the byte offset and the key or
//! tensor it was reading. [`GgufWriter`] builds small valid files for tests and tools.
//!
//! ```
//! use kiln_gguf::{GgmlType, GgufFile, GgufWriter};
//!
//! let mut w = GgufWriter::new();
//! w.metadata("general.architecture", "llama")
//!     .metadata("tokenizer.ggml.tokens", vec!["a", "b"])
//!     .tensor("w", &[4, 2], GgmlType::F32, vec![0u8; 32]);
//! let bytes = w.to_bytes()?;
//!
//! let file = GgufFile::from_bytes(&bytes)?;
//! assert_eq!(file.architecture(), Some("llama"));
//! assert_eq!(file.metadata().get_strings("tokenizer.ggml.tokens")?.map(<[String]>::len), Some(2));
//! let w = file.tensor("w").ok_or("no tensor w")?;
//! assert_eq!((w.n_elements, w.byte_size), (8, Some(32)));
//! assert_eq!(w.offset % file.alignment(), 0);
//! assert_eq!(file.tensor_data(&bytes, w)?.len(), 32);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

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
