//! Loading a DeepSeek-V4 model: from a Hugging Face folder, under DeepSeek's tensor names as
//! published (`embed.weight`, `layers.{i}.attn.kv_norm.weight`, `hc_head_fn`, ...) or as
//! transformers saves them (`model.` before them, `model.embed_tokens.weight`,
//! `model.layers.{i}.attn.norm.weight`, `model.hc_head.hc_fn`); or from a GGUF file as
//! llama.cpp's converter writes it (`deepseek4`: `token_embd.weight`, `blk.{i}.attn_q_a.weight`,
//! the routed experts stacked a projection, `blk.{i}.ffn_gate_exps.weight`, ...). Every part
//! asks for its tensors by DeepSeek's names; [`Names`] finds them in the file.

use std::path::Path;

use kiln_tensor::{Device, Tensor};

use super::model::Layer;
use super::{
    Attention, AttentionShape, AttentionWeights, Compression, Compressor, CompressorWeights, Csa,
    ExpertChoice, GateUp, HyperConnection, Indexer, IndexerWeights, Moe, MoeShape, MoeWeights,
};
use crate::safetensors::{FLOATS, StDtype, decode_ids};
use crate::weights::stack;
use crate::{
    DeepseekV4Config, GgufSource, HfSource, LoadOptions, ModelError, Result, V4Attention,
    WeightSource, fp8_block_size,
};

/// The files a model is read from.
pub(super) enum Files {
    Hf(HfSource),
    Gguf(GgufSource),
}

impl Files {
    /// A GGUF file, or a Hugging Face folder.
    pub(super) fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let mut src = HfSource::open(path, LoadOptions::default())?;
            let (name, text) = config_text(path)?;
            src.fp8_block = fp8_block_size(&name, &text)?;
            Ok(Files::Hf(src))
        } else {
            Ok(Files::Gguf(GgufSource::open(path)?))
        }
    }

    /// The model's config: the folder's `config.json`, or the file's metadata.
    pub(super) fn config(&self) -> Result<DeepseekV4Config> {
        match self {
            Files::Hf(src) => {
                let (name, text) = config_text(Path::new(&src.describe))?;
                DeepseekV4Config::from_hf_json(&name, &text)
            }
            Files::Gguf(src) => DeepseekV4Config::from_gguf(src.file()),
        }
    }

    pub(super) fn describe(&self) -> &str {
        match self {
            Files::Hf(src) => &src.describe,
            Files::Gguf(src) => src.describe(),
        }
    }
}

/// `path`'s DeepSeek-V4 config, when it is a folder whose `config.json` names `deepseek_v4`
/// or a GGUF file of architecture `deepseek4`; `None` for any other model, or a path that
/// does not open (the loader that takes it reports why).
pub fn detect(path: &Path) -> Result<Option<DeepseekV4Config>> {
    if path.is_file() {
        return match GgufSource::open(path) {
            Ok(src) if src.file().architecture() == Some("deepseek4") => {
                DeepseekV4Config::from_gguf(src.file()).map(Some)
            }
            _ => Ok(None),
        };
    }
    let Ok((name, text)) = config_text(path) else {
        return Ok(None);
    };
    let model_type = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("model_type")?.as_str().map(str::to_owned));
    match model_type.as_deref() {
        Some("deepseek_v4") => DeepseekV4Config::from_hf_json(&name, &text).map(Some),
        _ => Ok(None),
    }
}

/// A folder's `config.json`: its name for errors, and its text.
fn config_text(dir: &Path) -> Result<(String, String)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    Ok((path.display().to_string(), text))
}

