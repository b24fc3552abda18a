//! [`HfQuant`]: the `quantization_config` of an HF `config.json` — GPTQ (as GPTQModel and
//! AutoGPTQ write it), AutoAWQ's GEMM layout, and compressed-tensors' `pack-quantized`
//! (llm-compressor's W4A16 / W8A16). Every value kiln cannot load exactly is refused here, one
//! error naming the file and the field, before any tensor is read.

use serde_json::Value;

use super::hf::Fields;
use crate::{ModelError, Result};

/// Which checkpoint layout the quantized linear weights are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMethod {
    /// `qweight [in·bits/32, out]`, `qzeros [groups, out·bits/32]`, `scales [groups, out]`,
    /// `g_idx [in]`. `zeros_minus_one`: the `gptq` (v1) checkpoint format, whose packed zero
    /// words hold `zero − 1` in every field (subtracted word-wise, borrows included);
    /// `gptq_v2` stores the zeros themselves.
    Gptq { zeros_minus_one: bool },
    /// AutoAWQ's GEMM layout: `qweight [in, out/8]`, `qzeros [groups, out/8]` with the 8
    /// nibbles of a word in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales [groups, out]`.
    Awq,
    /// compressed-tensors `pack-quantized`: `weight_packed [out, in·bits/32]` of values offset
    /// by `2^(bits−1)`, `weight_scale [out, groups]`, `weight_zero_point` (asymmetric only,
    /// packed along the output dimension), optional `weight_g_idx [in]`.
    CompressedTensors,
}

/// How a checkpoint's linear weights are quantized; value = (q − zero)·scale per group of
/// input columns of one output row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HfQuant {
    pub method: QuantMethod,
    /// 4 or 8.
    pub bits: u32,
    /// Input columns sharing a scale and zero; `None`: the whole row (GPTQ's `-1`,
    /// compressed-tensors' `channel` strategy).
    pub group_size: Option<usize>,
    /// Symmetric: the zero is the midpoint (`2^(bits−1)`), so no zeros are stored or read.
    pub sym: bool,
}

const FIELD: &str = "quantization_config";

impl HfQuant {
    /// The `quantization_config` of a `config.json`'s text (`None` when it has none); `file`
    /// names it in errors.
    pub fn from_hf_json(file: &str, text: &str) -> Result<Option<Self>> {
        let root: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            file: file.into(),
            what: "not JSON",
            source,
        })?;
        let Some(qc) = root.get(FIELD).filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let v = qc.as_object().ok_or_else(|| ModelError::Config {
            file: file.into(),
            field: FIELD.into(),
            problem: "not a JSON object".into(),
        })?;
        let f = Fields {
            file,
            prefix: "quantization_config.",
            v,
        };
        let method = f
            .get("quant_method")
            .and_then(Value::as_str)
            .ok_or_else(|| f.err("quant_method", "missing or not a string"))?;
        match method {
            "gptq" => gptq(&f).map(Some),
            "awq" => awq(&f).map(Some),
            "compressed-tensors" => compressed_tensors(&f).map(Some),
            // GPT-OSS's release: only the experts are MXFP4, as `_blocks`/`_scales` tensors
            // the expert loader reads (`hf_experts.rs`); every other weight is float.
            "mxfp4" => Ok(None),
            // FP8 block-scaled weights load for DeepSeek-V4 only (`fp8_block_size`).
            other => Err(f.err(
                "quant_method",
                format!("`{other}` is not supported (gptq, awq, compressed-tensors, mxfp4)"),
            )),
        }
    }
}

/// The tile of weights one FP8 scale covers, `[rows, cols]`, as a `config.json`'s text says
/// (`quantization_config.weight_block_size` under `quant_method: fp8`, its other fields
/// checked), or DeepSeek's 128 × 128 where it says nothing. The FP8 weights themselves say so
/// by their dtype, their scales beside them (`block_scaled.rs`).
pub fn fp8_block_size(file: &str, text: &str) -> Result<[usize; 2]> {
    let root: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
        file: file.into(),
        what: "not JSON",
        source,
    })?;
    let qc = root.get(FIELD).and_then(Value::as_object);
    match qc {
        Some(v) if v.get("quant_method").and_then(Value::as_str) == Some("fp8") => {
            fp8_block(&Fields {
                file,
                prefix: "quantization_config.",
                v,
            })
        }
        _ => Ok(FP8_BLOCK),
    }
}

/// DeepSeek's FP8 tile (V3, V4): one scale a 128 × 128 block of a weight.
pub(crate) const FP8_BLOCK: [usize; 2] = [128, 128];

