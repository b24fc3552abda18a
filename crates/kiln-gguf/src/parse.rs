//! A bounds-checked little-endian reader and the GGUF grammar on top of it.
//!
//! Every count and length read from the input is checked against the bytes that are left
//! before anything is allocated, so a hostile header cannot ask for gigabytes.

use std::io::Read;

use crate::error::{GgufError, Result};
use crate::value::{MetadataArray, MetadataValue, ValueType};

/// Deepest nesting of arrays of arrays accepted; deeper input is malformed rather than a
/// stack overflow.
pub(crate) const MAX_ARRAY_DEPTH: u32 = 8;

pub(crate) struct Cursor<R> {
    inner: R,
    pos: u64,
    len: u64,
    file: String,
    /// What the bytes being read belong to ("value of key `x`"), for error messages.
    pub(crate) context: String,
}

impl<R: Read> Cursor<R> {
    pub(crate) fn new(inner: R, len: u64, file: String) -> Self {
        Self {
            inner,
            pos: 0,
            len,
            file,
            context: String::from("header"),
        }
    }

    pub(crate) fn pos(&self) -> u64 {
        self.pos
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    pub(crate) fn file(&self) -> &str {
        &self.file
    }

    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn what(&self, field: &str) -> String {
        format!("{field} of {}", self.context)
    }

    pub(crate) fn malformed(&self, offset: u64, field: &str, detail: String) -> GgufError {
        GgufError::Malformed {
            file: self.file.clone(),
            offset,
            what: self.what(field),
            detail,
        }
    }

    fn truncated(&self, field: &str, needed: u64) -> GgufError {
        GgufError::Truncated {
            file: self.file.clone(),
            offset: self.pos,
            what: self.what(field),
            needed,
            available: self.remaining(),
        }
    }

    fn fill(&mut self, buf: &mut [u8], field: &str) -> Result<()> {
        let n = buf.len() as u64;
        if n > self.remaining() {
            return Err(self.truncated(field, n));
        }
        match self.inner.read_exact(buf) {
            Ok(()) => {
                self.pos += n;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(self.truncated(field, n))
            }
            Err(source) => Err(GgufError::Io {
                file: self.file.clone(),
                source,
            }),
        }
    }

    pub(crate) fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.fill(&mut buf, field)?;
        Ok(buf)
    }

    /// Reads `n` bytes, allocating only once `n` is known to fit in what is left.
    pub(crate) fn bytes(&mut self, n: u64, field: &str) -> Result<Vec<u8>> {
        if n > self.remaining() {
            return Err(self.truncated(field, n));
        }
        let len = usize::try_from(n).map_err(|_| self.truncated(field, n))?;
        let mut buf = vec![0u8; len];
        self.fill(&mut buf, field)?;
        Ok(buf)
    }

