//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): its
//! request read into the front doors' shared [`Conversation`], and its answer, whole or as
//! Anthropic's named event stream (`message_start`, `content_block_start` / `_delta` /
//! `_stop` with `thinking_delta`, `signature_delta`, `text_delta` and `input_json_delta`,
//! `message_delta`, `message_stop`, `ping`). Errors take Anthropic's shape. Unknown fields
//! (`metadata`, `cache_control`, ...) are ignored; a malformed known field is a 400 naming it.

use std::hash::{Hash, Hasher};

use axum::response::sse;
use kiln_api::{
    ApiConfig, ApiError, Conversation, Finish, Message, PastCall, Reply, ReplyFormat, Role,
    SamplingOverlay, Tool, echo,
};
use kiln_engine::{Constraint, EngineInfo, Request, Usage};
use kiln_tokenizer::{Tokenizer, ToolCall, ToolChoice};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::convert::{core, render_into};
use crate::error::{ConstraintVia, Door, ErrorReply};
use crate::turn::{Writer, named};

/// `POST /v1/messages` (and `count_tokens`, which reads the same fields).
#[derive(Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    pub model: String,
    /// Required by Anthropic's API; `count_tokens` has none.
    pub max_tokens: Option<u32>,
    pub messages: Vec<Value>,
    /// A string or text blocks.
    pub system: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub stream: Option<bool>,
    /// `{"type": "enabled" | "disabled" | "adaptive", ...}`: `disabled` turns thinking off.
    pub thinking: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema": {...}}}`.
    pub output_config: Option<Value>,
}

/// A validated Messages call.
#[derive(Debug)]
pub(crate) struct Plan {
    pub request: Request,
    pub reply: ReplyFormat,
    pub stream: bool,
    pub via: Option<ConstraintVia>,
    /// Prompt tokens (`message_start` reports them before the engine has).
    pub prompt_tokens: usize,
}

/// The conversation of a Messages body, and where each tool it serves is in the body.
fn conversation(body: &MessagesRequest) -> Result<(Conversation, Vec<usize>), ErrorReply> {
    let mut messages = Vec::with_capacity(body.messages.len() + 1);
    if let Some(system) = &body.system {
        messages.push(Message::new(Role::System, text_blocks(system, "system")?));
    }
    for (i, m) in body.messages.iter().enumerate() {
        turn(i, m, &mut messages)?;
    }
    let mut c = Conversation::new(messages);
    let (tools, tools_at) = tools(body.tools.as_deref().unwrap_or_default())?;
    c.tools = tools;
    c.tool_choice = tool_choice(body.tool_choice.as_ref())?;
    let thinking = body.thinking.as_ref().and_then(|t| t.get("type"));
    if thinking.and_then(Value::as_str) == Some("disabled") {
        c.set_thinking(Some(false));
    }
    Ok((c, tools_at))
}

/// The prompt's tokens, as a create with this body renders it (`count_tokens`).
pub(crate) fn count(
    body: &MessagesRequest,
    tok: &Tokenizer,
    info: &EngineInfo,
    cfg: &ApiConfig,
) -> Result<usize, ErrorReply> {
    let err = core(Door::Messages, None);
    cfg.check_model(Some(&body.model)).map_err(&err)?;
    let (c, tools_at) = conversation(body)?;
    let prepared = c.prepare(tok, info, cfg).map_err(|e| {
        let e = e.renumber_tool(|i| tools_at.get(i).copied().unwrap_or(i));
        err(e)
    })?;
    Ok(prepared.ids.len())
}

pub(crate) fn plan(
    body: &MessagesRequest,
    label: &str,
    tok: &Tokenizer,
    info: &EngineInfo,
    cfg: &ApiConfig,
) -> Result<Plan, ErrorReply> {
    let max_tokens = match body.max_tokens {
        None => return Err(ErrorReply::invalid("max_tokens", "missing").shaped_for(Door::Messages)),
        Some(0) => {
            return Err(
                ErrorReply::invalid("max_tokens", "must be at least 1").shaped_for(Door::Messages)
            );
        }
        Some(m) => m as usize,
    };
    cfg.check_model(Some(&body.model))
        .map_err(core(Door::Messages, None))?;
    let overlay = SamplingOverlay {
        temperature: body.temperature,
        top_p: body.top_p,
        top_k: body.top_k.map(|k| k as usize),
        ..SamplingOverlay::default()
    };
    let mut request = cfg.request_up_to(info, &overlay, max_tokens);
    request.label = label.to_owned();
    request.stopping.stop = body.stop_sequences.clone().unwrap_or_default();
    request.constraint = output_format(body.output_config.as_ref())?;
    let via = request
        .constraint
        .as_ref()
        .map(|_| ConstraintVia::OutputConfig);
    let (c, tools_at) = conversation(body)?;
    let env = (tok, info, cfg);
    let (reply, via) = render_into(&c, &mut request, via, (Door::Messages, &tools_at), env)?;
    let prompt_tokens = match &request.prompt {
        kiln_engine::Prompt::TokenIds(ids) => ids.len(),
        kiln_engine::Prompt::Text(_) => 0,
    };
    Ok(Plan {
        request,
        reply,
        stream: body.stream.unwrap_or(false),
        via,
        prompt_tokens,
    })
}

