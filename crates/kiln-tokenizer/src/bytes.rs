//! A byte-level tokenizer with one token per byte and no merges: ids 0..256 are the byte
//! values. It fits tiny test models (vocabulary 256) and anything that wants raw bytes.

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use crate::error::{Result, TokenizerError};
use crate::pieces::byte_level_decoding;
use crate::tokenizer::{SpecialTokens, Tokenizer};

pub(crate) fn byte_level(specials: SpecialTokens) -> Result<Tokenizer> {
    let build_err = |source: tokenizers::Error| TokenizerError::Build {
        source_name: "byte-level vocabulary".into(),
        source,
    };
    let vocab: tokenizers::models::bpe::Vocab = byte_level_decoding()
        .into_iter()
        .map(|(c, b)| (c.to_string(), u32::from(b)))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(build_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, false)))
        .with_decoder(Some(ByteLevel::default()));
    Tokenizer::new(tok, specials, None)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::DecodeOptions;

    #[test]
    fn ids_are_bytes_and_text_round_trips() {
        let tok = byte_level(SpecialTokens {
            eos: Some(2),
            ..SpecialTokens::default()
        })
        .unwrap();
        assert_eq!(tok.vocab_size(), 256);
        let text = "héllo, wörld ✓";
        let ids = tok.encode(text).unwrap();
        let want: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(ids, want);
        assert_eq!(tok.decode(&ids).unwrap(), text);
        // Streaming never splits a character.
        let mut detok = tok.detokenizer(DecodeOptions::default());
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&detok.push(id).unwrap());
        }
        out.push_str(&detok.finish().unwrap());
        assert_eq!(out, text);
        assert_eq!(tok.special_tokens().stop_ids, vec![2]);
    }
}
