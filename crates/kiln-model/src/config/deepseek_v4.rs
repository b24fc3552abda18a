//! DeepSeek-V4's `config.json` (`model_type: deepseek_v4`), read under both the names the
//! hub's files use (DeepSeek's: `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
//! `n_routed_experts`, `rope_scaling`) and those transformers writes (`layer_types`,
//! `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, `rope_parameters` with
//! `main` and `compress`), with transformers' defaults (`DeepseekV4Config`: V4-Pro's layer
//! schedule) for what a file leaves out. A key kiln cannot honour is refused by name.
//!
//! It sizes the KV cache ([`DeepseekV4Config::kv_layout`], laid out as llama.cpp's
//! `llama_kv_cache_dsv4` keeps it) and the model `crate::v4` runs.

use kiln_attention::MAX_COMPRESSED_HEAD_DIM;
use kiln_kv::{CacheKind, Growth, KvLayout, LayerCache};
use kiln_tensor::{
    HcConfig, MAX_EXPERTS, MAX_EXPERTS_USED, MAX_STREAMS, RopeConfig, RopeLayout, RopeScaling,
    RotaryChannels,
};
use serde_json::{Map, Value};

use super::hf::{Fields, rope_dict};
use super::limits;
use crate::{ModelError, Result};

/// The most Sinkhorn-Knopp iterations a config may ask for (transformers' default is 20).
const MAX_SINKHORN_ITERS: usize = 1000;

/// A layer's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4Attention {
    /// The sliding window of raw K=V only (`sliding_attention`, ratio 0).
    Sliding,
    /// Compressed sparse attention: the window plus the indexer's top-k of entries pooled
    /// every `ratio` tokens over overlapping windows (`compressed_sparse_attention`, 4).
    Csa { ratio: u32 },
    /// Heavily compressed attention: the window plus every entry pooled every `ratio` tokens
    /// (`heavily_compressed_attention`, 128).
    Hca { ratio: u32 },
}

/// The lightning indexer (CSA layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct V4Indexer {
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

/// The mixture of experts every layer has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct V4Moe {
    pub experts: usize,
    pub used: usize,
    /// The routed experts' width, and the one shared expert's (transformers builds exactly
    /// one; the chosen experts' scores are always renormalised).
    pub expert_ffn: usize,
    /// The routed weights' factor (`routed_scaling_factor`).
    pub routed_scale: f32,
    /// The first layers route by token id (`tid2eid`) instead of by score.
    pub hash_layers: usize,
    /// The clamp of the SwiGLU in routed and shared experts.
    pub swiglu_limit: f32,
}

/// DeepSeek-V4's shape and hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekV4Config {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    /// Of q and of the one shared K=V head.
    pub head_dim: usize,
    /// RoPE's channels: the last ones of each head.
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    /// The raw K=V window every layer keeps.
    pub window: usize,
    pub attention: Vec<V4Attention>,
    /// RoPE's base of sliding-only layers (no scaling).
    pub rope_theta: f32,
    /// RoPE's base and scaling of CSA and HCA layers (YaRN without its magnitude factor).
    pub compress_rope_theta: f32,
    pub compress_scaling: RopeScaling,
    pub indexer: V4Indexer,
    /// The hyper-connections (mHC) around every sublayer.
    pub hc: HcConfig,
    pub moe: V4Moe,
    pub vocab: usize,
    pub rms_eps: f32,
    pub max_position: usize,
    pub tie_embeddings: bool,
    /// Multi-token-prediction layers the checkpoint carries (unused for inference).
    pub mtp_layers: usize,
}

/// transformers' `DeepseekV4Config` defaults (V4-Pro's shape where a file names nothing).
const DEFAULT_CSA_RATIO: u32 = 4;
const DEFAULT_HCA_RATIO: u32 = 128;
const DEFAULT_HASH_LAYERS: usize = 3;

