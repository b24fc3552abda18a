//! Typed metadata values and the metadata table.

use std::collections::HashMap;
use std::fmt;

use crate::error::{GgufError, Result};

/// The type tag of a metadata value, as numbered by the GGUF format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// 0: `u8`.
    U8,
    /// 1: `i8`.
    I8,
    /// 2: `u16`.
    U16,
    /// 3: `i16`.
    I16,
    /// 4: `u32`.
    U32,
    /// 5: `i32`.
    I32,
    /// 6: `f32`.
    F32,
    /// 7: `bool` (one byte, 0 or 1).
    Bool,
    /// 8: UTF-8 string with a `u64` length.
    String,
    /// 9: array: element type, `u64` count, elements.
    Array,
    /// 10: `u64`.
    U64,
    /// 11: `i64`.
    I64,
    /// 12: `f64`.
    F64,
}

impl ValueType {
    /// The type for a tag, or `None` for an unknown tag.
    pub fn from_tag(tag: u32) -> Option<Self> {
        Some(match tag {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The tag written in files.
    pub fn tag(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    /// The fewest bytes one value of this type takes in a file; used to bound counts by the
    /// input that is left before allocating anything.
    pub(crate) fn min_encoded_len(self) -> u64 {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            Self::Array => 12,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `f32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// A typed array (possibly of arrays).
    Array(MetadataArray),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f64`.
    F64(f64),
}

/// A typed array, stored compactly: one `Vec` of the element type, so a 50,000-entry score
/// table is a `Vec<f32>`, not 50,000 enum values.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataArray {
    /// `u8` elements.
    U8(Vec<u8>),
    /// `i8` elements.
    I8(Vec<i8>),
    /// `u16` elements.
    U16(Vec<u16>),
    /// `i16` elements.
    I16(Vec<i16>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// String elements.
    String(Vec<String>),
    /// Nested arrays; each may have its own element type.
    Array(Vec<MetadataArray>),
    /// `u64` elements.
    U64(Vec<u64>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `f64` elements.
    F64(Vec<f64>),
}

impl MetadataValue {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::F32(_) => ValueType::F32,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(_) => ValueType::Array,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value, widened; `None` for other types.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, if this is one.
    pub fn as_array(&self) -> Option<&MetadataArray> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description for error messages: the type, and the element type of arrays.
    pub fn describe(&self) -> String {
        match self {
            Self::Array(a) => format!("array<{}> of {}", a.element_type(), a.len()),
            other => other.value_type().to_string(),
        }
    }
}

impl MetadataArray {
    /// The element type.
    pub fn element_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::F32(_) => ValueType::F32,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(_) => ValueType::Array,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements, if they are strings.
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements, if they are `f32`.
    pub fn as_f32s(&self) -> Option<&[f32]> {
        match self {
            Self::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The elements widened to `i64`, if they are integers of any width that fits.
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        fn widen<T: Copy + TryInto<i64>>(v: &[T]) -> Option<Vec<i64>> {
            v.iter().map(|x| (*x).try_into().ok()).collect()
        }
        match self {
            Self::U8(v) => widen(v),
            Self::I8(v) => widen(v),
            Self::U16(v) => widen(v),
            Self::I16(v) => widen(v),
            Self::U32(v) => widen(v),
            Self::I32(v) => widen(v),
            Self::U64(v) => widen(v),
            Self::I64(v) => widen(v),
            _ => None,
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for MetadataValue {
            fn from(v: $t) -> Self {
                Self::$variant(v)
            }
        }
        impl From<Vec<$t>> for MetadataArray {
            fn from(v: Vec<$t>) -> Self {
                Self::$variant(v)
            }
        }
        impl From<Vec<$t>> for MetadataValue {
            fn from(v: Vec<$t>) -> Self {
                Self::Array(MetadataArray::$variant(v))
            }
        }
    )*};
}

value_from!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64,
);

impl From<&str> for MetadataValue {
    fn from(v: &str) -> Self {
        Self::String(v.to_owned())
    }
}

impl From<Vec<&str>> for MetadataValue {
    fn from(v: Vec<&str>) -> Self {
        Self::Array(MetadataArray::String(
            v.into_iter().map(str::to_owned).collect(),
        ))
    }
}

impl From<MetadataArray> for MetadataValue {
    fn from(v: MetadataArray) -> Self {
        Self::Array(v)
    }
}

/// The key/value metadata of a GGUF file, in file order, with lookup by key.
///
/// The typed getters return `Ok(None)` for an absent key and [`GgufError::WrongType`] for a
/// value of another type; integer getters accept any integer type whose value fits, because
/// writers disagree on widths (`u32` vs `i32` vs `u64`) for the same key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, MetadataValue)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts or replaces a value; returns the previous one.
    pub fn insert(
        &mut self,
        key: impl Into<String>,
        value: impl Into<MetadataValue>,
    ) -> Option<MetadataValue> {
        let key = key.into();
        let value = value.into();
        if let Some(&i) = self.index.get(&key) {
            return self
                .entries
                .get_mut(i)
                .map(|slot| std::mem::replace(&mut slot.1, value));
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        None
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetadataValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value under `key`.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.index
            .get(key)
            .and_then(|&i| self.entries.get(i))
            .map(|(_, v)| v)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a MetadataValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => match convert(value) {
                Some(v) => Ok(Some(v)),
                None => Err(GgufError::WrongType {
                    key: key.to_owned(),
                    expected,
                    found: match value.as_i128() {
                        Some(n) => format!("{} {n}", value.describe()),
                        None => value.describe(),
                    },
                }),
            },
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", MetadataValue::as_str)
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", |v| match v {
            MetadataValue::Bool(b) => Some(*b),
            _ => None,
        })
    }

    /// An integer value that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "an integer in u32 range", |v| {
            v.as_i128().and_then(|n| u32::try_from(n).ok())
        })
    }

    /// An integer value that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "an integer in u64 range", |v| {
            v.as_i128().and_then(|n| u64::try_from(n).ok())
        })
    }

    /// An integer value that fits in `i64`.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        self.typed(key, "an integer in i64 range", |v| {
            v.as_i128().and_then(|n| i64::try_from(n).ok())
        })
    }

    /// A float value (`f32`, or `f64` narrowed).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "a float", |v| match *v {
            MetadataValue::F32(x) => Some(x),
            #[allow(clippy::cast_possible_truncation)]
            MetadataValue::F64(x) => Some(x as f32),
            _ => None,
        })
    }

    /// An array value of any element type.
    pub fn get_array(&self, key: &str) -> Result<Option<&MetadataArray>> {
        self.typed(key, "an array", MetadataValue::as_array)
    }

    /// An array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Option<&[String]>> {
        self.typed(key, "an array of strings", |v| {
            v.as_array().and_then(MetadataArray::as_strings)
        })
    }

    /// An array of `f32`.
    pub fn get_f32s(&self, key: &str) -> Result<Option<&[f32]>> {
        self.typed(key, "an array of f32", |v| {
            v.as_array().and_then(MetadataArray::as_f32s)
        })
    }

    /// An array of integers of any width, widened to `i64`.
    pub fn get_i64s(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.typed(key, "an array of integers", |v| {
            v.as_array().and_then(MetadataArray::to_i64s)
        })
    }

    /// Like `get`, but an absent key is an error.
    pub fn require(&self, key: &str) -> Result<&MetadataValue> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_getters_accept_any_width_that_fits() -> Result<()> {
        let mut m = Metadata::new();
        m.insert("a", 7i32);
        m.insert("b", 7u64);
        m.insert("c", -1i32);
        m.insert("d", "text");
        assert_eq!(m.get_u32("a")?, Some(7));
        assert_eq!(m.get_u32("b")?, Some(7));
        assert_eq!(m.get_i64("c")?, Some(-1));
        assert_eq!(m.get_u32("missing")?, None);
        let err = m.get_u32("c").err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("metadata key `c` holds i32 -1, expected an integer in u32 range")
        );
        let err = m.get_bool("d").err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("metadata key `d` holds string, expected a bool")
        );
        Ok(())
    }

    #[test]
    fn insert_replaces_and_keeps_order() {
        let mut m = Metadata::new();
        assert_eq!(m.insert("x", 1u8), None);
        m.insert("y", 2u8);
        assert_eq!(m.insert("x", 3u8), Some(MetadataValue::U8(1)));
        let keys: Vec<_> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["x", "y"]);
        assert_eq!(m.get("x"), Some(&MetadataValue::U8(3)));
        assert!(matches!(m.require("z"), Err(GgufError::MissingKey { .. })));
    }

    #[test]
    fn array_accessors() -> Result<()> {
        let mut m = Metadata::new();
        m.insert("s", vec!["a", "b"]);
        m.insert("f", vec![1.5f32, 2.5]);
        m.insert("i", vec![1u8, 2, 3]);
        assert_eq!(
            m.get_strings("s")?,
            Some(&["a".to_owned(), "b".to_owned()][..])
        );
        assert_eq!(m.get_f32s("f")?, Some(&[1.5f32, 2.5][..]));
        assert_eq!(m.get_i64s("i")?, Some(vec![1, 2, 3]));
        assert!(m.get_f32s("s").is_err());
        assert_eq!(
            m.get("s").map(MetadataValue::describe).as_deref(),
            Some("array<string> of 2")
        );
        Ok(())
    }
}
