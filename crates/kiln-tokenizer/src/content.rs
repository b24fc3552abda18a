//! Chat content kept as plain text. A chat template writes control tokens (`<|im_start|>`,
//! `<start_of_turn>`) around each message; tokenizing the rendering as one text would also
//! turn the same spellings inside a user's message into control tokens, so a user could
//! forge a system turn. By default the content of every message that spells a special token
//! is cut out of the rendering and tokenized with special tokens read as plain text, as the
//! template renders them; the rest is tokenized as usual.
//!
//! The cut is found by rendering once more with each such content replaced by a marker (a
//! private-use character pair around a per-process nonce and the message index), and it is
//! used only when putting the contents back at the markers gives the real rendering byte for
//! byte; a template that rewrites such content (trims it, splits it) is refused instead
//! ([`TokenizerError::ContentRewritten`]).

use std::ops::Range;
use std::sync::OnceLock;

use serde::Serialize;
use serde_json::Value;

use crate::chat::{ChatOptions, ChatTemplate};
use crate::error::{Result, TokenizerError};
use crate::tokenizer::{EncodeOptions, Tokenizer};

const OPEN: char = '\u{F0000}';
const CLOSE: char = '\u{F0001}';

/// A conversation rendered for tokenizing: the template's text, and the byte ranges of it
/// that are message content to tokenize as plain text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    text: String,
    plain: Vec<Range<usize>>,
}

impl RenderedChat {
    /// The rendering, as the template wrote it.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Byte ranges of [`text`](Self::text) that are tokenized as plain text.
    pub fn plain_ranges(&self) -> &[Range<usize>] {
        &self.plain
    }
}

/// Per process: markers a client cannot predict (they could not forge a cut anyway: a cut
/// that does not reproduce the real rendering is refused).
fn nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    })
}

fn marker(i: usize) -> String {
    format!("{OPEN}{:016x}:{i}{CLOSE}", nonce())
}

impl Tokenizer {
    /// Renders `messages` (JSON objects with `role` and `content`, and whatever else the
    /// template reads) with `template`, or the model's own (ChatML when it has none but has
    /// ChatML's tokens). Unless `specials_in_content`, the content of a message that spells a
    /// special token is marked to be tokenized as plain text by
    /// [`encode_chat`](Self::encode_chat).
    pub fn render_chat_for_tokens<E: Serialize>(
        &self,
        template: Option<&ChatTemplate>,
        messages: &[Value],
        options: &ChatOptions,
        extra: &E,
        specials_in_content: bool,
    ) -> Result<RenderedChat> {
        let render = |m: &[Value]| match template {
            Some(t) => self.render_chat_with(t, m, options, extra),
            None => self.apply_chat_template_with(m, options, extra),
        };
        let text = render(messages)?;
        let spelled: Vec<(usize, &str, String)> = if specials_in_content {
            Vec::new()
        } else {
            messages
                .iter()
                .enumerate()
                .filter_map(|(i, m)| {
                    let c = m.get("content")?.as_str()?;
                    self.spelled_special(c).map(|t| (i, c, t))
                })
                .collect()
        };
        if spelled.is_empty() {
            return Ok(RenderedChat {
                text,
                plain: Vec::new(),
            });
        }
        let mut marked = messages.to_vec();
        for &(i, _, _) in &spelled {
            marked[i]["content"] = Value::String(marker(i));
        }
        let marked_text = render(&marked)?;
        // Put each content back at its markers, noting where it went.
        let content_of = |i: usize| spelled.iter().find(|s| s.0 == i).map(|s| s.1);
        let mut rebuilt = String::with_capacity(text.len());
        let mut plain = Vec::new();
        let mut rest = marked_text.as_str();
        let prefix = format!("{OPEN}{:016x}:", nonce());
        while let Some(at) = rest.find(&prefix) {
            rebuilt.push_str(&rest[..at]);
            let after = &rest[at + prefix.len()..];
            let index = after
                .find(CLOSE)
                .and_then(|end| Some((after[..end].parse::<usize>().ok()?, end)));
            let Some((i, end)) = index else {
                rebuilt.push_str(&prefix);
                rest = after;
                continue;
            };
            let Some(content) = content_of(i) else {
                rebuilt.push_str(&rest[at..at + prefix.len() + end + CLOSE.len_utf8()]);
                rest = &after[end + CLOSE.len_utf8()..];
                continue;
            };
            let start = rebuilt.len();
            rebuilt.push_str(content);
            plain.push(start..rebuilt.len());
            rest = &after[end + CLOSE.len_utf8()..];
        }
        rebuilt.push_str(rest);
        if rebuilt != text {
            let (message, token) = spelled
                .first()
                .map(|s| (s.0, s.2.clone()))
                .unwrap_or_default();
            return Err(TokenizerError::ContentRewritten { message, token });
        }
        Ok(RenderedChat { text, plain })
    }

    /// Token ids of a rendered chat, as transformers' `apply_chat_template(tokenize=True)`
    /// gives them (nothing added beyond what the template wrote), with the marked content
    /// tokenized as plain text.
    pub fn encode_chat(&self, chat: &RenderedChat) -> Result<Vec<u32>> {
        let opts = EncodeOptions {
            add_special_tokens: false,
            offsets: false,
        };
        let mut ids = Vec::new();
        let mut at = 0;
        for r in &chat.plain {
            if r.start > at {
                ids.extend(self.encode_with(&chat.text[at..r.start], opts)?.ids);
            }
            ids.extend(self.encode_plain(&chat.text[r.clone()])?);
            at = r.end;
        }
        if at < chat.text.len() || chat.text.is_empty() {
            ids.extend(self.encode_with(&chat.text[at..], opts)?.ids);
        }
        Ok(ids)
    }
}
