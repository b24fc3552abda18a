//! Harmony, GPT-OSS's reply format: the output is a run of messages, each a header (its
//! channel, and a recipient where it calls a tool) and a body:
//!
//! ```text
//! <|channel|>analysis<|message|>Let me look it up.<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}<|call|>
//! ```
//!
//! - `analysis` bodies are reasoning;
//! - `final` bodies, and `commentary` ones without a recipient (preambles), are content;
//! - a body sent `to=functions.NAME` is a call of NAME with the body as its arguments (with
//!   tools off, it is content);
//! - a body ends at `<|end|>`, `<|return|>` or `<|call|>`, or where the output ends (the last
//!   two stop generation, so the text usually ends inside the last body); a call cut short
//!   (the output ran out of tokens) is content, as other formats leave a broken call;
//! - an output that does not open with a marker is not Harmony (a constraint shaped it, say):
//!   all content.
//!
//! The output is read as text with its special tokens kept (openai-harmony reads the same
//! markers as token ids). Whole and streamed outputs go through one splitter, so a stream ends
//! where the whole read does: reasoning and content stream as they come, calls come whole at
//! the end; text that may be the start of a marker is held back.

use kiln_tokenizer::ToolCall;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
/// The markers that end a body.
const ENDS: [&str; 3] = ["<|end|>", "<|return|>", "<|call|>"];
/// The special tokens that stop generation after an assistant's action: its final answer, or
/// a call.
pub const STOPS: [&str; 2] = ["<|return|>", "<|call|>"];
/// The namespace of the functions a request's tools are shown in.
const FUNCTIONS: &str = "functions.";

/// Whether a chat template writes Harmony (GPT-OSS's, with its channels).
pub fn is_harmony_template(source: &str) -> bool {
    source.contains(CHANNEL) && source.contains(MESSAGE)
}

/// What a message's body is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    /// A call of this function, its arguments collected.
    Call(String, String),
}

/// Where the splitter is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Reading a header (collected) until `<|message|>`.
    Header(String),
    Body(Body),
    /// The output opened with text, not a marker: everything is content.
    Plain,
}

/// An output split: its reasoning, content and calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Messages {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// Splits a Harmony output as it streams.
#[derive(Debug, Clone)]
pub struct HarmonyStream {
    /// Tools on: bodies sent to a function are calls.
    tools: bool,
    state: State,
    /// A message has begun (its header read).
    started: bool,
    /// Text that may be the start of a marker, not yet read.
    held: String,
    calls: Vec<ToolCall>,
}

impl HarmonyStream {
    /// A splitter for an output that starts after the prompt's `<|start|>assistant`.
    pub fn new(tools: bool) -> Self {
        Self {
            tools,
            state: State::Header(String::new()),
            started: false,
            held: String::new(),
            calls: Vec::new(),
        }
    }

    /// Splits a whole output; `complete`: it ended by itself, not for want of tokens.
    pub fn split(tools: bool, text: &str, complete: bool) -> Messages {
        let mut s = Self::new(tools);
        let mut out = s.push(text);
        let end = s.finish(complete);
        out.reasoning.push_str(&end.reasoning);
        out.content.push_str(&end.content);
        out.calls = end.calls;
        out
    }