/// The GGUF name llama.cpp's converter gives DeepSeek's `name` (its `DeepseekV4Model`'s
/// table, read the other way).
fn gguf_name(name: &str) -> Option<String> {
    let root = match name {
        "embed.weight" => Some("token_embd.weight"),
        "norm.weight" => Some("output_norm.weight"),
        "head.weight" => Some("output.weight"),
        "hc_head_fn" => Some("output_hc_fn.weight"),
        "hc_head_base" => Some("output_hc_base.weight"),
        "hc_head_scale" => Some("output_hc_scale.weight"),
        _ => None,
    };
    if let Some(r) = root {
        return Some(r.to_string());
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let mapped = match part {
        "hc_attn_fn" | "hc_attn_base" | "hc_attn_scale" | "hc_ffn_fn" | "hc_ffn_base"
        | "hc_ffn_scale" => format!("{part}.weight"),
        "attn_norm.weight" | "ffn_norm.weight" => part.to_string(),
        "attn.attn_sink" => "attn_sinks.weight".into(),
        "attn.wq_a.weight" => "attn_q_a.weight".into(),
        "attn.wq_b.weight" => "attn_q_b.weight".into(),
        "attn.q_norm.weight" => "attn_q_a_norm.weight".into(),
        "attn.wkv.weight" => "attn_kv.weight".into(),
        "attn.kv_norm.weight" => "attn_kv_a_norm.weight".into(),
        "attn.wo_a.weight" => "attn_output_a.weight".into(),
        "attn.wo_b.weight" => "attn_output_b.weight".into(),
        "attn.indexer.wq_b.weight" => "indexer.attn_q_b.weight".into(),
        "attn.indexer.weights_proj.weight" => "indexer.proj.weight".into(),
        "ffn.gate.weight" => "ffn_gate_inp.weight".into(),
        "ffn.gate.bias" => "exp_probs_b.bias".into(),
        "ffn.gate.tid2eid" => "ffn_gate_tid2eid.weight".into(),
        "ffn.shared_experts.w1.weight" => "ffn_gate_shexp.weight".into(),
        "ffn.shared_experts.w2.weight" => "ffn_down_shexp.weight".into(),
        "ffn.shared_experts.w3.weight" => "ffn_up_shexp.weight".into(),
        other => {
            let (which, rest) = if let Some(r) = other.strip_prefix("attn.indexer.compressor.") {
                ("indexer_compressor", r)
            } else {
                ("attn_compressor", other.strip_prefix("attn.compressor.")?)
            };
            let field = match rest {
                "ape" => "ape",
                "wkv.weight" => "kv",
                "wgate.weight" => "gate",
                "norm.weight" => "norm",
                _ => return None,
            };
            format!("{which}_{field}.weight")
        }
    };
    Some(format!("blk.{layer}.{mapped}"))
}

/// Reads tensors by their DeepSeek names, whichever way the files spell them.
pub(super) struct Names<'a> {
    pub(super) src: &'a Files,
    pub(super) device: &'a Device,
    /// Bytes of the tensors put on `device` so far, as stored.
    pub(super) bytes: std::cell::Cell<u64>,
}