impl DeepseekV4Config {
    /// Reads `text`, the `config.json` at `file` (named in every error).
    pub fn from_hf_json(file: &str, text: &str) -> Result<Self> {
        let v: Map<String, Value> = serde_json::from_str(text).map_err(|e| ModelError::Config {
            file: file.into(),
            field: "(json)".into(),
            problem: e.to_string(),
        })?;
        let f = Fields {
            file,
            prefix: "",
            v: &v,
        };
        let model_type = f.get("model_type").and_then(Value::as_str).unwrap_or("");
        if model_type != "deepseek_v4" {
            return Err(f.err("model_type", format!("`{model_type}` is not deepseek_v4")));
        }
        let size_or = |k: &str, d: usize| -> Result<usize> { Ok(f.size_opt(k)?.unwrap_or(d)) };
        let float_or = |k: &str, d: f32| -> Result<f32> { Ok(f.float(k)?.unwrap_or(d)) };
        let layers = size_or("num_hidden_layers", 43)?;
        let head_dim = size_or("head_dim", 512)?;
        // transformers: `partial_rotary_factor` first, then the legacy `qk_rope_head_dim`.
        let rope_dim = match (
            f.float("partial_rotary_factor")?,
            f.size_opt("qk_rope_head_dim")?,
        ) {
            // transformers: `int(head_dim * partial_rotary_factor)`, truncating.
            (Some(p), _) => (head_dim as f64 * f64::from(p)) as usize,
            (None, Some(d)) => d,
            (None, None) => head_dim / 8,
        };
        let heads = size_or("num_attention_heads", 64)?;
        if let Some(kv) = f.size_opt("num_key_value_heads")?
            && kv != 1
        {
            return Err(f.err(
                "num_key_value_heads",
                format!("{kv}: DeepSeek-V4 has one shared K=V head"),
            ));
        }
        for (key, want) in [("hidden_act", "silu"), ("scoring_func", "sqrtsoftplus")] {
            if let Some(got) = f.get(key).and_then(Value::as_str)
                && got != want
            {
                return Err(f.err(key, format!("`{got}` is not supported ({want})")));
            }
        }
        for key in ["attention_bias", "mlp_bias"] {
            if f.bool(key) == Some(true) {
                return Err(f.err(key, "true is not supported (no biases)"));
            }
        }
        // Where transformers and llama.cpp read a key differently, only the value both agree
        // on is taken: transformers always renormalises and builds one shared expert.
        if f.bool("norm_topk_prob") == Some(false) {
            return Err(f.err(
                "norm_topk_prob",
                "false is not supported (the chosen experts' scores are renormalised)",
            ));
        }
        if let Some(n) = f.size_opt("n_shared_experts")?
            && n != 1
        {
            return Err(f.err("n_shared_experts", format!("{n} is not supported (one)")));
        }
        let moe = V4Moe {
            // transformers' own names win over the aliases it folds in.
            experts: match f.size_opt("num_local_experts")? {
                Some(n) => n,
                None => size_or("n_routed_experts", 256)?,
            },
            used: size_or("num_experts_per_tok", 6)?,
            expert_ffn: match f.size_opt("intermediate_size")? {
                Some(n) => n,
                None => size_or("moe_intermediate_size", 2048)?,
            },
            routed_scale: float_or("routed_scaling_factor", 1.5)?,
            hash_layers: hash_layers(&f, layers)?,
            swiglu_limit: float_or("swiglu_limit", 10.0)?,
        };
        let max_position = size_or("max_position_embeddings", 1 << 20)?;
        let rope = rope_params(&f, rope_dim as f32 / head_dim as f32, max_position)?;
        let cfg = Self {
            hidden: size_or("hidden_size", 4096)?,
            layers,
            heads,
            head_dim,
            rope_dim,
            q_lora_rank: size_or("q_lora_rank", 1024)?,
            o_groups: size_or("o_groups", 8)?,
            o_lora_rank: size_or("o_lora_rank", 1024)?,
            window: size_or("sliding_window", 128)?,
            attention: attention(&f, layers)?,
            rope_theta: rope.main_theta,
            compress_rope_theta: rope.compress_theta,
            compress_scaling: rope.compress_scaling,
            indexer: V4Indexer {
                heads: size_or("index_n_heads", 64)?,
                head_dim: size_or("index_head_dim", 128)?,
                topk: size_or("index_topk", 512)?,
            },
            hc: HcConfig {
                streams: size_or("hc_mult", 4)?,
                sinkhorn_iters: size_or("hc_sinkhorn_iters", 20)?,
                eps: float_or("hc_eps", 1e-6)?,
            },
            moe,
            vocab: size_or("vocab_size", 129_280)?,
            rms_eps: float_or("rms_norm_eps", 1e-6)?,
            max_position,
            tie_embeddings: f.bool("tie_word_embeddings").unwrap_or(false),
            mtp_layers: size_or("num_nextn_predict_layers", 1)?,
        };
        cfg.check().map_err(|(key, problem)| f.err(key, problem))?;
        Ok(cfg)
    }

