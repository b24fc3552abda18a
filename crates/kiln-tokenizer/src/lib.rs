#![doc = include_str!("../README.md")]

mod bytes;
mod chat;
mod content;
mod detok;
mod error;
mod gguf;
mod hf;
mod pieces;
mod pretok;
mod stop;
mod tokenizer;
mod tools;

use std::path::Path;

pub use chat::{CHATML_TEMPLATE, ChatMessage, ChatOptions, ChatTemplate};
pub use content::RenderedChat;
pub use detok::IncrementalDetokenizer;
pub use error::{Result, TokenizerError};
pub use stop::{StopHit, StopMatcher, StopOutput};
pub use tokenizer::{DecodeOptions, EncodeOptions, Encoding, SpecialTokens, TokenBytes, Tokenizer};
pub use tools::{
    ParsedOutput, ToolCall, ToolChoice, ToolChoiceError, ToolError, ToolFormat, ToolSpec, push_tool,
};

impl Tokenizer {
    /// Loads a Hugging Face model folder.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        hf::from_dir(dir.as_ref())
    }

    /// Builds the tokenizer described by GGUF metadata.
    pub fn from_gguf_metadata(metadata: &kiln_gguf::Metadata) -> Result<Self> {
        gguf::from_metadata(metadata)
    }

    /// One token per byte (ids `0..256` are the byte values), no merges, GPT-2 byte-level
    /// decoding: for tiny models with a 256-token vocabulary and for tests. `specials` names
    /// the ids that act as BOS/EOS/stop.
    pub fn byte_level(specials: SpecialTokens) -> Result<Self> {
        bytes::byte_level(specials)
    }

    /// Reads a GGUF file's head and builds its tokenizer.
    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = kiln_gguf::GgufFile::open(path)?;
        gguf::from_metadata(file.metadata()).map_err(|e| TokenizerError::InFile {
            path: path.to_owned(),
            source: Box::new(e),
        })
    }
}
