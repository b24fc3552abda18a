//! OpenAI's Responses API (`POST /v1/responses`): its request read into the front doors'
//! shared [`Conversation`], and its answer, whole or as the typed event stream the `openai`
//! client and the Agents SDK read. Input is a string or items (`message`, `function_call`,
//! `function_call_output`, `reasoning`, `custom_tool_call` and its output); function and
//! custom tools are served, hosted tools (`web_search`, `file_search`, ...) dropped with a log
//! line, as llama.cpp's server does, so Codex's requests work. Unknown fields are ignored; a
//! malformed known field is a 400 naming it.

use kiln_api::{
    ApiConfig, ApiError, Conversation, Field, Message, MessagePart, PastCall, Reply, ReplyFormat,
    Role, SamplingOverlay, Tool, echo,
};
use kiln_engine::{Constraint, EngineInfo, Request};
use kiln_tokenizer::{Tokenizer, ToolChoice};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::convert::{core, render_into};
use crate::error::{ConstraintVia, Door, ErrorReply};
use crate::store::ResponseStore;

/// `POST /v1/responses`: the fields kiln reads (the SDKs send more: `include`, `truncation`,
/// `prompt_cache_key`, `service_tier`, ... are ignored).
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    pub model: Option<String>,
    /// A string, or an array of items.
    pub input: Value,
    pub instructions: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<Value>,
    /// `{"effort": "none" | "low" | ...}`: `none` turns thinking off.
    pub reasoning: Option<Value>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    pub stream: Option<bool>,
    pub metadata: Option<Value>,
    pub user: Option<String>,
}

/// The tools a request serves, by kind: a custom tool's calls come back as
/// `custom_tool_call` items with free-form `input`.
#[derive(Debug, Clone, Default)]
pub(crate) struct ToolKinds {
    custom: Vec<String>,
    /// Where each tool served is in the body's `tools` (hosted ones dropped).
    wire: Vec<usize>,
}

impl ToolKinds {
    pub(crate) fn is_custom(&self, name: &str) -> bool {
        self.custom.iter().any(|c| c == name)
    }
}

/// A validated Responses call.
#[derive(Debug)]
pub(crate) struct Plan {
    pub request: Request,
    pub reply: ReplyFormat,
    pub stream: bool,
    pub store: bool,
    /// The conversation before this turn's output, without `instructions` (which a later
    /// `previous_response_id` does not inherit), kept with the response.
    pub history: Vec<Message>,
    pub kinds: ToolKinds,
    pub via: Option<ConstraintVia>,
    /// What the response object echoes of the request.
    pub echo: Map<String, Value>,
}

