//! `ModelConfig`: the normalised description the forward pass uses, read from GGUF metadata
//! (`config/gguf.rs`) or an HF `config.json` (`config/hf.rs`); the file formats stay there.
//! Every count and size is checked against [`limits`] before anything is sized by it.

mod deepseek_v4;
mod deepseek_v4_gguf;
mod gguf;
mod hf;
mod quant;

pub use deepseek_v4::{DeepseekV4Config, V4Attention, V4Indexer, V4Moe};
pub(crate) use quant::FP8_BLOCK;
pub use quant::{HfQuant, QuantMethod, fp8_block_size};

use kiln_tensor::{RopeConfig, RopeLayout, RopeScaling, RotaryChannels, Router};

use crate::{ModelError, Result};

/// Model families kiln runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Gemma 3's text model.
    Gemma3,
    /// Qwen3 with mixture-of-experts MLPs (Qwen3-30B-A3B).
    Qwen3Moe,
    /// Mistral with mixture-of-experts MLPs, as HF names it (llama.cpp's converter writes
    /// it as `llama` with experts).
    Mixtral,
    /// OpenAI's GPT-OSS: experts with biases and a clamped SwiGLU, attention sinks,
    /// alternating sliding and full layers, YaRN RoPE.
    GptOss,
}

/// The architectures kiln runs, as configs name them (for error messages).
pub const SUPPORTED_ARCHITECTURES: &str =
    "llama, mistral, qwen2, qwen3, gemma3, qwen3moe (qwen3_moe), mixtral, gpt-oss (gpt_oss)";

impl Arch {
    /// The name configs use (`llama`, `mistral`, `qwen2`, `qwen3`, `gemma3`).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Mixtral => "mixtral",
            Arch::GptOss => "gpt-oss",
        }
    }

    fn parse(file: &str, s: &str) -> Result<Self> {
        match s {
            "llama" => Ok(Arch::Llama),
            "mistral" => Ok(Arch::Mistral),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            // transformers names the text-only config `gemma3_text`.
            "gemma3" | "gemma3_text" => Ok(Arch::Gemma3),
            // GGUF's name, and transformers'.
            "qwen3moe" | "qwen3_moe" => Ok(Arch::Qwen3Moe),
            "mixtral" => Ok(Arch::Mixtral),
            "gpt-oss" | "gpt_oss" => Ok(Arch::GptOss),
            other => Err(ModelError::Architecture {
                file: file.into(),
                arch: other.into(),
            }),
        }
    }
}

/// The gated MLP's activation: `down(act(gate(x)) · up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama, Mistral, Qwen).
    Silu,
    /// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU: `(clamp(up, -7, 7) + 1) · g·σ(1.702·g)`, `g = min(gate, 7)`.
    SwigluOai,
}

/// Rotary embedding parameters of one kind of layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub theta: f32,
    pub scaling: RopeScaling,
}

/// How one layer attends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// Sliding window: a query at position `p` sees `p - W + 1 ..= p`; `None` is full
    /// attention.
    pub window: Option<usize>,
    pub rope: RopeParams,
}

/// The mixture-of-experts MLP of a model's sparse layers: a router picks `used` of `experts`
/// gated MLPs (`expert_ffn` wide) for each token and sums their outputs by its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    /// Experts each token uses (top-k).
    pub used: usize,
    /// Width of one expert's MLP.
    pub expert_ffn: usize,
    pub router: Router,
    /// The router and every expert projection carry a bias (GPT-OSS).
    pub biases: bool,
    /// Layers whose MLP is dense (`ffn` wide) instead (Qwen3-MoE's `mlp_only_layers`).
    pub dense_layers: Vec<usize>,
}

