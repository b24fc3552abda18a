//! The models kiln serves, whatever their graph: the dense and MoE transformers of
//! [`Model`] (Llama, Qwen, Gemma, Mixtral, gpt-oss), and DeepSeek-V4 ([`V4Model`]), whose
//! state lies in two pools rather than one K/V cache. The engine holds a [`Network`] and
//! steps it through one [`ModelRunner`](crate::ModelRunner).

use std::path::Path;

use kiln_tensor::Device;

use crate::v4::V4Model;
use crate::{DeepseekV4Config, Model, ModelConfig, Result};

/// A loaded model. (Made once and moved into a runner: its size is of no account.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Network {
    Dense(Model),
    DeepseekV4(V4Model),
}

impl From<Model> for Network {
    fn from(m: Model) -> Self {
        Network::Dense(m)
    }
}

impl From<V4Model> for Network {
    fn from(m: V4Model) -> Self {
        Network::DeepseekV4(m)
    }
}

impl Network {
    pub fn device(&self) -> Device {
        match self {
            Network::Dense(m) => m.device().clone(),
            Network::DeepseekV4(m) => m.device().clone(),
        }
    }

    /// Positions a sequence may reach: the model's context (DeepSeek-V4: the positions it
    /// was loaded for).
    pub fn max_position(&self) -> usize {
        match self {
            Network::Dense(m) => m.config().max_position,
            Network::DeepseekV4(m) => m.max_positions(),
        }
    }

    pub fn vocab(&self) -> usize {
        match self {
            Network::Dense(m) => m.config().vocab,
            Network::DeepseekV4(m) => m.config().vocab,
        }
    }

    /// Bytes of weights resident on the device (quantized sizes as stored).
    pub fn weight_bytes(&self) -> u64 {
        match self {
            Network::Dense(m) => m.weight_bytes(),
            Network::DeepseekV4(m) => m.weight_bytes(),
        }
    }
}

/// A model's config, before its weights load.
#[derive(Debug, Clone)]
pub enum NetworkConfig {
    Dense(ModelConfig),
    DeepseekV4(Box<DeepseekV4Config>),
}

impl NetworkConfig {
    /// `path`'s DeepSeek-V4 config, when it is a folder whose `config.json` names
    /// `deepseek_v4` or a GGUF file of architecture `deepseek4`; `None` for any other model
    /// (its own loader reports what is wrong with it).
    pub fn deepseek_v4(path: &Path) -> Result<Option<DeepseekV4Config>> {
        crate::v4::detect(path)
    }

    /// The architecture's name (`llama`, …, `deepseek_v4`).
    pub fn arch_name(&self) -> &'static str {
        match self {
            NetworkConfig::Dense(c) => c.arch.name(),
            NetworkConfig::DeepseekV4(_) => "deepseek_v4",
        }
    }

    /// Positions the model was trained for.
    pub fn max_position(&self) -> usize {
        match self {
            NetworkConfig::Dense(c) => c.max_position,
            NetworkConfig::DeepseekV4(c) => c.max_position,
        }
    }

    pub fn vocab(&self) -> usize {
        match self {
            NetworkConfig::Dense(c) => c.vocab,
            NetworkConfig::DeepseekV4(c) => c.vocab,
        }
    }

    /// The dense graph's config (`None` for DeepSeek-V4).
    pub fn dense(&self) -> Option<&ModelConfig> {
        match self {
            NetworkConfig::Dense(c) => Some(c),
            NetworkConfig::DeepseekV4(_) => None,
        }
    }
}