/// The parameters a custom tool is shown to the template with: its free-form input.
fn custom_parameters() -> Value {
    json!({"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]})
}

pub(crate) fn plan(
    body: &ResponsesRequest,
    label: &str,
    tok: &Tokenizer,
    info: &EngineInfo,
    cfg: &ApiConfig,
    store: &ResponseStore,
) -> Result<Plan, ErrorReply> {
    let err = core(Door::Responses, None);
    cfg.check_model(body.model.as_deref()).map_err(&err)?;
    let mut history = match &body.previous_response_id {
        None => Vec::new(),
        Some(id) => store.history(id).ok_or_else(|| {
            let mut e = ErrorReply::not_found(format!(
                "previous_response_id: no stored response `{}` (unknown, deleted or evicted)",
                echo(id)
            ));
            e.param = Some("previous_response_id".into());
            e
        })?,
    };
    history.extend(input(&body.input)?);
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(i) = &body.instructions {
        messages.push(Message::new(Role::System, i.clone()));
    }
    messages.extend(history.iter().cloned());
    let (tools, kinds) = tools(body.tools.as_deref().unwrap_or_default())?;
    let mut conversation = Conversation::new(messages);
    conversation.tools = tools;
    conversation.tool_choice = tool_choice(body.tool_choice.as_ref())?;
    conversation.set_thinking(thinking(body.reasoning.as_ref())?);
    let overlay = SamplingOverlay {
        temperature: body.temperature,
        top_p: body.top_p,
        ..SamplingOverlay::default()
    };
    let max = body.max_output_tokens.map(|m| m as usize);
    let mut request = cfg.request(info, &overlay, max, None).map_err(&err)?;
    request.label = label.to_owned();
    request.constraint = text_format(body.text.as_ref())?;
    let via = request
        .constraint
        .as_ref()
        .map(|_| ConstraintVia::TextFormat);
    let env = (tok, info, cfg);
    let (reply, via) = render_into(
        &conversation,
        &mut request,
        via,
        (Door::Responses, &kinds.wire),
        env,
    )?;
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(body.instructions));
    echo.insert("max_output_tokens".into(), json!(body.max_output_tokens));
    echo.insert(
        "parallel_tool_calls".into(),
        json!(body.parallel_tool_calls.unwrap_or(true)),
    );
    echo.insert(
        "previous_response_id".into(),
        json!(body.previous_response_id),
    );
    echo.insert("temperature".into(), json!(request.sampling.temperature));
    echo.insert("top_p".into(), json!(request.sampling.top_p));
    echo.insert(
        "tool_choice".into(),
        body.tool_choice.clone().unwrap_or(json!("auto")),
    );
    echo.insert(
        "tools".into(),
        json!(body.tools.clone().unwrap_or_default()),
    );
    echo.insert(
        "text".into(),
        body.text
            .clone()
            .unwrap_or(json!({"format": {"type": "text"}})),
    );
    echo.insert(
        "metadata".into(),
        body.metadata.clone().unwrap_or(json!({})),
    );
    echo.insert("store".into(), json!(body.store.unwrap_or(true)));
    Ok(Plan {
        request,
        reply,
        stream: body.stream.unwrap_or(false),
        store: body.store.unwrap_or(true),
        history,
        kinds,
        via,
        echo,
    })
}

/// `reasoning.effort`: `none` turns thinking off; anything else leaves the template's
/// default.
fn thinking(v: Option<&Value>) -> Result<Option<bool>, ErrorReply> {
    match v.and_then(|r| r.get("effort")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(e)) if e == "none" => Ok(Some(false)),
        Some(Value::String(_)) => Ok(None),
        Some(_) => Err(ErrorReply::invalid("reasoning.effort", "expected a string")),
    }
}

/// `text.format`.
fn text_format(v: Option<&Value>) -> Result<Option<Constraint>, ErrorReply> {
    let Some(format) = v.and_then(|t| t.get("format")) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => match format.get("schema") {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                Ok(Some(Constraint::JsonSchema(schema.clone())))
            }
            Some(_) => Err(ErrorReply::invalid(
                "text.format.schema",
                "expected a JSON Schema object",
            )),
            None => Err(ErrorReply::invalid("text.format.schema", "missing")),
        },
        Some(other) => Err(ErrorReply::invalid(
            "text.format.type",
            format!(
                "`{}` is not one of text, json_object, json_schema",
                echo(other)
            ),
        )),
        None => Err(ErrorReply::invalid(
            "text.format",
            "expected an object with `type`",
        )),
    }
}

/// `tools`: function and custom tools served, hosted ones dropped with a log line.
fn tools(list: &[Value]) -> Result<(Vec<Tool>, ToolKinds), ErrorReply> {
    let mut tools = Vec::new();
    let mut kinds = ToolKinds::default();
    for (i, t) in list.iter().enumerate() {
        let name = || {
            t.get("name")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| ErrorReply::invalid(format!("tools[{i}].name"), "missing"))
        };
        let description = t
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_owned);
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                tools.push(Tool {
                    name: name()?,
                    description,
                    parameters: t.get("parameters").cloned(),
                });
                kinds.wire.push(i);
            }
            Some("custom") => {
                let name = name()?;
                kinds.custom.push(name.clone());
                tools.push(Tool {
                    name,
                    description,
                    parameters: Some(custom_parameters()),
                });
                kinds.wire.push(i);
            }
            Some(other) => {
                tracing::info!(tool = %echo(other), "dropping a hosted tool kiln does not run");
            }
            None => return Err(ErrorReply::invalid(format!("tools[{i}].type"), "missing")),
        }
    }
    Ok((tools, kinds))
}

