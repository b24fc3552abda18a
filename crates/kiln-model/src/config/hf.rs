//! [`ModelConfig`] from a Hugging Face `config.json`, as transformers 4.x and 5 write it.

use kiln_tensor::{RopeLayout, RopeScaling, Router};
use serde_json::{Map, Value};

use super::{
    Arch, FamilyDefaults, LayerAttention, ModelConfig, MoeConfig, RopeParams, alternating_pattern,
    gemma_pattern, limits,
};
use crate::{ModelError, Result};

/// Reads fields of one `config.json` object, naming the file and field in every error.
pub(super) struct Fields<'a> {
    pub(super) file: &'a str,
    /// Where `v` sits in the file (`"quantization_config."`; empty for the top level).
    pub(super) prefix: &'a str,
    pub(super) v: &'a Map<String, Value>,
}

impl Fields<'_> {
    pub(super) fn err(&self, field: &str, problem: impl Into<String>) -> ModelError {
        ModelError::Config {
            file: self.file.into(),
            field: format!("{}{field}", self.prefix),
            problem: problem.into(),
        }
    }

    pub(super) fn get(&self, k: &str) -> Option<&Value> {
        self.v.get(k).filter(|x| !x.is_null())
    }

    /// A size: a non-negative integer no larger than `u32::MAX` (the limits come later).
    pub(super) fn size_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_u64()
                .filter(|&n| n <= u64::from(u32::MAX))
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.err(k, format!("{x} is not a size"))),
        }
    }

    pub(super) fn size(&self, k: &str) -> Result<usize> {
        self.size_opt(k)?
            .ok_or_else(|| self.err(k, "missing or not a number"))
    }

    pub(super) fn float(&self, k: &str) -> Result<Option<f32>> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_f64()
                .map(|f| Some(f as f32))
                .ok_or_else(|| self.err(k, format!("{x} is not a number"))),
        }
    }

    pub(super) fn bool(&self, k: &str) -> Option<bool> {
        self.get(k).and_then(Value::as_bool)
    }
}

/// One rope dictionary (`rope_scaling`, `rope_parameters` or one of its per-layer-type
/// entries): its `rope_theta` if it has one, and its scaling.
pub(super) fn rope_dict(
    f: &Fields<'_>,
    field: &str,
    s: &Value,
) -> Result<(Option<f32>, RopeScaling)> {
    let theta = s
        .get("rope_theta")
        .and_then(Value::as_f64)
        .map(|x| x as f32);
    let ty = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let num = |k: &str| {
        s.get(k)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| f.err(&format!("{field}.{k}"), "missing or not a number"))
    };
    let scaling = match ty {
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position: num("original_max_position_embeddings")? as u32,
        },
        "yarn" => {
            let opt = |k: &str| s.get(k).and_then(Value::as_f64).map(|x| x as f32);
            // transformers' defaults: the original context is the model's, the factor their
            // ratio, the attention factor 0.1·ln(factor) + 1 (or DeepSeek's mscale ratio).
            let original = match s
                .get("original_max_position_embeddings")
                .and_then(Value::as_f64)
                .filter(|&o| o >= 1.0)
            {
                Some(o) => o as u32,
                None => f.size("max_position_embeddings")? as u32,
            };
            let factor = match opt("factor") {
                Some(x) => x,
                None => f.size("max_position_embeddings")? as f32 / original.max(1) as f32,
            };
            RopeScaling::Yarn {
                factor,
                original_max_position: original,
                beta_fast: opt("beta_fast").filter(|&b| b != 0.0).unwrap_or(32.0),
                beta_slow: opt("beta_slow").filter(|&b| b != 0.0).unwrap_or(1.0),
                attention_factor: opt("attention_factor").unwrap_or_else(|| {
                    RopeScaling::yarn_attention_factor(factor, opt("mscale"), opt("mscale_all_dim"))
                }),
                truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }
        }
        "default" | "" => RopeScaling::None,
        other => {
            return Err(f.err(
                &format!("{field}.rope_type"),
                format!("unsupported `{other}` (linear, llama3, yarn)"),
            ));
        }
    };
    Ok((theta, scaling))
}

