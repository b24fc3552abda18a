//! The reasoning split: separates a model's `<think>…</think>` block from its reply, for a
//! whole output and while streaming, as vLLM's `--reasoning-parser deepseek_r1|qwen3` do.
//!
//! Behaviour (vLLM's `vllm/reasoning/basic_parsers.py`, `deepseek_r1_reasoning_parser.py`,
//! `qwen3_reasoning_parser.py`), made identical for whole and streamed outputs:
//!
//! - Reasoning ends at the first `</think>`; everything after it is content, verbatim (leading
//!   newlines kept, later tags kept as text).
//! - The first `<think>` before it is removed. Text before it stays in the part it was in,
//!   except a whitespace-only prefix at the very start, which is dropped.
//! - `deepseek_r1` starts inside the reasoning whether or not the prompt opened it, so an
//!   output without tags is all reasoning.
//! - `qwen3` starts inside the reasoning only when the prompt opened it (thinking mode); if not
//!   (thinking disabled, or an older template where the model writes `<think>` itself) the
//!   output is content until a `<think>`, and a lone `</think>` is ordinary text.
//! - An empty part is `None`, never `Some("")`.
//!
//! vLLM detects tags as special token ids; kiln matches the decoded text, holding back a
//! streamed suffix that may be the start of a tag.

use std::fmt;
use std::str::FromStr;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Which reasoning syntax a model writes (vLLM's `--reasoning-parser` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// DeepSeek-R1 and its distills: reasoning first, with or without `<think>`.
    DeepSeekR1,
    /// Qwen3: reasoning only when the template (or the model) opens `<think>`.
    Qwen3,
}

impl ReasoningParser {
    /// The names `--reasoning-parser` accepts, one per variant.
    pub const NAMES: [&'static str; 2] = ["deepseek_r1", "qwen3"];

    /// vLLM's name for this parser.
    pub fn name(self) -> &'static str {
        match self {
            Self::DeepSeekR1 => Self::NAMES[0],
            Self::Qwen3 => Self::NAMES[1],
        }
    }

    /// Whether a rendered prompt leaves a think block open (ends with `<think>` plus optional
    /// whitespace, no `</think>` after it), as DeepSeek-R1's and Qwen3's thinking templates
    /// do (`<|im_start|>assistant\n<think>\n`). Qwen3 with thinking disabled renders
    /// `<think>\n\n</think>\n\n`, which is closed.
    pub fn prompt_opens(self, rendered_prompt: &str) -> bool {
        rendered_prompt.trim_end().ends_with(OPEN)
    }

    /// Splits a whole output. `opened`: the prompt left `<think>` open.
    pub fn split(self, text: &str, opened: bool) -> Split {
        // One mechanism for both paths, so a stream always ends where the whole split does.
        let mut stream = self.stream(opened);
        let mut out = stream.push(text);
        out.append(stream.finish());
        out
    }

    /// A splitter for a streamed output.
    pub fn stream(self, opened: bool) -> ReasoningStream {
        let phase = match self {
            // vLLM's deepseek_r1 treats text without tags as reasoning (R1 may omit `<think>`).
            Self::DeepSeekR1 => Phase::Reasoning,
            Self::Qwen3 if opened => Phase::Reasoning,
            // vLLM routes qwen3 output as content when the prompt closed the block.
            Self::Qwen3 => Phase::Before,
        };
        ReasoningStream {
            phase,
            open_pending: true,
            at_start: true,
            held: String::new(),
        }
    }
}

/// A request's reasoning syntax, and whether its prompt left the think block open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reasoning {
    pub parser: ReasoningParser,
    /// The rendered prompt ends inside `<think>` ([`ReasoningParser::prompt_opens`]).
    pub opened: bool,
}

impl Reasoning {
    /// For a prompt rendered as `rendered_prompt`.
    pub fn for_prompt(parser: ReasoningParser, rendered_prompt: &str) -> Self {
        Self {
            parser,
            opened: parser.prompt_opens(rendered_prompt),
        }
    }

    /// Splits a whole output.
    pub fn split(self, text: &str) -> Split {
        self.parser.split(text, self.opened)
    }

    /// A splitter for a streamed output.
    pub fn stream(self) -> ReasoningStream {
        self.parser.stream(self.opened)
    }

    /// Whether the output starts inside the reasoning: a constraint on the answer must then
    /// let the model close it first.
    pub fn starts_inside(self) -> bool {
        !self.stream().in_content()
    }
}

