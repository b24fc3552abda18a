#![doc = include_str!("../README.md")]

mod cpu;
mod device;
mod dtype;
mod error;
mod gpu;
mod host;
mod keep;
mod ops;
mod quant;
mod recorder;
mod tensor;

pub use cpu::{CpuContext, Isa, RoutedStats};
pub use device::{
    BackendChoice, DEFAULT_SPLIT_K_WORKGROUPS, Device, DeviceInfo, DeviceOptions, HostStats,
    KernelTime, Kernels, MATVEC_GPU_THREADS, MatvecShape, Profile,
};
pub use dtype::{DType, QK, QK_K};
pub use error::{Result, TensorError};
pub use gpu::{Access, COOP_F16_16, CoopConfig, GpuContext, KernelDef, TemplateError};
pub use keep::Keep;
pub use ops::sample;
pub use ops::{
    Activation, Choice, ClampLimit, ColumnIndex, HcConfig, HcWeights, LinearOps, MAX_EXPERTS,
    MAX_EXPERTS_USED, MAX_STREAMS, MappedRows, NO_ENTRY, PoolWindows, RmsNorm, RopeConfig,
    RopeLayout, RopePositions, RopeScaling, RopeTable, RotaryChannels, Router, Routes, RowMap,
};
pub use quant::{dequantize, int8_activation_bounds, quantize};
pub use recorder::Recorder;
pub use tensor::Tensor;
