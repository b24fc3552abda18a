//! Byte-level pre-tokenizers for the names GGUF files give in `tokenizer.ggml.pre`.
//!
//! Each is built the way the model's own `tokenizer.json` builds it, so that a GGUF tokenizer
//! splits text exactly as the Hugging Face one does.

use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Result, TokenizerError};

/// Llama 3's split (also used by its derivatives).
pub(crate) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: like Llama 3's, but every digit on its own.
pub(crate) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const SUPPORTED: &str = "`default`/`gpt2`, `smollm`/`starcoder`, `llama-bpe`/`llama3`/`llama-v3`/`smaug-bpe`/`falcon3`/`dbrx`, `qwen2`/`deepseek-r1-qwen`";

/// The normalizer (if any) and pre-tokenizer for `pre`; `None` means GPT-2's default.
pub(crate) fn for_name(
    pre: Option<&str>,
) -> Result<(Option<NormalizerWrapper>, PreTokenizerWrapper)> {
    // GPT-2's own regex, inside ByteLevel.
    let gpt2 = || ByteLevel::new(false, true, true);
    let split_then_bytes = |regex: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(regex.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|source| TokenizerError::Build {
            source_name: String::from("GGUF metadata: pre-tokenizer regex"),
            source,
        })?;
        Ok(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])
        .into())
    };
    Ok(match pre {
        None | Some("default" | "gpt2" | "gpt-2") => (None, gpt2().into()),
        // llama.cpp splits `\p{N}` first; the model's tokenizer.json says Digits(individual).
        Some("smollm" | "starcoder") => (
            None,
            Sequence::new(vec![Digits::new(true).into(), gpt2().into()]).into(),
        ),
        Some("llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" | "falcon3" | "dbrx") => {
            (None, split_then_bytes(LLAMA3_SPLIT)?)
        }
        // Qwen2's tokenizer.json normalizes to NFC before splitting.
        Some("qwen2" | "deepseek-r1-qwen") => (Some(NFC.into()), split_then_bytes(QWEN2_SPLIT)?),
        Some(other) => {
            return Err(TokenizerError::UnknownPreTokenizer {
                pre: other.to_owned(),
                supported: SUPPORTED.to_owned(),
            });
        }
    })
}
