//! Hugging Face weights: the safetensors format (an 8-byte little-endian header length, a JSON
//! header mapping tensor names to dtype, shape and byte range, then the raw data), single-file
//! or sharded through `model.safetensors.index.json`, and [`HfSource`] serving them by role.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;

use kiln_tensor::{DType, Device, QK, Tensor};
use serde_json::{Map, Value};

use crate::config::HfQuant;
use crate::files::DataFile;
use crate::weights::{ExpertProj, Linear, Weight, WeightSource, stack_experts};
use crate::{ModelError, Result};

/// Element types a safetensors header may name. kiln loads the float ones as weights; the
/// integer ones hold quantized checkpoints' packed words, zeros and group indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StDtype {
    F32,
    F16,
    BF16,
    I64,
    I32,
    I8,
    U8,
    /// Anything else (`F8_E4M3`, `U16`, ...): listed, refused at load.
    Other,
}

impl StDtype {
    fn parse(s: &str) -> Self {
        match s {
            "F32" => StDtype::F32,
            "F16" => StDtype::F16,
            "BF16" => StDtype::BF16,
            "I64" => StDtype::I64,
            "I32" => StDtype::I32,
            "I8" => StDtype::I8,
            "U8" => StDtype::U8,
            _ => StDtype::Other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StDtype::F32 => "F32",
            StDtype::F16 => "F16",
            StDtype::BF16 => "BF16",
            StDtype::I64 => "I64",
            StDtype::I32 => "I32",
            StDtype::I8 => "I8",
            StDtype::U8 => "U8",
            StDtype::Other => "other",
        }
    }

    pub(crate) fn size(self) -> Option<usize> {
        match self {
            StDtype::I64 => Some(8),
            StDtype::F32 | StDtype::I32 => Some(4),
            StDtype::F16 | StDtype::BF16 => Some(2),
            StDtype::I8 | StDtype::U8 => Some(1),
            StDtype::Other => None,
        }
    }

    pub(crate) fn kiln(self) -> Option<DType> {
        match self {
            StDtype::F32 => Some(DType::F32),
            StDtype::F16 => Some(DType::F16),
            StDtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) dtype: StDtype,
    /// The dtype string as the header spells it (for error messages).
    pub(crate) dtype_name: String,
    pub(crate) shape: Vec<usize>,
    /// Byte range within the whole file.
    range: Range<usize>,
}

/// One `.safetensors` file: its header parsed, its tensors read when loaded.
#[derive(Debug)]
pub struct SafetensorsFile {
    name: String,
    data: Data,
    pub(crate) tensors: HashMap<String, Entry>,
}

/// Where a file's tensor bytes are.
#[derive(Debug)]
enum Data {
    /// Opened from disk: each tensor is read when it is loaded.
    File(DataFile),
    /// Handed over whole ([`SafetensorsFile::from_bytes`]).
    Memory(Vec<u8>),
}

/// Largest JSON header accepted; the reference implementation refuses larger ones too, and a
/// corrupt length must not become a huge allocation.
const MAX_HEADER_BYTES: u64 = 100_000_000;

fn format_err(file: &str, problem: impl Into<String>) -> ModelError {
    ModelError::Format {
        file: file.into(),
        problem: problem.into(),
    }
}

impl SafetensorsFile {
    /// Reads the header of the file at `path`; tensor data stays in the file until loaded.
    pub fn open(path: &Path) -> Result<Self> {
        let data = DataFile::open(path)?;
        let name = data.name().to_string();
        let file_len = data.len();
        if file_len < 8 {
            return Err(too_short(&name, file_len));
        }
        let len8 = data.read(0..8, "the header length")?;
        let data_start = header_end(&name, le_u64(&len8), file_len)?;
        let header = data.read(8..data_start, "the header")?;
        let tensors = parse_header(&name, &header, data_start, file_len)?;
        Ok(Self {
            name,
            data: Data::File(data),
            tensors,
        })
    }