/// `tool_choice`: `none`, `auto`, `required`, or a named function or custom tool.
fn tool_choice(v: Option<&Value>) -> Result<Option<ToolChoice>, ErrorReply> {
    let bad = |why: &str| ErrorReply::invalid("tool_choice", why);
    Ok(Some(match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(bad("expected none, auto, required or a named tool")),
        },
        Some(o) => match o.get("type").and_then(Value::as_str) {
            Some("function" | "custom") => match o.get("name").and_then(Value::as_str) {
                Some(n) => ToolChoice::Function(n.to_owned()),
                None => return Err(bad("a named tool choice needs `name`")),
            },
            Some("allowed_tools") => match o.get("mode").and_then(Value::as_str) {
                Some("required") => ToolChoice::Required,
                _ => ToolChoice::Auto,
            },
            _ => return Err(bad("expected none, auto, required or a named tool")),
        },
    }))
}

/// `input` as conversation messages: a string is one user message; items in order, each
/// call joined to the assistant turn that made it and each reasoning item to the turn after
/// it.
pub(crate) fn input(v: &Value) -> Result<Vec<Message>, ErrorReply> {
    let items = match v {
        Value::String(s) => return Ok(vec![Message::new(Role::User, s.clone())]),
        Value::Array(items) => items,
        _ => {
            return Err(ErrorReply::invalid(
                "input",
                "expected a string or an array of items",
            ));
        }
    };
    let mut out: Vec<Message> = Vec::with_capacity(items.len());
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let at = |f: &str| format!("input[{i}]{f}");
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            // The Agents SDK sends bare `{"role", "content"}` messages.
            .or_else(|| item.get("role").map(|_| "message"));
        match kind {
            Some("message") => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
                let role = Role::parse(role)
                    .filter(|r| *r != Role::Tool)
                    .ok_or_else(|| {
                        let why = format!(
                            "`{}` is not one of system, developer, user, assistant",
                            echo(role)
                        );
                        let part = MessagePart::Role;
                        let e = ApiError::invalid(Field::Message { index: i, part }, why);
                        ErrorReply::from_api(&e, Door::Responses, None)
                    })?;
                let text = content(item.get("content"), &at(".content"))?;
                let mut m = Message::new(role, text);
                if role == Role::Assistant {
                    m.reasoning = reasoning.take();
                }
                out.push(m);
            }
            Some(call @ ("function_call" | "custom_tool_call")) => {
                let name = str_field(item, "name", &at)?;
                let call_id = str_field(item, "call_id", &at)?;
                let arguments = if call == "custom_tool_call" {
                    json!({"input": item.get("input").and_then(Value::as_str).unwrap_or_default()})
                        .to_string()
                } else {
                    str_field(item, "arguments", &at)?
                };
                let past = PastCall {
                    id: call_id,
                    name,
                    arguments,
                };
                // Calls right after an assistant turn (or another call) belong to it, unless
                // reasoning came between: that starts the next turn.
                match out.last_mut() {
                    Some(m) if m.role == Role::Assistant && reasoning.is_none() => {
                        m.tool_calls.push(past);
                    }
                    _ => {
                        let mut m = Message::new(Role::Assistant, "");
                        m.reasoning = reasoning.take();
                        m.tool_calls.push(past);
                        out.push(m);
                    }
                }
            }
            Some("function_call_output" | "custom_tool_call_output") => {
                let call_id = str_field(item, "call_id", &at)?;
                let text = content(item.get("output"), &at(".output"))?;
                let mut m = Message::new(Role::Tool, text);
                m.tool_call_id = Some(call_id);
                out.push(m);
            }
            Some("reasoning") => {
                let text = reasoning_text(item);
                if !text.is_empty() {
                    reasoning = Some(text);
                }
            }
            Some(other) => {
                tracing::info!(item = %echo(other), "dropping an input item kiln does not read");
            }
            None => return Err(ErrorReply::invalid(at(".type"), "missing")),
        }
    }
    Ok(out)
}