impl fmt::Display for ReasoningParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReasoningParser {
    type Err = UnknownParser;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "deepseek_r1" => Ok(Self::DeepSeekR1),
            "qwen3" => Ok(Self::Qwen3),
            _ => Err(UnknownParser(s.to_owned())),
        }
    }
}

/// A `--reasoning-parser` name that is not one of [`ReasoningParser::NAMES`].
#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not one of {names}", names = ReasoningParser::NAMES.join(", "))]
pub struct UnknownParser(pub String);

/// An output (or a delta of one) split in two; `None`/empty when that part has nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// The text inside the think block, tags removed.
    pub reasoning: Option<String>,
    /// The reply.
    pub content: Option<String>,
}

impl Split {
    fn add(&mut self, reasoning: bool, text: &str) {
        if text.is_empty() {
            return;
        }
        let part = if reasoning {
            &mut self.reasoning
        } else {
            &mut self.content
        };
        part.get_or_insert_with(String::new).push_str(text);
    }

    fn append(&mut self, other: Split) {
        self.add(true, other.reasoning.as_deref().unwrap_or_default());
        self.add(false, other.content.as_deref().unwrap_or_default());
    }
}

/// Where the splitter is in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Content that a `<think>` may still turn into reasoning (qwen3, prompt not opened).
    Before,
    /// Inside the think block, until `</think>`.
    Reasoning,
    /// After the think block: everything is content.
    Content,
}

/// Incremental splitting: the concatenation of every `push` result plus `finish` equals `split`
/// of the whole text, whatever the chunking.
#[derive(Debug, Clone)]
pub struct ReasoningStream {
    phase: Phase,
    /// No `<think>` removed yet: vLLM strips only the first one.
    open_pending: bool,
    /// Nothing shown yet, so whitespace before a first `<think>` can still be dropped.
    at_start: bool,
    /// Text that may be the start of a tag (or leading whitespace), not yet shown.
    held: String,
}

impl ReasoningStream {
    /// The parts of `delta` that can be shown now (text that may be the start of a tag is held
    /// back).
    pub fn push(&mut self, delta: &str) -> Split {
        let mut out = Split::default();
        let mut rest = std::mem::take(&mut self.held);
        rest.push_str(delta);
        let mut rest = rest.as_str();
        loop {
            let in_reasoning = match self.phase {
                Phase::Content => {
                    out.add(false, rest);
                    return out;
                }
                Phase::Before => false,
                Phase::Reasoning => true,
            };
            let open = self.open_pending.then(|| rest.find(OPEN)).flatten();
            let close = in_reasoning.then(|| rest.find(CLOSE)).flatten();
            match (open, close) {
                (Some(at), c) if c.is_none_or(|c| at < c) => {
                    let (before, after) = rest.split_at(at);
                    if !(self.at_start && before.trim_start().is_empty()) {
                        self.show(&mut out, in_reasoning, before);
                    }
                    self.open_pending = false;
                    self.phase = Phase::Reasoning;
                    rest = &after[OPEN.len()..];
                }
                (_, Some(at)) => {
                    let (before, after) = rest.split_at(at);
                    self.show(&mut out, true, before);
                    self.open_pending = false;
                    self.phase = Phase::Content;
                    rest = &after[CLOSE.len()..];
                }
                (_, None) => {
                    let keep = self.hold_len(rest, in_reasoning);
                    let (now, later) = rest.split_at(rest.len() - keep);
                    self.show(&mut out, in_reasoning, now);
                    self.held = later.to_owned();
                    return out;
                }
            }
        }
    }

