//! [`HfSource`]: a Hugging Face model folder's weights, single-file or sharded through
//! `model.safetensors.index.json`, served by weight role, with the load options' casts and
//! quantization applied.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use kiln_tensor::{DType, Device, QK, Tensor};
use serde_json::Value;

use crate::config::HfQuant;
use crate::safetensors::{Entry, FLOATS, SafetensorsFile, StDtype, format_err};
use crate::weights::{ExpertProj, Linear, Weight, WeightSource, stack_experts};
use crate::{ModelError, Result};

/// How an HF checkpoint's float weights are turned into device tensors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Cast float weights to F16 or F32 (`None`: as stored, BF16 included: the kernels read BF16).
    pub dtype: Option<DType>,
    /// Quantize 2-D projection and embedding weights whose rows are a multiple of 32 to
    /// Q8_0/Q4_0/Q4_1 at load (norms and biases stay F32).
    pub quantize: Option<DType>,
}

impl LoadOptions {
    fn check(&self, file: &str) -> Result<()> {
        let bad = |field: &str, d: DType, allowed: &str| ModelError::Config {
            file: file.into(),
            field: field.into(),
            problem: format!("{d:?} is not one of {allowed}"),
        };
        if let Some(d) = self.dtype
            && !matches!(d, DType::F16 | DType::F32)
        {
            return Err(bad("dtype", d, "F16, F32"));
        }
        if let Some(q) = self.quantize
            && !q.is_quantized()
        {
            return Err(bad("quantize", q, "Q8_0, Q4_0, Q4_1"));
        }
        Ok(())
    }
}

/// The weights of a Hugging Face model folder: shard headers parsed at open, each tensor read
/// from its shard when loaded.
#[derive(Debug)]
pub struct HfSource {
    pub(crate) describe: String,
    pub(crate) files: Vec<SafetensorsFile>,
    /// Tensor name → index into `files`.
    pub(crate) index: HashMap<String, usize>,
    options: LoadOptions,
    /// `config.json`'s `quantization_config` (`hf_quant.rs` loads those weights).
    pub(crate) quant: Option<HfQuant>,
    /// The architecture `config.json` names: GPT-OSS's experts are stacked tensors of their
    /// own layout (`hf_experts.rs`).
    pub(crate) arch: Option<crate::Arch>,
    /// The tile an FP8 weight's scale covers (`block_scaled.rs`).
    pub(crate) fp8_block: [usize; 2],
}