    pub(crate) fn u32(&mut self, field: &str) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, field: &str) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A count of items each taking at least `min_item_len` bytes, checked against the input
    /// left so that a later `Vec::with_capacity(count)` is bounded by the input size.
    pub(crate) fn count(&mut self, field: &str, min_item_len: u64) -> Result<usize> {
        let at = self.pos;
        let count = self.u64(field)?;
        let needed = count.saturating_mul(min_item_len);
        if needed > self.remaining() {
            return Err(GgufError::Truncated {
                file: self.file.clone(),
                offset: at,
                what: self.what(field),
                needed,
                available: self.remaining(),
            });
        }
        usize::try_from(count)
            .map_err(|_| self.malformed(at, field, format!("{count} is too large")))
    }

    pub(crate) fn string(&mut self, field: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(field)?;
        let bytes = self.bytes(len, field)?;
        String::from_utf8(bytes).map_err(|e| {
            self.malformed(
                at,
                field,
                format!(
                    "not valid UTF-8 (at byte {} of the string)",
                    e.utf8_error().valid_up_to()
                ),
            )
        })
    }

    pub(crate) fn value_type(&mut self, field: &str) -> Result<ValueType> {
        let at = self.pos;
        let tag = self.u32(field)?;
        ValueType::from_tag(tag)
            .ok_or_else(|| self.malformed(at, field, format!("unknown value type {tag}")))
    }

    pub(crate) fn value(&mut self, ty: ValueType) -> Result<MetadataValue> {
        Ok(match ty {
            ValueType::U8 => MetadataValue::U8(u8::from_le_bytes(self.array("u8")?)),
            ValueType::I8 => MetadataValue::I8(i8::from_le_bytes(self.array("i8")?)),
            ValueType::U16 => MetadataValue::U16(u16::from_le_bytes(self.array("u16")?)),
            ValueType::I16 => MetadataValue::I16(i16::from_le_bytes(self.array("i16")?)),
            ValueType::U32 => MetadataValue::U32(u32::from_le_bytes(self.array("u32")?)),
            ValueType::I32 => MetadataValue::I32(i32::from_le_bytes(self.array("i32")?)),
            ValueType::F32 => MetadataValue::F32(f32::from_le_bytes(self.array("f32")?)),
            ValueType::U64 => MetadataValue::U64(u64::from_le_bytes(self.array("u64")?)),
            ValueType::I64 => MetadataValue::I64(i64::from_le_bytes(self.array("i64")?)),
            ValueType::F64 => MetadataValue::F64(f64::from_le_bytes(self.array("f64")?)),
            ValueType::Bool => MetadataValue::Bool(self.bool()?),
            ValueType::String => MetadataValue::String(self.string("string")?),
            ValueType::Array => MetadataValue::Array(self.metadata_array(1)?),
        })
    }

    fn bool(&mut self) -> Result<bool> {
        let at = self.pos;
        match self.array::<1>("bool")? {
            [0] => Ok(false),
            [1] => Ok(true),
            [b] => Err(self.malformed(at, "bool", format!("byte {b} is neither 0 nor 1"))),
        }
    }

    /// Reads `count` fixed-size little-endian numbers in one bounded read.
    fn numbers<T, const N: usize>(
        &mut self,
        count: usize,
        field: &str,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let raw = self.bytes((count as u64).saturating_mul(N as u64), field)?;
        Ok(raw
            .chunks_exact(N)
            .map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                decode(b)
            })
            .collect())
    }

    fn metadata_array(&mut self, depth: u32) -> Result<MetadataArray> {
        let at = self.pos;
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.malformed(
                at,
                "array",
                format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
            ));
        }
        let ty = self.value_type("array element type")?;
        let n = self.count("array length", ty.min_encoded_len())?;
        Ok(match ty {
            ValueType::U8 => MetadataArray::U8(self.bytes(n as u64, "u8 array")?),
            ValueType::I8 => MetadataArray::I8(self.numbers(n, "i8 array", i8::from_le_bytes)?),
            ValueType::U16 => {
                MetadataArray::U16(self.numbers(n, "u16 array", u16::from_le_bytes)?)
            }
            ValueType::I16 => {
                MetadataArray::I16(self.numbers(n, "i16 array", i16::from_le_bytes)?)
            }
            ValueType::U32 => {
                MetadataArray::U32(self.numbers(n, "u32 array", u32::from_le_bytes)?)
            }
            ValueType::I32 => {
                MetadataArray::I32(self.numbers(n, "i32 array", i32::from_le_bytes)?)
            }
            ValueType::F32 => {
                MetadataArray::F32(self.numbers(n, "f32 array", f32::from_le_bytes)?)
            }
            ValueType::U64 => {
                MetadataArray::U64(self.numbers(n, "u64 array", u64::from_le_bytes)?)
            }
            ValueType::I64 => {
                MetadataArray::I64(self.numbers(n, "i64 array", i64::from_le_bytes)?)
            }
            ValueType::F64 => {
                MetadataArray::F64(self.numbers(n, "f64 array", f64::from_le_bytes)?)
            }
            ValueType::Bool => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.bool()?);
                }
                MetadataArray::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string("string array element")?);
                }
                MetadataArray::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.metadata_array(depth + 1)?);
                }
                MetadataArray::Array(v)
            }
        })
    }
}
