//! A Responses turn's answer: the `response` object (whole, and as the stream's last event)
//! and the stream's typed events, each with `sequence_number`: `response.created`,
//! `response.in_progress`, a `reasoning` item (`response.reasoning_text.delta`/`.done`), a
//! `message` item (`response.content_part.added`, `response.output_text.delta`/`.done`,
//! `response.content_part.done`), call items (`response.function_call_arguments.delta`/`.done`
//! or `response.custom_tool_call_input.delta`/`.done`), each opened by
//! `response.output_item.added` and closed by `response.output_item.done`; then
//! `response.completed`, or `response.incomplete`; a failure is an `error` event, then
//! `response.failed`.

use std::sync::Arc;

use axum::response::sse;
use kiln_api::{ApiError, ErrorKind, Finish, Reply};
use kiln_engine::Usage;
use kiln_tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

use crate::error::{Door, ErrorReply};
use crate::responses::{Plan, ToolKinds, as_history};
use crate::store::ResponseStore;
use crate::turn::{Writer, named};

pub(crate) fn hex_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

/// What every object and event of one response repeats, and where it is kept.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub echo: Map<String, Value>,
    pub kinds: ToolKinds,
    pub tokenizer: Tokenizer,
    /// Where the response goes when it is stored, with the conversation before it.
    pub keep: Option<(Arc<ResponseStore>, Vec<kiln_api::Message>)>,
}

impl Ctx {
    pub(crate) fn new(
        id: String,
        plan: &mut Plan,
        model: String,
        created_at: u64,
        tokenizer: Tokenizer,
        store: &Arc<ResponseStore>,
    ) -> Self {
        Self {
            id,
            created_at,
            model,
            echo: std::mem::take(&mut plan.echo),
            kinds: std::mem::take(&mut plan.kinds),
            tokenizer,
            keep: plan
                .store
                .then(|| (store.clone(), std::mem::take(&mut plan.history))),
        }
    }