/// The key holding the expert count: transformers 5 writes `num_local_experts` for both
/// families, Qwen's own configs `num_experts`.
fn experts_key(f: &Fields<'_>) -> &'static str {
    if f.get("num_local_experts").is_some() {
        "num_local_experts"
    } else {
        "num_experts"
    }
}

/// GPT-OSS's clamped SwiGLU, which kiln's kernels hold as constants: the `swiglu_limit`
/// and `swiglu_alpha` its configs write.
const SWIGLU_OAI: [(&str, f32); 2] = [("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)];

/// The experts of a `qwen3_moe`, `mixtral` or `gpt_oss` config (`None` for the dense
/// families).
fn hf_moe(f: &Fields<'_>, arch: Arch, layers: usize) -> Result<Option<MoeConfig>> {
    let (ffn_key, router) = match arch {
        Arch::Qwen3Moe => (
            "moe_intermediate_size",
            Router::SoftmaxTopK {
                renorm: f.bool("norm_topk_prob").unwrap_or(false),
            },
        ),
        Arch::Mixtral => ("intermediate_size", Router::SoftmaxTopK { renorm: true }),
        Arch::GptOss => ("intermediate_size", Router::TopKSoftmax),
        _ => return Ok(None),
    };
    if arch == Arch::GptOss {
        for (key, value) in SWIGLU_OAI {
            if let Some(v) = f.float(key)?
                && v != value
            {
                return Err(f.err(key, format!("{v} is not supported (GPT-OSS's {value})")));
            }
        }
    } else if let Some(act) = f.get("hidden_act").and_then(Value::as_str)
        && act != "silu"
    {
        return Err(f.err("hidden_act", format!("`{act}` is not supported (silu)")));
    }
    let experts = f.size(experts_key(f))?;
    if experts == 0 {
        // transformers builds every layer dense then.
        return Ok(None);
    }
    // Qwen3-MoE: a layer is sparse unless listed in `mlp_only_layers`, and only every
    // `decoder_sparse_step`-th (1-based) is.
    let step = f.size_opt("decoder_sparse_step")?.unwrap_or(1).max(1);
    let only: Vec<usize> = match f.get("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(v)) => v
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64().map(|l| l as usize).ok_or_else(|| {
                    f.err(
                        &format!("mlp_only_layers[{i}]"),
                        format!("{x} is not a layer"),
                    )
                })
            })
            .collect::<Result<_>>()?,
        Some(other) => return Err(f.err("mlp_only_layers", format!("{other} is not a list"))),
    };
    if let Some(&l) = only.iter().find(|&&l| l >= layers) {
        return Err(f.err("mlp_only_layers", format!("layer {l} of {layers} layers")));
    }
    let dense_layers = (0..layers.min(limits::LAYERS))
        .filter(|l| only.contains(l) || !(l + 1).is_multiple_of(step))
        .collect();
    Ok(Some(MoeConfig {
        experts,
        used: f.size("num_experts_per_tok")?,
        expert_ffn: f.size(ffn_key)?,
        router,
        biases: arch == Arch::GptOss,
        dense_layers,
    }))
}

const FULL: &str = "full_attention";
const SLIDING: &str = "sliding_attention";

impl ModelConfig {
    /// From an HF `config.json`'s text; `file` names it in errors.
    pub fn from_hf_json(file: &str, text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            file: file.into(),
            what: "not JSON",
            source,
        })?;
        let v = root.as_object().ok_or_else(|| ModelError::Config {
            file: file.into(),
            field: "(top level)".into(),
            problem: "not a JSON object".into(),
        })?;
        let f = Fields {
            file,
            prefix: "",
            v,
        };
        let arch_name = f
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| f.err("model_type", "missing or not a string"))?;
        if arch_name == "gemma3" && f.get("text_config").is_some() {
            return Err(f.err(
                "model_type",
                "a multimodal Gemma 3 checkpoint: kiln runs the text model (`gemma3_text`)",
            ));
        }
        let arch = Arch::parse(file, arch_name)?;
        let hidden = f.size("hidden_size")?;
        let heads = f.size("num_attention_heads")?;
        let layers = f.size("num_hidden_layers")?;
        let gemma = arch == Arch::Gemma3;
        // Gemma3TextConfig's defaults, for the keys a config may leave out.
        let head_dim = match f.size_opt("head_dim")? {
            Some(h) => h,
            None if gemma => 256,
            None => hidden.checked_div(heads).unwrap_or(0),
        };
        if gemma && f.bool("use_bidirectional_attention") == Some(true) {
            return Err(f.err(
                "use_bidirectional_attention",
                "bidirectional (embedding) Gemma models are not supported",
            ));
        }
        let default_theta = if gemma { 1_000_000.0 } else { 10000.0 };

        // transformers 5 writes `rope_parameters` (with `rope_theta` inside; for Gemma 3 one
        // entry per layer type); 4.x wrote `rope_scaling` and a top-level `rope_theta`, and
        // Gemma 3's `rope_local_base_freq`.
        let params = f.get("rope_parameters").or_else(|| f.get("rope_scaling"));
        let per_type = params
            .and_then(Value::as_object)
            .filter(|p| p.contains_key(FULL) || p.contains_key(SLIDING));
        let top_theta = f.float("rope_theta")?;
        let (global, local) = match per_type {
            Some(p) => {
                let entry = |t: &str| -> Result<Option<RopeParams>> {
                    p.get(t)
                        .map(|s| {
                            let (theta, scaling) =
                                rope_dict(&f, &format!("rope_parameters.{t}"), s)?;
                            Ok(RopeParams {
                                theta: theta.or(top_theta).unwrap_or(default_theta),
                                scaling,
                            })
                        })
                        .transpose()
                };
                let global = entry(FULL)?;
                let local = entry(SLIDING)?;
                let any = global.or(local).unwrap_or(RopeParams {
                    theta: 10000.0,
                    scaling: RopeScaling::None,
                });
                (global.unwrap_or(any), local.unwrap_or(any))
            }
            None => {
                let (theta, scaling) = match params {
                    Some(s) => rope_dict(&f, "rope_scaling", s)?,
                    None => (None, RopeScaling::None),
                };
                let global = RopeParams {
                    theta: top_theta.or(theta).unwrap_or(default_theta),
                    scaling,
                };
                // Gemma 3's local layers have their own base and no scaling.
                let local = match (arch, f.float("rope_local_base_freq")?) {
                    (Arch::Gemma3, base) => RopeParams {
                        theta: base.unwrap_or(10000.0),
                        scaling: RopeScaling::None,
                    },
                    (_, _) => global,
                };
                (global, local)
            }
        };

        let window = match f.size_opt("sliding_window")? {
            None if gemma => Some(4096),
            w => w.filter(|&w| w > 0),
        };
        let use_window = match arch {
            Arch::Llama => false,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
                f.bool("use_sliding_window").unwrap_or(false)
            }
            Arch::Mistral | Arch::Mixtral | Arch::Gemma3 | Arch::GptOss => true,
        };
        let kinds: Vec<bool> = match f.get("layer_types") {
            Some(Value::Array(types)) => types
                .iter()
                .take(limits::LAYERS + 1)
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some(SLIDING) => Ok(true),
                    Some(FULL) => Ok(false),
                    _ => Err(f.err(
                        &format!("layer_types[{i}]"),
                        format!("{t} is not `{SLIDING}` or `{FULL}`"),
                    )),
                })
                .collect::<Result<_>>()?,
            Some(other) => {
                return Err(f.err("layer_types", format!("{other} is not a list")));
            }
            None if arch == Arch::Gemma3 => {
                let period = f.size_opt("sliding_window_pattern")?.unwrap_or(6);
                gemma_pattern(layers.min(limits::LAYERS), period).collect()
            }
            None if arch == Arch::GptOss => {
                alternating_pattern(layers.min(limits::LAYERS)).collect()
            }
            None => vec![use_window; layers.min(limits::LAYERS)],
        };
        let attention = kinds
            .into_iter()
            .map(|sliding| match window {
                Some(w) if sliding && use_window => LayerAttention {
                    window: Some(w),
                    rope: local,
                },
                _ => LayerAttention {
                    window: None,
                    rope: global,
                },
            })
            .collect();

        if f.float("attn_logit_softcapping")?.is_some_and(|c| c > 0.0) {
            return Err(f.err(
                "attn_logit_softcapping",
                "attention logit soft-capping is not supported",
            ));
        }
        if gemma
            && let Some(act) = f
                .get("hidden_activation")
                .or_else(|| f.get("hidden_act"))
                .and_then(Value::as_str)
            && act != "gelu_pytorch_tanh"
        {
            return Err(f.err(
                "hidden_activation",
                format!("`{act}` is not supported (gelu_pytorch_tanh)"),
            ));
        }
        let family = FamilyDefaults::of(arch, hidden);
        let attention_bias = f.bool("attention_bias").unwrap_or(arch == Arch::GptOss);
        let scalar = match f.float("query_pre_attn_scalar")? {
            Some(s) if gemma => s,
            None if gemma => 256.0,
            _ => head_dim as f32,
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            layers,
            heads,
            kv_heads: f.size_opt("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            ffn: f.size("intermediate_size")?,
            vocab: f.size("vocab_size")?,
            rms_eps: f.float("rms_norm_eps")?.unwrap_or(1e-6),
            rope_layout: RopeLayout::HalfSplit,
            max_position: f.size_opt("max_position_embeddings")?.unwrap_or(2048),
            // Gemma ties its head to the embeddings unless told otherwise.
            tie_embeddings: f.bool("tie_word_embeddings").unwrap_or(gemma),
            attention,
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            // Qwen2's biases are Q/K/V's only; where `attention_bias` is set, transformers
            // gives the output projection one too.
            o_bias: arch != Arch::Qwen2 && attention_bias,
            attn_sinks: arch == Arch::GptOss,
            qk_norm: family.qk_norm,
            sandwich_norms: family.sandwich_norms,
            // HF Gemma checkpoints hold `w`; the model scales by `1 + w`.
            norm_offset: if gemma { 1.0 } else { 0.0 },
            activation: family.activation,
            embed_scale: family.embed_scale,
            attn_scale: 1.0 / scalar.sqrt(),
            final_logit_softcap: f.float("final_logit_softcapping")?.filter(|&c| c > 0.0),
            moe: hf_moe(&f, arch, layers)?,
        };
        // `validate` speaks Qwen3-MoE's names; say which key this file used.
        cfg.validate(file).map_err(|e| match e {
            ModelError::Config {
                file,
                field,
                problem,
            } => ModelError::Config {
                field: match (field.as_str(), arch) {
                    ("num_experts", _) => experts_key(&f).into(),
                    ("moe_intermediate_size", Arch::Mixtral) => "intermediate_size".into(),
                    _ => field,
                },
                file,
                problem,
            },
            other => other,
        })
    }
}
