//! # kiln-tensor
//!
//! Tensors on a compute [`Device`]: the `wgpu` product path, whose kernels are WGSL compute
//! shaders (Vulkan, Metal, DX12 — and Mesa's lavapipe CPU driver in tests), or the CPU
//! reference backend every kernel is tested against. Quantized GGUF weights (`Q8_0`, `Q4_0`,
//! `Q4_1`, `Q5_0`, `Q5_1` and the K-quants `Q2_K` … `Q6_K`), kiln's zero-point formats
//! (`Q4_Z`, `Q8_Z`, for GPTQ/AWQ checkpoints) and BF16 stay as they are on the device and are
//! dequantized inside the kernels.
//!
//! Ops are recorded on a [`Recorder`]: on wgpu a whole sequence is encoded into one command
//! encoder and submitted once; on the CPU each op runs as it is recorded.
//!
//! ```
//! use kiln_tensor::{Device, DType, Recorder, Tensor};
//!
//! # fn main() -> Result<(), kiln_tensor::TensorError> {
//! let dev = Device::cpu(); // or Device::new(&DeviceOptions::default())? for the best GPU
//! let x = Tensor::from_f32(&dev, &[1, 64], &vec![0.5; 64])?;
//! // Three constant rows, quantized to Q4_1 (a constant block is exact: d = 0, m = value).
//! let rows: Vec<f32> = [1.0, 3.0, 2.0].iter().flat_map(|&v| vec![v; 64]).collect();
//! let w = Tensor::quantize_f32(&dev, DType::Q4_1, &[3, 64], &rows)?;
//! let mut rec = Recorder::new(&dev);
//! let y = rec.matmul(&x, &w, None)?;
//! let best = rec.argmax(&y)?;
//! rec.submit()?;
//! assert_eq!(y.to_f32_vec()?, vec![32.0, 96.0, 64.0]);
//! assert_eq!(best.to_u32_vec()?, vec![1]);
//! # Ok(())
//! # }
//! ```

mod device;
mod dtype;
mod error;
mod gpu;
mod ops;
mod quant;
mod recorder;
mod tensor;

pub use device::{BackendChoice, Device, DeviceInfo, DeviceOptions, KernelTime, Profile};
pub use dtype::{DType, QK, QK_K};
pub use error::{Result, TensorError};
pub use gpu::{Access, GpuContext, KernelDef, TemplateError};
pub use ops::{
    Activation, ColumnIndex, RopeConfig, RopeLayout, RopePositions, RopeScaling, RopeTable,
};
pub use quant::{dequantize, quantize};
pub use recorder::Recorder;
pub use tensor::Tensor;