    /// The response object.
    fn object(&self, status: &str, output: &[Value], usage: Option<Value>) -> Value {
        let mut o = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": null,
            "incomplete_details": null,
            "reasoning": {"effort": null, "summary": null},
            "truncation": "disabled",
            "user": null,
        });
        if let Value::Object(map) = &mut o {
            map.extend(self.echo.clone());
        }
        o
    }

    fn usage(&self, u: &Usage, reasoning: Option<&str>) -> Value {
        // The reasoning's tokens, counted by tokenizing its text again.
        let reasoning_tokens = reasoning
            .and_then(|r| self.tokenizer.encode(r).ok())
            .map_or(0, |ids| ids.len().min(u.completion_tokens));
        json!({
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        })
    }

    /// The whole response for a finished turn (stored when asked).
    pub(crate) fn finished(&self, reply: &Reply, items: Vec<Value>, usage: &Usage) -> Value {
        let incomplete = matches!(reply.finish, Some(Finish::Length | Finish::ContextLength));
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        let usage = self.usage(usage, reply.reasoning.as_deref());
        let mut o = self.object(status, &items, Some(usage));
        if incomplete {
            o["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        if let Some((store, history)) = &self.keep {
            let calls: Vec<(String, String)> = items
                .iter()
                .filter(|i| i.get("call_id").is_some())
                .map(|i| {
                    let s = |k: &str| i.get(k).and_then(Value::as_str).unwrap_or_default();
                    (s("id").to_owned(), s("call_id").to_owned())
                })
                .collect();
            let mut history = history.clone();
            history.push(as_history(reply, &calls));
            store.put(&self.id, o.clone(), history);
        }
        o
    }
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(id: &str, status: &str, content: Vec<Value>) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

/// A call's item: a function call, or a custom tool's call with its free-form input.
fn call_item(kinds: &ToolKinds, name: &str, arguments: &str, status: &str) -> Value {
    let call_id = format!("call_{:024x}", rand::random::<u128>() >> 32);
    if kinds.is_custom(name) {
        let input = serde_json::from_str::<Value>(arguments)
            .ok()
            .and_then(|v| v.get("input").and_then(Value::as_str).map(str::to_owned))
            .unwrap_or_else(|| arguments.to_owned());
        return json!({"type": "custom_tool_call", "id": hex_id("ctc"), "call_id": call_id,
                      "name": name, "input": input, "status": status});
    }
    json!({"type": "function_call", "id": hex_id("fc"), "call_id": call_id, "name": name,
           "arguments": arguments, "status": status})
}

/// A whole output's items: reasoning, the message (when there is text, or nothing else), the
/// calls.
pub(crate) fn items(ctx: &Ctx, reply: &Reply) -> Vec<Value> {
    let mut out = Vec::new();
    if let Some(r) = &reply.reasoning {
        out.push(reasoning_item(&hex_id("rs"), r));
    }
    let text = reply.content.as_deref().unwrap_or_default();
    if !text.is_empty() || reply.calls.is_empty() {
        out.push(message_item(
            &hex_id("msg"),
            "completed",
            vec![text_part(text)],
        ));
    }
    for c in &reply.calls {
        out.push(call_item(&ctx.kinds, &c.name, &c.arguments, "completed"));
    }
    out
}

/// Which item is open in the stream.
#[derive(Debug)]
enum Open {
    None,
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
}

/// The stream's events for one turn.
#[derive(Debug)]
pub(crate) struct ResponsesWriter {
    ctx: Ctx,
    seq: u64,
    open: Open,
    /// Items done, in order.
    items: Vec<Value>,
    /// All the reasoning and all the text so far, for the stored conversation.
    reasoning: String,
    text: String,
}

impl ResponsesWriter {
    pub(crate) fn new(ctx: Ctx) -> Self {
        Self {
            ctx,
            seq: 0,
            open: Open::None,
            items: Vec::new(),
            reasoning: String::new(),
            text: String::new(),
        }
    }

    fn emit(&mut self, name: &str, mut data: Value, out: &mut Vec<sse::Event>) {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.push(named(name, &data));
    }

    fn index(&self) -> usize {
        self.items.len()
    }

    /// Opens `item` at the next output index.
    fn add(&mut self, item: &Value, out: &mut Vec<sse::Event>) {
        let i = self.index();
        self.emit(
            "response.output_item.added",
            json!({"output_index": i, "item": item}),
            out,
        );
    }

    fn done(&mut self, item: Value, out: &mut Vec<sse::Event>) {
        let i = self.index();
        self.emit(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
            out,
        );
        self.items.push(item);
    }

    /// Closes the open item.
    fn close(&mut self, out: &mut Vec<sse::Event>) {
        let i = self.index();
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => {}
            Open::Reasoning { id, text } => {
                let ev =
                    json!({"item_id": id, "output_index": i, "content_index": 0, "text": text});
                self.emit("response.reasoning_text.done", ev, out);
                self.done(reasoning_item(&id, &text), out);
            }
            Open::Message { id, text } => {
                let at = json!({"item_id": id, "output_index": i, "content_index": 0});
                let mut ev = at.clone();
                ev["text"] = json!(text);
                ev["logprobs"] = json!([]);
                self.emit("response.output_text.done", ev, out);
                let mut ev = at;
                ev["part"] = text_part(&text);
                self.emit("response.content_part.done", ev, out);
                self.done(message_item(&id, "completed", vec![text_part(&text)]), out);
            }
        }
    }

    fn open_message(&mut self, out: &mut Vec<sse::Event>) -> String {
        if let Open::Message { id, .. } = &self.open {
            return id.clone();
        }
        self.close(out);
        let id = hex_id("msg");
        self.add(&message_item(&id, "in_progress", Vec::new()), out);
        let i = self.index();
        let ev =
            json!({"item_id": id, "output_index": i, "content_index": 0, "part": text_part("")});
        self.emit("response.content_part.added", ev, out);
        self.open = Open::Message {
            id: id.clone(),
            text: String::new(),
        };
        id
    }

    fn call(&mut self, name: &str, arguments: &str, out: &mut Vec<sse::Event>) {
        let done = call_item(&self.ctx.kinds, name, arguments, "completed");
        let mut added = done.clone();
        added["status"] = json!("in_progress");
        let custom = done["type"] == "custom_tool_call";
        let (field, delta, finished) = if custom {
            (
                "input",
                "response.custom_tool_call_input.delta",
                "response.custom_tool_call_input.done",
            )
        } else {
            (
                "arguments",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
            )
        };
        added[field] = json!("");
        self.add(&added, out);
        let i = self.index();
        let text = done[field].clone();
        let id = done["id"].clone();
        self.emit(
            delta,
            json!({"item_id": id, "output_index": i, "delta": text}),
            out,
        );
        self.emit(
            finished,
            json!({"item_id": id, "output_index": i, field: text}),
            out,
        );
        self.done(done, out);
    }
}