    /// Sizes within [`limits`] and shapes that fit together; an error is the field (by its
    /// `config.json` name) and what is wrong.
    pub(super) fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        let bounded = [
            ("num_hidden_layers", self.layers, limits::LAYERS),
            ("hidden_size", self.hidden, limits::HIDDEN),
            ("num_attention_heads", self.heads, limits::HEADS),
            ("head_dim", self.head_dim, MAX_COMPRESSED_HEAD_DIM),
            ("vocab_size", self.vocab, limits::VOCAB),
            ("moe_intermediate_size", self.moe.expert_ffn, limits::FFN),
            ("sliding_window", self.window, limits::WINDOW),
            (
                "index_head_dim",
                self.indexer.head_dim,
                MAX_COMPRESSED_HEAD_DIM,
            ),
            ("index_n_heads", self.indexer.heads, limits::HEADS),
            ("index_topk", self.indexer.topk, limits::WINDOW),
            ("q_lora_rank", self.q_lora_rank, limits::HIDDEN),
            ("o_lora_rank", self.o_lora_rank, limits::HIDDEN),
            ("n_routed_experts", self.moe.experts, MAX_EXPERTS),
            (
                "num_experts_per_tok",
                self.moe.used,
                MAX_EXPERTS_USED.min(self.moe.experts),
            ),
            ("hc_mult", self.hc.streams, MAX_STREAMS),
            (
                "hc_sinkhorn_iters",
                self.hc.sinkhorn_iters,
                MAX_SINKHORN_ITERS,
            ),
            (
                "max_position_embeddings",
                self.max_position,
                limits::POSITIONS,
            ),
        ];
        for (key, v, max) in bounded {
            if v == 0 || v > max {
                return Err((key, format!("{v} is outside 1..={max}")));
            }
        }
        let rope_width = self.head_dim.min(self.indexer.head_dim);
        if self.rope_dim == 0 || self.rope_dim > rope_width || !self.rope_dim.is_multiple_of(2) {
            return Err((
                "qk_rope_head_dim",
                format!(
                    "{}: an even count of at most head_dim and index_head_dim ({rope_width})",
                    self.rope_dim
                ),
            ));
        }
        if self.o_groups == 0 || !self.heads.is_multiple_of(self.o_groups) {
            return Err((
                "o_groups",
                format!("{} does not divide {} heads", self.o_groups, self.heads),
            ));
        }
        Ok(())
    }

    /// The rotary embedding of the sliding-only layers at `width` channels a head: the
    /// trailing `rope_dim` channels in interleaved pairs, base `rope_theta`, unscaled
    /// (transformers' `main`).
    pub fn main_rope(&self, width: usize) -> RopeConfig {
        RopeConfig {
            theta: self.rope_theta,
            scaling: RopeScaling::None,
            ..self.compressed_rope(width)
        }
    }

    /// The rotary embedding of the compressed layers (CSA and HCA: their queries, raw keys,
    /// entries and indexer) at `width` channels a head: the trailing `rope_dim` channels
    /// turned in interleaved pairs (transformers' `apply_rotary_pos_emb`), base
    /// `compress_rope_theta`, with its YaRN scaling.
    pub fn compressed_rope(&self, width: usize) -> RopeConfig {
        RopeConfig {
            head_dim: width,
            rotary_dim: self.rope_dim,
            theta: self.compress_rope_theta,
            scaling: self.compress_scaling,
            layout: RopeLayout::Interleaved,
            rotated: RotaryChannels::Trailing,
        }
    }

    /// One sequence's caches as llama.cpp's `llama_kv_cache_dsv4` keeps them (K=V, so one
    /// vector an entry): every layer a ring of `window` raw rows of `head_dim`; a CSA layer one
    /// entry of `head_dim` and one indexer key of `index_head_dim` every `ratio` tokens, and
    /// its two overlapping compressors' state (2·ratio rows of kv and gate, 2·width wide, f32);
    /// an HCA layer one entry every `ratio` tokens and its compressor's `ratio` rows of kv and
    /// gate (f32).
    pub fn kv_layout(&self) -> KvLayout {
        let mut caches = Vec::new();
        let (hd, id) = (self.head_dim as u32, self.indexer.head_dim as u32);
        for (layer, a) in (0u32..).zip(&self.attention) {
            let cache = |kind, width, vectors, growth, f32| LayerCache {
                layer,
                kind,
                width,
                vectors,
                growth,
                f32,
            };
            caches.push(cache(
                CacheKind::Window,
                hd,
                1,
                Growth::Last(self.window as u64),
                false,
            ));
            match *a {
                V4Attention::Sliding => {}
                V4Attention::Csa { ratio } => {
                    let r = u64::from(ratio);
                    caches.extend([
                        cache(CacheKind::Compressed, hd, 1, Growth::Every(r), false),
                        cache(CacheKind::IndexerKeys, id, 1, Growth::Every(r), false),
                        cache(
                            CacheKind::CompressorState,
                            2 * hd,
                            2,
                            Growth::Fixed(2 * r),
                            true,
                        ),
                        cache(
                            CacheKind::CompressorState,
                            2 * id,
                            2,
                            Growth::Fixed(2 * r),
                            true,
                        ),
                    ]);
                }
                V4Attention::Hca { ratio } => {
                    let r = u64::from(ratio);
                    caches.extend([
                        cache(CacheKind::Compressed, hd, 1, Growth::Every(r), false),
                        cache(CacheKind::CompressorState, hd, 2, Growth::Fixed(r), true),
                    ]);
                }
            }
        }
        KvLayout { caches }
    }
}