    /// The reasoning and content of `delta` that can be shown now (calls wait for
    /// [`finish`](Self::finish)).
    pub fn push(&mut self, delta: &str) -> Messages {
        let mut out = Messages::default();
        let mut rest = std::mem::take(&mut self.held);
        rest.push_str(delta);
        let mut rest = rest.as_str();
        loop {
            match &mut self.state {
                State::Plain => {
                    out.content.push_str(rest);
                    return out;
                }
                State::Header(header) => {
                    // A header is short: held whole until its `<|message|>`, which may come
                    // in pieces.
                    let seen = header.len();
                    header.push_str(rest);
                    if !self.started && !opens_with_marker(header) {
                        out.content.push_str(header);
                        self.state = State::Plain;
                        return out;
                    }
                    let Some(at) = header.find(MESSAGE) else {
                        return out;
                    };
                    self.started = true;
                    let after = at + MESSAGE.len() - seen;
                    header.truncate(at);
                    let body = self.body_of_header();
                    self.state = State::Body(body);
                    rest = &rest[after..];
                }
                State::Body(_) => {
                    let end = ENDS
                        .iter()
                        .filter_map(|m| rest.find(m).map(|at| (at, m.len())))
                        .min();
                    match end {
                        Some((at, len)) => {
                            self.body_text(&rest[..at], &mut out);
                            self.end_body();
                            rest = &rest[at + len..];
                        }
                        None => {
                            let keep = held_len(rest);
                            let (now, later) = rest.split_at(rest.len() - keep);
                            self.body_text(now, &mut out);
                            self.held = later.to_owned();
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// The output ended: what was held back, and the calls (`complete`: it ended by itself;
    /// a call it was still writing when it ran out of tokens is content).
    pub fn finish(&mut self, complete: bool) -> Messages {
        let mut out = Messages::default();
        let held = std::mem::take(&mut self.held);
        match &mut self.state {
            State::Body(Body::Call(_, args)) if !complete => {
                out.content.push_str(args);
                out.content.push_str(&held);
            }
            State::Body(_) => {
                self.body_text(&held, &mut out);
                self.end_body();
            }
            State::Plain => out.content.push_str(&held),
            // Text that never reached a `<|message|>`: not Harmony after all, so it is shown
            // as content (markers and all) rather than lost.
            State::Header(header) => {
                let text = format!("{header}{held}");
                if !text.trim().is_empty() {
                    out.content.push_str(&text);
                }
            }
        }
        self.state = State::Header(String::new());
        out.calls = std::mem::take(&mut self.calls);
        out
    }

    /// Whether the reasoning is over: the current message is not an analysis one.
    pub fn in_content(&self) -> bool {
        self.state != State::Body(Body::Reasoning)
    }

    /// The body a header (`<|start|>assistant`, `<|channel|>NAME`, ` to=RECIPIENT`,
    /// ` <|constrain|>json`, in the orders Harmony allows) announces.
    fn body_of_header(&mut self) -> Body {
        let State::Header(header) = &mut self.state else {
            return Body::Content;
        };
        let header = std::mem::take(header);
        let words = header
            .rsplit(START)
            .next()
            .unwrap_or_default()
            .replace(CHANNEL, " <channel> ")
            .replace(CONSTRAIN, " ");
        let mut channel = "";
        let mut recipient = None;
        let mut tokens = words.split_whitespace();
        while let Some(w) = tokens.next() {
            if w == "<channel>" {
                channel = tokens.next().unwrap_or_default();
            } else if let Some(to) = w.strip_prefix("to=") {
                recipient = Some(to);
            }
        }
        match (channel, recipient.and_then(|r| r.strip_prefix(FUNCTIONS))) {
            (_, Some(name)) if self.tools => Body::Call(name.to_owned(), String::new()),
            ("analysis", _) => Body::Reasoning,
            _ => Body::Content,
        }
    }

    fn body_text(&mut self, text: &str, out: &mut Messages) {
        match &mut self.state {
            State::Body(Body::Reasoning) => out.reasoning.push_str(text),
            State::Body(Body::Content) => out.content.push_str(text),
            State::Body(Body::Call(_, args)) => args.push_str(text),
            State::Header(_) | State::Plain => {}
        }
    }

    fn end_body(&mut self) {
        if let State::Body(Body::Call(name, args)) = &mut self.state {
            self.calls.push(ToolCall {
                name: std::mem::take(name),
                arguments: std::mem::take(args),
            });
        }
        self.state = State::Header(String::new());
    }
}

/// Whether `text` (a header so far) opens with a marker, or may yet.
fn opens_with_marker(text: &str) -> bool {
    text.starts_with("<|") || "<|".starts_with(text)
}

/// How many trailing bytes of a body's `text` may be the start of a marker that ends it.
fn held_len(text: &str) -> usize {
    // Markers are ASCII, so a suffix matching a marker's prefix starts on a char boundary.
    ENDS.iter()
        .flat_map(|m| (1..m.len()).filter(move |&n| text.ends_with(&m[..n])))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::Value;

    use super::*;

    /// Splits `text` whole, in one delta and a char at a time: all three the same.
    fn split_every_way(tools: bool, text: &str) -> Messages {
        let whole = HarmonyStream::split(tools, text, true);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        for deltas in [vec![text.to_owned()], chars] {
            let mut s = HarmonyStream::new(tools);
            let mut got = Messages::default();
            for d in &deltas {
                let m = s.push(d);
                assert!(m.calls.is_empty(), "calls come at the end");
                got.reasoning.push_str(&m.reasoning);
                got.content.push_str(&m.content);
            }
            let end = s.finish(true);
            got.reasoning.push_str(&end.reasoning);
            got.content.push_str(&end.content);
            got.calls = end.calls;
            assert_eq!(got, whole, "{text:?} in {} deltas", deltas.len());
        }
        whole
    }

    /// Each completion split as openai-harmony parses its tokens
    /// (`tests/fixtures/harmony.json`, `scripts/make_harmony_fixtures.py`): analysis
    /// messages are the reasoning, final and recipient-less commentary ones the content, a
    /// message to `functions.NAME` a call of NAME; with tools off, such a message is content.
    #[test]
    fn completions_split_as_openai_harmony_parses_them() {
        let fixture: Value =
            serde_json::from_str(include_str!("../tests/fixtures/harmony.json")).unwrap();
        for case in fixture["parses"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let mut want = Messages::default();
            let mut as_content = String::new();
            for m in case["messages"].as_array().unwrap() {
                let body = m["text"].as_str().unwrap();
                let function = m["recipient"]
                    .as_str()
                    .and_then(|r| r.strip_prefix(FUNCTIONS));
                match (m["channel"].as_str(), function) {
                    (_, Some(name)) => {
                        want.calls.push(ToolCall {
                            name: name.to_owned(),
                            arguments: body.to_owned(),
                        });
                        as_content.push_str(body);
                    }
                    (Some("analysis"), None) => want.reasoning.push_str(body),
                    _ => {
                        want.content.push_str(body);
                        as_content.push_str(body);
                    }
                }
            }
            assert_eq!(split_every_way(true, text), want, "{text:?}");
            let off = split_every_way(false, text);
            assert_eq!(
                (off.content, off.calls),
                (as_content, Vec::new()),
                "{text:?}"
            );
        }
    }

    /// Generation stops at `<|return|>` or `<|call|>` (stop tokens, left out of the text):
    /// the last body then simply ends, a call included.
    #[test]
    fn an_output_stopped_at_its_last_body_keeps_it() {
        let text = "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant\
                    <|channel|>commentary to=functions.get_weather <|constrain|>json\
                    <|message|>{\"location\":\"Oslo\"}";
        let m = split_every_way(true, text);
        assert_eq!(m.reasoning, "Look it up.");
        assert_eq!(
            m.calls,
            [ToolCall {
                name: "get_weather".into(),
                arguments: "{\"location\":\"Oslo\"}".into()
            }]
        );
        let m = split_every_way(true, "<|channel|>final<|message|>Hi <|end");
        assert_eq!(m.content, "Hi <|end", "a marker cut short is text");
        // Text that does not open with a marker is not Harmony: content as it comes (a JSON
        // format shaped it, say).
        let mut s = HarmonyStream::new(true);
        assert_eq!(s.push("{\"a\": ").content, "{\"a\": ");
        assert_eq!(split_every_way(true, "{\"a\": 1}").content, "{\"a\": 1}");
        // A call cut short by the token limit is content, not a call of broken JSON.
        let cut = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1";
        let m = HarmonyStream::split(true, cut, false);
        assert_eq!((m.content.as_str(), m.calls.len()), ("{\"a\": 1", 0));
        assert_eq!(HarmonyStream::split(true, cut, true).calls.len(), 1);
    }
}