impl HfSource {
    /// Reads `model.safetensors`, or the shards `model.safetensors.index.json` names.
    pub fn open(dir: &Path, options: LoadOptions) -> Result<Self> {
        let describe = dir.display().to_string();
        options.check(&describe)?;
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let mut files = Vec::new();
        let mut index = HashMap::new();
        if single.is_file() {
            let f = SafetensorsFile::open(&single)?;
            index.extend(f.names().map(|n| (n.to_string(), 0)));
            files.push(f);
        } else if index_path.is_file() {
            let ip = index_path.display().to_string();
            let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io {
                path: index_path.clone(),
                source,
            })?;
            let v: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
                file: ip.clone(),
                what: "not JSON",
                source,
            })?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| format_err(&ip, "no `weight_map` object"))?;
            let mut shard_ids: HashMap<String, usize> = HashMap::new();
            for (tensor, shard) in map {
                let shard = shard.as_str().ok_or_else(|| {
                    format_err(&ip, format!("weight_map[{tensor}] is not a file name"))
                })?;
                if shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
                    return Err(format_err(
                        &ip,
                        format!("weight_map[{tensor}]: `{shard}` is not a file in the folder"),
                    ));
                }
                let id = match shard_ids.get(shard) {
                    Some(&id) => id,
                    None => {
                        files.push(SafetensorsFile::open(&dir.join(shard))?);
                        shard_ids.insert(shard.to_string(), files.len() - 1);
                        files.len() - 1
                    }
                };
                if !files[id].contains(tensor) {
                    return Err(ModelError::Tensor {
                        file: files[id].name().into(),
                        tensor: tensor.clone(),
                        problem: format!("listed in {ip} but not in the shard"),
                    });
                }
                index.insert(tensor.clone(), id);
            }
        } else {
            return Err(ModelError::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json in the folder",
                ),
            });
        }
        Ok(Self {
            describe,
            files,
            index,
            options,
            quant: None,
            arch: None,
            fp8_block: crate::config::FP8_BLOCK,
        })
    }

    pub fn options(&self) -> LoadOptions {
        self.options
    }

    /// Bytes of tensor data in the files.
    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes_where(|_| true)
    }

    /// Bytes of the tensors whose names `keep` picks.
    pub(crate) fn stored_bytes_where(&self, keep: impl Fn(&str) -> bool) -> u64 {
        self.files
            .iter()
            .flat_map(|f| &f.tensors)
            .filter(|(name, _)| keep(name))
            .map(|(_, e)| e.range.len() as u64)
            .sum()
    }

    /// The tensor name of `w` in this checkpoint: transformers' usual one, else the name of
    /// the family (Mixtral, GPT-OSS) by whose names this checkpoint calls its first router
    /// (a missing weight is then named as this checkpoint would name it), else any alias
    /// present.
    fn key(&self, w: Weight) -> String {
        let name = w.hf_name();
        if self.index.contains_key(&name) {
            return name;
        }
        let present = |n: &Option<String>| n.as_ref().is_some_and(|n| self.index.contains_key(n));
        let family = Weight::Router(0).hf_aliases().iter().position(present);
        let aliases = w.hf_aliases();
        let alias = match family {
            Some(i) if aliases[i].is_some() => aliases[i].clone(),
            _ => aliases.iter().find(|a| present(a)).cloned().flatten(),
        };
        alias.unwrap_or(name)
    }

    /// Tensor `name`, checked: present, of shape `shape` and one of `dtypes` (which the error
    /// lists); with the file that holds it.
    fn checked_entry(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[StDtype],
    ) -> Result<(&SafetensorsFile, &Entry)> {
        let err = |file: &str, problem: String| ModelError::Tensor {
            file: file.into(),
            tensor: name.into(),
            problem,
        };
        let fi = *self
            .index
            .get(name)
            .ok_or_else(|| err(&self.describe, "missing".into()))?;
        let file = &self.files[fi];
        let e = file
            .tensors
            .get(name)
            .ok_or_else(|| err(file.name(), "missing".into()))?;
        if !dtypes.contains(&e.dtype) {
            let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
            return Err(err(
                file.name(),
                format!(
                    "dtype {} is not supported ({})",
                    e.dtype_name,
                    names.join(", ")
                ),
            ));
        }
        if e.shape != shape {
            return Err(err(
                file.name(),
                format!("shape {:?} disagrees with config.json's {shape:?}", e.shape),
            ));
        }
        Ok((file, e))
    }

    /// The bytes of tensor `name`, checked as [`HfSource::checked_entry`] does; with its
    /// dtype and the file that holds it.
    pub(crate) fn checked_bytes(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[StDtype],
    ) -> Result<(StDtype, Cow<'_, [u8]>, &str)> {
        let (file, e) = self.checked_entry(name, shape, dtypes)?;
        Ok((e.dtype, file.bytes(name, e)?, file.name()))
    }

    /// Float weights stored as `stored` (F32, F16, BF16) uploaded as the load options ask:
    /// quantized where asked and a row is whole blocks, cast to F16 or F32, or as stored.
    /// Errors name tensor `name` of `file`.
    pub(crate) fn upload(
        &self,
        device: &Device,
        stored: StDtype,
        shape: &[usize],
        bytes: &[u8],
        (file, name): (&str, &str),
    ) -> Result<Tensor> {
        let wrap = |r: kiln_tensor::Result<Tensor>| {
            r.map_err(|source| ModelError::Upload {
                file: file.into(),
                tensor: name.into(),
                source: Box::new(source),
            })
        };
        let stored = stored.kiln().unwrap_or(DType::F32);
        let f32s = || {
            wrap(Tensor::from_bytes(&Device::Reference, stored, shape, bytes))?
                .to_f32_vec()
                .map_err(ModelError::from)
        };
        let cols = shape.last().copied().unwrap_or(0);
        if let Some(q) = self.options.quantize
            && shape.len() >= 2
            && cols.is_multiple_of(QK)
        {
            return wrap(Tensor::quantize_f32(device, q, shape, &f32s()?));
        }
        match self.options.dtype {
            None => wrap(Tensor::from_bytes(device, stored, shape, bytes)),
            Some(DType::F16) if stored == DType::F16 => {
                wrap(Tensor::from_bytes(device, DType::F16, shape, bytes))
            }
            Some(DType::F16) => {
                let halves: Vec<u8> = f32s()?
                    .into_iter()
                    .flat_map(|x| half::f16::from_f32(x).to_le_bytes())
                    .collect();
                wrap(Tensor::from_bytes(device, DType::F16, shape, &halves))
            }
            Some(_) => wrap(Tensor::from_f32(device, shape, &f32s()?)),
        }
    }

    /// The checked entry for `w`: present, F32/F16/BF16, of shape `shape`.
    fn entry(&self, w: Weight, shape: &[usize]) -> Result<(&SafetensorsFile, &Entry)> {
        self.checked_entry(&self.key(w), shape, FLOATS)
    }
}

impl WeightSource for HfSource {
    fn describe(&self) -> &str {
        &self.describe
    }

    fn has(&self, w: Weight) -> bool {
        self.index.contains_key(&self.key(w)) || self.is_quantized(w)
    }

    fn name_of(&self, w: Weight) -> String {
        self.key(w)
    }

    fn load_linear(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Linear> {
        if self.is_quantized(w) {
            return self.load_quantized(device, w, shape);
        }
        Ok(Linear {
            weight: self.load(device, w, shape)?,
            input_perm: None,
        })
    }

    fn load(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Tensor> {
        if self.is_quantized(w) {
            let l = self.load_quantized(device, w, shape)?;
            if l.input_perm.is_some() {
                return Err(ModelError::Tensor {
                    file: self.describe.clone(),
                    tensor: w.hf_name(),
                    problem: "act-order weights need their input permutation (load_linear)".into(),
                });
            }
            return Ok(l.weight);
        }
        let (file, e) = self.entry(w, shape)?;
        let name = self.key(w);
        self.upload(
            device,
            e.dtype,
            shape,
            &file.bytes(&name, e)?,
            (file.name(), &name),
        )
    }

    fn load_experts(
        &self,
        device: &Device,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 3],
    ) -> Result<Tensor> {
        match self.stacked_experts(device, layer, proj, shape)? {
            Some(t) => Ok(t),
            None => stack_experts(self, device, layer, proj, shape),
        }
    }

    fn load_expert_bias(
        &self,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 2],
    ) -> Result<Vec<f32>> {
        self.stacked_expert_bias(layer, proj, shape)
    }

    fn load_f32(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Tensor> {
        let (file, e) = self.entry(w, shape)?;
        let v = file.entry_f32(&self.key(w), e)?;
        Ok(Tensor::from_f32(device, shape, &v)?)
    }
}
