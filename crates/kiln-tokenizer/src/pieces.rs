//! Per-token byte contributions, so the incremental detokenizer can reproduce the tokenizer's
//! own decoder exactly without re-decoding the whole sequence at every step.
//!
//! Two decoder shapes are modelled: GPT-2 byte-level (`ByteLevel`), and SentencePiece as
//! Hugging Face writes it (`Replace("▁", " ")`, `ByteFallback`, `Fuse`, optional
//! `Strip(" ", 1, 0)`). Anything else falls back to decoding through `tokenizers` itself.

use std::collections::HashMap;

/// Which decoder the tokenizer has, as far as incremental decoding cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// Token chars map to bytes; the text is the lossy UTF-8 decoding of all bytes.
    ByteLevel,
    /// `▁` is a space, `<0xNN>` tokens are bytes whose runs must be valid UTF-8 as a whole
    /// (else each byte becomes U+FFFD), and maybe one leading space of the output is dropped.
    SentencePiece { strip_leading_space: bool },
    /// Unknown decoder: decode through `tokenizers`.
    Generic,
}

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    start: u32,
    len: u32,
    present: bool,
    special: bool,
    /// SentencePiece byte-fallback token `<0xNN>`.
    byte: Option<u8>,
}

/// One token's contribution to the decoded output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// Bytes (byte-level) or UTF-8 text (SentencePiece).
    Bytes(&'a [u8]),
    /// A SentencePiece byte-fallback byte.
    Byte(u8),
}

#[derive(Debug)]
pub(crate) struct PieceTable {
    scheme: Scheme,
    entries: Vec<Entry>,
    data: Vec<u8>,
}

impl PieceTable {
    pub(crate) fn build(tokenizer: &tokenizers::Tokenizer) -> Self {
        let scheme = detect_scheme(tokenizer);
        let added = tokenizer.get_added_tokens_decoder();
        let max_added = added.keys().max().map_or(0, |&m| m as usize + 1);
        let len = tokenizer.get_vocab_size(false).max(max_added);
        let byte_of_char = byte_level_decoding();
        let mut entries = vec![Entry::default(); len];
        let mut data = Vec::new();
        for (id, entry) in (0u32..).zip(entries.iter_mut()) {
            let Some(token) = tokenizer.id_to_token(id) else {
                continue;
            };
            entry.present = true;
            entry.special = added.get(&id).is_some_and(|t| t.special);
            entry.start = u32::try_from(data.len()).unwrap_or(u32::MAX);
            match scheme {
                Scheme::ByteLevel => {
                    let mapped: Option<Vec<u8>> = token
                        .chars()
                        .map(|c| byte_of_char.get(&c).copied())
                        .collect();
                    data.extend(mapped.unwrap_or_else(|| token.into_bytes()));
                }
                Scheme::SentencePiece { .. } => {
                    entry.byte = byte_fallback(&token);
                    if entry.byte.is_none() {
                        data.extend(token.replace('\u{2581}', " ").into_bytes());
                    }
                }
                Scheme::Generic => {}
            }
            entry.len = u32::try_from(data.len())
                .unwrap_or(u32::MAX)
                .saturating_sub(entry.start);
        }
        Self {
            scheme,
            entries,
            data,
        }
    }

    pub(crate) fn scheme(&self) -> Scheme {
        self.scheme
    }

    pub(crate) fn len(&self) -> u32 {
        u32::try_from(self.entries.len()).unwrap_or(u32::MAX)
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.entry(id).is_some_and(|e| e.present)
    }

    pub(crate) fn is_special(&self, id: u32) -> bool {
        self.entry(id).is_some_and(|e| e.special)
    }

