//! A small GGUF writer: builds valid files for tests, fixtures and tools.

use crate::error::{GgufError, Result};
use crate::file::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use crate::ggml::GgmlType;
use crate::value::{Metadata, MetadataArray, MetadataValue};

/// Builds a GGUF file in memory.
///
/// Metadata is written in insertion order; tensor data is padded to the alignment
/// (`general.alignment` when set, else 32). The version defaults to 3.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    version: u32,
    metadata: Metadata,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file.
    pub fn new() -> Self {
        Self {
            version: 3,
            metadata: Metadata::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the version field written (any value, so tests can write unsupported ones).
    pub fn with_version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Adds (or replaces) a metadata entry.
    pub fn metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<MetadataValue>,
    ) -> &mut Self {
        self.metadata.insert(key, value);
        self
    }

    /// Adds a tensor; `dims` in ggml order (fastest-moving first).
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
        self
    }

    /// The encoded file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let alignment = match self.metadata.get_u64(ALIGNMENT_KEY)? {
            Some(a) if a.is_power_of_two() => a,
            Some(a) => {
                return Err(GgufError::Write {
                    detail: format!("{ALIGNMENT_KEY} {a} is not a power of two"),
                });
            }
            None => DEFAULT_ALIGNMENT,
        };
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        put_u64(&mut out, self.tensors.len());
        put_u64(&mut out, self.metadata.len());
        for (key, value) in self.metadata.iter() {
            put_str(&mut out, key);
            out.extend_from_slice(&value.value_type().tag().to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset: u64 = 0;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let n_elements = t.dims.iter().product::<u64>();
            if let Some(size) = t.ggml_type.byte_size(n_elements)
                && size != t.data.len() as u64
            {
                return Err(GgufError::Write {
                    detail: format!(
                        "tensor `{}`: {} data bytes, a {} tensor of {:?} takes {size}",
                        t.name,
                        t.data.len(),
                        t.ggml_type,
                        t.dims
                    ),
                });
            }
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.0.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
        }
        let data_start = (out.len() as u64).next_multiple_of(alignment);
        for (t, rel) in self.tensors.iter().zip(offsets) {
            pad_to(&mut out, data_start + rel);
            out.extend_from_slice(&t.data);
        }
        Ok(out)
    }
}

fn pad_to(out: &mut Vec<u8>, len: u64) {
    while (out.len() as u64) < len {
        out.push(0);
    }
}

fn put_u64(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(n as u64).to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &MetadataValue) {
    match value {
        MetadataValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::Bool(v) => out.push(u8::from(*v)),
        MetadataValue::String(v) => put_str(out, v),
        MetadataValue::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, array: &MetadataArray) {
    fn each<T>(out: &mut Vec<u8>, v: &[T], mut put: impl FnMut(&mut Vec<u8>, &T)) {
        put_u64(out, v.len());
        for x in v {
            put(out, x);
        }
    }
    out.extend_from_slice(&array.element_type().tag().to_le_bytes());
    match array {
        MetadataArray::U8(v) => each(out, v, |o, x| o.push(*x)),
        MetadataArray::I8(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::U16(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::I16(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::U32(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::I32(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::F32(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::U64(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::I64(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::F64(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        MetadataArray::Bool(v) => each(out, v, |o, x| o.push(u8::from(*x))),
        MetadataArray::String(v) => each(out, v, |o, x| put_str(o, x)),
        MetadataArray::Array(v) => each(out, v, put_array),
    }
}
