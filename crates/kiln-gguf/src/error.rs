//! The one error type of this crate.

/// Everything that can go wrong reading or writing a GGUF container.
///
/// `file` is the path of the file, or `<bytes>` for an in-memory buffer; offsets are absolute
/// byte positions in it, so a message points at the exact place that is wrong.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or read.
    #[error("{file}: cannot read: {source}")]
    Io {
        /// Path of the file.
        file: String,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("{file}: not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// Path of the file.
        file: String,
        /// The bytes found instead.
        found: [u8; 4],
    },
    /// A version this crate does not read (it reads 2 and 3, little-endian).
    #[error(
        "{file}: unsupported GGUF version {version} (kiln reads versions 2 and 3, little-endian)"
    )]
    UnsupportedVersion {
        /// Path of the file.
        file: String,
        /// The version field as read little-endian.
        version: u32,
    },
    /// The input ends before something it announces.
    #[error(
        "{file}: truncated at byte {offset} reading {what}: needs {needed} bytes, {available} left"
    )]
    Truncated {
        /// Path of the file.
        file: String,
        /// Where the read started.
        offset: u64,
        /// What was being read, with the key or tensor it belongs to.
        what: String,
        /// Bytes the read needs (a lower bound for counts).
        needed: u64,
        /// Bytes left in the input.
        available: u64,
    },
    /// A field holds a value the format forbids.
    #[error("{file}: byte {offset}: {what}: {detail}")]
    Malformed {
        /// Path of the file.
        file: String,
        /// Where the offending field starts.
        offset: u64,
        /// The field, with the key or tensor it belongs to.
        what: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A metadata key that a caller requires is absent.
    #[error("metadata key `{key}` is missing")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value has another type than the caller asked for.
    #[error("metadata key `{key}` holds {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type asked for.
        expected: &'static str,
        /// The type (and, for numbers out of range, the value) found.
        found: String,
    },
    /// A tensor's bytes were asked for but lie outside the buffer given.
    #[error("tensor `{tensor}`: data {start}..{end} lies outside the {len}-byte buffer")]
    TensorOutOfBounds {
        /// The tensor's name.
        tensor: String,
        /// First byte of its data.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// Length of the buffer.
        len: u64,
    },
    /// The writer was given something it cannot encode.
    #[error("cannot write GGUF: {detail}")]
    Write {
        /// What is wrong.
        detail: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
