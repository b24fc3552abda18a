//! Tool calls in model output: which syntax a chat template teaches its model, how to read
//! calls back out of the text, and the grammar (llguidance's Lark syntax, with `%json` for
//! arguments) that makes a model write a call whose arguments match the function's schema.
//!
//! The formats, as the models' chat templates write them:
//! - Hermes / Qwen: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block
//!   per call;
//! - Llama 3.1+: a JSON object `{"name": "f", "parameters": {...}}` as the whole reply
//!   (optionally after `<|python_tag|>`), calls separated by `;`;
//! - Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`.

use serde_json::{Map, Value, json};

/// A model's tool-call syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    /// The JSON Schema of its arguments (an object schema; `{}` when none was given).
    pub parameters: Value,
}

/// What a request's `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer in text; the tools are not shown to the template.
    None,
    /// The model decides (the default when tools are given).
    Auto,
    /// At least one call: generated under [`ToolFormat::call_grammar`] of every tool.
    Required,
    /// A call to this function, under its grammar.
    Function(String),
}

impl ToolChoice {
    /// Checks the choice against the tools given.
    pub fn check(&self, tools: &[ToolSpec]) -> Result<(), ToolChoiceError> {
        match self {
            Self::Required | Self::Function(_) if tools.is_empty() => Err(ToolChoiceError::NoTools),
            Self::Function(n) if !tools.iter().any(|t| &t.name == n) => {
                Err(ToolChoiceError::Unknown(n.clone()))
            }
            _ => Ok(()),
        }
    }

    /// Whether replies are read for calls (tools given, choice not `none`).
    pub fn tools_on(&self, tools: &[ToolSpec]) -> bool {
        !tools.is_empty() && *self != Self::None
    }

    /// The tools a forced call picks among; empty when the call is not forced.
    pub fn forced(&self, tools: &[ToolSpec]) -> Vec<ToolSpec> {
        match self {
            Self::Required => tools.to_vec(),
            Self::Function(n) => tools.iter().filter(|t| &t.name == n).cloned().collect(),
            Self::None | Self::Auto => Vec::new(),
        }
    }
}

/// Why a `tool_choice` does not fit the tools given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolChoiceError {
    #[error("forcing a call needs tools")]
    NoTools,
    #[error("names `{0}`, which is not among the tools")]
    Unknown(String),
}

/// Why a tool definition is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    #[error("expected 1 to 64 letters, digits, `_` and `-`")]
    BadName,
    #[error("`{0}` is defined twice")]
    Duplicate(String),
    #[error("expected a JSON Schema object")]
    BadParameters,
}

impl ToolError {
    /// Whether the parameters are at fault (else the name).
    pub fn in_parameters(&self) -> bool {
        matches!(self, Self::BadParameters)
    }
}

/// Adds a tool to those given before it: a valid name (OpenAI's rule: 1 to 64 letters, digits,
/// `_` and `-`) not used yet, and a JSON Schema object for its arguments (`None`: any object).
pub fn push_tool(
    tools: &mut Vec<ToolSpec>,
    name: &str,
    parameters: Option<Value>,
) -> Result<(), ToolError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !valid {
        return Err(ToolError::BadName);
    }
    if tools.iter().any(|t| t.name == name) {
        return Err(ToolError::Duplicate(name.to_owned()));
    }
    let parameters = match parameters {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p,
        Some(_) => return Err(ToolError::BadParameters),
    };
    tools.push(ToolSpec {
        name: name.to_owned(),
        parameters,
    });
    Ok(())
}

/// One call read back from the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// The output split into text and calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedOutput {
    /// What is left outside the calls, trimmed; `None` when nothing is.
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

impl ToolFormat {
    /// The syntax a chat template's own markup shows (Hermes when it shows none: the template
    /// does not teach tools, and a forced call's grammar writes Hermes blocks).
    pub fn for_template(source: &str) -> Self {
        if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<tool_call>") {
            Self::Hermes
        } else if source.contains("<|python_tag|>") || source.contains("ipython") {
            Self::Llama3Json
        } else {
            Self::Hermes
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
        }
    }

    /// The key the format puts a call's arguments under.
    fn arguments_key(&self) -> &'static str {
        match self {
            Self::Llama3Json => "parameters",
            Self::Hermes | Self::Mistral => "arguments",
        }
    }

    /// A grammar for exactly one call to one of `tools` (non-empty), in this format, whose
    /// arguments are valid under the function's parameter schema. JSON is compact, as
    /// `json.dumps` writes it.
    pub fn call_grammar(&self, tools: &[ToolSpec]) -> String {
        let key = self.arguments_key();
        let calls: Vec<Value> = tools
            .iter()
            .map(|t| {
                let mut props = Map::new();
                props.insert("name".into(), json!({ "const": t.name }));
                props.insert(key.into(), t.parameters.clone());
                json!({
                    "type": "object",
                    "properties": props,
                    "required": ["name", key],
                    "additionalProperties": false
                })
            })
            .collect();
        let call = json!({
            "anyOf": calls,
            "x-guidance": {
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": "
            }
        });
        match self {
            Self::Hermes => format!("start: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\""),
            Self::Llama3Json => format!("start: %json {call}"),
            Self::Mistral => {
                let list = json!({
                    "type": "array",
                    "items": call,
                    "minItems": 1,
                    "maxItems": 1,
                    "x-guidance": call["x-guidance"].clone()
                });
                format!("start: \"[TOOL_CALLS]\" %json {list}")
            }
        }
    }

    /// The calls in `text` and what is left around them. Text that only looks like a call
    /// (a block whose JSON does not parse, an object without a name) stays content.
    pub fn parse(&self, text: &str) -> ParsedOutput {
        let (content, calls) = match self {
            Self::Hermes => parse_hermes(text),
            Self::Llama3Json => parse_llama3(text),
            Self::Mistral => parse_mistral(text),
        };
        let content = content.trim();
        ParsedOutput {
            content: (!content.is_empty()).then(|| content.to_owned()),
            calls,
        }
    }
}

