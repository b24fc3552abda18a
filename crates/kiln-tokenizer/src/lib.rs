//! Turns text into a model's token ids and back, exactly as the model's own tokenizer does, and
//! turns a stream of generated ids into UTF-8-safe text deltas.
//!
//! - [`Tokenizer::from_hf_dir`] loads a Hugging Face folder (`tokenizer.json`,
//!   `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`);
//!   [`Tokenizer::from_gguf_file`] / [`Tokenizer::from_gguf_metadata`] build the same tokenizer
//!   from a GGUF file's `tokenizer.ggml.*` metadata (`gpt2` byte-level BPE, `llama`
//!   SentencePiece BPE). Both produce a real `tokenizers::Tokenizer`.
//! - [`Tokenizer::apply_chat_template`] renders the model's Jinja chat template (ChatML when it
//!   has none).
//! - [`IncrementalDetokenizer`] turns ids into text deltas that never split a character and
//!   concatenate to the full decode; [`StopMatcher`] finds stop strings across deltas.
//!
//! This crate knows nothing of tensors, devices or requests.
//!
//! ```
//! use kiln_gguf::Metadata;
//! use kiln_tokenizer::{DecodeOptions, StopMatcher, Tokenizer};
//!
//! // A tiny byte-level BPE vocabulary, as a GGUF file would store it.
//! let mut md = Metadata::new();
//! md.insert("tokenizer.ggml.model", "gpt2");
//! md.insert("tokenizer.ggml.tokens", vec!["<|end|>", "h", "i", "Ġ", "hi", "Ġhi"]);
//! md.insert("tokenizer.ggml.token_type", vec![3i32, 1, 1, 1, 1, 1]);
//! md.insert("tokenizer.ggml.merges", vec!["h i", "Ġ hi"]);
//! md.insert("tokenizer.ggml.eos_token_id", 0u32);
//! let tok = Tokenizer::from_gguf_metadata(&md)?;
//!
//! let ids = tok.encode("hi hi<|end|>")?;
//! assert_eq!(ids, [4, 5, 0]);
//! assert_eq!(tok.special_tokens().stop_ids, [0]);
//!
//! let mut detok = tok.detokenizer(DecodeOptions { skip_special_tokens: true });
//! let mut stop = StopMatcher::new([" h"]);
//! let mut text = String::new();
//! for id in ids {
//!     let out = stop.push(&detok.push(id)?);
//!     text.push_str(&out.text);
//!     if out.hit.is_some() {
//!         break;
//!     }
//! }
//! assert_eq!(text, "hi");
//! # Ok::<(), kiln_tokenizer::TokenizerError>(())
//! ```

mod bytes;
mod chat;
mod detok;
mod error;
mod gguf;
mod hf;
mod pieces;
mod pretok;
mod stop;
mod tokenizer;

use std::path::Path;

pub use chat::{CHATML_TEMPLATE, ChatMessage, ChatOptions, ChatTemplate};
pub use detok::IncrementalDetokenizer;
pub use error::{Result, TokenizerError};
pub use stop::{StopHit, StopMatcher, StopOutput};
pub use tokenizer::{DecodeOptions, EncodeOptions, Encoding, SpecialTokens, Tokenizer};

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
