//! An output read as a reply, the same on every door: the reasoning split off first
//! (`--reasoning-parser`), then, with tools on, the calls read out of the content; and how
//! it ended, `tool_calls` when it ended by itself with calls. Streamed, the reasoning and the
//! content go out as they come, except that with tools on the content is held to the end
//! (a call cannot be told from text before it is whole). A Harmony output (GPT-OSS) says
//! which is which in each message's header ([`crate::harmony`]), so its content streams with
//! tools on too.

use kiln_engine::FinishReason;
use kiln_tokenizer::{ToolCall, ToolFormat};

use crate::harmony::{HarmonyStream, Messages};
use crate::reasoning::{Reasoning, ReasoningStream, Split};

/// How to read a request's outputs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplyFormat {
    /// Tools on: the syntax calls are written in.
    pub tools: Option<ToolFormat>,
    /// The reasoning syntax, and whether the prompt left the think block open.
    pub reasoning: Option<Reasoning>,
    /// The output is Harmony (GPT-OSS's channels), which says both what is reasoning and
    /// what is a call: `reasoning` is then unused.
    pub harmony: bool,
}

/// How an output ended, as the doors report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token.
    Eos,
    /// The structured-output constraint admits no further token.
    ConstraintComplete,
    StopSequence(String),
    StopToken(u32),
    /// The call's token limit.
    Length,
    /// The model's context filled.
    ContextLength,
    /// It ended by itself with tool calls.
    ToolCalls,
}

impl Finish {
    fn of(f: &FinishReason, calls: bool) -> Self {
        match f {
            FinishReason::Length => Self::Length,
            FinishReason::ContextLength => Self::ContextLength,
            _ if calls => Self::ToolCalls,
            FinishReason::EosToken => Self::Eos,
            FinishReason::ConstraintComplete => Self::ConstraintComplete,
            FinishReason::StopSequence(s) => Self::StopSequence(s.clone()),
            FinishReason::StopToken(id) => Self::StopToken(*id),
        }
    }
}

/// A whole output read (or, from [`ReplyStream::finish`], what is left of a streamed one).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub reasoning: Option<String>,
    /// The text outside the reasoning and the calls (`None`: nothing, with a parser or calls).
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
    pub finish: Option<Finish>,
}

impl ReplyFormat {
    /// Reads a whole output.
    pub fn read(&self, text: &str, finish: Option<&FinishReason>) -> Reply {
        if self.harmony {
            let m = HarmonyStream::split(self.tools.is_some(), text, ended_by_itself(finish));
            return harmony_reply(m, finish);
        }
        let (reasoning, content) = match self.reasoning {
            Some(r) => {
                let Split { reasoning, content } = r.split(text);
                (reasoning, content)
            }
            None => (None, Some(text.to_owned())),
        };
        self.with_calls(reasoning, content, finish)
    }

    /// A reader for a streamed output.
    pub fn stream(&self) -> ReplyStream {
        ReplyStream {
            format: *self,
            reasoning: self.reasoning.map(Reasoning::stream),
            harmony: self
                .harmony
                .then(|| HarmonyStream::new(self.tools.is_some())),
            held: String::new(),
        }
    }

    fn with_calls(
        &self,
        reasoning: Option<String>,
        content: Option<String>,
        finish: Option<&FinishReason>,
    ) -> Reply {
        let (content, calls) = match (self.tools, content) {
            (Some(format), Some(text)) => {
                let parsed = format.parse(&text);
                if parsed.calls.is_empty() {
                    (Some(text), Vec::new())
                } else {
                    (parsed.content, parsed.calls)
                }
            }
            (_, content) => (content, Vec::new()),
        };
        Reply {
            finish: finish.map(|f| Finish::of(f, !calls.is_empty())),
            reasoning,
            content,
            calls,
        }
    }
}

/// Whether an output ended by itself, not for want of tokens or room.
fn ended_by_itself(finish: Option<&FinishReason>) -> bool {
    !matches!(
        finish,
        Some(FinishReason::Length | FinishReason::ContextLength)
    )
}

