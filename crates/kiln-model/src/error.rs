//! Errors of model loading and the forward pass; each names the file and what was wrong.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] kiln_gguf::GgufError),
    #[error("{file}: config field `{field}`: {problem}")]
    Config {
        file: String,
        field: String,
        problem: String,
    },
    #[error("{file}: tensor `{tensor}`: {problem}")]
    Tensor {
        file: String,
        tensor: String,
        problem: String,
    },
    /// A tensor read fine but the device refused it (too large, out of memory).
    #[error("{file}: tensor `{tensor}` cannot be put on the device")]
    Upload {
        file: String,
        tensor: String,
        #[source]
        source: Box<kiln_tensor::TensorError>,
    },
    #[error("{file}: {problem}")]
    Format { file: String, problem: String },
    /// Bytes the file's head promised could not be read: the file shrank since it was opened,
    /// the read failed, or there is no memory for the buffer.
    #[error("{file}: {what}: cannot read bytes {start}..{end}")]
    Read {
        file: String,
        /// What the bytes are: "tensor `blk.0.attn_q.weight`", "the header".
        what: String,
        start: u64,
        end: u64,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (or a safetensors header) is not valid JSON, or could not be written.
    #[error("{file}: {what}")]
    Json {
        file: String,
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{file}: unsupported architecture `{arch}` (supported: {supported})", supported = crate::config::SUPPORTED_ARCHITECTURES)]
    Architecture { file: String, arch: String },
    #[error(transparent)]
    Device(#[from] kiln_tensor::TensorError),
    #[error(transparent)]
    Kv(#[from] kiln_attention::KvDeviceError),
    /// A sequence's blocks (DeepSeek-V4's own block manager: `V4Sequence`).
    #[error("KV blocks: {0}")]
    Blocks(#[from] kiln_kv::KvError),
    #[error("forward: {0}")]
    Batch(String),
    /// A perplexity run asked for something its windows cannot do.
    #[error("perplexity: {field}: {reason}")]
    Perplexity { field: &'static str, reason: String },
    /// The INT4 KV cache's key calibration could not run.
    #[error("kv calibration: {0}")]
    Calibration(String),
    /// The device returned fewer results than the step computed.
    #[error("read back {got} token ids for {want} logits rows")]
    Readback { got: usize, want: usize },
    /// A step's sequence gave a device sampling for each of a different number of rows.
    #[error("{got} row samplings given for {want} logits rows")]
    SampleRows { got: usize, want: usize },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
