//! [`ModelFiles`]: a model path as users pass it — a `.gguf` file or a Hugging Face folder —
//! opened into its config and weight source.

use std::path::{Path, PathBuf};

use crate::safetensors::{HfSource, LoadOptions};
use crate::weights::{GgufSource, WeightSource};
use crate::{ModelConfig, ModelError, Result};

/// Which format a model path holds.
#[derive(Debug)]
pub enum ModelSource {
    Gguf(GgufSource),
    /// An HF folder: `config.json` plus safetensors weights (tokenizer files beside them).
    Hf {
        dir: PathBuf,
        weights: HfSource,
    },
}

/// A model's config and weights, from either format.
#[derive(Debug)]
pub struct ModelFiles {
    config: ModelConfig,
    source: ModelSource,
}

impl ModelFiles {
    /// Opens `path`: a folder is read as an HF model folder, anything else as a GGUF file.
    /// `options` apply to HF float weights; a GGUF file loads as stored and refuses them.
    pub fn open(path: &Path, options: LoadOptions) -> Result<Self> {
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(|source| ModelError::Io {
                path: cfg_path.clone(),
                source,
            })?;
            let config = ModelConfig::from_hf_json(&cfg_path.display().to_string(), &text)?;
            let weights = HfSource::open(path, options)?;
            return Ok(Self {
                config,
                source: ModelSource::Hf {
                    dir: path.to_path_buf(),
                    weights,
                },
            });
        }
        if options != LoadOptions::default() {
            return Err(ModelError::Config {
                file: path.display().to_string(),
                field: "dtype/quantize".into(),
                problem:
                    "load-time casts apply to Hugging Face folders; GGUF weights load as stored"
                        .into(),
            });
        }
        let gguf = GgufSource::open(path)?;
        let config = ModelConfig::from_gguf(gguf.file())?;
        Ok(Self {
            config,
            source: ModelSource::Gguf(gguf),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn source(&self) -> &ModelSource {
        &self.source
    }

    /// The weights, for [`crate::Model::load`].
    pub fn weights(&self) -> &dyn WeightSource {
        match &self.source {
            ModelSource::Gguf(g) => g,
            ModelSource::Hf { weights, .. } => weights,
        }
    }

    /// Bytes of weight data as stored in the file(s).
    pub fn stored_bytes(&self) -> u64 {
        match &self.source {
            ModelSource::Gguf(g) => g.file().tensors().iter().filter_map(|t| t.byte_size).sum(),
            ModelSource::Hf { weights, .. } => weights.stored_bytes(),
        }
    }
}