    /// What was held back, once the output ended.
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let held = std::mem::take(&mut self.held);
        self.show(&mut out, self.phase == Phase::Reasoning, &held);
        out
    }

    /// Whether the reasoning has ended (content follows): structured output and tool parsing
    /// apply only after it. Also true before any `<think>` when qwen3's prompt did not open
    /// one, since that output is content.
    pub fn in_content(&self) -> bool {
        self.phase != Phase::Reasoning
    }

    fn show(&mut self, out: &mut Split, reasoning: bool, text: &str) {
        if !text.is_empty() {
            self.at_start = false;
            out.add(reasoning, text);
        }
    }

    /// How many trailing bytes of `text` (which holds no whole tag looked for) must wait for
    /// the next delta: a partial tag, or leading whitespace that a `<think>` would drop.
    fn hold_len(&self, text: &str, in_reasoning: bool) -> usize {
        if self.open_pending && self.at_start && OPEN.starts_with(text.trim_start()) {
            return text.len();
        }
        let mut tags = [None, None];
        if self.open_pending {
            tags[0] = Some(OPEN);
        }
        if in_reasoning {
            tags[1] = Some(CLOSE);
        }
        // Tags are ASCII, so a suffix matching a tag's prefix starts on a char boundary.
        tags.into_iter()
            .flatten()
            .flat_map(|tag| (1..tag.len()).filter(move |&n| text.ends_with(&tag[..n])))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use ReasoningParser::{DeepSeekR1, Qwen3};

    fn split(reasoning: Option<&str>, content: Option<&str>) -> Split {
        Split {
            reasoning: reasoning.map(str::to_owned),
            content: content.map(str::to_owned),
        }
    }

    /// Streams `deltas` and joins what comes out.
    fn streamed(parser: ReasoningParser, opened: bool, deltas: &[&str]) -> Split {
        let mut stream = parser.stream(opened);
        let mut out = Split::default();
        for delta in deltas {
            out.append(stream.push(delta));
        }
        out.append(stream.finish());
        out
    }

    /// Checks the whole split, and the stream fed whole and one char at a time.
    #[track_caller]
    fn check(
        parser: ReasoningParser,
        opened: bool,
        text: &str,
        want: (Option<&str>, Option<&str>),
    ) {
        let want = split(want.0, want.1);
        assert_eq!(
            parser.split(text, opened),
            want,
            "{parser} opened={opened} {text:?}"
        );
        assert_eq!(
            streamed(parser, opened, &[text]),
            want,
            "{text:?} in one delta"
        );
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(streamed(parser, opened, &chars), want, "{text:?} by chars");
    }

    #[test]
    fn each_parser_opened_or_not_on_each_shape() {
        // (parser, opened, no tags, closed think, unclosed think, only `</think>`)
        type Want = (Option<&'static str>, Option<&'static str>);
        let cases: [(ReasoningParser, bool, [Want; 4]); 4] = [
            (
                DeepSeekR1,
                false,
                [
                    (Some("Hi"), None),
                    (Some("r"), Some("\n\nHi")),
                    (Some("r"), None),
                    (Some("r"), Some("Hi")),
                ],
            ),
            (
                DeepSeekR1,
                true,
                [
                    (Some("Hi"), None),
                    (Some("r"), Some("\n\nHi")),
                    (Some("r"), None),
                    (Some("r"), Some("Hi")),
                ],
            ),
            (
                Qwen3,
                false,
                [
                    (None, Some("Hi")),
                    (Some("r"), Some("\n\nHi")),
                    (Some("r"), None),
                    (None, Some("r</think>Hi")),
                ],
            ),
            (
                Qwen3,
                true,
                [
                    (Some("Hi"), None),
                    (Some("r"), Some("\n\nHi")),
                    (Some("r"), None),
                    (Some("r"), Some("Hi")),
                ],
            ),
        ];
        let texts = ["Hi", "<think>r</think>\n\nHi", "<think>r", "r</think>Hi"];
        for (parser, opened, wants) in cases {
            for (text, want) in texts.iter().zip(wants) {
                check(parser, opened, text, want);
            }
        }
    }

    #[test]
    fn deepseek_r1_cases_from_vllm() {
        // vLLM tests/reasoning/test_deepseekr1_reasoning_parser.py; its empty reasoning ("")
        // is None here, as its streaming variant reports.
        let cases = [
            (
                "This is a reasoning section</think>This is the rest",
                Some("This is a reasoning section"),
                Some("This is the rest"),
            ),
            (
                "This is a reasoning section</think>",
                Some("This is a reasoning section"),
                None,
            ),
            ("This is content", Some("This is content"), None),
            (
                "This\nThat</think>This is the rest\nThat",
                Some("This\nThat"),
                Some("This is the rest\nThat"),
            ),
            ("</think>This is the rest", None, Some("This is the rest")),
            (
                "<think>This is a reasoning section</think>This is the rest",
                Some("This is a reasoning section"),
                Some("This is the rest"),
            ),
            (
                "<think>This is a reasoning section</think>",
                Some("This is a reasoning section"),
                None,
            ),
            (
                "<think>This\nThat</think>This is the rest\nThat",
                Some("This\nThat"),
                Some("This is the rest\nThat"),
            ),
            (
                "<think>This is a reasoning section",
                Some("This is a reasoning section"),
                None,
            ),
            ("", None, None),
            // NEW_LINE (whole output): the newline before `<think>` is dropped.
            (
                "\n<think>This is a reasoning section</think>\nThis is the rest",
                Some("This is a reasoning section"),
                Some("\nThis is the rest"),
            ),
        ];
        for (text, reasoning, content) in cases {
            check(DeepSeekR1, false, text, (reasoning, content));
            check(DeepSeekR1, true, text, (reasoning, content));
        }
    }

    #[test]
    fn base_parser_edge_cases_from_vllm() {
        // vLLM tests/reasoning/test_base_thinking_reasoning_parser.py, with `<think>` tags.
        let cases = [
            (
                "First</think>Middle</think>Last",
                Some("First"),
                Some("Middle</think>Last"),
            ),
            (
                "<think>Outer<think>Inner</think>Content",
                Some("Outer<think>Inner"),
                Some("Content"),
            ),
            (
                "<thinking>Not a real token</thinking>Content",
                Some("<thinking>Not a real token</thinking>Content"),
                None,
            ),
            ("<think></think>", None, None),
        ];
        for (text, reasoning, content) in cases {
            check(DeepSeekR1, false, text, (reasoning, content));
            check(Qwen3, true, text, (reasoning, content));
        }
    }

    #[test]
    fn qwen3_cases_from_vllm() {
        // vLLM tests/reasoning/test_qwen3_reasoning_parser.py. Thinking enabled = prompt opened.
        let opened = [
            (
                "This is a reasoning section</think>This is the rest",
                Some("This is a reasoning section"),
                Some("This is the rest"),
            ),
            (
                "This is a reasoning section</think>",
                Some("This is a reasoning section"),
                None,
            ),
            (
                "<think>This is a reasoning section</think>This is the rest",
                Some("This is a reasoning section"),
                Some("This is the rest"),
            ),
            ("This is the rest", Some("This is the rest"), None),
            (
                "<think>This is a reasoning\nsection</think>This is the rest\nThat",
                Some("This is a reasoning\nsection"),
                Some("This is the rest\nThat"),
            ),
            (
                "<think>This is a reasoning section",
                Some("This is a reasoning section"),
                None,
            ),
        ];
        for (text, reasoning, content) in opened {
            check(Qwen3, true, text, (reasoning, content));
        }
        // Its multi-token delta cases.
        let deltas: [(&[&str], _, _); 4] = [
            (
                &[
                    "<think>This is a reasoning section",
                    "</think>",
                    "This is the rest",
                ],
                Some("This is a reasoning section"),
                Some("This is the rest"),
            ),
            (
                &["reasoning section", "</think>This is the rest"],
                Some("reasoning section"),
                Some("This is the rest"),
            ),
            (&["<think>reasoning</think>"], Some("reasoning"), None),
            (
                &["reasoning section", "</think>content"],
                Some("reasoning section"),
                Some("content"),
            ),
        ];
        for (deltas, reasoning, content) in deltas {
            assert_eq!(
                streamed(Qwen3, true, deltas),
                split(reasoning, content),
                "{deltas:?}"
            );
        }
        // Thinking disabled (the template closed the block, so the prompt is not open).
        let tool_call = "<tool_call>\n<function=bash>\n</function>\n</tool_call>";
        for text in [
            "This is plain content",
            &format!("I need to read the file.\n\n{tool_call}"),
        ] {
            check(Qwen3, false, text, (None, Some(text)));
        }
        // Old template: the model opens the block itself; the whole output keeps the original's
        // `<think>` in the output, not in the prompt.
        check(
            Qwen3,
            false,
            "<think>\nr\n</think>\n\nHi",
            (Some("\nr\n"), Some("\n\nHi")),
        );
        // Not followed: vLLM's Qwen3.5 rule that `<tool_call>\n<function=` ends an unclosed
        // think block. Here it stays reasoning until `</think>`.
        let text = format!("I need to read the file.\n\n{tool_call}");
        check(Qwen3, true, &text, (Some(&text), None));
    }

    #[test]
    fn text_before_think() {
        // Whitespace at the start is dropped, other text stays in the part it was in.
        check(
            DeepSeekR1,
            false,
            " \n<think>r</think>c",
            (Some("r"), Some("c")),
        );
        check(
            DeepSeekR1,
            false,
            "a<think>r</think>c",
            (Some("ar"), Some("c")),
        );
        check(Qwen3, false, "\n<think>r</think>c", (Some("r"), Some("c")));
        check(Qwen3, false, "a<think>r</think>c", (Some("r"), Some("ac")));
        check(DeepSeekR1, false, "a <think>r", (Some("a r"), None));
        check(Qwen3, false, "a \n<think>r", (Some("r"), Some("a \n")));
        check(Qwen3, false, "\n\nc", (None, Some("\n\nc")));
        check(DeepSeekR1, true, "\n\n", (Some("\n\n"), None));
        // Only the first `<think>` is removed; after `</think>` tags are text.
        check(
            DeepSeekR1,
            false,
            "r</think>c<think>x",
            (Some("r"), Some("c<think>x")),
        );
    }

    #[test]
    fn multi_byte_text_around_tags() {
        let text = "é<think>日本語🙂</think>🦀ü";
        check(DeepSeekR1, false, text, (Some("é日本語🙂"), Some("🦀ü")));
        check(Qwen3, false, text, (Some("日本語🙂"), Some("é🦀ü")));
        check(
            Qwen3,
            true,
            "思考🙂</think>答え",
            (Some("思考🙂"), Some("答え")),
        );
        check(Qwen3, true, "思考</thinkö>", (Some("思考</thinkö>"), None));
    }

    #[test]
    fn push_holds_back_only_a_possible_tag() {
        let mut stream = Qwen3.stream(true);
        assert_eq!(stream.push("abc</th"), split(Some("abc"), None));
        assert!(!stream.in_content());
        assert_eq!(stream.push("ink>\n"), split(None, Some("\n")));
        assert!(stream.in_content());
        assert_eq!(stream.push("</th"), split(None, Some("</th")));
        assert_eq!(stream.finish(), Split::default());

        let mut stream = DeepSeekR1.stream(false);
        assert_eq!(stream.push("x <"), split(Some("x "), None));
        assert_eq!(stream.push("b"), split(Some("<b"), None));
        assert_eq!(stream.push("</"), Split::default());
        assert_eq!(stream.finish(), split(Some("</"), None));
    }

    #[test]
    fn in_content_follows_the_phase() {
        let mut stream = Qwen3.stream(false);
        assert!(stream.in_content());
        stream.push("<think>");
        assert!(!stream.in_content());
        stream.push("r</think>");
        assert!(stream.in_content());
        assert!(!DeepSeekR1.stream(false).in_content());
    }

    /// Feeds every cutting of `rest` into 1–4 byte chunks at char boundaries.
    fn every_chunking(
        stream: &ReasoningStream,
        rest: &str,
        got: &Split,
        want: &Split,
        cuts: &mut Vec<usize>,
    ) -> usize {
        if rest.is_empty() {
            let mut got = got.clone();
            got.append(stream.clone().finish());
            assert_eq!(&got, want, "chunk lengths {cuts:?}");
            return 1;
        }
        let mut count = 0;
        for n in (1..=4).filter(|&n| n <= rest.len() && rest.is_char_boundary(n)) {
            let mut stream = stream.clone();
            let mut got = got.clone();
            got.append(stream.push(&rest[..n]));
            cuts.push(n);
            count += every_chunking(&stream, &rest[n..], &got, want, cuts);
            cuts.pop();
        }
        count
    }

    #[test]
    fn streaming_equals_whole_split_for_every_chunking() {
        let pieces = [
            "a", " ", "\n", "<", "</", "<think>", "</think>", "<thi", "é", "🙂",
        ];
        let mut texts: Vec<String> = [
            "",
            "<think>a</think>b",
            "\n<think>é</think>🙂",
            "a</think><think>",
            " <th</think>",
            "<<think>></think>",
        ]
        .map(String::from)
        .to_vec();
        for a in pieces {
            for b in pieces {
                texts.push(format!("{a}{b}"));
                for c in pieces {
                    let text = format!("{a}{b}{c}");
                    if text.len() <= 10 {
                        texts.push(text);
                    }
                }
            }
        }
        let mut chunkings = 0;
        for text in &texts {
            for parser in [DeepSeekR1, Qwen3] {
                for opened in [false, true] {
                    let want = parser.split(text, opened);
                    let stream = parser.stream(opened);
                    chunkings +=
                        every_chunking(&stream, text, &Split::default(), &want, &mut Vec::new());
                }
            }
        }
        assert!(chunkings > 100_000, "{chunkings}");
    }

    #[test]
    fn prompt_opens_only_on_a_trailing_open_tag() {
        for parser in [DeepSeekR1, Qwen3] {
            assert!(parser.prompt_opens("<|im_start|>assistant\n<think>\n"));
            assert!(parser.prompt_opens("<｜Assistant｜><think>"));
            assert!(!parser.prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
            assert!(!parser.prompt_opens("<|im_start|>assistant\n"));
            assert!(!parser.prompt_opens(""));
        }
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_listed() {
        for name in ReasoningParser::NAMES {
            assert_eq!(name.parse::<ReasoningParser>().unwrap().name(), name);
        }
        let err = "deepseek-r1".parse::<ReasoningParser>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "`deepseek-r1` is not one of deepseek_r1, qwen3"
        );
    }
}
