//! `ModelConfig`: the normalised description the forward pass uses, read from GGUF metadata or
//! an HF `config.json` (the file formats stay in this module).

use kiln_gguf::GgufFile;
use kiln_tensor::{RopeConfig, RopeLayout, RopeScaling};
use serde_json::Value;

use crate::{ModelError, Result};

/// Model families kiln runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
}

impl Arch {
    /// The name configs use (`llama`, `mistral`, `qwen2`).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
        }
    }

    fn parse(file: &str, s: &str) -> Result<Self> {
        match s {
            "llama" => Ok(Arch::Llama),
            "mistral" => Ok(Arch::Mistral),
            "qwen2" => Ok(Arch::Qwen2),
            other => Err(ModelError::Architecture {
                file: file.into(),
                arch: other.into(),
            }),
        }
    }
}

/// Everything the forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Rotary layout of the Q/K weights as stored: llama GGUF files permute Q/K rows for
    /// interleaved pairs; HF checkpoints use the half-split layout.
    pub rope_layout: RopeLayout,
    pub max_position: usize,
    pub tie_embeddings: bool,
    pub sliding_window: Option<usize>,
    /// Q/K/V projections carry biases (qwen2).
    pub qkv_bias: bool,
}

impl ModelConfig {
    /// The K/V shape of this model's cache, stored as `dtype` (for planning and sizing).
    pub fn kv_shape(&self, dtype: kiln_kv::KvDtype) -> kiln_kv::KvShape {
        kiln_kv::KvShape {
            num_layers: self.layers as u32,
            num_kv_heads: self.kv_heads as u32,
            head_dim: self.head_dim as u32,
            dtype,
        }
    }

    /// The device KV cache of this model for a pool of `pool.num_blocks` blocks.
    pub fn kv_cache_config(&self, pool: crate::KvPoolConfig) -> kiln_attention::KvCacheConfig {
        kiln_attention::KvCacheConfig {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: pool.block_size as usize,
            num_blocks: pool.num_blocks as usize,
            dtype: pool.dtype,
        }
    }

    pub fn rope(&self) -> RopeConfig {
        RopeConfig {
            head_dim: self.head_dim,
            rotary_dim: self.head_dim,
            theta: self.rope_theta,
            scaling: self.rope_scaling,
            layout: self.rope_layout,
        }
    }