/// The layers' attention: `layer_types` (transformers), else `compress_ratios` (the hub's
/// per-layer 0 / 4 / 128, MTP layers past the last), else transformers' default: V4-Pro's
/// two HCA layers, then HCA and CSA alternating.
fn attention(f: &Fields<'_>, layers: usize) -> Result<Vec<V4Attention>> {
    let rates = match f.get("compress_rates") {
        None => None,
        Some(Value::Object(r)) => Some(r),
        Some(x) => return Err(f.err("compress_rates", format!("{x} is not an object"))),
    };
    // transformers: the legacy scalars override the dict; the dict names both types.
    let rate = |name: &str, legacy: &str, default: u32| -> Result<u32> {
        let given = match (f.get(legacy), rates) {
            (Some(x), _) => Some((legacy.to_owned(), x.clone())),
            (None, Some(r)) => match r.get(name) {
                Some(x) => Some((format!("compress_rates.{name}"), x.clone())),
                None => {
                    return Err(f.err(
                        &format!("compress_rates.{name}"),
                        "missing (the dict names both compressed layer types)",
                    ));
                }
            },
            (None, None) => None,
        };
        match given {
            None => Ok(default),
            Some((key, x)) => x
                .as_u64()
                .filter(|&r| (2..=1 << 16).contains(&r))
                .map(|r| r as u32)
                .ok_or_else(|| f.err(&key, format!("{x} is not a compression ratio (2..=65536)"))),
        }
    };
    let csa = rate(
        "compressed_sparse_attention",
        "compress_rate_csa",
        DEFAULT_CSA_RATIO,
    )?;
    let hca = rate(
        "heavily_compressed_attention",
        "compress_rate_hca",
        DEFAULT_HCA_RATIO,
    )?;
    let list = |key: &str| -> Result<Option<Vec<Value>>> {
        match f.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) if a.len() >= layers => Ok(Some(a[..layers].to_vec())),
            Some(x) => Err(f.err(
                key,
                format!("{x} is not a list of at least {layers} layers"),
            )),
        }
    };
    if let Some(types) = list("layer_types")? {
        return types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("sliding_attention") => Ok(V4Attention::Sliding),
                Some("compressed_sparse_attention") => Ok(V4Attention::Csa { ratio: csa }),
                Some("heavily_compressed_attention") => Ok(V4Attention::Hca { ratio: hca }),
                _ => Err(f.err(
                    &format!("layer_types[{i}]"),
                    format!(
                        "{t} is not sliding_attention, compressed_sparse_attention or \
                         heavily_compressed_attention"
                    ),
                )),
            })
            .collect();
    }
    if let Some(ratios) = list("compress_ratios")? {
        return ratios
            .iter()
            .enumerate()
            .map(|(i, r)| match r.as_u64() {
                Some(0) => Ok(V4Attention::Sliding),
                Some(4) => Ok(V4Attention::Csa { ratio: csa }),
                Some(128) => Ok(V4Attention::Hca { ratio: hca }),
                _ => Err(f.err(
                    &format!("compress_ratios[{i}]"),
                    format!("{r} is not 0, 4 or 128"),
                )),
            })
            .collect();
    }
    Ok((0..layers)
        .map(|i| {
            if i < 2 || (i - 2) % 2 == 0 {
                V4Attention::Hca { ratio: hca }
            } else {
                V4Attention::Csa { ratio: csa }
            }
        })
        .collect())
}

