//! [`DeepseekV4Config`] from a GGUF file as llama.cpp's converter writes DeepSeek-V4
//! (`general.architecture` `deepseek4`; its `DeepseekV4Model`): the `deepseek4.*` keys, each
//! error naming the file and the key.

use kiln_gguf::GgufFile;
use kiln_tensor::{HcConfig, RopeScaling};

use super::deepseek_v4::{DeepseekV4Config, V4Attention, V4Indexer, V4Moe};
use super::gguf::gguf_yarn;
use crate::{ModelError, Result};

/// llama.cpp's `expert_gating_func` for sqrt(softplus) scores (`LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS`).
const GATING_SQRT_SOFTPLUS: u64 = 4;

/// The GGUF key (after `deepseek4.`) behind a field [`DeepseekV4Config::check`] names.
fn gguf_key(field: &str) -> &str {
    match field {
        "num_hidden_layers" => "block_count",
        "hidden_size" => "embedding_length",
        "num_attention_heads" => "attention.head_count",
        "head_dim" => "attention.key_length",
        "vocab_size" => "tokenizer.ggml.tokens",
        "moe_intermediate_size" => "expert_feed_forward_length",
        "sliding_window" => "attention.sliding_window",
        "index_head_dim" => "attention.indexer.key_length",
        "index_n_heads" => "attention.indexer.head_count",
        "qk_rope_head_dim" => "rope.dimension_count",
        "o_groups" => "attention.output_group_count",
        "hc_mult" => "hyper_connection.count",
        "hc_sinkhorn_iters" => "hyper_connection.sinkhorn_iterations",
        "index_topk" => "attention.indexer.top_k",
        "q_lora_rank" => "attention.q_lora_rank",
        "o_lora_rank" => "attention.output_lora_rank",
        "n_routed_experts" => "expert_count",
        "num_experts_per_tok" => "expert_used_count",
        "max_position_embeddings" => "context_length",
        other => other,
    }
}