    /// The most bytes one token stands for (at least 1).
    pub(crate) fn longest(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.present)
            .map(|e| if e.byte.is_some() { 1 } else { e.len as usize })
            .max()
            .unwrap_or(0)
            .max(1)
    }

    fn entry(&self, id: u32) -> Option<&Entry> {
        self.entries.get(usize::try_from(id).ok()?)
    }

    /// What `id` adds to the output; `None` for ids outside the vocabulary.
    pub(crate) fn piece(&self, id: u32) -> Option<Piece<'_>> {
        let e = self.entry(id).filter(|e| e.present)?;
        if let Some(b) = e.byte {
            return Some(Piece::Byte(b));
        }
        let start = e.start as usize;
        self.data
            .get(start..start + e.len as usize)
            .map(Piece::Bytes)
    }
}

/// The byte a SentencePiece `<0xNN>` token stands for, parsed exactly as `tokenizers`'
/// `ByteFallback` decoder does.
fn byte_fallback(token: &str) -> Option<u8> {
    if token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') {
        token.get(3..5).and_then(|h| u8::from_str_radix(h, 16).ok())
    } else {
        None
    }
}

/// GPT-2's byte-to-char table, inverted: printable Latin-1 bytes stand for themselves, the
/// other 68 bytes are spelled with the chars from U+0100 on, in byte order.
pub(crate) fn byte_level_decoding() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = HashMap::with_capacity(256);
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
        map.insert(c, b);
    }
    map
}

fn detect_scheme(tokenizer: &tokenizers::Tokenizer) -> Scheme {
    let Some(decoder) = tokenizer.get_decoder() else {
        return Scheme::Generic;
    };
    let Ok(json) = serde_json::to_value(decoder) else {
        return Scheme::Generic;
    };
    let ty = |v: &serde_json::Value| v.get("type").and_then(|t| t.as_str()).map(str::to_owned);
    match ty(&json).as_deref() {
        Some("ByteLevel") => Scheme::ByteLevel,
        Some("Sequence") => {
            let Some(steps) = json.get("decoders").and_then(|d| d.as_array()) else {
                return Scheme::Generic;
            };
            let is_replace = |v: &serde_json::Value| {
                ty(v).as_deref() == Some("Replace")
                    && v.pointer("/pattern/String").and_then(|p| p.as_str()) == Some("\u{2581}")
                    && v.get("content").and_then(|c| c.as_str()) == Some(" ")
            };
            let is_strip = |v: &serde_json::Value| {
                ty(v).as_deref() == Some("Strip")
                    && v.get("content").and_then(|c| c.as_str()) == Some(" ")
                    && v.get("start").and_then(serde_json::Value::as_u64) == Some(1)
                    && v.get("stop").and_then(serde_json::Value::as_u64) == Some(0)
            };
            let head_ok = steps.len() >= 3
                && is_replace(&steps[0])
                && ty(&steps[1]).as_deref() == Some("ByteFallback")
                && ty(&steps[2]).as_deref() == Some("Fuse");
            match (head_ok, steps.get(3), steps.len()) {
                (true, None, 3) => Scheme::SentencePiece {
                    strip_leading_space: false,
                },
                (true, Some(strip), 4) if is_strip(strip) => Scheme::SentencePiece {
                    strip_leading_space: true,
                },
                _ => Scheme::Generic,
            }
        }
        _ => Scheme::Generic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_with_the_known_spellings() {
        let map = byte_level_decoding();
        assert_eq!(map.len(), 256);
        assert_eq!(map.get(&'Ġ'), Some(&b' '));
        assert_eq!(map.get(&'Ċ'), Some(&b'\n'));
        assert_eq!(map.get(&'ĉ'), Some(&b'\t'));
        assert_eq!(map.get(&'A'), Some(&b'A'));
        assert_eq!(map.get(&'Ã'), Some(&0xC3));
    }

    #[test]
    fn byte_fallback_tokens_parse_like_tokenizers() {
        assert_eq!(byte_fallback("<0x0A>"), Some(10));
        assert_eq!(byte_fallback("<0xff>"), Some(255));
        assert_eq!(
            byte_fallback("<0x+1>"),
            Some(1),
            "from_str_radix accepts a sign"
        );
        assert_eq!(byte_fallback("<0xGG>"), None);
        assert_eq!(byte_fallback("<0x0A"), None);
    }
}