impl MoeConfig {
    /// One line for `kiln info`.
    pub fn summary(&self, layers: usize) -> String {
        let router = match self.router {
            Router::SoftmaxTopK { renorm: true } => "softmax, top-k renormalised",
            Router::SoftmaxTopK { renorm: false } => "softmax, top-k as is",
            Router::TopKSoftmax => "top-k, then softmax",
            Router::SqrtSoftplus { .. } => "sqrt-softplus scores, top-k renormalised and scaled",
        };
        let biases = if self.biases {
            "; router and experts with biases"
        } else {
            ""
        };
        format!(
            "{} experts of {} a layer, {} used a token ({router}{biases}); {} of {layers} \
             layers sparse",
            self.experts,
            self.expert_ffn,
            self.used,
            layers - self.dense_layers.len()
        )
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
    /// Rotary layout of the Q/K weights as stored: llama GGUF files permute Q/K rows for
    /// interleaved pairs; HF checkpoints use the half-split layout.
    pub rope_layout: RopeLayout,
    pub max_position: usize,
    pub tie_embeddings: bool,
    /// Each layer's attention: its window and its RoPE (Gemma 3 mixes sliding-window layers
    /// with RoPE base 10,000 and full-attention layers with their own base and scaling).
    pub attention: Vec<LayerAttention>,
    /// Q/K/V projections carry biases (qwen2, gpt-oss).
    pub qkv_bias: bool,
    /// The attention output projection carries a bias (gpt-oss).
    pub o_bias: bool,
    /// Each layer has attention sinks, a logit per query head (gpt-oss).
    pub attn_sinks: bool,
    /// Q and K are RMS-normalised per head before RoPE (qwen3, gemma3).
    pub qk_norm: bool,
    /// Norms after attention and after the MLP too (gemma3): the pre-MLP norm is then a
    /// weight of its own (`pre_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// Added to every RMSNorm weight at load: Gemma scales by `1 + w` and HF checkpoints hold
    /// `w`, while llama.cpp's GGUF already holds `1 + w` (0 there and for other families).
    pub norm_offset: f32,
    pub activation: Activation,
    /// Embeddings are multiplied by this (gemma3: `sqrt(hidden)`).
    pub embed_scale: Option<f32>,
    /// Softmax scale of attention scores (`1/sqrt(head_dim)`, or gemma's
    /// `query_pre_attn_scalar^-0.5`).
    pub attn_scale: f32,
    /// Final logits become `cap · tanh(logits / cap)`.
    pub final_logit_softcap: Option<f32>,
    /// Mixture-of-experts MLPs (`None`: every MLP is dense).
    pub moe: Option<MoeConfig>,
}

/// Upper bounds on what a config may ask for. Larger values are corrupt files, not models:
/// they are refused before anything (a RoPE table, a layer list) is sized by them.
pub mod limits {
    pub const LAYERS: usize = 1024;
    pub const HIDDEN: usize = 1 << 16;
    pub const HEADS: usize = 1024;
    pub const FFN: usize = 1 << 20;
    pub const VOCAB: usize = 1 << 22;
    /// Context length: the RoPE tables hold `positions × head_dim` floats each.
    pub const POSITIONS: usize = 1 << 20;
    pub const WINDOW: usize = POSITIONS;
}

impl ModelConfig {
    /// The weight of layer `l`'s norm before its MLP: Gemma 3's `pre_feedforward_layernorm`
    /// beside its sandwich norms; GPT-OSS's `post_attention_norm` in llama.cpp's files (its
    /// HF name is everyone's `post_attention_layernorm`); `ffn_norm` elsewhere.
    pub fn ffn_norm_weight(&self, l: usize) -> crate::Weight {
        match self.arch {
            _ if self.sandwich_norms => crate::Weight::PreFfnNorm(l),
            Arch::GptOss => crate::Weight::PostAttnNorm(l),
            _ => crate::Weight::FfnNorm(l),
        }
    }

    /// Whether layer `l`'s MLP is a mixture of experts.
    pub fn sparse_layer(&self, l: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| !m.dense_layers.contains(&l))
    }

    /// The K/V shape of this model's cache, stored as `dtype` (for planning and sizing).
    /// Every layer keeps every token's K/V: block tables are shared by all layers.
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

    /// The window the KV manager may free blocks behind: only when every layer has one (the
    /// widest), since one block table serves all layers and a full-attention layer still
    /// reads every token.
    pub fn kv_window(&self) -> Option<usize> {
        self.attention
            .iter()
            .map(|a| a.window)
            .try_fold(0, |w, a| a.map(|a| w.max(a)))
            .filter(|&w| w > 0)
    }

    /// The sliding window, when the layers that have one share it (`None` for full attention
    /// everywhere).
    pub fn sliding_window(&self) -> Option<usize> {
        self.attention.iter().filter_map(|a| a.window).max()
    }

    /// Layers with a sliding window, and layers with full attention.
    pub fn attention_mix(&self) -> (usize, usize) {
        let windowed = self.attention.iter().filter(|a| a.window.is_some()).count();
        (windowed, self.attention.len() - windowed)
    }

    /// One line on how the layers attend and what that means for the KV cache, for `kiln
    /// info`: a mixed model keeps every token of every layer, since one block table serves
    /// all layers and its full-attention layers read the whole context.
    pub fn attention_summary(&self) -> String {
        let (windowed, full) = self.attention_mix();
        let rope = |a: &LayerAttention| match a.rope.scaling {
            RopeScaling::None => format!("RoPE base {}", a.rope.theta),
            s => format!("RoPE base {} scaled {s:?}", a.rope.theta),
        };
        let first_windowed = self.attention.iter().find(|a| a.window.is_some());
        let first_full = self.attention.iter().find(|a| a.window.is_none());
        match (first_windowed, first_full) {
            (Some(w), None) => format!(
                "{windowed} layers with a {}-token sliding window ({}); KV blocks behind the \
                 window are freed",
                w.window.unwrap_or(0),
                rope(w)
            ),
            (Some(w), Some(f)) => format!(
                "{windowed} layers with a {}-token sliding window ({}), {full} with full \
                 attention ({}); every layer keeps every token's K/V (the full layers need \
                 them), so the KV cost per token counts all {} layers",
                w.window.unwrap_or(0),
                rope(w),
                rope(f),
                self.layers
            ),
            (None, Some(f)) => format!("{full} layers with full attention ({})", rope(f)),
            (None, None) => "no layers".into(),
        }
    }