fn invalid(param: impl Into<String>, why: impl std::fmt::Display) -> ErrorReply {
    ErrorReply::invalid(param, why).shaped_for(Door::Messages)
}

/// `output_config.format`: a JSON schema the reply must match.
fn output_format(v: Option<&Value>) -> Result<Option<Constraint>, ErrorReply> {
    let Some(format) = v.and_then(|o| o.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match (
        format.get("type").and_then(Value::as_str),
        format.get("schema"),
    ) {
        (Some("json_schema"), Some(schema @ (Value::Object(_) | Value::Bool(_)))) => {
            Ok(Some(Constraint::JsonSchema(schema.clone())))
        }
        (Some("json_schema"), _) => Err(invalid(
            "output_config.format.schema",
            "expected a JSON Schema object",
        )),
        _ => Err(invalid("output_config.format.type", "expected json_schema")),
    }
}

/// `system` or a tool result's content: a string or text blocks, joined.
fn text_blocks(v: &Value, field: &str) -> Result<String, ErrorReply> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        texts.push(b.get("text").and_then(Value::as_str).unwrap_or_default());
                    }
                    Some(other) => return Err(unsupported(&format!("{field}[{j}]"), other)),
                    None => return Err(invalid(format!("{field}[{j}].type"), "missing")),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(invalid(
            field,
            "expected a string or an array of text blocks",
        )),
    }
}

fn unsupported(field: &str, kind: &str) -> ErrorReply {
    let why = match kind {
        "image" | "document" => "is not supported until kiln serves a vision model",
        _ => "is not a block kiln reads",
    };
    invalid(format!("{field}.type"), format!("`{}` {why}", echo(kind)))
}

/// One message of the body as the conversation's turns: a user turn's `tool_result` blocks
/// become tool messages, its text a user message; an assistant turn's `thinking`, `text` and
/// `tool_use` blocks one assistant message.
fn turn(i: usize, m: &Value, out: &mut Vec<Message>) -> Result<(), ErrorReply> {
    let at = |f: &str| format!("messages[{i}]{f}");
    let role = match m.get("role").and_then(Value::as_str) {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        _ => return Err(invalid(at(".role"), "expected user or assistant")),
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(Message::new(role, s.clone()));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(invalid(
                at(".content"),
                "expected a string or an array of blocks",
            ));
        }
    };
    let mut text = Vec::new();
    let mut msg = Message::new(role, "");
    for (j, b) in blocks.iter().enumerate() {
        let field = at(&format!(".content[{j}]"));
        let kind = b.get("type").and_then(Value::as_str);
        match (role, kind) {
            (_, Some("text")) => {
                text.push(b.get("text").and_then(Value::as_str).unwrap_or_default())
            }
            (Role::User, Some("tool_result")) => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("{field}.tool_use_id"), "expected a string"))?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_blocks(c, &format!("{field}.content"))?,
                };
                let mut result = Message::new(Role::Tool, content);
                result.tool_call_id = Some(id.to_owned());
                result.is_error = b.get("is_error").and_then(Value::as_bool).unwrap_or(false);
                out.push(result);
            }
            (Role::Assistant, Some("thinking")) => {
                let t = b
                    .get("thinking")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                msg.reasoning = Some(t.to_owned());
            }
            (Role::Assistant, Some("redacted_thinking")) => {}
            (Role::Assistant, Some("tool_use")) => {
                let s = |k: &str| {
                    b.get(k)
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                        .ok_or_else(|| invalid(format!("{field}.{k}"), "expected a string"))
                };
                msg.tool_calls.push(PastCall {
                    id: s("id")?,
                    name: s("name")?,
                    arguments: b.get("input").cloned().unwrap_or(json!({})).to_string(),
                });
            }
            (_, Some(other)) => return Err(unsupported(&field, other)),
            (_, None) => return Err(invalid(format!("{field}.type"), "missing")),
        }
    }
    if role == Role::Assistant || !text.is_empty() {
        msg.content = text.join("\n");
        out.push(msg);
    }
    Ok(())
}

