//! [`HfSource`]'s quantized linear weights: GPTQ / AWQ / compressed-tensors tensor sets read,
//! checked against `config.json`'s `quantization_config` ([`HfQuant`]) and the layer's shape,
//! and repacked (`repack.rs`) into kiln's block dtypes, which stay packed on the device.

use kiln_tensor::{Device, Tensor};

use crate::config::{HfQuant, QuantMethod};
use crate::hf_source::HfSource;
use crate::repack::{self, CtZeros, RepackError, Repacked};
use crate::safetensors::{Entry, SafetensorsFile, StDtype};
use crate::weights::{Linear, Weight};
use crate::{ModelError, Result};

/// The stored tensors of one quantized linear weight, by the suffixes each format uses.
struct Names {
    base: String,
}

impl Names {
    fn of(w: Weight) -> Self {
        let name = w.hf_name();
        Self {
            base: name.strip_suffix(".weight").unwrap_or(&name).to_string(),
        }
    }

    fn get(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.base)
    }
}

/// The tensor that marks a weight as quantized in each format.
fn marker(method: QuantMethod) -> &'static str {
    match method {
        QuantMethod::Gptq { .. } | QuantMethod::Awq => "qweight",
        QuantMethod::CompressedTensors => "weight_packed",
    }
}

impl HfSource {
    /// Marks the checkpoint's linear weights as quantized as `quant` says (`None`: float).
    pub fn with_quant(mut self, quant: Option<HfQuant>) -> Self {
        self.quant = quant;
        self
    }

    /// The checkpoint's quantization, from `config.json`.
    pub fn quant(&self) -> Option<HfQuant> {
        self.quant
    }

    /// Whether `w` is stored quantized (its format's packed tensor is present; modules the
    /// quantizer skipped, such as `lm_head`, keep a float `weight`).
    pub(crate) fn is_quantized(&self, w: Weight) -> bool {
        self.quant
            .is_some_and(|q| self.index.contains_key(&Names::of(w).get(marker(q.method))))
    }

    /// A stored tensor of any dtype, with its file.
    pub(crate) fn raw(&self, name: &str) -> Option<(&SafetensorsFile, &Entry)> {
        let file = &self.files[*self.index.get(name)?];
        Some((file, file.tensors.get(name)?))
    }

    fn missing(&self, name: &str, why: &str) -> ModelError {
        ModelError::Tensor {
            file: self.describe.clone(),
            tensor: name.into(),
            problem: format!("missing ({why})"),
        }
    }

    /// Tensor `name` of a quantized weight, its shape checked against `shape` (what the
    /// layer and `quantization_config` imply), and an error maker naming its file.
    fn shaped(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&SafetensorsFile, &Entry, impl Fn(String) -> ModelError)> {
        let (file, e) = self
            .raw(name)
            .ok_or_else(|| self.missing(name, "quantized checkpoint"))?;
        let err = move |problem: String| ModelError::Tensor {
            file: file.name().into(),
            tensor: name.into(),
            problem,
        };
        if e.shape != shape {
            return Err(err(format!(
                "shape {:?}, expected {shape:?} for this layer and quantization_config",
                e.shape
            )));
        }
        Ok((file, e, err))
    }

    /// An integer tensor of one of `dtypes` and of shape `shape`, as i32.
    fn ints(&self, name: &str, shape: &[usize], dtypes: &[StDtype]) -> Result<Vec<i32>> {
        let (file, e, err) = self.shaped(name, shape)?;
        if !dtypes.contains(&e.dtype) {
            let want: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
            return Err(err(format!(
                "dtype {} is not {}",
                e.dtype_name,
                want.join(" or ")
            )));
        }
        let bytes = file.bytes(name, e)?;
        let v = match e.dtype {
            StDtype::I64 => bytes
                .chunks_exact(8)
                .map(|b| {
                    let x = i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                    i32::try_from(x).map_err(|_| err(format!("{x} does not fit 32 bits")))
                })
                .collect::<Result<_>>()?,
            StDtype::I8 => bytes.iter().map(|&b| i32::from(b as i8)).collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        };
        Ok(v)
    }

    /// A float scale tensor of shape `shape` as f16 bits (kiln's blocks hold f16 scales):
    /// F16 as stored; BF16 and F32 rounded, with a warning when that changes a value.
    fn scales(&self, name: &str, shape: &[usize]) -> Result<Vec<u16>> {
        let (file, e, err) = self.shaped(name, shape)?;
        let (v, inexact) = match e.dtype {
            StDtype::F16 => {
                let bits: Vec<u16> = file
                    .bytes(name, e)?
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                (bits, 0)
            }
            StDtype::BF16 | StDtype::F32 => {
                let wide = file.entry_f32(name, e)?;
                let bits: Vec<u16> = wide
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect();
                let inexact = wide
                    .iter()
                    .zip(&bits)
                    .filter(|&(&x, &b)| half::f16::from_bits(b).to_f32() != x)
                    .count();
                (bits, inexact)
            }
            _ => {
                return Err(err(format!(
                    "dtype {} is not F16, BF16 or F32",
                    e.dtype_name
                )));
            }
        };
        if inexact > 0 {
            tracing::warn!(
                "{}: tensor `{name}`: {inexact} of {} scales rounded to f16",
                file.name(),
                v.len()
            );
        }
        Ok(v)
    }