impl DeepseekV4Config {
    /// From `file`'s `deepseek4.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let src = file.source().to_string();
        let md = file.metadata();
        let key = |k: &str| format!("deepseek4.{k}");
        let err = |k: &str, problem: String| ModelError::Config {
            file: src.clone(),
            field: key(k),
            problem,
        };
        let arch = md.get_str("general.architecture")?.unwrap_or("");
        if arch != "deepseek4" {
            return Err(ModelError::Config {
                file: src.clone(),
                field: "general.architecture".into(),
                problem: format!("`{arch}` is not deepseek4"),
            });
        }
        let size = |k: &str| -> Result<usize> {
            let v = md
                .get_u64(&key(k))?
                .ok_or_else(|| err(k, "missing".into()))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v <= 1 << 40)
                .ok_or_else(|| err(k, format!("{v} is not a plausible size")))
        };
        let float = |k: &str| -> Result<f32> {
            md.get_f32(&key(k))?.ok_or_else(|| err(k, "missing".into()))
        };
        let one = |k: &str, want: u64, what: &str| -> Result<()> {
            match md.get_u64(&key(k))? {
                Some(v) if v != want => Err(err(k, format!("{v} is not supported ({what})"))),
                _ => Ok(()),
            }
        };
        one(
            "attention.head_count_kv",
            1,
            "DeepSeek-V4 has one shared K=V head",
        )?;
        one("expert_shared_count", 1, "one shared expert")?;
        one(
            "expert_gating_func",
            GATING_SQRT_SOFTPLUS,
            "4: sqrt(softplus)",
        )?;
        if md.get_bool(&key("expert_weights_norm"))? == Some(false) {
            return Err(err(
                "expert_weights_norm",
                "false is not supported (the chosen experts' scores are renormalised)".into(),
            ));
        }
        let layers = size("block_count")?;
        let head_dim = size("attention.key_length")?;
        if let Some(v) = md.get_u64(&key("attention.value_length"))?
            && v as usize != head_dim
        {
            return Err(err(
                "attention.value_length",
                format!("{v}: K and V are one vector of key_length {head_dim}"),
            ));
        }
        let ratios = md
            .get_i64s(&key("attention.compress_ratios"))?
            .ok_or_else(|| err("attention.compress_ratios", "missing".into()))?;
        if ratios.len() < layers {
            return Err(err(
                "attention.compress_ratios",
                format!("{} entries for {layers} layers", ratios.len()),
            ));
        }
        let attention = ratios[..layers]
            .iter()
            .map(|&r| match r {
                0 => Ok(V4Attention::Sliding),
                4 => Ok(V4Attention::Csa { ratio: 4 }),
                128 => Ok(V4Attention::Hca { ratio: 128 }),
                other => Err(err(
                    "attention.compress_ratios",
                    format!("{other} is not one of 0, 4, 128"),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let limit = |k: &str| -> Result<f32> {
            let v = md
                .get_f32s(&key(k))?
                .ok_or_else(|| err(k, "missing".into()))?;
            match v.first() {
                Some(&l) if v.iter().all(|&x| x == l) => Ok(l),
                _ => Err(err(k, format!("{v:?}: one bound for every layer"))),
            }
        };
        let swiglu_limit = limit("swiglu_clamp_exp")?;
        if limit("swiglu_clamp_shexp")? != swiglu_limit {
            return Err(err(
                "swiglu_clamp_shexp",
                "differs from swiglu_clamp_exp (one bound for routed and shared experts)".into(),
            ));
        }
        let max_position = size("context_length")?;
        // YaRN applies to the compressed layers alone, without its magnitude factor (llama.cpp
        // cancels it; transformers sets it to 1).
        let compress_scaling = match md.get_str(&key("rope.scaling.type"))? {
            None | Some("none") => RopeScaling::None,
            Some("yarn") => match gguf_yarn(md, &key, &src)? {
                RopeScaling::Yarn {
                    factor,
                    original_max_position,
                    beta_fast,
                    beta_slow,
                    truncate,
                    ..
                } => RopeScaling::Yarn {
                    factor,
                    original_max_position,
                    beta_fast,
                    beta_slow,
                    attention_factor: 1.0,
                    truncate,
                },
                other => other,
            },
            Some(other) => {
                return Err(err(
                    "rope.scaling.type",
                    format!("`{other}` is not supported (yarn)"),
                ));
            }
        };
        let vocab = match md.get_strings("tokenizer.ggml.tokens")? {
            Some(t) => t.len(),
            None => file
                .tensor("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .unwrap_or(0) as usize,
        };
        let moe = V4Moe {
            experts: size("expert_count")?,
            used: size("expert_used_count")?,
            expert_ffn: size("expert_feed_forward_length")?,
            routed_scale: float("expert_weights_scale")?,
            hash_layers: md
                .get_u64(&key("hash_layer_count"))?
                .unwrap_or(0)
                .min(layers as u64) as usize,
            swiglu_limit,
        };
        let cfg = Self {
            hidden: size("embedding_length")?,
            layers,
            heads: size("attention.head_count")?,
            head_dim,
            rope_dim: size("rope.dimension_count")?,
            q_lora_rank: size("attention.q_lora_rank")?,
            o_groups: size("attention.output_group_count")?,
            o_lora_rank: size("attention.output_lora_rank")?,
            window: size("attention.sliding_window")?,
            attention,
            rope_theta: float("rope.freq_base")?,
            compress_rope_theta: float("attention.compress_rope_freq_base")?,
            compress_scaling,
            indexer: V4Indexer {
                heads: size("attention.indexer.head_count")?,
                head_dim: size("attention.indexer.key_length")?,
                topk: size("attention.indexer.top_k")?,
            },
            hc: HcConfig {
                streams: size("hyper_connection.count")?,
                sinkhorn_iters: size("hyper_connection.sinkhorn_iterations")?,
                eps: float("hyper_connection.epsilon")?,
            },
            moe,
            vocab,
            rms_eps: float("attention.layer_norm_rms_epsilon")?,
            max_position,
            tie_embeddings: file.tensor("output.weight").is_none(),
            mtp_layers: md.get_u64(&key("nextn_predict_layers"))?.unwrap_or(0) as usize,
        };
        cfg.check()
            .map_err(|(field, problem)| err(gguf_key(field), problem))?;
        Ok(cfg)
    }
}
