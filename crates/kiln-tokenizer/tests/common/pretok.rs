//! A byte-level GGUF vocabulary named by its pre-tokenizer, and how a tokenizer splits text
//! before BPE.

use kiln_gguf::Metadata;
use kiln_tokenizer::Tokenizer;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

/// A two-token `gpt2` vocabulary whose `tokenizer.ggml.pre` is `pre`.
pub fn gpt2_metadata(pre: &str) -> Metadata {
    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", "gpt2");
    md.insert("tokenizer.ggml.pre", pre);
    md.insert("tokenizer.ggml.tokens", vec!["a", "b"]);
    md.insert("tokenizer.ggml.merges", Vec::<String>::new());
    md
}

/// The pieces `tok` cuts `text` into before BPE (after its normalizer, if any).
pub fn splits(tok: &Tokenizer, text: &str) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let mut s = PreTokenizedString::from(text);
    if let Some(n) = tok.inner().get_normalizer() {
        s = PreTokenizedString::from(tokenizers::NormalizedString::from(text));
        s.normalize(|n2| tokenizers::Normalizer::normalize(n, n2))
            .map_err(|e| e.to_string())?;
    }
    tok.inner()
        .get_pre_tokenizer()
        .ok_or("no pre-tokenizer")?
        .pre_tokenize(&mut s)
        .map_err(|e| e.to_string())?;
    Ok(s.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(t, _, _)| t.to_owned())
        .collect())
}
