//! A parsed GGUF container: version, metadata, tensor infos and where the data starts.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::ops::Range;
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::ggml::GgmlType;
use crate::parse::Cursor;
use crate::value::Metadata;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides [`DEFAULT_ALIGNMENT`].
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Most dimensions a ggml tensor has.
pub const MAX_DIMS: u32 = 4;

/// Where one tensor's data is and how it is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the fastest-moving (contiguous) one.
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section, as stored.
    pub relative_offset: u64,
    /// Offset of the data from the start of the file.
    pub offset: u64,
    /// Number of elements (the product of `dims`).
    pub n_elements: u64,
    /// Bytes of data, when the type's layout is known (see [`GgmlType::block_layout`]).
    pub byte_size: Option<u64>,
}

impl TensorInfo {
    /// The absolute byte range of the data in the file, when its size is known.
    pub fn data_range(&self) -> Option<Range<u64>> {
        self.byte_size.map(|size| self.offset..self.offset + size)
    }
}

/// The parsed head of a GGUF file: everything but the tensor data itself.
///
/// Parse with [`GgufFile::open`] (reads only the head of the file, never the tensor data) or
/// [`GgufFile::from_bytes`]; get a tensor's bytes out of a buffer holding the whole file with
/// [`GgufFile::tensor_data`], or read [`TensorInfo::data_range`] from the file yourself.
#[derive(Debug, Clone)]
pub struct GgufFile {
    source: String,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
    file_len: u64,
}

impl GgufFile {
    /// Parses the head of the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io = |source| GgufError::Io {
            file: name.clone(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Self::from_reader(BufReader::new(file), len, name.clone())
    }

    /// Parses a whole GGUF file held in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Self::from_reader(bytes, bytes.len() as u64, String::from("<bytes>"))
    }

    /// Parses from any reader positioned at the start of a GGUF file of `len` bytes; `source`
    /// names it in errors.
    pub fn from_reader(reader: impl Read, len: u64, source: impl Into<String>) -> Result<Self> {
        parse(Cursor::new(reader, len, source.into()))
    }

    /// Path of the file, or `<bytes>`.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The key/value metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// Alignment of tensor data in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Length of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// `general.architecture`, when present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata
            .get("general.architecture")
            .and_then(|v| v.as_str())
    }

    /// The bytes of `tensor` inside `file_bytes`, a buffer holding the whole file.
    pub fn tensor_data<'a>(&self, file_bytes: &'a [u8], tensor: &TensorInfo) -> Result<&'a [u8]> {
        let len = file_bytes.len() as u64;
        let out_of_bounds = |end| GgufError::TensorOutOfBounds {
            tensor: tensor.name.clone(),
            start: tensor.offset,
            end,
            len,
        };
        let range = tensor.data_range().ok_or_else(|| GgufError::Malformed {
            file: self.source.clone(),
            offset: tensor.offset,
            what: format!("data of tensor `{}`", tensor.name),
            detail: format!("size of ggml type {} is not known", tensor.ggml_type),
        })?;
        let start = usize::try_from(range.start).map_err(|_| out_of_bounds(range.end))?;
        let end = usize::try_from(range.end).map_err(|_| out_of_bounds(range.end))?;
        file_bytes
            .get(start..end)
            .ok_or_else(|| out_of_bounds(range.end))
    }
}