/// `tools`: custom tools with an `input_schema`; Anthropic's server tools (typed
/// `web_search_…`, `bash_…`) are dropped with a log line. With each tool served, where it is
/// in the body.
fn tools(list: &[Value]) -> Result<(Vec<Tool>, Vec<usize>), ErrorReply> {
    let mut tools = Vec::with_capacity(list.len());
    let mut at = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                tracing::info!(tool = %echo(other), "dropping a server tool kiln does not run");
                continue;
            }
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("tools[{i}].name"), "expected a string"))?;
        tools.push(Tool {
            name: name.to_owned(),
            description: t
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_owned),
            parameters: t.get("input_schema").cloned(),
        });
        at.push(i);
    }
    Ok((tools, at))
}

/// `tool_choice`: `auto`, `any` (some call), `tool` (this one) or `none`.
fn tool_choice(v: Option<&Value>) -> Result<Option<ToolChoice>, ErrorReply> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    Ok(Some(match v.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Function(n.to_owned()),
            None => return Err(invalid("tool_choice.name", "missing")),
        },
        _ => {
            return Err(invalid(
                "tool_choice.type",
                "expected auto, any, tool or none",
            ));
        }
    }))
}

/// `stop_reason` and `stop_sequence`.
fn stop(f: Option<&Finish>) -> (&'static str, Option<String>) {
    match f {
        Some(Finish::Length) => ("max_tokens", None),
        Some(Finish::ContextLength) => ("model_context_window_exceeded", None),
        Some(Finish::StopSequence(s)) => ("stop_sequence", Some(s.clone())),
        Some(Finish::ToolCalls) => ("tool_use", None),
        Some(Finish::Eos | Finish::ConstraintComplete | Finish::StopToken(_)) | None => {
            ("end_turn", None)
        }
    }
}

/// kiln's opaque signature of a thinking block (Anthropic's clients send it back unchanged).
fn signature(thinking: &str) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    thinking.hash(&mut h);
    format!("kiln-{:016x}", h.finish())
}

fn tool_use(c: &ToolCall) -> Value {
    let input = serde_json::from_str::<Value>(&c.arguments).unwrap_or(json!({}));
    json!({"type": "tool_use", "id": format!("toolu_{:024x}", rand::random::<u128>() >> 32),
           "name": c.name, "input": input})
}

/// Anthropic's usage: prompt tokens read from the prefix cache are counted apart.
fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_prompt_tokens.min(u.prompt_tokens),
        "cache_read_input_tokens": u.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    })
}

/// The whole message.
pub(crate) fn message(id: &str, model: &str, reply: &Reply, u: &Usage) -> Value {
    let mut content = Vec::new();
    if let Some(r) = &reply.reasoning {
        content.push(json!({"type": "thinking", "thinking": r, "signature": signature(r)}));
    }
    match reply.content.as_deref() {
        Some(t) if !t.is_empty() => content.push(json!({"type": "text", "text": t})),
        // An empty reply is still one (empty) text block, as the stream sends it.
        _ if content.is_empty() && reply.calls.is_empty() => {
            content.push(json!({"type": "text", "text": ""}));
        }
        _ => {}
    }
    content.extend(reply.calls.iter().map(tool_use));
    let (stop_reason, stop_sequence) = stop(reply.finish.as_ref());
    json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage(u)})
}

/// The open content block of a stream.
#[derive(Debug, PartialEq)]
enum Block {
    None,
    Thinking(String),
    Text,
}

/// The stream's events for one message.
#[derive(Debug)]
pub(crate) struct MessagesWriter {
    id: String,
    model: String,
    prompt_tokens: usize,
    index: usize,
    open: Block,
}

impl MessagesWriter {
    pub(crate) fn new(id: String, model: String, prompt_tokens: usize) -> Self {
        Self {
            id,
            model,
            prompt_tokens,
            index: 0,
            open: Block::None,
        }
    }

    fn emit(&self, name: &str, mut data: Value, out: &mut Vec<sse::Event>) {
        data["type"] = json!(name);
        out.push(named(name, &data));
    }

    fn close(&mut self, out: &mut Vec<sse::Event>) {
        match std::mem::replace(&mut self.open, Block::None) {
            Block::None => return,
            Block::Thinking(text) => {
                let delta = json!({"type": "signature_delta", "signature": signature(&text)});
                self.emit(
                    "content_block_delta",
                    json!({"index": self.index, "delta": delta}),
                    out,
                );
            }
            Block::Text => {}
        }
        self.emit("content_block_stop", json!({"index": self.index}), out);
        self.index += 1;
    }

    fn open(&mut self, block: Block, start: Value, out: &mut Vec<sse::Event>) {
        self.close(out);
        self.emit(
            "content_block_start",
            json!({"index": self.index, "content_block": start}),
            out,
        );
        self.open = block;
    }
}