    /// `w` (`[rows, cols]` = `shape`) from its quantized tensors, repacked into blocks.
    pub(crate) fn load_quantized(
        &self,
        device: &Device,
        w: Weight,
        shape: &[usize],
    ) -> Result<Linear> {
        let (Some(q), &[rows, cols]) = (self.quant, shape) else {
            return Err(ModelError::Tensor {
                file: self.describe.clone(),
                tensor: w.hf_name(),
                problem: format!("a quantized weight must be 2-D, not {shape:?}"),
            });
        };
        let n = Names::of(w);
        let pack = (32 / q.bits) as usize;
        // Groups along the input dimension, as the config promises.
        let groups = q.group_size.map_or(1, |g| cols.div_ceil(g));
        let (unpacked, first) = match q.method {
            QuantMethod::Gptq { zeros_minus_one } => {
                let qw = self.ints(&n.get("qweight"), &[cols / pack, rows], &[StDtype::I32])?;
                let qz = self.ints(&n.get("qzeros"), &[groups, rows / pack], &[StDtype::I32])?;
                let sc = self.scales(&n.get("scales"), &[groups, rows])?;
                let gi = self.g_idx(&n.get("g_idx"), cols)?;
                let u = repack::gptq(
                    rows,
                    cols,
                    q.bits,
                    &qw,
                    &qz,
                    &sc,
                    gi.as_deref(),
                    q.group_size,
                    zeros_minus_one,
                );
                (u, "qweight")
            }
            QuantMethod::Awq => {
                let qw = self.ints(&n.get("qweight"), &[cols, rows / 8], &[StDtype::I32])?;
                let qz = self.ints(&n.get("qzeros"), &[groups, rows / 8], &[StDtype::I32])?;
                let sc = self.scales(&n.get("scales"), &[groups, rows])?;
                let u = repack::awq(rows, cols, &qw, &qz, &sc, q.group_size);
                (u, "qweight")
            }
            QuantMethod::CompressedTensors => {
                let ws_name = n.get("weight_shape");
                if self.raw(&ws_name).is_some() {
                    let ws = self.ints(&ws_name, &[2], &[StDtype::I32, StDtype::I64])?;
                    if ws != [rows as i32, cols as i32] {
                        return Err(self.tensor_err(
                            &ws_name,
                            format!("{ws:?} disagrees with config.json's [{rows}, {cols}]"),
                        ));
                    }
                }
                let wp = self.ints(
                    &n.get("weight_packed"),
                    &[rows, cols / pack],
                    &[StDtype::I32],
                )?;
                let sc = self.scales(&n.get("weight_scale"), &[rows, groups])?;
                let zp_name = n.get("weight_zero_point");
                // Symmetric checkpoints may still carry all-zero points; they are not read.
                let (zp_bytes, zp_words): (Vec<i8>, Vec<i32>);
                let zeros = match self.raw(&zp_name).map(|(_, e)| e.dtype) {
                    _ if q.sym => CtZeros::Symmetric,
                    Some(StDtype::I8) => {
                        zp_bytes = self
                            .ints(&zp_name, &[rows, groups], &[StDtype::I8])?
                            .into_iter()
                            .map(|x| x as i8)
                            .collect();
                        CtZeros::Bytes(&zp_bytes)
                    }
                    Some(_) => {
                        zp_words =
                            self.ints(&zp_name, &[rows.div_ceil(pack), groups], &[StDtype::I32])?;
                        CtZeros::Packed(&zp_words)
                    }
                    None => {
                        return Err(self.missing(&zp_name, "asymmetric weights need zero points"));
                    }
                };
                let gi = self.g_idx(&n.get("weight_g_idx"), cols)?;
                let u = repack::compressed_tensors(
                    rows,
                    cols,
                    q.bits,
                    &wp,
                    &sc,
                    zeros,
                    gi.as_deref(),
                    q.group_size,
                );
                (u, "weight_packed")
            }
        };
        let named = |e: RepackError| {
            let t = match (e.tensor, q.method) {
                ("weight", _) => first,
                ("g_idx", QuantMethod::CompressedTensors) => "weight_g_idx",
                (t, _) => t,
            };
            self.tensor_err(&n.get(t), e.problem)
        };
        let Repacked { dtype, bytes, perm } =
            unpacked.and_then(|u| u.to_blocks()).map_err(named)?;
        let weight = Tensor::from_bytes(device, dtype, shape, &bytes).map_err(|source| {
            ModelError::Upload {
                file: self.describe.clone(),
                tensor: n.get(first),
                source: Box::new(source),
            }
        })?;
        Ok(Linear {
            weight,
            input_perm: perm,
        })
    }

    /// The optional group index of each of `cols` input columns.
    fn g_idx(&self, name: &str, cols: usize) -> Result<Option<Vec<i32>>> {
        self.raw(name)
            .map(|_| self.ints(name, &[cols], &[StDtype::I32, StDtype::I64]))
            .transpose()
    }

    fn tensor_err(&self, name: &str, problem: String) -> ModelError {
        let file = self
            .index
            .get(name)
            .map_or(self.describe.as_str(), |&i| self.files[i].name());
        ModelError::Tensor {
            file: file.into(),
            tensor: name.into(),
            problem,
        }
    }
}