/// `quant_method: fp8`'s fields (transformers' `FineGrainedFP8Config`, DeepSeek's): E4M3
/// codes, and a scale a `weight_block_size` tile whose columns are whole blocks of kiln's 32.
/// Activations are not quantized (kiln computes them in f32), so `activation_scheme` only has
/// to be one of the two there are.
fn fp8_block(f: &Fields<'_>) -> Result<[usize; 2]> {
    if let Some(fmt) = string(f, "fmt")?
        && fmt != "e4m3"
    {
        return Err(f.err("fmt", format!("`{fmt}` is not supported (e4m3)")));
    }
    if let Some(a) = string(f, "activation_scheme")?
        && !matches!(a, "dynamic" | "static")
    {
        return Err(f.err(
            "activation_scheme",
            format!("`{a}` is not dynamic or static"),
        ));
    }
    if let Some(s) = string(f, "scale_fmt")?
        && s != "ue8m0"
    {
        return Err(f.err("scale_fmt", format!("`{s}` is not supported (ue8m0)")));
    }
    let Some(v) = f.get("weight_block_size") else {
        return Ok(FP8_BLOCK);
    };
    let dims: Option<Vec<usize>> = v.as_array().map(|a| {
        a.iter()
            .filter_map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
            .collect()
    });
    match dims.as_deref() {
        Some(&[r, c]) if r > 0 && c > 0 && c % 32 == 0 => Ok([r, c]),
        _ => Err(f.err(
            "weight_block_size",
            format!(
                "{v} is not supported ([rows, cols], the columns a multiple of 32; per-tensor \
                 and per-channel FP8 are not read)"
            ),
        )),
    }
}

/// `bits` (or `key`): 4 or 8.
fn bits(f: &Fields<'_>, key: &str) -> Result<u32> {
    match f.size_opt(key)? {
        Some(b @ (4 | 8)) => Ok(b as u32),
        Some(b) => Err(f.err(key, format!("{b}-bit weights are not supported (4, 8)"))),
        None => Err(f.err(key, "missing")),
    }
}

/// `group_size`: a positive multiple of 32 (kiln's blocks are 32 columns of one group), or
/// `-1` for one group a row.
fn group_size(f: &Fields<'_>, key: &str) -> Result<Option<usize>> {
    let Some(v) = f.get(key) else {
        return Err(f.err(key, "missing"));
    };
    match v.as_i64() {
        Some(-1) => Ok(None),
        Some(g) if g > 0 && g % 32 == 0 && g <= i64::from(u32::MAX) => Ok(Some(g as usize)),
        _ => Err(f.err(
            key,
            format!("{v} is not supported (a positive multiple of 32, or -1 for whole rows)"),
        )),
    }
}

fn flag(f: &Fields<'_>, key: &str, default: bool) -> Result<bool> {
    match f.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| f.err(key, format!("{v} is not true or false"))),
    }
}

fn string<'v>(f: &Fields<'v>, key: &str) -> Result<Option<&'v str>> {
    match f.v.get(key).filter(|x| !x.is_null()) {
        None => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| f.err(key, format!("{v} is not a string"))),
    }
}

fn gptq(f: &Fields<'_>) -> Result<HfQuant> {
    let bits = bits(f, "bits")?;
    let group_size = group_size(f, "group_size")?;
    // desc_act only changes g_idx, which the loader reads whatever the flag says; the flag
    // must still be a flag.
    flag(f, "desc_act", false)?;
    let sym = flag(f, "sym", true)?;
    // GPTQModel writes `format`; AutoGPTQ, optimum and older GPTQModel `checkpoint_format`.
    let key = if f.get("format").is_some() {
        "format"
    } else {
        "checkpoint_format"
    };
    let zeros_minus_one = match string(f, key)? {
        None | Some("gptq") => true,
        Some("gptq_v2") => false,
        Some(other) => {
            return Err(f.err(key, format!("`{other}` is not supported (gptq, gptq_v2)")));
        }
    };
    if let Some(p) = string(f, "pack_dtype")?
        && p != "int32"
    {
        return Err(f.err("pack_dtype", format!("`{p}` is not supported (int32)")));
    }
    if flag(f, "lm_head", false)? {
        return Err(f.err("lm_head", "a quantized LM head is not supported"));
    }
    if let Some(d) = f.get("dynamic")
        && d.as_object().is_none_or(|m| !m.is_empty())
    {
        return Err(f.err(
            "dynamic",
            "per-module quantization overrides are not supported",
        ));
    }
    Ok(HfQuant {
        method: QuantMethod::Gptq { zeros_minus_one },
        bits,
        group_size,
        sym,
    })
}

