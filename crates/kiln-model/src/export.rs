//! GGUF → Hugging Face folder: `model.safetensors` (dequantized weights), `config.json`,
//! `tokenizer_config.json`, `generation_config.json`, and `tokenizer.json` when the caller
//! supplies it (this crate does not build tokenizers).
//!
//! llama.cpp stores llama Q/K projection rows permuted for interleaved RoPE; the export undoes
//! that so the folder has the half-split layout every HF checkpoint has.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_tensor::{Device, RopeLayout, RopeScaling};
use serde_json::{Map, Value, json};

use crate::safetensors::{StDtype, encode_safetensors};
use crate::weights::{GgufSource, Weight, WeightSource};
use crate::{Activation, Arch, ModelConfig, ModelError, Result};

/// What [`write_hf_folder`] writes.
#[derive(Debug, Clone)]
pub struct HfExport {
    /// F32 (exact for dequantized GGUF weights), F16 or BF16.
    pub dtype: StDtype,
    /// `tokenizer.json` contents (e.g. a GGUF-built tokenizer serialized); `None` writes none.
    pub tokenizer_json: Option<String>,
}

impl Default for HfExport {
    fn default() -> Self {
        Self {
            dtype: StDtype::F32,
            tokenizer_json: None,
        }
    }
}

/// Every weight the config names, with its row-major shape, in checkpoint order.
pub fn weight_shapes(cfg: &ModelConfig, has_lm_head: bool) -> Vec<(Weight, Vec<usize>)> {
    let (h, qd, kvd) = (
        cfg.hidden,
        cfg.heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    );
    let mut v = vec![(Weight::Embed, vec![cfg.vocab, h])];
    for l in 0..cfg.layers {
        v.push((Weight::AttnNorm(l), vec![h]));
        v.push((Weight::Q(l), vec![qd, h]));
        v.push((Weight::K(l), vec![kvd, h]));
        v.push((Weight::V(l), vec![kvd, h]));
        if cfg.qkv_bias {
            v.extend([
                (Weight::QBias(l), vec![qd]),
                (Weight::KBias(l), vec![kvd]),
                (Weight::VBias(l), vec![kvd]),
            ]);
        }
        if cfg.qk_norm {
            v.push((Weight::QNorm(l), vec![cfg.head_dim]));
            v.push((Weight::KNorm(l), vec![cfg.head_dim]));
        }
        v.push((Weight::O(l), vec![h, qd]));
        if cfg.sandwich_norms {
            v.push((Weight::PostAttnNorm(l), vec![h]));
            v.push((Weight::PreFfnNorm(l), vec![h]));
            v.push((Weight::PostFfnNorm(l), vec![h]));
        } else {
            v.push((Weight::FfnNorm(l), vec![h]));
        }
        v.push((Weight::Gate(l), vec![cfg.ffn, h]));
        v.push((Weight::Up(l), vec![cfg.ffn, h]));
        v.push((Weight::Down(l), vec![h, cfg.ffn]));
    }
    v.push((Weight::FinalNorm, vec![h]));
    if has_lm_head && !cfg.tie_embeddings {
        v.push((Weight::LmHead, vec![cfg.vocab, h]));
    }
    v
}

/// Undoes llama.cpp's Q/K row permutation, head by head: for head_dim `d`, GGUF row `2i` is
/// HF row `i` and GGUF row `2i + 1` is HF row `i + d/2`. `x` is `[heads·d, cols]` row-major.
pub fn unpermute_rows(x: &[f32], head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    let half = head_dim / 2;
    let heads = x.len() / (head_dim * cols).max(1);
    for h in 0..heads {
        let base = h * head_dim;
        for i in 0..half {
            for (j, hf_row) in [(0, i), (1, i + half)] {
                let src = (base + 2 * i + j) * cols;
                let dst = (base + hf_row) * cols;
                out[dst..dst + cols].copy_from_slice(&x[src..src + cols]);
            }
        }
    }
    out
}