fn str_field(item: &Value, f: &str, at: &dyn Fn(&str) -> String) -> Result<String, ErrorReply> {
    item.get(f)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| ErrorReply::invalid(at(&format!(".{f}")), "expected a string"))
}

/// A message's content or a tool's output: a string or parts (`input_text`, `output_text`,
/// `text`); other parts (images, files) are refused until kiln reads them.
fn content(v: Option<&Value>, field: &str) -> Result<String, ErrorReply> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text" | "summary_text") => {
                        texts.push(p.get("text").and_then(Value::as_str).unwrap_or_default());
                    }
                    Some("refusal") => {
                        texts.push(p.get("refusal").and_then(Value::as_str).unwrap_or_default());
                    }
                    Some(other) => {
                        return Err(ErrorReply::invalid(
                            format!("{field}[{j}].type"),
                            format!("`{}` is not supported (this model reads text)", echo(other)),
                        ));
                    }
                    None => {
                        return Err(ErrorReply::invalid(
                            format!("{field}[{j}]"),
                            "expected an object with `type`",
                        ));
                    }
                }
            }
            // As chat completions and Messages join a message's parts (vLLM's way).
            Ok(texts.join("\n"))
        }
        Some(_) => Err(ErrorReply::invalid(
            field,
            "expected a string or an array of parts",
        )),
    }
}

/// A reasoning item's text: its `content` (`reasoning_text` parts), else its summary.
fn reasoning_text(item: &Value) -> String {
    let texts = |key: &str| -> String {
        item.get(key)
            .and_then(Value::as_array)
            .map(|parts| {
                parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    };
    let content = texts("content");
    if content.is_empty() {
        texts("summary")
    } else {
        content
    }
}

/// The turn's output as the assistant message a later `previous_response_id` continues.
pub(crate) fn as_history(reply: &Reply, calls: &[(String, String)]) -> Message {
    let mut m = Message::new(Role::Assistant, reply.content.clone().unwrap_or_default());
    m.reasoning = reply.reasoning.clone();
    m.tool_calls = reply
        .calls
        .iter()
        .zip(calls)
        .map(|(c, (_, call_id))| PastCall {
            id: call_id.clone(),
            name: c.name.clone(),
            arguments: c.arguments.clone(),
        })
        .collect();
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_turns() {
        let items = json!([
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "42"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            {"type": "web_search_call", "id": "ws"},
        ]);
        let m = input(&items).unwrap_or_default();
        assert_eq!(m.len(), 4);
        assert_eq!((m[0].role, m[0].content.as_str()), (Role::User, "hi"));
        assert_eq!(m[1].role, Role::Assistant);
        assert_eq!(m[1].reasoning.as_deref(), Some("think"));
        assert_eq!(m[1].tool_calls[0].id, "c1");
        assert_eq!((m[2].role, m[2].content.as_str()), (Role::Tool, "42"));
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(m[3].content, "done");
        let bad = input(
            &json!([{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]),
        );
        assert_eq!(
            bad.err().and_then(|e| e.param).as_deref(),
            Some("input[0].content[0].type")
        );
        let bad = input(&json!([{"role": "wizard", "content": "x"}]));
        assert_eq!(
            bad.err().and_then(|e| e.param).as_deref(),
            Some("input[0].role")
        );
    }

    #[test]
    fn hosted_tools_are_dropped_custom_ones_kept() {
        let (tools, kinds) = tools(&[
            json!({"type": "function", "name": "shell", "parameters": {"type": "object"}}),
            json!({"type": "custom", "name": "apply_patch", "format": {"type": "text"}}),
            json!({"type": "web_search"}),
        ])
        .unwrap_or_default();
        assert_eq!(tools.len(), 2);
        assert!(kinds.is_custom("apply_patch") && !kinds.is_custom("shell"));
    }
}