fn parse<R: Read>(mut cur: Cursor<R>) -> Result<GgufFile> {
    let magic: [u8; 4] = cur.array("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic {
            file: cur.file().to_owned(),
            found: magic,
        });
    }
    let version = cur.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion {
            file: cur.file().to_owned(),
            version,
        });
    }
    // Smallest encodings: a tensor info is name length + n_dims + type + offset; a key/value
    // is key length + type tag + a one-byte value.
    let tensor_count = cur.count("tensor count", 8 + 4 + 4 + 8)?;
    let kv_count = cur.count("metadata count", 8 + 4 + 1)?;

    let mut metadata = Metadata::new();
    for i in 0..kv_count {
        cur.context = format!("metadata entry #{i}");
        let at = cur.pos();
        let key = cur.string("key")?;
        cur.context = format!("metadata key `{key}`");
        let ty = cur.value_type("value type")?;
        let value = cur.value(ty)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(cur.malformed(at, "key", String::from("appears twice")));
        }
    }

    let alignment = match metadata.get_u64(ALIGNMENT_KEY) {
        Ok(None) => DEFAULT_ALIGNMENT,
        Ok(Some(a)) if a.is_power_of_two() => a,
        Ok(Some(a)) => {
            return Err(cur.malformed(
                cur.pos(),
                ALIGNMENT_KEY,
                format!("{a} is not a power of two"),
            ));
        }
        Err(e) => {
            return Err(cur.malformed(cur.pos(), ALIGNMENT_KEY, e.to_string()));
        }
    };

    let mut infos = Vec::with_capacity(tensor_count);
    for i in 0..tensor_count {
        cur.context = format!("tensor info #{i}");
        infos.push(read_tensor_info(&mut cur)?);
    }
    let data_offset = cur.pos().div_ceil(alignment).saturating_mul(alignment);

    let mut by_name = HashMap::with_capacity(infos.len());
    let mut tensors = Vec::with_capacity(infos.len());
    for (i, raw) in infos.into_iter().enumerate() {
        let bad = |detail: String| GgufError::Malformed {
            file: cur.file().to_owned(),
            offset: raw.at,
            what: format!("tensor info of `{}`", raw.name),
            detail,
        };
        if !raw.relative_offset.is_multiple_of(alignment) {
            return Err(bad(format!(
                "data offset {} is not a multiple of the alignment {alignment}",
                raw.relative_offset
            )));
        }
        let offset = data_offset
            .checked_add(raw.relative_offset)
            .ok_or_else(|| bad(format!("data offset {} overflows", raw.relative_offset)))?;
        let byte_size = match raw.ggml_type.block_layout() {
            None => None,
            Some(layout) => {
                let inner = raw.dims.first().copied().unwrap_or(1);
                if !inner.is_multiple_of(layout.block_elems) {
                    return Err(bad(format!(
                        "first dimension {inner} is not a multiple of the {} block size {}",
                        raw.ggml_type, layout.block_elems
                    )));
                }
                raw.ggml_type.byte_size(raw.n_elements)
            }
        };
        if let Some(size) = byte_size {
            let end = offset.checked_add(size);
            if end.is_none_or(|end| end > cur.len()) {
                return Err(bad(format!(
                    "{size} bytes of data at byte {offset} run past the end of the {}-byte file",
                    cur.len()
                )));
            }
        }
        if by_name.insert(raw.name.clone(), i).is_some() {
            return Err(bad(String::from("tensor name appears twice")));
        }
        tensors.push(TensorInfo {
            name: raw.name,
            dims: raw.dims,
            ggml_type: raw.ggml_type,
            relative_offset: raw.relative_offset,
            offset,
            n_elements: raw.n_elements,
            byte_size,
        });
    }

    Ok(GgufFile {
        source: cur.file().to_owned(),
        version,
        file_len: cur.len(),
        metadata,
        tensors,
        by_name,
        alignment,
        data_offset,
    })
}

struct RawTensorInfo {
    at: u64,
    name: String,
    dims: Vec<u64>,
    n_elements: u64,
    ggml_type: GgmlType,
    relative_offset: u64,
}

fn read_tensor_info<R: Read>(cur: &mut Cursor<R>) -> Result<RawTensorInfo> {
    let at = cur.pos();
    let name = cur.string("name")?;
    cur.context = format!("tensor info of `{name}`");
    let dims_at = cur.pos();
    let n_dims = cur.u32("dimension count")?;
    if n_dims > MAX_DIMS {
        return Err(cur.malformed(
            dims_at,
            "dimension count",
            format!("{n_dims} dimensions, ggml has at most {MAX_DIMS}"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    let mut n_elements: u64 = 1;
    for _ in 0..n_dims {
        let d_at = cur.pos();
        let d = cur.u64("dimension")?;
        n_elements = n_elements.checked_mul(d).ok_or_else(|| {
            cur.malformed(
                d_at,
                "dimension",
                String::from("element count overflows u64"),
            )
        })?;
        dims.push(d);
    }
    let ggml_type = GgmlType(cur.u32("ggml type")?);
    let relative_offset = cur.u64("data offset")?;
    Ok(RawTensorInfo {
        at,
        name,
        dims,
        n_elements,
        ggml_type,
        relative_offset,
    })
}