fn awq(f: &Fields<'_>) -> Result<HfQuant> {
    // transformers and AutoAWQ write `bits`; AutoAWQ's own quant_config.json `w_bit`.
    let bits_key = if f.get("bits").is_some() {
        "bits"
    } else {
        "w_bit"
    };
    let bits = bits(f, bits_key)?;
    if bits != 4 {
        return Err(f.err(bits_key, "AWQ's GEMM layout is 4-bit only"));
    }
    let group_key = if f.get("group_size").is_some() {
        "group_size"
    } else {
        "q_group_size"
    };
    let group_size = group_size(f, group_key)?;
    if !flag(f, "zero_point", true)? {
        return Err(f.err(
            "zero_point",
            "AWQ without zero points is not the GEMM layout kiln reads",
        ));
    }
    let key = if f.get("version").is_some() {
        "version"
    } else {
        "format"
    };
    if let Some(v) = string(f, key)?
        && !v.eq_ignore_ascii_case("gemm")
    {
        return Err(f.err(key, format!("AWQ `{v}` is not supported (gemm)")));
    }
    Ok(HfQuant {
        method: QuantMethod::Awq,
        bits,
        group_size,
        sym: false,
    })
}

fn compressed_tensors(f: &Fields<'_>) -> Result<HfQuant> {
    let top_format = string(f, "format")?;
    for key in ["kv_cache_scheme", "sparsity_config", "transform_config"] {
        if let Some(v) = f.get(key)
            && v.as_object().is_none_or(|m| !m.is_empty())
        {
            return Err(f.err(key, format!("{v}: not supported")));
        }
    }
    if let Some(s) = string(f, "quantization_status")?
        && s != "compressed"
    {
        return Err(f.err(
            "quantization_status",
            format!("`{s}`: kiln reads compressed (packed) checkpoints"),
        ));
    }
    let groups = f
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or_else(|| f.err("config_groups", "missing or not a non-empty object"))?;
    let mut scheme: Option<(String, HfQuant)> = None;
    for (name, g) in groups {
        let Some(g) = g.as_object() else {
            return Err(f.err(&format!("config_groups.{name}"), "not an object"));
        };
        let prefix = format!("{}config_groups.{name}.", f.prefix);
        let gf = Fields {
            file: f.file,
            prefix: &prefix,
            v: g,
        };
        let format = string(&gf, "format")?.or(top_format);
        match format {
            Some("pack-quantized") => {}
            Some(other) => {
                return Err(gf.err(
                    "format",
                    format!("`{other}` is not supported (pack-quantized)"),
                ));
            }
            None => return Err(f.err("format", "missing")),
        }
        if gf.get("input_activations").is_some() {
            return Err(gf.err(
                "input_activations",
                "activation quantization is not supported (weight-only schemes, W4A16, W8A16)",
            ));
        }
        if gf.get("output_activations").is_some() {
            return Err(gf.err("output_activations", "output quantization is not supported"));
        }
        let w = gf
            .get("weights")
            .and_then(Value::as_object)
            .ok_or_else(|| gf.err("weights", "missing or not an object"))?;
        let wprefix = format!("{prefix}weights.");
        let wf = Fields {
            file: f.file,
            prefix: &wprefix,
            v: w,
        };
        let q = ct_weights(&wf)?;
        match &scheme {
            None => scheme = Some((name.clone(), q)),
            Some((first, s)) if *s != q => {
                return Err(gf.err(
                    "weights",
                    format!("differs from config group `{first}`: one weight scheme for every layer is supported"),
                ));
            }
            Some(_) => {}
        }
    }
    scheme
        .map(|(_, q)| q)
        .ok_or_else(|| f.err("config_groups", "no weight scheme"))
}