/// Hash-routed layers: `mlp_layer_types` (transformers: `hash_moe` first, then `moe`), else
/// `num_hash_layers`, else 3.
fn hash_layers(f: &Fields<'_>, layers: usize) -> Result<usize> {
    if let Some(types) = f.get("mlp_layer_types") {
        let Some(types) = types.as_array().filter(|t| t.len() >= layers) else {
            return Err(f.err(
                "mlp_layer_types",
                format!("{types} is not a list of at least {layers} layers"),
            ));
        };
        let hashed = types
            .iter()
            .take(layers)
            .take_while(|t| t.as_str() == Some("hash_moe"))
            .count();
        for (i, t) in types.iter().enumerate().take(layers).skip(hashed) {
            if t.as_str() != Some("moe") {
                return Err(f.err(
                    &format!("mlp_layer_types[{i}]"),
                    format!("{t}: hash_moe layers first, then moe"),
                ));
            }
        }
        return Ok(hashed);
    }
    Ok(f.size_opt("num_hash_layers")?
        .unwrap_or(DEFAULT_HASH_LAYERS)
        .min(layers))
}

/// The two RoPEs: sliding-only layers' (plain) and compressed layers' (YaRN or plain).
struct V4Rope {
    main_theta: f32,
    compress_theta: f32,
    compress_scaling: RopeScaling,
}