/// A Harmony output's parts as a reply.
fn harmony_reply(m: Messages, finish: Option<&FinishReason>) -> Reply {
    let some = |s: String| (!s.is_empty()).then_some(s);
    Reply {
        finish: finish.map(|f| Finish::of(f, !m.calls.is_empty())),
        reasoning: some(m.reasoning),
        content: some(m.content),
        calls: m.calls,
    }
}

/// What a delta of a streamed output shows now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Piece {
    pub reasoning: String,
    pub content: String,
}

/// Reads a streamed output delta by delta.
#[derive(Debug, Clone)]
pub struct ReplyStream {
    format: ReplyFormat,
    reasoning: Option<ReasoningStream>,
    harmony: Option<HarmonyStream>,
    /// Tools on: the content so far, read for calls when the output ends.
    held: String,
}

impl ReplyStream {
    /// The parts of a delta that can be shown now.
    pub fn push(&mut self, delta: &str) -> Piece {
        if let Some(h) = &mut self.harmony {
            let m = h.push(delta);
            return Piece {
                reasoning: m.reasoning,
                content: m.content,
            };
        }
        let (reasoning, content) = match &mut self.reasoning {
            Some(s) => {
                let Split { reasoning, content } = s.push(delta);
                (reasoning.unwrap_or_default(), content.unwrap_or_default())
            }
            None => (String::new(), delta.to_owned()),
        };
        if self.format.tools.is_some() {
            self.held.push_str(&content);
            return Piece {
                reasoning,
                content: String::new(),
            };
        }
        Piece { reasoning, content }
    }

    /// The output ended: what was held back, with the calls read out of the content.
    pub fn finish(&mut self, finish: Option<&FinishReason>) -> Reply {
        if let Some(h) = &mut self.harmony {
            return harmony_reply(h.finish(ended_by_itself(finish)), finish);
        }
        let Split { reasoning, content } = match &mut self.reasoning {
            Some(s) => s.finish(),
            None => Split::default(),
        };
        let content = if self.format.tools.is_some() {
            let mut all = std::mem::take(&mut self.held);
            all.push_str(content.as_deref().unwrap_or_default());
            (!all.is_empty()).then_some(all)
        } else {
            content
        };
        self.format.with_calls(reasoning, content, finish)
    }

    /// Whether the reasoning is over (or there is none): content follows.
    pub fn in_content(&self) -> bool {
        if let Some(h) = &self.harmony {
            return h.in_content();
        }
        self.reasoning
            .as_ref()
            .is_none_or(ReasoningStream::in_content)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::ReasoningParser;

    #[test]
    fn calls_after_the_reasoning_end_with_tool_calls() {
        let f = ReplyFormat {
            tools: Some(ToolFormat::Hermes),
            reasoning: Some(Reasoning {
                parser: ReasoningParser::Qwen3,
                opened: true,
            }),
            harmony: false,
        };
        let text = "let me look\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let whole = f.read(text, Some(&FinishReason::EosToken));
        assert_eq!(whole.reasoning.as_deref(), Some("let me look\n"));
        assert_eq!(whole.calls.len(), 1);
        assert_eq!(whole.calls[0].name, "f");
        assert_eq!(whole.finish, Some(Finish::ToolCalls));
        // Streamed byte by byte: the reasoning as it comes, the calls at the end, the same.
        let mut s = f.stream();
        let mut reasoning = String::new();
        for (i, c) in text.char_indices() {
            let p = s.push(&text[i..i + c.len_utf8()]);
            assert!(p.content.is_empty(), "content held while tools are on");
            reasoning.push_str(&p.reasoning);
        }
        let end = s.finish(Some(&FinishReason::EosToken));
        reasoning.push_str(end.reasoning.as_deref().unwrap_or_default());
        assert_eq!(Some(reasoning), whole.reasoning);
        assert_eq!(
            (end.calls, end.content, end.finish),
            (whole.calls, whole.content, whole.finish)
        );
    }

    #[test]
    fn plain_text_is_content() {
        let f = ReplyFormat::default();
        let r = f.read("hi", Some(&FinishReason::StopSequence("x".into())));
        assert_eq!(r.content.as_deref(), Some("hi"));
        assert_eq!(r.finish, Some(Finish::StopSequence("x".into())));
        let mut s = f.stream();
        assert_eq!(s.push("h").content, "h");
        assert!(s.in_content());
    }
}