/// One compressed-tensors `weights` quantization-args object.
fn ct_weights(f: &Fields<'_>) -> Result<HfQuant> {
    if let Some(t) = string(f, "type")?
        && t != "int"
    {
        return Err(f.err("type", format!("`{t}` is not supported (int)")));
    }
    let bits = bits(f, "num_bits")?;
    if flag(f, "dynamic", false)? {
        return Err(f.err("dynamic", "dynamic weight quantization is not supported"));
    }
    let group_size = match string(f, "strategy")? {
        Some("group") => match group_size(f, "group_size")? {
            Some(g) => Some(g),
            None => return Err(f.err("group_size", "the group strategy needs a group size")),
        },
        Some("channel") => None,
        Some(other) => {
            return Err(f.err(
                "strategy",
                format!("`{other}` is not supported (group, channel)"),
            ));
        }
        None => return Err(f.err("strategy", "missing")),
    };
    // Activation order only changes the stored `weight_g_idx` (or nothing); an unknown kind
    // may mean a layout kiln does not know.
    match string(f, "actorder")? {
        None | Some("group" | "weight" | "static") => {}
        Some(other) => {
            return Err(f.err(
                "actorder",
                format!("`{other}` is not supported (group, weight, static)"),
            ));
        }
    }
    Ok(HfQuant {
        method: QuantMethod::CompressedTensors,
        bits,
        group_size,
        sym: flag(f, "symmetric", true)?,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(qc: &str) -> Result<Option<HfQuant>> {
        HfQuant::from_hf_json(
            "config.json",
            &format!(r#"{{"model_type": "llama", "quantization_config": {qc}}}"#),
        )
    }

    fn err(qc: &str) -> String {
        parse(qc).unwrap_err().to_string()
    }

    #[test]
    fn parses_each_method() {
        assert_eq!(
            HfQuant::from_hf_json("config.json", r#"{"model_type": "llama"}"#).unwrap(),
            None
        );
        let q = parse(r#"{"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": true, "sym": false, "format": "gptq_v2"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            q,
            HfQuant {
                method: QuantMethod::Gptq {
                    zeros_minus_one: false
                },
                bits: 8,
                group_size: None,
                sym: false
            }
        );
        let q = parse(r#"{"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": true, "version": "GEMM"}"#)
            .unwrap()
            .unwrap();
        assert_eq!((q.method, q.group_size), (QuantMethod::Awq, Some(64)));
        let q = parse(
            r#"{"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128, "actorder": null}}}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (q.method, q.bits, q.group_size, q.sym),
            (QuantMethod::CompressedTensors, 4, Some(128), true)
        );
    }

    #[test]
    fn refusals_name_the_field() {
        let cases = [
            (
                r#"{"quant_method": "gptq", "bits": 3, "group_size": 128}"#,
                "quantization_config.bits",
                "3-bit",
            ),
            (
                r#"{"quant_method": "hqq", "bits": 4}"#,
                "quantization_config.quant_method",
                "hqq",
            ),
            (
                r#"{"quant_method": "gptq", "bits": 4, "group_size": 100}"#,
                "quantization_config.group_size",
                "multiple of 32",
            ),
            (
                r#"{"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}"#,
                "quantization_config.checkpoint_format",
                "marlin",
            ),
            (
                r#"{"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "yes"}"#,
                "quantization_config.desc_act",
                "true or false",
            ),
            (
                r#"{"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": true}"#,
                "quantization_config.lm_head",
                "LM head",
            ),
            (
                r#"{"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}"#,
                "quantization_config.version",
                "gemv",
            ),
            (
                r#"{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": false}"#,
                "quantization_config.zero_point",
                "zero points",
            ),
            (
                r#"{"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {"num_bits": 8, "strategy": "channel"}}}}"#,
                "quantization_config.config_groups.g.format",
                "float-quantized",
            ),
            (
                r#"{"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128}, "input_activations": {"num_bits": 8}}}}"#,
                "quantization_config.config_groups.g.input_activations",
                "activation",
            ),
            (
                r#"{"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "tensor"}}}}"#,
                "quantization_config.config_groups.g.weights.strategy",
                "tensor",
            ),
            (
                r#"{"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "dynamic"}}}}"#,
                "quantization_config.config_groups.g.weights.actorder",
                "dynamic",
            ),
        ];
        for (qc, field, what) in cases {
            let e = err(qc);
            assert!(
                e.contains("config.json") && e.contains(&format!("`{field}`")) && e.contains(what),
                "{qc}: {e}"
            );
        }
    }
}

#[cfg(test)]
mod fp8_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn block(qc: &str) -> Result<[usize; 2]> {
        fp8_block_size(
            "config.json",
            &format!(r#"{{"model_type": "deepseek_v4", "quantization_config": {qc}}}"#),
        )
    }

    #[test]
    fn fp8_tiles_are_read_or_default_to_deepseeks() {
        let hub = r#"{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}"#;
        assert_eq!(block(hub).unwrap(), [128, 128]);
        let small = r#"{"quant_method": "fp8", "weight_block_size": [64, 32]}"#;
        assert_eq!(block(small).unwrap(), [64, 32]);
        assert_eq!(block(r#"{"quant_method": "fp8"}"#).unwrap(), [128, 128]);
        assert_eq!(fp8_block_size("c", "{}").unwrap(), [128, 128]);
    }

    #[test]
    fn fp8_fields_kiln_cannot_read_are_refused_by_name() {
        for (qc, field) in [
            (r#"{"quant_method": "fp8", "fmt": "e5m2"}"#, "fmt"),
            (
                r#"{"quant_method": "fp8", "scale_fmt": "fp32"}"#,
                "scale_fmt",
            ),
            (
                r#"{"quant_method": "fp8", "activation_scheme": "x"}"#,
                "activation_scheme",
            ),
            (
                r#"{"quant_method": "fp8", "weight_block_size": [128, 100]}"#,
                "weight_block_size",
            ),
            (
                r#"{"quant_method": "fp8", "weight_block_size": [128]}"#,
                "weight_block_size",
            ),
        ] {
            let msg = block(qc).unwrap_err().to_string();
            assert!(
                msg.contains("config.json")
                    && msg.contains(&format!("quantization_config.{field}")),
                "{qc}: {msg}"
            );
        }
    }
}
