//! The safetensors format (an 8-byte little-endian header length, a JSON header mapping tensor
//! names to dtype, shape and byte range, then the raw data): one file read
//! ([`SafetensorsFile`]) and written ([`encode_safetensors`]). `hf_source.rs` serves a folder's
//! files by weight role.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;

use kiln_tensor::{DType, Device, Tensor};
use serde_json::{Map, Value};

use crate::files::DataFile;
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
    /// OCP FP8 E4M3 codes (`float8_e4m3fn`): FP8 checkpoints' weights (`block_scaled.rs`).
    F8E4M3,
    /// Power-of-two exponents (`float8_e8m0fnu`): DeepSeek's block scales.
    F8E8M0,
    /// Anything else (`F8_E5M2`, `U16`, ...): listed, refused at load.
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
            "F8_E4M3" => StDtype::F8E4M3,
            "F8_E8M0" => StDtype::F8E8M0,
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
            StDtype::F8E4M3 => "F8_E4M3",
            StDtype::F8E8M0 => "F8_E8M0",
            StDtype::Other => "other",
        }
    }

    pub(crate) fn size(self) -> Option<usize> {
        match self {
            StDtype::I64 => Some(8),
            StDtype::F32 | StDtype::I32 => Some(4),
            StDtype::F16 | StDtype::BF16 => Some(2),
            StDtype::I8 | StDtype::U8 | StDtype::F8E4M3 | StDtype::F8E8M0 => Some(1),
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
    pub(crate) range: Range<usize>,
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

pub(crate) fn format_err(file: &str, problem: impl Into<String>) -> ModelError {
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

    fn entry(&self, tensor: &str) -> Result<&Entry> {
        self.tensors.get(tensor).ok_or_else(|| ModelError::Tensor {
            file: self.name.clone(),
            tensor: tensor.into(),
            problem: "missing".into(),
        })
    }

    /// A float tensor's values as f32 (F32, F16, BF16).
    pub fn read_f32(&self, tensor: &str) -> Result<Vec<f32>> {
        self.entry_f32(tensor, self.entry(tensor)?)
    }

    /// An integer tensor's values as ids (I64 or I32, each in `0..=u32::MAX`): index tables
    /// such as DeepSeek-V4's `tid2eid`.
    pub fn read_ids(&self, tensor: &str) -> Result<Vec<u32>> {
        let e = self.entry(tensor)?;
        decode_ids((&self.name, tensor), e.dtype, &self.bytes(tensor, e)?)
    }

    /// A tensor's stored bytes, whatever its dtype.
    pub fn read_bytes(&self, tensor: &str) -> Result<Vec<u8>> {
        Ok(self.bytes(tensor, self.entry(tensor)?)?.into_owned())
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

/// The ids in `bytes` of tensor `name` of `file`, stored as `dtype` (I64 or I32, each in
/// `0..=u32::MAX`).
pub(crate) fn decode_ids(
    (file, name): (&str, &str),
    dtype: StDtype,
    bytes: &[u8],
) -> Result<Vec<u32>> {
    let bad = |problem: String| ModelError::Tensor {
        file: file.into(),
        tensor: name.into(),
        problem,
    };
    let values: Vec<i64> = match dtype {
        StDtype::I64 => bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect(),
        StDtype::I32 => bytes
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        other => {
            return Err(bad(format!(
                "dtype {} is not an index table's (I64 or I32)",
                other.name()
            )));
        }
    };
    values
        .into_iter()
        .map(|v| u32::try_from(v).map_err(|_| bad(format!("value {v} is not an id"))))
        .collect()
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
