//! Errors of the device KV layer.

use kiln_tensor::TensorError;

/// What went wrong storing K/V or attending over them.
#[derive(Debug, thiserror::Error)]
pub enum KvDeviceError {
    /// A launch or an allocation failed on the device.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The device could not hold a pool (too large for a binding, out of memory).
    #[error("kv cache: the {what} pool of {blocks} blocks")]
    Pool {
        what: &'static str,
        blocks: usize,
        #[source]
        source: TensorError,
    },
    /// A batch or tensor does not fit the cache's configuration.
    #[error("kv cache: {0}")]
    Invalid(String),
}

/// `Result` with [`KvDeviceError`].
pub type Result<T, E = KvDeviceError> = std::result::Result<T, E>;