/// A call from a JSON object with a string `name` and object (or JSON-text) arguments under
/// `arguments` or `parameters`.
fn call_of(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_owned();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        None => "{}".to_owned(),
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).ok()?;
            s.clone()
        }
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

fn parse_hermes(text: &str) -> (String, Vec<ToolCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        match serde_json::from_str::<Value>(body.trim())
            .ok()
            .as_ref()
            .and_then(call_of)
        {
            Some(call) => {
                content.push_str(&rest[..start]);
                calls.push(call);
            }
            None => content.push_str(&rest[..rest.len() - next.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    (content, calls)
}

fn parse_llama3(text: &str) -> (String, Vec<ToolCall>) {
    let body = text.trim();
    let mut rest = body
        .strip_prefix("<|python_tag|>")
        .unwrap_or(body)
        .trim_start();
    let mut calls = Vec::new();
    // Objects separated by `;`, which the JSON reader stops before.
    while rest.starts_with('{') {
        let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let Some(call) = it.next().and_then(Result::ok).as_ref().and_then(call_of) else {
            break;
        };
        calls.push(call);
        rest = rest[it.byte_offset()..].trim_start();
        match rest.strip_prefix(';') {
            Some(r) => rest = r.trim_start(),
            None => break,
        }
    }
    if calls.is_empty() {
        return (text.to_owned(), Vec::new());
    }
    (rest.to_owned(), calls)
}

fn parse_mistral(text: &str) -> (String, Vec<ToolCall>) {
    const MARK: &str = "[TOOL_CALLS]";
    let Some(start) = text.find(MARK) else {
        return (text.to_owned(), Vec::new());
    };
    let body = &text[start + MARK.len()..];
    let mut it = serde_json::Deserializer::from_str(body.trim_start()).into_iter::<Value>();
    let calls: Option<Vec<ToolCall>> = match it.next() {
        Some(Ok(Value::Array(items))) => items.iter().map(call_of).collect(),
        Some(Ok(v @ Value::Object(_))) => call_of(&v).map(|c| vec![c]),
        _ => None,
    };
    match calls {
        Some(calls) if !calls.is_empty() => (text[..start].to_owned(), calls),
        _ => (text.to_owned(), Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn formats_follow_the_template() {
        assert_eq!(
            ToolFormat::for_template("{{- '<tool_call>\\n' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::for_template("{{- '[TOOL_CALLS]' }}"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::for_template("<|start_header_id|>ipython<|end_header_id|>"),
            ToolFormat::Llama3Json
        );
        assert_eq!(
            ToolFormat::for_template("{{ message }}"),
            ToolFormat::Hermes
        );
    }

    /// Output as the Qwen 2.5 / Hermes templates teach it, and what is not a call.
    #[test]
    fn hermes_blocks_become_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let p = ToolFormat::Hermes.parse(text);
        assert_eq!(p.content.as_deref(), Some("Let me check."));
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", "{\"city\":\"Paris\"}"),
                call("get_time", "{}")
            ]
        );
        let broken = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>";
        let p = ToolFormat::Hermes.parse(broken);
        assert!(p.calls.is_empty());
        assert_eq!(p.content.as_deref(), Some(broken));
        assert_eq!(
            ToolFormat::Hermes.parse("plain answer").content.as_deref(),
            Some("plain answer")
        );
        // Unterminated (the output ran out after the JSON).
        let p =
            ToolFormat::Hermes.parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}");
        assert_eq!(p.calls, vec![call("f", "{\"a\":1}")]);
        assert_eq!(p.content, None);
    }

    #[test]
    fn llama3_and_mistral_calls_parse() {
        let p = ToolFormat::Llama3Json.parse(
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}",
        );
        assert_eq!(p.calls, vec![call("a", "{\"x\":1}"), call("b", "{}")]);
        assert_eq!(p.content, None);
        let p = ToolFormat::Llama3Json.parse("{\"answer\": 42}");
        assert!(p.calls.is_empty());
        let p = ToolFormat::Mistral
            .parse("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"q\": \"x\"}}]");
        assert_eq!(p.calls, vec![call("f", "{\"q\":\"x\"}")]);
        assert_eq!(p.content, None);
    }

    /// The grammar's text is a Lark start rule around `%json` with the function's schema.
    #[test]
    fn call_grammars_carry_each_function_schema() {
        let tools = [ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        }];
        let g = ToolFormat::Hermes.call_grammar(&tools);
        assert!(g.starts_with("start: \"<tool_call>\\n\" %json {"), "{g}");
        assert!(g.ends_with("\"\\n</tool_call>\""), "{g}");
        assert!(g.contains("\"const\":\"get_weather\""), "{g}");
        assert!(
            ToolFormat::Llama3Json
                .call_grammar(&tools)
                .contains("\"parameters\"")
        );
        assert!(
            ToolFormat::Mistral
                .call_grammar(&tools)
                .starts_with("start: \"[TOOL_CALLS]\"")
        );
    }
}