impl Names<'_> {
    /// The files' name for DeepSeek's `name`.
    fn resolve(&self, name: &str) -> String {
        match self.src {
            Files::Hf(src) => {
                let saved = match name {
                    "embed.weight" => "model.embed_tokens.weight".to_string(),
                    "head.weight" => "head.weight".to_string(),
                    n if n.starts_with("hc_head_") => format!("model.hc_head.hc_{}", &n[8..]),
                    n => format!("model.{}", n.replace(".attn.kv_norm.", ".attn.norm.")),
                };
                if src.index.contains_key(name) || !src.index.contains_key(&saved) {
                    name.to_string()
                } else {
                    saved
                }
            }
            // A name the converter does not write stays DeepSeek's: the load then reports it
            // missing by that name.
            Files::Gguf(_) => gguf_name(name).unwrap_or_else(|| name.to_string()),
        }
    }

    /// A tensor of `shape`, as stored (a float, or a GGUF's block format).
    pub(super) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let n = self.resolve(name);
        self.count(self.load(self.device, &n, shape)?)
    }

    /// `t`, put on the device, counted.
    fn count(&self, t: Tensor) -> Result<Tensor> {
        self.bytes
            .set(self.bytes.get() + crate::model::bytes_of(&t));
        Ok(t)
    }

    fn load(&self, device: &Device, n: &str, shape: &[usize]) -> Result<Tensor> {
        match self.src {
            Files::Hf(src) => {
                if let Some(t) = src.block_scaled(device, n, shape)? {
                    return Ok(t);
                }
                let (dtype, bytes, file) = src.checked_bytes(n, shape, FLOATS)?;
                src.upload(device, dtype, shape, &bytes, (file, n))
            }
            Files::Gguf(src) => src.load_tensor(device, n, shape),
        }
    }

    /// A tensor of `shape` in F32 whatever it is stored as (norms, biases, mHC's and the
    /// compressors' small tensors, which transformers keeps in f32).
    pub(super) fn f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let n = self.resolve(name);
        let t = self.load(&Device::Reference, &n, shape)?;
        self.count(Tensor::from_f32(self.device, shape, &t.to_f32_vec()?)?)
    }

    /// Several tensors' rows stacked into one of `shape` (each expert's `[w1; w3]`, every
    /// expert's projection), in the dtype they are stored in.
    fn stacked(&self, names: &[String], each: &[usize], shape: &[usize]) -> Result<Tensor> {
        let parts = names.iter().map(|name| {
            let n = self.resolve(name);
            let t = self.load(&Device::Reference, &n, each)?;
            Ok((n, t))
        });
        let what = names.first().map_or("", String::as_str);
        self.count(stack(self.device, self.src.describe(), what, parts, shape)?)
    }

    /// An index table of `shape` (I64 or I32).
    fn ids(&self, name: &str, shape: &[usize]) -> Result<Vec<u32>> {
        let n = self.resolve(name);
        match self.src {
            Files::Hf(src) => {
                let (dtype, bytes, file) =
                    src.checked_bytes(&n, shape, &[StDtype::I64, StDtype::I32])?;
                decode_ids((file, &n), dtype, &bytes)
            }
            Files::Gguf(src) => src.load_ids(&n, shape),
        }
    }

    /// Layer `layer`'s routed experts: gate and up, and down. A folder has one tensor an
    /// expert and projection (stacked here, gate and up together); a GGUF file one a
    /// projection, every expert's.
    fn experts(&self, c: &DeepseekV4Config, layer: usize) -> Result<(GateUp, Tensor)> {
        let (e, h, f) = (c.moe.experts, c.hidden, c.moe.expert_ffn);
        match self.src {
            Files::Hf(_) => {
                let p = format!("layers.{layer}.ffn.experts.");
                let expert = |x: usize, w: &str| format!("{p}{x}.{w}.weight");
                let gate_up: Vec<String> = (0..e)
                    .flat_map(|x| [expert(x, "w1"), expert(x, "w3")])
                    .collect();
                let down: Vec<String> = (0..e).map(|x| expert(x, "w2")).collect();
                Ok((
                    GateUp::Stacked(self.stacked(&gate_up, &[f, h], &[e, 2 * f, h])?),
                    self.stacked(&down, &[h, f], &[e, h, f])?,
                ))
            }
            Files::Gguf(_) => {
                let t = |w: &str, shape: &[usize]| {
                    self.count(self.load(
                        self.device,
                        &format!("blk.{layer}.ffn_{w}_exps.weight"),
                        shape,
                    )?)
                };
                Ok((
                    GateUp::Apart {
                        gate: t("gate", &[e, f, h])?,
                        up: t("up", &[e, f, h])?,
                    },
                    t("down", &[e, h, f])?,
                ))
            }
        }
    }

    /// Layer `layer`'s shared expert: gate and up (stacked where the files allow), down.
    fn shared(&self, c: &DeepseekV4Config, layer: usize) -> Result<(GateUp, Tensor)> {
        let (h, f) = (c.hidden, c.moe.expert_ffn);
        let name = |w: &str| format!("layers.{layer}.ffn.shared_experts.{w}.weight");
        let gate_up = match self.src {
            Files::Hf(_) => {
                GateUp::Stacked(self.stacked(&[name("w1"), name("w3")], &[f, h], &[2 * f, h])?)
            }
            Files::Gguf(_) => GateUp::Apart {
                gate: self.tensor(&name("w1"), &[f, h])?,
                up: self.tensor(&name("w3"), &[f, h])?,
            },
        };
        Ok((gate_up, self.tensor(&name("w2"), &[h, f])?))
    }
}

pub(super) fn load_layer(names: &Names<'_>, c: &DeepseekV4Config, i: usize) -> Result<Layer> {
    let p = format!("layers.{i}.");
    let file = names.src.describe().to_string();
    let (h, n) = (c.hidden, c.hc.streams);
    let mix = (2 + n) * n;
    let hc = |which: &str| -> Result<HyperConnection> {
        let [f, b, s] = [
            format!("{p}hc_{which}_fn"),
            format!("{p}hc_{which}_base"),
            format!("{p}hc_{which}_scale"),
        ];
        HyperConnection::new(
            &file,
            [&f, &b, &s],
            [
                names.f32(&f, &[mix, n * h])?,
                names.f32(&b, &[mix])?,
                names.f32(&s, &[3])?,
            ],
            c.hc,
            c.rms_eps,
        )
    };
    Ok(Layer {
        attn_hc: hc("attn")?,
        attn_norm: names.f32(&format!("{p}attn_norm.weight"), &[h])?,
        attn: load_attention(names, c, i)?,
        ffn_hc: hc("ffn")?,
        ffn_norm: names.f32(&format!("{p}ffn_norm.weight"), &[h])?,
        moe: load_moe(names, c, i)?,
    })
}