impl Writer for MessagesWriter {
    fn start(&mut self, out: &mut Vec<sse::Event>) {
        let message = json!({"id": self.id, "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null,
            // The whole prompt: which of it the prefix cache holds is known at the end.
            "usage": {"input_tokens": self.prompt_tokens, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0, "output_tokens": 0}});
        self.emit("message_start", json!({"message": message}), out);
        self.emit("ping", json!({}), out);
    }

    fn reasoning(&mut self, delta: &str, out: &mut Vec<sse::Event>) {
        if !matches!(self.open, Block::Thinking(_)) {
            let start = json!({"type": "thinking", "thinking": "", "signature": ""});
            self.open(Block::Thinking(String::new()), start, out);
        }
        if let Block::Thinking(text) = &mut self.open {
            text.push_str(delta);
        }
        let delta = json!({"type": "thinking_delta", "thinking": delta});
        self.emit(
            "content_block_delta",
            json!({"index": self.index, "delta": delta}),
            out,
        );
    }

    fn content(&mut self, delta: &str, out: &mut Vec<sse::Event>) {
        if self.open != Block::Text {
            self.open(Block::Text, json!({"type": "text", "text": ""}), out);
        }
        let delta = json!({"type": "text_delta", "text": delta});
        self.emit(
            "content_block_delta",
            json!({"index": self.index, "delta": delta}),
            out,
        );
    }

    fn end(&mut self, rest: Reply, u: &Usage, out: &mut Vec<sse::Event>) {
        if let Some(r) = rest.reasoning.as_deref().filter(|r| !r.is_empty()) {
            self.reasoning(r, out);
        }
        match rest.content.as_deref() {
            Some(t) if !t.is_empty() => self.content(t, out),
            // An empty reply is still one (empty) text block.
            _ if self.index == 0 && self.open == Block::None && rest.calls.is_empty() => {
                self.open(Block::Text, json!({"type": "text", "text": ""}), out);
            }
            _ => {}
        }
        self.close(out);
        for c in &rest.calls {
            let mut block = tool_use(c);
            let input = block["input"].to_string();
            block["input"] = json!({});
            self.emit(
                "content_block_start",
                json!({"index": self.index, "content_block": block}),
                out,
            );
            let delta = json!({"type": "input_json_delta", "partial_json": input});
            self.emit(
                "content_block_delta",
                json!({"index": self.index, "delta": delta}),
                out,
            );
            self.emit("content_block_stop", json!({"index": self.index}), out);
            self.index += 1;
        }
        let (stop_reason, stop_sequence) = stop(rest.finish.as_ref());
        let delta = json!({"stop_reason": stop_reason, "stop_sequence": stop_sequence});
        self.emit(
            "message_delta",
            json!({"delta": delta, "usage": usage(u)}),
            out,
        );
        self.emit("message_stop", json!({}), out);
    }

    fn fail(&mut self, e: &ApiError, out: &mut Vec<sse::Event>) {
        let reply = ErrorReply::from_api(e, Door::Messages, None);
        // The body Anthropic's shape gives the error, as an `error` event.
        if let Ok(body) = serde_json::from_str::<Value>(&reply.body_json()) {
            out.push(named("error", &body));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_and_blocks() {
        let mut out = Vec::new();
        let assistant = json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "kiln-0"},
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a"}}]});
        let user = json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no", "is_error": true},
            {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]});
        turn(0, &assistant, &mut out).ok();
        turn(1, &user, &mut out).ok();
        assert_eq!(out.len(), 4);
        assert_eq!(out[0].reasoning.as_deref(), Some("hm"));
        assert_eq!(out[0].tool_calls[0].arguments, r#"{"path":"a"}"#);
        assert_eq!((out[1].role, out[1].content.as_str()), (Role::Tool, "x"));
        assert!(out[2].is_error && !out[1].is_error);
        assert_eq!(
            (out[3].role, out[3].content.as_str()),
            (Role::User, "go on")
        );
        let image = json!({"role": "user", "content": [{"type": "image", "source": {}}]});
        let e = turn(2, &image, &mut out).err();
        assert_eq!(
            e.and_then(|e| e.param).as_deref(),
            Some("messages[2].content[0].type")
        );
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(stop(Some(&Finish::Length)).0, "max_tokens");
        assert_eq!(
            stop(Some(&Finish::ContextLength)).0,
            "model_context_window_exceeded"
        );
        assert_eq!(stop(Some(&Finish::ToolCalls)).0, "tool_use");
        assert_eq!(
            stop(Some(&Finish::StopSequence("x".into()))),
            ("stop_sequence", Some("x".into()))
        );
        assert_eq!(stop(Some(&Finish::Eos)).0, "end_turn");
    }
}