fn is_norm(w: Weight) -> bool {
    matches!(
        w,
        Weight::FinalNorm
            | Weight::AttnNorm(_)
            | Weight::FfnNorm(_)
            | Weight::QNorm(_)
            | Weight::KNorm(_)
            | Weight::PostAttnNorm(_)
            | Weight::PreFfnNorm(_)
            | Weight::PostFfnNorm(_)
    )
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A float as JSON, printed from its shortest f32 form (1e-5, not 9.99999974e-6).
fn num(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

fn config_json(cfg: &ModelConfig, bos: Option<u64>, eos: Option<u64>, dtype: StDtype) -> Value {
    let (model_type, arch) = match cfg.arch {
        Arch::Llama => ("llama", "LlamaForCausalLM"),
        Arch::Mistral => ("mistral", "MistralForCausalLM"),
        Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
        Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
        Arch::Gemma3 => ("gemma3_text", "Gemma3ForCausalLM"),
        // Refused by `write_hf_folder`: their experts are not written.
        Arch::Qwen3Moe => ("qwen3_moe", "Qwen3MoeForCausalLM"),
        Arch::Mixtral => ("mixtral", "MixtralForCausalLM"),
        Arch::GptOss => ("gpt_oss", "GptOssForCausalLM"),
    };
    // The full-attention layers' RoPE is the model's `rope_theta`/`rope_scaling`; Gemma's
    // sliding layers have their own base.
    let global = cfg
        .attention
        .iter()
        .find(|a| a.window.is_none())
        .or(cfg.attention.first())
        .map(|a| a.rope);
    let local = cfg
        .attention
        .iter()
        .find(|a| a.window.is_some())
        .map(|a| a.rope);
    let mut v = json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab,
        "hidden_act": match cfg.activation {
            // GPT-OSS's config names its clamped SwiGLU `silu` too.
            Activation::Silu | Activation::SwigluOai => "silu",
            Activation::GeluTanh => "gelu_pytorch_tanh",
        },
        "rms_norm_eps": num(cfg.rms_eps),
        "rope_theta": num(global.map_or(10000.0, |r| r.theta)),
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "torch_dtype": match dtype { StDtype::F16 => "float16", StDtype::BF16 => "bfloat16", _ => "float32" },
    });
    if let Value::Object(m) = &mut v {
        if let Some(b) = bos {
            m.insert("bos_token_id".into(), b.into());
        }
        if let Some(e) = eos {
            m.insert("eos_token_id".into(), e.into());
        }
        if let Some(RopeScaling::Linear { factor }) = global.map(|r| r.scaling) {
            m.insert(
                "rope_scaling".into(),
                json!({"rope_type": "linear", "factor": num(factor)}),
            );
        }
        if let Some(w) = cfg.sliding_window() {
            m.insert("sliding_window".into(), w.into());
            m.insert("use_sliding_window".into(), true.into());
        }
        if cfg.arch == Arch::Gemma3 {
            m.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
            let types: Vec<Value> = cfg
                .attention
                .iter()
                .map(|a| {
                    if a.window.is_some() {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                    .into()
                })
                .collect();
            m.insert("layer_types".into(), types.into());
            if let Some(l) = local {
                m.insert("rope_local_base_freq".into(), num(l.theta));
            }
            m.insert(
                "query_pre_attn_scalar".into(),
                num((1.0 / (cfg.attn_scale * cfg.attn_scale)).round()),
            );
            if let Some(c) = cfg.final_logit_softcap {
                m.insert("final_logit_softcapping".into(), num(c));
            }
        }
    }
    v
}

/// Writes `out_dir` as an HF model folder built from the GGUF file at `gguf_path`. The weights
/// file is written last, through a temporary name, so its presence means a complete folder.
pub fn write_hf_folder(gguf_path: &Path, out_dir: &Path, options: &HfExport) -> Result<()> {
    let src = GgufSource::open(gguf_path)?;
    let cfg = ModelConfig::from_gguf(src.file())?;
    if cfg.moe.is_some() {
        return Err(ModelError::Format {
            file: src.describe().into(),
            problem: "export-hf writes dense models only; this one has mixture-of-experts layers"
                .into(),
        });
    }
    let md = src.file().metadata();
    let tokens = md.get_strings("tokenizer.ggml.tokens")?.unwrap_or(&[]);
    let bos = md.get_u64("tokenizer.ggml.bos_token_id")?;
    let eos = md.get_u64("tokenizer.ggml.eos_token_id")?;
    let token = |id: Option<u64>| id.and_then(|i| tokens.get(i as usize)).cloned();

    std::fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    let write = |name: &str, text: String| {
        let p = out_dir.join(name);
        std::fs::write(&p, text).map_err(io(&p))
    };
    let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_default();
    write(
        "config.json",
        pretty(&config_json(&cfg, bos, eos, options.dtype)),
    )?;
    let mut tc = Map::new();
    if let Some(t) = token(bos) {
        tc.insert("bos_token".into(), t.into());
    }
    if let Some(t) = token(eos) {
        tc.insert("eos_token".into(), t.into());
    }
    if let Some(t) = md.get_str("tokenizer.chat_template")? {
        tc.insert("chat_template".into(), t.into());
    }
    tc.insert("model_max_length".into(), cfg.max_position.into());
    write("tokenizer_config.json", pretty(&Value::Object(tc)))?;
    let mut gen_cfg = Map::new();
    if let Some(b) = bos {
        gen_cfg.insert("bos_token_id".into(), b.into());
    }
    if let Some(e) = eos {
        gen_cfg.insert("eos_token_id".into(), e.into());
    }
    write("generation_config.json", pretty(&Value::Object(gen_cfg)))?;
    if let Some(t) = &options.tokenizer_json {
        write("tokenizer.json", t.clone())?;
    }

    let permuted = cfg.rope_layout == RopeLayout::Interleaved;
    let mut tensors = Vec::new();
    for (w, shape) in weight_shapes(&cfg, src.has(Weight::LmHead)) {
        let mut v = src.load(&Device::Reference, w, &shape)?.to_f32_vec()?;
        // llama.cpp stores Gemma's norm weights as `1 + w`; HF checkpoints hold `w`.
        if cfg.arch == Arch::Gemma3 && is_norm(w) {
            v.iter_mut().for_each(|x| *x -= 1.0);
        }
        if permuted
            && matches!(
                w,
                Weight::Q(_) | Weight::K(_) | Weight::QBias(_) | Weight::KBias(_)
            )
        {
            let cols = if shape.len() == 2 { shape[1] } else { 1 };
            v = unpermute_rows(&v, cfg.head_dim, cols);
        }
        let bytes: Vec<u8> = match options.dtype {
            StDtype::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            StDtype::BF16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        tensors.push((w.hf_name(), options.dtype, shape, bytes));
    }
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let body = encode_safetensors(&tensors, &meta)?;
    drop(tensors);
    let partial = out_dir.join("model.safetensors.partial");
    std::fs::write(&partial, body).map_err(io(&partial))?;
    let dest = out_dir.join("model.safetensors");
    std::fs::rename(&partial, &dest).map_err(io(&dest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's permutation (HF → GGUF), as its converter defines it: per head, view the
    /// rows as [2, d/2] and transpose to [d/2, 2]: GGUF row 2i + j = HF row j·d/2 + i.
    fn permute(hf: &[f32], head_dim: usize, cols: usize) -> Vec<f32> {
        let mut out = vec![0f32; hf.len()];
        let heads = hf.len() / (head_dim * cols);
        for h in 0..heads {
            for i in 0..head_dim / 2 {
                for j in 0..2 {
                    let g = (h * head_dim + 2 * i + j) * cols;
                    let f = (h * head_dim + j * head_dim / 2 + i) * cols;
                    out[g..g + cols].copy_from_slice(&hf[f..f + cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // One head, head_dim 4, one column: GGUF rows [a, b, c, d] are HF rows [a, c, b, d].
        assert_eq!(
            unpermute_rows(&[0.0, 1.0, 2.0, 3.0], 4, 1),
            [0.0, 2.0, 1.0, 3.0]
        );
        // Three heads of 8, two columns: the round trip is the identity.
        let hf: Vec<f32> = (0..3 * 8 * 2).map(|i| i as f32).collect();
        let gguf = permute(&hf, 8, 2);
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_rows(&gguf, 8, 2), hf);
    }

    #[test]
    fn config_numbers_are_written_in_their_short_form() {
        assert_eq!(num(1e-5).as_f64(), Some(1e-5));
        assert_eq!(num(100000.0).as_f64(), Some(100000.0));
    }
}
