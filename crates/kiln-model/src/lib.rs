#![doc = include_str!("../README.md")]

mod block_scaled;
mod config;
mod error;
pub mod export;
mod files;
mod hf_experts;
mod hf_quant;
mod hf_source;
mod model;
mod network;
pub mod perplexity;
mod repack;
mod runner;
mod safetensors;
mod synthetic;
pub mod v4;
mod weights;

pub use config::{
    Activation, Arch, DeepseekV4Config, HfQuant, LayerAttention, ModelConfig, MoeConfig,
    QuantMethod, RopeParams, SUPPORTED_ARCHITECTURES, V4Attention, V4Indexer, V4Moe,
    fp8_block_size, limits,
};
pub use error::{ModelError, Result};
pub use files::{ModelFiles, ModelSource};
pub use hf_source::{HfSource, LoadOptions};
pub use model::{CpuExperts, CpuMoe, LogitsAt, Model, SeqInput};
pub use network::{Network, NetworkConfig};
pub use runner::{
    CALIBRATION_TOKENS, KV_CALIBRATION_TEXT, KvPoolConfig, ModelRunner, StepOutput, StepSeq,
};
pub use safetensors::{SafetensorsFile, StDtype, encode_safetensors};
pub use synthetic::SyntheticSource;
pub use weights::{ExpertProj, GgufSource, Linear, Weight, WeightSource, stack_experts};