    /// The rotary embedding of layers with these parameters.
    pub fn rope(&self, params: RopeParams) -> RopeConfig {
        RopeConfig {
            head_dim: self.head_dim,
            rotary_dim: self.head_dim,
            theta: params.theta,
            scaling: params.scaling,
            layout: self.rope_layout,
            rotated: RotaryChannels::Leading,
        }
    }

    /// Checks every size against [`limits`] and the fields against each other.
    fn validate(self, file: &str) -> Result<Self> {
        let bad = |field: &str, problem: String| {
            Err(ModelError::Config {
                file: file.into(),
                field: field.into(),
                problem,
            })
        };
        for (f, v, max) in [
            ("hidden_size", self.hidden, limits::HIDDEN),
            ("num_hidden_layers", self.layers, limits::LAYERS),
            ("num_attention_heads", self.heads, limits::HEADS),
            ("num_key_value_heads", self.kv_heads, limits::HEADS),
            ("head_dim", self.head_dim, kiln_attention::MAX_HEAD_DIM),
            ("intermediate_size", self.ffn, limits::FFN),
            ("vocab_size", self.vocab, limits::VOCAB),
            (
                "max_position_embeddings",
                self.max_position,
                limits::POSITIONS,
            ),
        ] {
            if v == 0 || v > max {
                return bad(f, format!("{v} is outside 1..={max}"));
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
        if !self.head_dim.is_multiple_of(4) {
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
        if self.attention.len() != self.layers {
            return bad(
                "layer_types",
                format!(
                    "{} entries for {} layers",
                    self.attention.len(),
                    self.layers
                ),
            );
        }
        for a in &self.attention {
            if !(a.rope.theta.is_finite() && a.rope.theta > 0.0) {
                return bad("rope_theta", format!("{} must be positive", a.rope.theta));
            }
            let factor_ok = match a.rope.scaling {
                RopeScaling::None => true,
                RopeScaling::Linear { factor } => factor.is_finite() && factor > 0.0,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    ..
                } => [factor, low_freq_factor, high_freq_factor]
                    .iter()
                    .all(|f| f.is_finite() && *f > 0.0),
                RopeScaling::Yarn {
                    factor,
                    original_max_position,
                    beta_fast,
                    beta_slow,
                    attention_factor,
                    ..
                } => {
                    original_max_position > 0
                        && [factor, beta_fast, beta_slow, attention_factor]
                            .iter()
                            .all(|f| f.is_finite() && *f > 0.0)
                }
            };
            if !factor_ok {
                return bad("rope_scaling", "factors must be positive".into());
            }
            if let Some(w) = a.window
                && (w == 0 || w > limits::WINDOW)
            {
                return bad(
                    "sliding_window",
                    format!("{w} is outside 1..={}", limits::WINDOW),
                );
            }
        }
        if let Some(m) = &self.moe {
            let used_max = m.experts.min(kiln_tensor::MAX_EXPERTS_USED);
            for (f, v, max) in [
                ("num_experts", m.experts, kiln_tensor::MAX_EXPERTS),
                ("num_experts_per_tok", m.used, used_max),
                ("moe_intermediate_size", m.expert_ffn, limits::FFN),
            ] {
                if v == 0 || v > max {
                    return bad(f, format!("{v} is outside 1..={max}"));
                }
            }
        }
        for (f, v) in [
            ("attn_scale", Some(self.attn_scale)),
            ("embed_scale", self.embed_scale),
            ("final_logit_softcapping", self.final_logit_softcap),
        ] {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return bad(f, format!("{v} must be positive"));
            }
        }
        Ok(self)
    }
}

/// The per-family parts of a config that neither format spells out the same way.
struct FamilyDefaults {
    qk_norm: bool,
    sandwich_norms: bool,
    activation: Activation,
    embed_scale: Option<f32>,
}

impl FamilyDefaults {
    fn of(arch: Arch, hidden: usize) -> Self {
        let gemma = arch == Arch::Gemma3;
        Self {
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
            sandwich_norms: gemma,
            activation: match arch {
                Arch::Gemma3 => Activation::GeluTanh,
                Arch::GptOss => Activation::SwigluOai,
                _ => Activation::Silu,
            },
            // transformers builds the scale as `hidden ** 0.5` in the weights' dtype (f32).
            embed_scale: gemma.then(|| (hidden as f32).sqrt()),
        }
    }
}

/// GPT-OSS's layer pattern (transformers' default `layer_types`, llama.cpp's SWA pattern 2):
/// even layers slide, odd ones attend fully. The iterator yields `true` for sliding layers.
fn alternating_pattern(layers: usize) -> impl Iterator<Item = bool> {
    (0..layers).map(|l| l % 2 == 0)
}

/// Gemma 3's layer pattern when a file gives only its period: every `period`-th layer
/// (1-based) has full attention, the others the sliding window.
/// `period` is at least 1; the iterator yields `true` for sliding-window layers.
fn gemma_pattern(layers: usize, period: usize) -> impl Iterator<Item = bool> {
    (0..layers).map(move |l| !(l + 1).is_multiple_of(period.max(1)))
}