    fn validate(self, file: &str) -> Result<Self> {
        let bad = |field: &str, problem: String| {
            Err(ModelError::Config {
                file: file.into(),
                field: field.into(),
                problem,
            })
        };
        for (f, v) in [
            ("hidden_size", self.hidden),
            ("num_hidden_layers", self.layers),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.ffn),
            ("vocab_size", self.vocab),
        ] {
            if v == 0 {
                return bad(f, "must be positive".into());
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} query heads are not a multiple of {} kv heads",
                    self.heads, self.kv_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(4) || self.head_dim > kiln_attention::MAX_HEAD_DIM {
            return bad(
                "head_dim",
                format!(
                    "{} must be a multiple of 4 up to {}",
                    self.head_dim,
                    kiln_attention::MAX_HEAD_DIM
                ),
            );
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad("rms_norm_eps", format!("{} must be positive", self.rms_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(
                "rope_theta",
                format!("{} must be positive", self.rope_theta),
            );
        }
        Ok(self)
    }

    /// From a GGUF file's `general.architecture` and `<arch>.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let src = file.source().to_string();
        let md = file.metadata();
        let arch_name = md
            .get_str("general.architecture")?
            .ok_or_else(|| ModelError::Config {
                file: src.clone(),
                field: "general.architecture".into(),
                problem: "missing".into(),
            })?;
        let arch = Arch::parse(&src, arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let need = |k: &str| -> Result<u64> {
            md.get_u64(&key(k))?.ok_or_else(|| ModelError::Config {
                file: src.clone(),
                field: key(k),
                problem: "missing".into(),
            })
        };
        let hidden = need("embedding_length")? as usize;
        let heads = need("attention.head_count")? as usize;
        let kv_heads = md
            .get_u64(&key("attention.head_count_kv"))?
            .map_or(heads, |v| v as usize);
        let head_dim = match md.get_u64(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None if heads > 0 => hidden / heads,
            None => 0,
        };
        let vocab = match md.get_u64(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => md
                .get_strings("tokenizer.ggml.tokens")?
                .map_or(0, <[String]>::len),
        };
        let rope_scaling = match md.get_str(&key("rope.scaling.type"))? {
            Some("linear") => RopeScaling::Linear {
                factor: md.get_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0),
            },
            _ => RopeScaling::None,
        };
        let tie_embeddings = file.tensor("output.weight").is_none();
        let cfg = ModelConfig {
            arch,
            hidden,
            layers: need("block_count")? as usize,
            heads,
            kv_heads,
            head_dim,
            ffn: need("feed_forward_length")? as usize,
            vocab,
            rms_eps: md
                .get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope_theta: md.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
            rope_scaling,
            // llama.cpp permutes llama Q/K for interleaved RoPE; qwen2 keeps the HF layout.
            rope_layout: if arch == Arch::Qwen2 {
                RopeLayout::HalfSplit
            } else {
                RopeLayout::Interleaved
            },
            max_position: md
                .get_u64(&key("context_length"))?
                .map_or(2048, |v| v as usize),
            tie_embeddings,
            sliding_window: md
                .get_u64(&key("attention.sliding_window"))?
                .map(|v| v as usize)
                .filter(|&w| w > 0),
            qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        };
        cfg.validate(&src)
    }

    /// From an HF `config.json`'s text; `file` names it in errors.
    pub fn from_hf_json(file: &str, text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            file: file.into(),
            what: "not JSON",
            source,
        })?;
        let field = |k: &str| ModelError::Config {
            file: file.into(),
            field: k.into(),
            problem: "missing or not a number".into(),
        };
        let uint = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| field(k))
        };
        let float = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let arch_name = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| field("model_type"))?;
        let arch = Arch::parse(file, arch_name)?;
        let hidden = uint("hidden_size")?;
        let heads = uint("num_attention_heads")?;
        let head_dim = match v.get("head_dim").and_then(Value::as_u64) {
            Some(h) => h as usize,
            None => hidden.checked_div(heads).unwrap_or(0),
        };
        // transformers 5 writes `rope_parameters` (with `rope_theta` inside); 4.x wrote
        // `rope_scaling` and a top-level `rope_theta`.
        let rope_params = v
            .get("rope_parameters")
            .filter(|s| !s.is_null())
            .or_else(|| v.get("rope_scaling").filter(|s| !s.is_null()));
        let rope_theta = float("rope_theta").or_else(|| {
            rope_params
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
                .map(|x| x as f32)
        });
        let rope_scaling = match rope_params {
            None => RopeScaling::None,
            Some(s) => {
                let ty = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let f = |k: &str| {
                    s.get(k)
                        .and_then(Value::as_f64)
                        .map(|x| x as f32)
                        .ok_or_else(|| field(&format!("rope_scaling.{k}")))
                };
                match ty {
                    "linear" => RopeScaling::Linear {
                        factor: f("factor")?,
                    },
                    "llama3" => RopeScaling::Llama3 {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position: f("original_max_position_embeddings")? as u32,
                    },
                    "default" | "" => RopeScaling::None,
                    other => {
                        return Err(ModelError::Config {
                            file: file.into(),
                            field: "rope_scaling.rope_type".into(),
                            problem: format!("unsupported `{other}` (linear, llama3)"),
                        });
                    }
                }
            }
        };
        let sliding_window = match arch {
            Arch::Qwen2
                if !v
                    .get("use_sliding_window")
                    .and_then(Value::as_bool)
                    .unwrap_or(false) =>
            {
                None
            }
            Arch::Llama => None,
            _ => v
                .get("sliding_window")
                .and_then(Value::as_u64)
                .map(|w| w as usize)
                .filter(|&w| w > 0),
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            layers: uint("num_hidden_layers")?,
            heads,
            kv_heads: v
                .get("num_key_value_heads")
                .and_then(Value::as_u64)
                .map_or(heads, |x| x as usize),
            head_dim,
            ffn: uint("intermediate_size")?,
            vocab: uint("vocab_size")?,
            rms_eps: float("rms_norm_eps").unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10000.0),
            rope_scaling,
            rope_layout: RopeLayout::HalfSplit,
            max_position: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map_or(2048, |x| x as usize),
            tie_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            sliding_window,
            qkv_bias: arch == Arch::Qwen2
                || v.get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
        };
        cfg.validate(file)
    }
}