    /// Parses and checks the header of a whole file held in memory; `name` is used in errors.
    pub fn from_bytes(name: String, bytes: Vec<u8>) -> Result<Self> {
        let file_len = bytes.len() as u64;
        let len8 = bytes.get(..8).ok_or_else(|| too_short(&name, file_len))?;
        let data_start = header_end(&name, le_u64(len8), file_len)?;
        // `header_end` checked the range against the length.
        let header = bytes.get(8..data_start as usize).unwrap_or_default();
        let tensors = parse_header(&name, header, data_start, file_len)?;
        Ok(Self {
            name,
            data: Data::Memory(bytes),
            tensors,
        })
    }

    /// The stored bytes of `tensor` (entry `e`): read from the file, or borrowed from memory.
    pub(crate) fn bytes(&self, tensor: &str, e: &Entry) -> Result<Cow<'_, [u8]>> {
        match &self.data {
            Data::File(f) => Ok(Cow::Owned(f.read(
                e.range.start as u64..e.range.end as u64,
                &format!("tensor `{tensor}`"),
            )?)),
            Data::Memory(b) => {
                b.get(e.range.clone())
                    .map(Cow::Borrowed)
                    .ok_or_else(|| ModelError::Tensor {
                        file: self.name.clone(),
                        tensor: tensor.into(),
                        problem: format!("bytes {:?} lie outside the data", e.range),
                    })
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn contains(&self, tensor: &str) -> bool {
        self.tensors.contains_key(tensor)
    }

    /// Tensor names in this file.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A float tensor's values as f32 (F32, F16, BF16).
    pub fn read_f32(&self, tensor: &str) -> Result<Vec<f32>> {
        let e = self.tensors.get(tensor).ok_or_else(|| ModelError::Tensor {
            file: self.name.clone(),
            tensor: tensor.into(),
            problem: "missing".into(),
        })?;
        self.entry_f32(tensor, e)
    }

    /// The values of `name` (entry `e`) as f32.
    pub(crate) fn entry_f32(&self, name: &str, e: &Entry) -> Result<Vec<f32>> {
        let bytes = self.bytes(name, e)?;
        let bytes = bytes.as_ref();
        let v = match e.dtype {
            StDtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            StDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            StDtype::F16 => {
                Tensor::from_bytes(&Device::Reference, DType::F16, &e.shape, bytes)?.to_f32_vec()?
            }
            _ => {
                return Err(ModelError::Tensor {
                    file: self.name.clone(),
                    tensor: name.into(),
                    problem: format!("dtype {} is not supported", e.dtype_name),
                });
            }
        };
        Ok(v)
    }

    /// Stored dtype and shape of a tensor.
    pub fn info(&self, tensor: &str) -> Option<(StDtype, &[usize])> {
        self.tensors
            .get(tensor)
            .map(|e| (e.dtype, e.shape.as_slice()))
    }
}

fn too_short(file: &str, len: u64) -> ModelError {
    format_err(
        file,
        format!("truncated: {len} bytes, too short for the 8-byte header length"),
    )
}

/// The little-endian u64 its first 8 bytes spell (callers checked there are 8).
fn le_u64(b: &[u8]) -> u64 {
    b.get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// Where the data starts (after the 8-byte length and the header), checked against the file's
/// length and [`MAX_HEADER_BYTES`] before the header is read.
fn header_end(file: &str, header_len: u64, file_len: u64) -> Result<u64> {
    if header_len > MAX_HEADER_BYTES {
        return Err(format_err(
            file,
            format!(
                "truncated or corrupt header: it claims {header_len} bytes, more than a header may have ({MAX_HEADER_BYTES})"
            ),
        ));
    }
    let end = header_len + 8;
    if end > file_len {
        return Err(format_err(
            file,
            format!(
                "truncated or corrupt header: it claims {header_len} bytes but the file has {file_len}"
            ),
        ));
    }
    Ok(end)
}

/// The tensor entries of a JSON header, their byte ranges checked against the data section
/// (`data_start..file_len`).
fn parse_header(
    name: &str,
    header: &[u8],
    data_start: u64,
    file_len: u64,
) -> Result<HashMap<String, Entry>> {
    let header: Map<String, Value> =
        serde_json::from_slice(header).map_err(|source| ModelError::Json {
            file: name.into(),
            what: "header is not a JSON object",
            source,
        })?;
    let too_big = || {
        format_err(
            name,
            format!("{file_len} bytes: too large for this machine"),
        )
    };
    let data_start = usize::try_from(data_start).map_err(|_| too_big())?;
    let data_len = usize::try_from(file_len)
        .map_err(|_| too_big())?
        .saturating_sub(data_start);
    let mut tensors = HashMap::with_capacity(header.len());
    for (tname, v) in &header {
        if tname == "__metadata__" {
            continue;
        }
        let bad = |problem: String| ModelError::Tensor {
            file: name.into(),
            tensor: tname.clone(),
            problem,
        };
        let dtype_name = v
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("header entry has no `dtype` string".into()))?;
        let sizes = |key: &str| {
            v.get(key).and_then(Value::as_array).and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
        };
        let shape = sizes("shape")
            .ok_or_else(|| bad("header entry has no `shape` list of sizes".into()))?;
        let offs = sizes("data_offsets")
            .filter(|o| o.len() == 2 && o[0] <= o[1])
            .ok_or_else(|| bad("header entry has no `data_offsets` [begin, end]".into()))?;
        if offs[1] > data_len {
            return Err(bad(format!(
                "data_offsets {offs:?} run past the end of the data ({data_len} bytes): file truncated?"
            )));
        }
        let dtype = StDtype::parse(dtype_name);
        if let Some(size) = dtype.size() {
            let want = shape.iter().try_fold(size, |a, &d| a.checked_mul(d));
            if want != Some(offs[1] - offs[0]) {
                return Err(bad(format!(
                    "{} bytes for {dtype_name} {shape:?}",
                    offs[1] - offs[0]
                )));
            }
        }
        tensors.insert(
            tname.clone(),
            Entry {
                dtype,
                dtype_name: dtype_name.to_string(),
                shape,
                range: data_start + offs[0]..data_start + offs[1],
            },
        );
    }
    Ok(tensors)
}

/// Serializes tensors (name, dtype, shape, little-endian bytes) as one safetensors file body.
pub fn encode_safetensors(
    tensors: &[(String, StDtype, Vec<usize>, Vec<u8>)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert(
            "__metadata__".into(),
            Value::from(
                metadata
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::from(v.clone())))
                    .collect::<Map<_, _>>(),
            ),
        );
    }
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        if *dtype == StDtype::Other {
            return Err(ModelError::Tensor {
                file: "(safetensors writer)".into(),
                tensor: name.clone(),
                problem: "only F32, F16, BF16, I64, I32 and I8 can be written".into(),
            });
        }
        let mut e = Map::new();
        e.insert("dtype".into(), Value::from(dtype.name()));
        e.insert("shape".into(), Value::from(shape.clone()));
        e.insert(
            "data_offsets".into(),
            Value::from(vec![offset, offset + data.len()]),
        );
        header.insert(name.clone(), Value::Object(e));
        offset += data.len();
    }
    let mut json =
        serde_json::to_vec(&Value::Object(header)).map_err(|source| ModelError::Json {
            file: "(safetensors writer)".into(),
            what: "cannot write the header",
            source,
        })?;
    // Data starts 8-byte aligned, as the reference writer does.
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    Ok(out)
}

/// The float dtypes kiln loads from safetensors.
pub(crate) const FLOATS: &[StDtype] = &[StDtype::F32, StDtype::F16, StDtype::BF16];

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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn encoded_files_parse_back() {
        let data: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let bytes = encode_safetensors(
            &[("a".into(), StDtype::F32, vec![2], data)],
            &BTreeMap::new(),
        )
        .unwrap();
        let f = SafetensorsFile::from_bytes("t".into(), bytes).unwrap();
        assert_eq!(f.info("a"), Some((StDtype::F32, &[2usize][..])));
        assert!(
            SafetensorsFile::from_bytes("t".into(), vec![1, 2, 3])
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
    }
}