impl Writer for ResponsesWriter {
    fn start(&mut self, out: &mut Vec<sse::Event>) {
        let r = self.ctx.object("in_progress", &[], None);
        self.emit("response.created", json!({"response": r}), out);
        self.emit("response.in_progress", json!({"response": r}), out);
    }

    fn reasoning(&mut self, delta: &str, out: &mut Vec<sse::Event>) {
        self.reasoning.push_str(delta);
        if !matches!(self.open, Open::Reasoning { .. }) {
            self.close(out);
            let id = hex_id("rs");
            let item = json!({"type": "reasoning", "id": id, "summary": [], "content": []});
            self.add(&item, out);
            self.open = Open::Reasoning {
                id,
                text: String::new(),
            };
        }
        let i = self.index();
        if let Open::Reasoning { id, text } = &mut self.open {
            text.push_str(delta);
            let ev = json!({"item_id": id, "output_index": i, "content_index": 0, "delta": delta});
            self.emit("response.reasoning_text.delta", ev, out);
        }
    }

    fn content(&mut self, delta: &str, out: &mut Vec<sse::Event>) {
        self.text.push_str(delta);
        let id = self.open_message(out);
        let i = self.index();
        if let Open::Message { text, .. } = &mut self.open {
            text.push_str(delta);
        }
        let ev = json!({"item_id": id, "output_index": i, "content_index": 0, "delta": delta,
                        "logprobs": []});
        self.emit("response.output_text.delta", ev, out);
    }

    fn end(&mut self, mut rest: Reply, usage: &Usage, out: &mut Vec<sse::Event>) {
        if let Some(r) = rest.reasoning.take().filter(|r| !r.is_empty()) {
            self.reasoning(&r, out);
        }
        let text = rest.content.take().unwrap_or_default();
        let wrote_text = matches!(self.open, Open::Message { .. })
            || self.items.iter().any(|i| i["type"] == "message");
        if !text.is_empty() || (!wrote_text && rest.calls.is_empty()) {
            // An empty reply is still one (empty) message.
            self.open_message(out);
            if !text.is_empty() {
                self.content(&text, out);
            }
        }
        self.close(out);
        for c in &rest.calls {
            self.call(&c.name, &c.arguments, out);
        }
        // The reply as a whole, for the stored conversation.
        let reply = Reply {
            reasoning: (!self.reasoning.is_empty()).then(|| self.reasoning.clone()),
            content: Some(std::mem::take(&mut self.text)),
            calls: rest.calls,
            finish: rest.finish,
        };
        let items = std::mem::take(&mut self.items);
        let r = self.ctx.finished(&reply, items, usage);
        let name = if r["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(name, json!({"response": r}), out);
    }

    fn fail(&mut self, e: &ApiError, out: &mut Vec<sse::Event>) {
        let reply = ErrorReply::from_api(e, Door::Responses, None);
        let ev = json!({"code": reply.code, "message": reply.message, "param": reply.param});
        self.emit("error", ev, out);
        let mut r = self.ctx.object("failed", &self.items, None);
        // `response.error.code` is one of OpenAI's few codes.
        let code = match e.kind() {
            ErrorKind::Overloaded => "rate_limit_exceeded",
            _ => "server_error",
        };
        r["error"] = json!({"code": code, "message": reply.message});
        self.emit("response.failed", json!({"response": r}), out);
    }
}
