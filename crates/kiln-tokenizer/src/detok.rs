//! Incremental detokenization: ids in one at a time, text deltas out.

use crate::error::Result;
use crate::pieces::{Piece, Scheme};
use crate::tokenizer::{DecodeOptions, Tokenizer};

/// Turns a stream of ids into text deltas.
///
/// Invariants: every delta is valid UTF-8 and never ends inside a character (bytes that may
/// still become one are held back); the deltas of [`push`](Self::push) followed by
/// [`finish`](Self::finish) concatenate to exactly `tokenizer.decode_with(ids, options)`, for
/// byte-level BPE and SentencePiece decoders (leading space and byte fallback included).
/// Other decoders are handled by re-decoding the sequence, which is exact for decoders whose
/// output only grows at the end.
#[derive(Debug)]
pub struct IncrementalDetokenizer {
    tokenizer: Tokenizer,
    options: DecodeOptions,
    /// Byte-level: bytes not yet emitted (an incomplete UTF-8 sequence).
    /// SentencePiece: the current run of byte-fallback bytes.
    pending: Vec<u8>,
    /// SentencePiece with `Strip`: nothing non-empty has been emitted yet.
    at_start: bool,
    /// Generic fallback: all ids and the text emitted so far.
    ids: Vec<u32>,
    emitted: String,
}

impl IncrementalDetokenizer {
    pub(crate) fn new(tokenizer: Tokenizer, options: DecodeOptions) -> Self {
        Self {
            tokenizer,
            options,
            pending: Vec::new(),
            at_start: true,
            ids: Vec::new(),
            emitted: String::new(),
        }
    }

    /// Feeds one id; returns the text it makes final (often empty). An id outside the
    /// vocabulary is an error and leaves the state unchanged.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer.check_ids(&[id])?;
        if self.options.skip_special_tokens && self.tokenizer.is_special(id) {
            // Skipped before decoding, as `tokenizers` does: bytes on both sides join up.
            return Ok(String::new());
        }
        let scheme = self.tokenizer.pieces().scheme();
        match (scheme, self.tokenizer.pieces().piece(id)) {
            (Scheme::ByteLevel, Some(Piece::Bytes(b))) => {
                self.pending.extend_from_slice(b);
                Ok(take_complete_utf8(&mut self.pending))
            }
            (Scheme::SentencePiece { .. }, Some(Piece::Byte(b))) => {
                self.pending.push(b);
                Ok(String::new())
            }
            (
                Scheme::SentencePiece {
                    strip_leading_space,
                },
                Some(Piece::Bytes(b)),
            ) => {
                let mut out = flush_byte_run(&mut self.pending);
                out.push_str(&String::from_utf8_lossy(b));
                Ok(self.leading(out, strip_leading_space))
            }
            _ => self.push_generic(id),
        }
    }

    /// Ends the stream: returns whatever was held back, decoded as the full decode would
    /// (an unfinished UTF-8 sequence becomes U+FFFD). The detokenizer can be reused after.
    pub fn finish(&mut self) -> Result<String> {
        let out = match self.tokenizer.pieces().scheme() {
            Scheme::ByteLevel => {
                let out = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                out
            }
            Scheme::SentencePiece {
                strip_leading_space,
            } => {
                let out = flush_byte_run(&mut self.pending);
                self.leading(out, strip_leading_space)
            }
            Scheme::Generic => {
                let full = self.tokenizer.decode_with(&self.ids, self.options)?;
                let out = full
                    .strip_prefix(self.emitted.as_str())
                    .unwrap_or_default()
                    .to_owned();
                self.ids.clear();
                self.emitted.clear();
                out
            }
        };
        self.at_start = true;
        Ok(out)
    }

    fn leading(&mut self, mut out: String, strip: bool) -> String {
        if strip && self.at_start && !out.is_empty() {
            self.at_start = false;
            if out.starts_with(' ') {
                out.remove(0);
            }
        }
        out
    }

    fn push_generic(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let full = self.tokenizer.decode_with(&self.ids, self.options)?;
        if full.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        match full.strip_prefix(self.emitted.as_str()) {
            Some(delta) => {
                let delta = delta.to_owned();
                self.emitted = full;
                Ok(delta)
            }
            None => Ok(String::new()),
        }
    }
}

/// Removes and returns the longest prefix of `pending` that is final: valid UTF-8, with each
/// invalid sequence replaced by U+FFFD exactly as `String::from_utf8_lossy` would; keeps an
/// unfinished sequence at the end.
fn take_complete_utf8(pending: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut rest: &[u8] = pending;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, tail) = rest.split_at(e.valid_up_to());
                out.push_str(&String::from_utf8_lossy(valid));
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        rest = tail.get(n..).unwrap_or_default();
                    }
                    None => {
                        rest = tail;
                        break;
                    }
                }
            }
        }
    }
    let keep = rest.len();
    pending.drain(..pending.len() - keep);
    out
}

/// A finished run of byte-fallback bytes, as `tokenizers`' `ByteFallback` decodes it: the
/// whole run as UTF-8 if valid, else one U+FFFD per byte.
fn flush_byte_run(run: &mut Vec<u8>) -> String {
    if run.is_empty() {
        return String::new();
    }
    let out = match std::str::from_utf8(run) {
        Ok(s) => s.to_owned(),
        Err(_) => char::REPLACEMENT_CHARACTER.to_string().repeat(run.len()),
    };
    run.clear();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_unfinished_sequences_only() {
        let mut p = "a€".as_bytes()[..3].to_vec();
        assert_eq!(take_complete_utf8(&mut p), "a");
        assert_eq!(p, [0xE2, 0x82]);
        p.push(0xAC);
        assert_eq!(take_complete_utf8(&mut p), "€");
        assert!(p.is_empty());
        let mut p = vec![0xE2, 0x82, b'x', 0xFF, 0xF0];
        assert_eq!(take_complete_utf8(&mut p), "\u{FFFD}x\u{FFFD}");
        assert_eq!(p, [0xF0]);
    }

    #[test]
    fn byte_runs_follow_byte_fallback() {
        assert_eq!(flush_byte_run(&mut vec![0xE2, 0x82, 0xAC]), "€");
        assert_eq!(flush_byte_run(&mut vec![b'a', 0xE2]), "\u{FFFD}\u{FFFD}");
        assert_eq!(flush_byte_run(&mut Vec::new()), "");
    }
}
