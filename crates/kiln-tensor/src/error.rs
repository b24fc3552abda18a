//! The one error type of `kiln-tensor`: every variant names what failed.

use crate::DType;

/// Everything that can go wrong in `kiln-tensor`.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// No GPU adapter matched the request (`--backend wgpu` with no adapter, for example).
    #[error("no wgpu adapter available: {0}")]
    NoAdapter(String),
    /// The adapter refused to create a device.
    #[error("wgpu adapter `{adapter}` refused to create a device: {source}")]
    DeviceRequest {
        adapter: String,
        #[source]
        source: wgpu::RequestDeviceError,
    },
    /// An unknown backend name was given (`auto|wgpu|cpu|reference` are accepted).
    #[error("unknown backend `{0}`: expected one of auto, wgpu, cpu, reference")]
    UnknownBackend(String),
    /// An unknown kernel set was given (`tested|experimental` are accepted).
    #[error("unknown kernel set `{0}`: expected tested or experimental")]
    UnknownKernels(String),
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: &'static str, detail: String },
    /// An op does not support a tensor's dtype.
    #[error("{op}: dtype {dtype:?} is not supported for {what}")]
    DType {
        op: &'static str,
        what: &'static str,
        dtype: DType,
    },
    /// Host data does not have the length the shape and dtype imply.
    #[error("{what}: expected {expected} bytes for the shape and dtype, got {got}")]
    DataLength {
        what: String,
        expected: usize,
        got: usize,
    },
    /// A buffer would exceed what the device can bind or allocate.
    #[error("{what}: {bytes} bytes exceeds the device limit of {limit} bytes ({limit_name})")]
    TooLarge {
        what: String,
        bytes: u64,
        limit: u64,
        limit_name: &'static str,
    },
    /// An index (token id, position) lies outside its table.
    #[error("{op}: {what} {index} is out of range (limit {limit})")]
    OutOfRange {
        op: &'static str,
        what: &'static str,
        index: usize,
        limit: usize,
    },
    /// A tensor lives on a different device than the recorder it is used with.
    #[error("{op}: tensor lives on a different device than the recorder")]
    DeviceMismatch { op: &'static str },
    /// WGSL failed to compile or a pipeline failed validation; carries the source.
    #[error("kernel `{kernel}` failed to build: {message}\n--- WGSL source ---\n{source_text}")]
    Shader {
        kernel: String,
        message: String,
        source_text: String,
    },
    /// A kernel's template does not render with the defines it was given (a bug in the
    /// kernel or its launch).
    #[error("kernel `{kernel}`: template")]
    Template {
        kernel: String,
        #[source]
        source: crate::gpu::TemplateError,
    },
    /// The device reported an error while mapping, waiting or reading back.
    #[error("wgpu error during {during}")]
    Gpu {
        during: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The device reported an error for a submitted step (validation, out of memory).
    #[error("wgpu error during submit (kernels: {kernels})")]
    Submit {
        kernels: String,
        #[source]
        source: wgpu::Error,
    },
    /// A logits row's sampling parameters are out of range.
    #[error("sample: row {row}: {source}")]
    Sampling {
        row: usize,
        #[source]
        source: crate::ops::sample::SamplingError,
    },
    /// Bad op arguments not covered above (zero-sized dims, bad eps, ...).
    #[error("{op}: invalid argument: {detail}")]
    Invalid { op: &'static str, detail: String },
}

impl TensorError {
    /// `map_err` for a wgpu call that failed during `during`, keeping its error as the cause.
    pub(crate) fn gpu<E>(during: &'static str) -> impl FnOnce(E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        move |e| Self::Gpu {
            during,
            source: Box::new(e),
        }
    }
}

/// Result alias used throughout `kiln-tensor`.
pub type Result<T, E = TensorError> = std::result::Result<T, E>;
