//! [`ModelConfig`] from a GGUF file's `general.architecture` and `<arch>.*` metadata, with
//! llama.cpp's conventions (its converters' defaults and weight layouts).

use kiln_gguf::{GgufError, GgufFile};
use kiln_tensor::{RopeLayout, RopeScaling, Router};

use super::{
    Arch, FamilyDefaults, LayerAttention, ModelConfig, MoeConfig, RopeParams, alternating_pattern,
    gemma_pattern, limits,
};
use crate::{ModelError, Result, Weight};

/// Gemma 3's defaults that llama.cpp's converter does not write: its local (sliding) layers
/// use RoPE base 10,000 and every sixth layer attends fully.
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;
const GEMMA3_PATTERN: usize = 6;

/// The GGUF key (after `<arch>.`) behind a field `validate` names in HF terms.
fn gguf_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "hidden_size" => "embedding_length",
        "num_hidden_layers" => "block_count",
        "num_attention_heads" => "attention.head_count",
        "num_key_value_heads" => "attention.head_count_kv",
        "head_dim" => "attention.key_length",
        "intermediate_size" => "feed_forward_length",
        "max_position_embeddings" => "context_length",
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "rope_theta" => "rope.freq_base",
        "sliding_window" => "attention.sliding_window",
        "rope_scaling" => "rope.scaling.factor",
        "num_experts" => "expert_count",
        "num_experts_per_tok" => "expert_used_count",
        "moe_intermediate_size" => "expert_feed_forward_length",
        _ => return None,
    })
}

/// The router llama.cpp's metadata describes: `expert_gating_func` 1 (softmax, the default)
/// with `expert_weights_norm` (llama.cpp renormalises the top-k of `qwen3moe` and `llama`
/// files, which do not write it); `gpt-oss` takes the top k, then their softmax (llama.cpp's
/// graph for it says so, not its metadata).
fn gguf_router(
    md: &kiln_gguf::Metadata,
    src: &str,
    arch: Arch,
    key: &dyn Fn(&str) -> String,
) -> Result<Router> {
    const SOFTMAX: u64 = 1;
    if arch == Arch::GptOss {
        return Ok(Router::TopKSoftmax);
    }
    match md.get_u64(&key("expert_gating_func"))? {
        None | Some(SOFTMAX) => Ok(Router::SoftmaxTopK {
            renorm: md.get_bool(&key("expert_weights_norm"))?.unwrap_or(true),
        }),
        Some(other) => Err(ModelError::Config {
            file: src.into(),
            field: key("expert_gating_func"),
            problem: format!("router {other} is not supported (1: softmax)"),
        }),
    }
}

/// YaRN as llama.cpp runs it from a file's `rope.scaling.*` keys: beta fast and slow
/// (32 and 1 unless written), the correction range rounded out to whole dimensions, and the
/// attention factor `0.1·ln(factor) + 1` (llama.cpp derives it; a written `yarn_attn_factor`
/// is overridden there too).
pub(super) fn gguf_yarn(
    md: &kiln_gguf::Metadata,
    key: &dyn Fn(&str) -> String,
    src: &str,
) -> Result<RopeScaling> {
    let factor = md.get_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0);
    let original = md
        .get_u64(&key("rope.scaling.original_context_length"))?
        .ok_or_else(|| ModelError::Config {
            file: src.into(),
            field: key("rope.scaling.original_context_length"),
            problem: "missing (YaRN needs the original context length)".into(),
        })?;
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position: u32::try_from(original).unwrap_or(u32::MAX),
        beta_fast: md
            .get_f32(&key("rope.scaling.yarn_beta_fast"))?
            .unwrap_or(32.0),
        beta_slow: md
            .get_f32(&key("rope.scaling.yarn_beta_slow"))?
            .unwrap_or(1.0),
        attention_factor: RopeScaling::yarn_attention_factor(factor, None, None),
        truncate: true,
    })
}