/// [`V4Rope`] as transformers resolves it: `rope_scaling` wins (it is the compressed layers'
/// scaling, their base `compress_rope_theta`, the main base `rope_theta`); else a nested
/// `rope_parameters` with both `main` and `compress`, each with its own `rope_theta` and
/// `partial_rotary_factor` (kiln takes one rotary width for both, `factor`); else a flat
/// `rope_parameters` as the compressed layers' scaling. YaRN runs without its magnitude
/// factor in both references (transformers sets it to 1 where a file leaves it out,
/// llama.cpp cancels it): a file that gives another is refused, as is nested YaRN without
/// one, which transformers would apply.
fn rope_params(f: &Fields<'_>, factor: f32, max_position: usize) -> Result<V4Rope> {
    let top_theta = |k: &str, d: f32| -> Result<f32> { Ok(f.float(k)?.unwrap_or(d)) };
    let params = f.get("rope_parameters");
    let nested = params.filter(|p| p.get("main").is_some() || p.get("compress").is_some());
    if let (None, Some(p)) = (f.get("rope_scaling"), nested) {
        let mut thetas = [0f32; 2];
        for (i, half) in ["main", "compress"].into_iter().enumerate() {
            let field = format!("rope_parameters.{half}");
            let Some(d) = p.get(half).filter(|d| d.is_object()) else {
                return Err(f.err(&field, "missing: `main` and `compress` come together"));
            };
            let got = d.get("partial_rotary_factor").and_then(Value::as_f64);
            if got.is_none_or(|g| (g as f32 - factor).abs() > 1e-6) {
                return Err(f.err(
                    &format!("{field}.partial_rotary_factor"),
                    format!("{got:?}: kiln rotates the same {factor} of each head in every layer"),
                ));
            }
            thetas[i] = d
                .get("rope_theta")
                .and_then(Value::as_f64)
                .ok_or_else(|| f.err(&format!("{field}.rope_theta"), "missing"))?
                as f32;
        }
        let (_, main) = rope_dict(f, "rope_parameters.main", &p["main"])?;
        if main != RopeScaling::None {
            return Err(f.err(
                "rope_parameters.main.rope_type",
                "sliding-only layers take plain RoPE",
            ));
        }
        let compress = &p["compress"];
        if compress.get("attention_factor").is_none() && yarn(compress) {
            return Err(f.err(
                "rope_parameters.compress.attention_factor",
                "missing: transformers would scale by YaRN's factor, llama.cpp would not",
            ));
        }
        return Ok(V4Rope {
            main_theta: thetas[0],
            compress_theta: thetas[1],
            compress_scaling: compress_scaling(
                f,
                "rope_parameters.compress",
                compress,
                max_position,
            )?,
        });
    }
    let (field, dict) = match f.get("rope_scaling") {
        Some(s) => ("rope_scaling", Some(s)),
        None => ("rope_parameters", params),
    };
    Ok(V4Rope {
        main_theta: top_theta("rope_theta", 10_000.0)?,
        compress_theta: top_theta("compress_rope_theta", 160_000.0)?,
        compress_scaling: match dict {
            Some(d) => compress_scaling(f, field, d, max_position)?,
            None => RopeScaling::None,
        },
    })
}

fn yarn(d: &Value) -> bool {
    let ty = d.get("rope_type").or_else(|| d.get("type"));
    ty.and_then(Value::as_str) == Some("yarn")
}

/// The compressed layers' scaling from `d` (at `field`): YaRN with its magnitude factor 1 (a
/// file's other value refused), or plain. `factor` must be given; the original context
/// defaults to the model's.
fn compress_scaling(
    f: &Fields<'_>,
    field: &str,
    d: &Value,
    max_position: usize,
) -> Result<RopeScaling> {
    if yarn(d) {
        if d.get("factor").and_then(Value::as_f64).is_none() {
            return Err(f.err(&format!("{field}.factor"), "missing"));
        }
        if let Some(a) = d.get("attention_factor").and_then(Value::as_f64)
            && a != 1.0
        {
            return Err(f.err(
                &format!("{field}.attention_factor"),
                format!("{a} is not supported (1: DeepSeek-V4 runs YaRN without it)"),
            ));
        }
    }
    let mut d = d.clone();
    if let Some(o) = d.as_object_mut() {
        o.entry("original_max_position_embeddings")
            .or_insert_with(|| Value::from(max_position as u64));
    }
    let (_, mut scaling) = rope_dict(f, field, &d)?;
    match &mut scaling {
        RopeScaling::Yarn {
            attention_factor, ..
        } => *attention_factor = 1.0,
        RopeScaling::None => {}
        _ => {
            return Err(f.err(
                field,
                "compressed layers take YaRN or plain RoPE (DeepSeek-V4)",
            ));
        }
    }
    Ok(scaling)
}
