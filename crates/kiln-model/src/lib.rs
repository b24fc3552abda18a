//! # kiln-model
//!
//! Decoder language models (`llama`, `mistral`, `qwen2`, `qwen3`, `gemma3`) on a `kiln-tensor` device: the
//! normalised [`ModelConfig`] read from GGUF metadata or an HF `config.json`, weights from GGUF
//! files kept in their stored (possibly quantized) dtype or from HF safetensors folders — float,
//! or GPTQ / AWQ / compressed-tensors INT4 and INT8 checkpoints ([`HfQuant`]), repacked at load
//! into 32-element blocks that stay packed on the device ([`ModelFiles`] opens either; [`export::write_hf_folder`] turns a GGUF file into a folder), and the forward pass over a batch
//! that mixes prefill chunks and decode tokens of different sequences, with K/V in a paged
//! cache (`kiln-attention` storage, `kiln-kv` block tables). [`ModelRunner`] pairs a model with
//! its KV pool and runs one step for a batch: one submit, and only the readback asked for.
//!
//! ```
//! use kiln_model::{ModelConfig, Arch};
//!
//! let json = r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
//!   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
//!   "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;
//! let cfg = ModelConfig::from_hf_json("config.json", json)?;
//! assert_eq!((cfg.arch, cfg.head_dim, cfg.kv_heads), (Arch::Llama, 16, 2));
//! # Ok::<(), kiln_model::ModelError>(())
//! ```

mod config;
mod error;
pub mod export;
mod files;
mod hf_quant;
mod model;
pub mod perplexity;
mod repack;
mod runner;
mod safetensors;
mod weights;

pub use config::{
    Activation, Arch, HfQuant, LayerAttention, ModelConfig, QuantMethod, RopeParams,
    SUPPORTED_ARCHITECTURES, limits,
};
pub use error::{ModelError, Result};
pub use files::{ModelFiles, ModelSource};
pub use model::{LogitsAt, Model, SeqInput};
pub use runner::{KvPoolConfig, ModelRunner, StepOutput, StepSeq};
pub use safetensors::{HfSource, LoadOptions, SafetensorsFile, StDtype, encode_safetensors};
pub use weights::{GgufSource, Linear, Weight, WeightSource};