impl ModelConfig {
    /// From a GGUF file's `general.architecture` and `<arch>.*` metadata. Errors name the
    /// file and the metadata key.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let src = file.source();
        let arch = file.architecture().unwrap_or("general");
        Self::read_gguf(file).map_err(|e| match e {
            // A key of the wrong type: name the file too.
            ModelError::Gguf(GgufError::WrongType {
                key,
                expected,
                found,
            }) => ModelError::Config {
                file: src.into(),
                field: key,
                problem: format!("holds {found}, expected {expected}"),
            },
            ModelError::Gguf(g) => ModelError::Format {
                file: src.into(),
                problem: g.to_string(),
            },
            // `validate` speaks config.json's names; say which GGUF key it was.
            ModelError::Config {
                file,
                field,
                problem,
            } => ModelError::Config {
                file,
                field: gguf_key(&field).map_or(field, |k| format!("{arch}.{k}")),
                problem,
            },
            other => other,
        })
    }

    fn read_gguf(file: &GgufFile) -> Result<Self> {
        let src = file.source().to_string();
        let md = file.metadata();
        let missing = |field: String| ModelError::Config {
            file: src.clone(),
            field,
            problem: "missing".into(),
        };
        let arch_name = md
            .get_str("general.architecture")?
            .ok_or_else(|| missing("general.architecture".into()))?;
        let arch = Arch::parse(&src, arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        // Counts are bounded here, before any arithmetic or allocation uses them; `validate`
        // gives the precise limits afterwards.
        let size = |k: &str, v: u64| -> Result<usize> {
            usize::try_from(v)
                .ok()
                .filter(|&v| v <= 1 << 40)
                .ok_or_else(|| ModelError::Config {
                    file: src.clone(),
                    field: key(k),
                    problem: format!("{v} is not a plausible size"),
                })
        };
        let need = |k: &str| -> Result<usize> {
            let v = md.get_u64(&key(k))?.ok_or_else(|| missing(key(k)))?;
            size(k, v)
        };
        let opt = |k: &str| -> Result<Option<usize>> {
            md.get_u64(&key(k))?.map(|v| size(k, v)).transpose()
        };
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let layers = need("block_count")?;
        let kv_heads = opt("attention.head_count_kv")?.unwrap_or(heads);
        let head_dim = match opt("attention.key_length")? {
            Some(v) => v,
            None => hidden.checked_div(heads).unwrap_or(0),
        };
        let vocab = match opt("vocab_size")? {
            Some(v) => v,
            None => md
                .get_strings("tokenizer.ggml.tokens")?
                .map_or(0, <[String]>::len),
        };
        let rope_scaling = match md.get_str(&key("rope.scaling.type"))? {
            Some("linear") => RopeScaling::Linear {
                factor: md.get_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0),
            },
            Some("yarn") => gguf_yarn(md, &key, &src)?,
            Some("none") | None => RopeScaling::None,
            Some(other) => {
                return Err(ModelError::Config {
                    file: src,
                    field: key("rope.scaling.type"),
                    problem: format!("unsupported `{other}` (linear, yarn)"),
                });
            }
        };
        let global = RopeParams {
            theta: md.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
            scaling: rope_scaling,
        };
        let window = opt("attention.sliding_window")?.filter(|&w| w > 0);
        let attention: Vec<LayerAttention> = if arch == Arch::Gemma3 {
            let local = RopeParams {
                theta: md
                    .get_f32(&key("rope.freq_base_swa"))?
                    .unwrap_or(GEMMA3_LOCAL_ROPE_BASE),
                scaling: RopeScaling::None,
            };
            let period = opt("attention.sliding_window_pattern")?.unwrap_or(GEMMA3_PATTERN);
            if layers > limits::LAYERS {
                Vec::new() // `validate` names the layer count
            } else {
                gemma_pattern(layers, period)
                    .map(|sliding| match (sliding, window) {
                        (true, Some(w)) => LayerAttention {
                            window: Some(w),
                            rope: local,
                        },
                        _ => LayerAttention {
                            window: None,
                            rope: global,
                        },
                    })
                    .collect()
            }
        } else if arch == Arch::GptOss {
            alternating_pattern(layers.min(limits::LAYERS))
                .map(|sliding| LayerAttention {
                    window: window.filter(|_| sliding),
                    rope: global,
                })
                .collect()
        } else {
            let layer = LayerAttention {
                window,
                rope: global,
            };
            vec![layer; layers.min(limits::LAYERS)]
        };
        let attn_softcap = md.get_f32(&key("attn_logit_softcapping"))?;
        if attn_softcap.is_some_and(|c| c > 0.0) {
            return Err(ModelError::Config {
                file: src,
                field: key("attn_logit_softcapping"),
                problem: "attention logit soft-capping is not supported".into(),
            });
        }
        let family = FamilyDefaults::of(arch, hidden);
        // llama.cpp scales Gemma 3 scores by 1/sqrt(head_dim) (its `query_pre_attn_scalar`),
        // except for the 27B model (62 layers), where transformers' config has hidden/heads.
        let scalar = if arch == Arch::Gemma3 && layers == 62 {
            hidden.checked_div(heads).unwrap_or(0)
        } else {
            head_dim
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            ffn: need("feed_forward_length")?,
            vocab,
            rms_eps: md
                .get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            // llama.cpp permutes llama (and mistral) Q/K rows for interleaved RoPE; the other
            // families keep the HF layout and run the half-split ("neox") rotation.
            rope_layout: match arch {
                Arch::Llama | Arch::Mistral | Arch::Mixtral => RopeLayout::Interleaved,
                Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::GptOss => {
                    RopeLayout::HalfSplit
                }
            },
            max_position: opt("context_length")?.unwrap_or(2048),
            tie_embeddings: file.tensor("output.weight").is_none(),
            attention,
            qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
            o_bias: file.tensor("blk.0.attn_output.bias").is_some(),
            attn_sinks: arch == Arch::GptOss,
            qk_norm: family.qk_norm,
            sandwich_norms: family.sandwich_norms,
            // llama.cpp's converter stores Gemma's norm weights as `1 + w` already.
            norm_offset: 0.0,
            activation: family.activation,
            embed_scale: family.embed_scale,
            attn_scale: 1.0 / (scalar as f32).sqrt(),
            final_logit_softcap: md
                .get_f32(&key("final_logit_softcapping"))?
                .filter(|&c| c > 0.0),
            moe: None,
        };
        let moe = match opt("expert_count")? {
            None | Some(0) => None,
            Some(experts) => {
                let used = need("expert_used_count")?;
                Some(MoeConfig {
                    experts,
                    used,
                    // Without the key llama.cpp sizes `llama` experts (Mixtral) by
                    // feed_forward_length, `qwen3moe` ones by its share of a token's experts.
                    expert_ffn: match opt("expert_feed_forward_length")? {
                        Some(f) => f,
                        None if arch == Arch::Qwen3Moe => cfg.ffn / used.max(1),
                        None => cfg.ffn,
                    },
                    router: gguf_router(md, &src, arch, &key)?,
                    biases: arch == Arch::GptOss,
                    // A layer without a router has a dense MLP.
                    dense_layers: (0..layers.min(limits::LAYERS))
                        .filter(|&l| file.tensor(&Weight::Router(l).gguf_name()).is_none())
                        .collect(),
                })
            }
        };
        ModelConfig { moe, ..cfg }.validate(&src)
    }
}