fn load_compressor(
    names: &Names<'_>,
    c: &DeepseekV4Config,
    p: &str,
    width: usize,
    ratio: usize,
    overlapping: bool,
) -> Result<Compressor> {
    let rows = if overlapping { 2 * width } else { width };
    let w = CompressorWeights {
        kv: names.f32(&format!("{p}wkv.weight"), &[rows, c.hidden])?,
        gate: names.f32(&format!("{p}wgate.weight"), &[rows, c.hidden])?,
        ape: names.f32(&format!("{p}ape"), &[ratio, rows])?,
        norm: names.f32(&format!("{p}norm.weight"), &[width])?,
    };
    Compressor::new(names.src.describe(), p, w, ratio, overlapping, c.rms_eps)
}

fn load_attention(names: &Names<'_>, c: &DeepseekV4Config, i: usize) -> Result<Attention> {
    let p = format!("layers.{i}.attn.");
    let (h, d, heads, q) = (c.hidden, c.head_dim, c.heads, c.q_lora_rank);
    let (g, r) = (c.o_groups, c.o_lora_rank);
    let t = |n: &str, shape: &[usize]| names.tensor(&format!("{p}{n}"), shape);
    let f = |n: &str, shape: &[usize]| names.f32(&format!("{p}{n}"), shape);
    let w = AttentionWeights {
        q_a: t("wq_a.weight", &[q, h])?,
        q_norm: f("q_norm.weight", &[q])?,
        q_b: t("wq_b.weight", &[heads * d, q])?,
        kv: t("wkv.weight", &[d, h])?,
        kv_norm: f("kv_norm.weight", &[d])?,
        o_a: t("wo_a.weight", &[g * r, heads * d / g.max(1)])?,
        o_b: t("wo_b.weight", &[h, g * r])?,
        sinks: f("attn_sink", &[heads])?,
    };
    let compression = match c.attention[i] {
        V4Attention::Sliding => Compression::None,
        V4Attention::Hca { ratio } => Compression::Hca(Box::new(load_compressor(
            names,
            c,
            &format!("{p}compressor."),
            d,
            ratio as usize,
            false,
        )?)),
        V4Attention::Csa { ratio } => {
            let ratio = ratio as usize;
            let ix = &c.indexer;
            let ip = format!("{p}indexer.");
            let indexer = Indexer::new(
                names.src.describe(),
                &ip,
                load_compressor(
                    names,
                    c,
                    &format!("{ip}compressor."),
                    ix.head_dim,
                    ratio,
                    true,
                )?,
                IndexerWeights {
                    q: t("indexer.wq_b.weight", &[ix.heads * ix.head_dim, q])?,
                    head_weights: f("indexer.weights_proj.weight", &[ix.heads, h])?,
                },
                ix.heads,
                ix.topk,
            )?;
            Compression::Csa(Box::new(Csa {
                compressor: load_compressor(names, c, &format!("{p}compressor."), d, ratio, true)?,
                indexer,
            }))
        }
    };
    let shape = AttentionShape {
        heads,
        head_dim: d,
        groups: g,
        window: c.window as u32,
        eps: c.rms_eps,
    };
    Attention::new(names.src.describe(), &p, w, compression, shape)
}

fn load_moe(names: &Names<'_>, c: &DeepseekV4Config, i: usize) -> Result<Moe> {
    let p = format!("layers.{i}.ffn.");
    let (e, h) = (c.moe.experts, c.hidden);
    let choice = if i < c.moe.hash_layers {
        ExpertChoice::Hashed {
            table: names.ids(&format!("{p}gate.tid2eid"), &[c.vocab, c.moe.used])?,
        }
    } else {
        ExpertChoice::Scored {
            bias: names.f32(&format!("{p}gate.bias"), &[e])?,
        }
    };
    let (gate_up, down) = names.experts(c, i)?;
    let (shared_gate_up, shared_down) = names.shared(c, i)?;
    let w = MoeWeights {
        router: names.f32(&format!("{p}gate.weight"), &[e, h])?,
        choice,
        gate_up,
        down,
        shared_gate_up,
        shared_down,
    };
    let shape = MoeShape {
        experts: e,
        used: c.moe.used,
        scale: c.moe.routed_scale,
        limit: c.moe.swiglu_limit,
    };
    Moe::new(names.src.describe(), &p, w, shape)
}
