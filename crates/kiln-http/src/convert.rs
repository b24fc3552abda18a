//! OpenAI request bodies to engine requests, with the server's defaults and limits. The engine
//! validates what it owns (vocabulary, sampling ranges, context room, `n`); this edge checks
//! what only the wire has (shapes of `prompt`, `stop`, `messages`, another model's name).

use kiln_api::{
    ApiConfig, ApiError, Conversation, Field, Message, MessagePart, PastCall, ReplyFormat, Role,
    SamplingOverlay, Tool, echo,
};
use kiln_engine::{Constraint, EngineInfo, OutputOptions, Prompt, Request};
use kiln_tokenizer::{Tokenizer, ToolChoice};
use serde_json::Value;

use crate::error::{ConstraintVia, Door, ErrorReply};
use crate::openai::{ChatMessageIn, ChatRequest, Common, CompletionRequest};

/// The legacy completions API's default `max_tokens` (OpenAI's and vLLM's).
const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// One validated call: an engine request per prompt, and how to answer.
#[derive(Debug)]
pub(crate) struct Plan {
    pub requests: Vec<Request>,
    /// Outputs per prompt.
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// Alternatives per token when logprobs were asked for.
    pub logprobs: Option<usize>,
    /// Which body field the constraint came from, so the engine's refusal names it.
    pub constraint_via: Option<ConstraintVia>,
    /// How outputs read (reasoning, tool calls).
    pub reply: ReplyFormat,
    /// Completions' `echo`: each prompt's text, put in front of its outputs.
    pub echo: Option<Vec<String>>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token.
    pub prompt_logprobs: Option<usize>,
}

/// An error of the front-door core, in `door`'s words.
pub(crate) fn core(
    door: Door,
    via: Option<ConstraintVia>,
) -> impl Fn(kiln_api::ApiError) -> ErrorReply {
    move |e| ErrorReply::from_api(&e, door, via)
}

/// Renders `c` into `r` as every door does; with a forced call, its grammar is the request's
/// constraint (so an error about it names `tool_choice`, else `via`). `tools_at[i]` is where
/// the body has `c.tools[i]` (empty: the same place), for a door that dropped some.
pub(crate) fn render_into(
    c: &Conversation,
    r: &mut Request,
    via: Option<ConstraintVia>,
    (door, tools_at): (Door, &[usize]),
    (tok, info, cfg): (&Tokenizer, &EngineInfo, &ApiConfig),
) -> Result<(ReplyFormat, Option<ConstraintVia>), ErrorReply> {
    let prepared = c.prepare(tok, info, cfg).map_err(|e| {
        let e = e.renumber_tool(|i| tools_at.get(i).copied().unwrap_or(i));
        ErrorReply::from_api(&e, door, via)
    })?;
    let via = if prepared.forced.is_some() {
        Some(ConstraintVia::ToolChoice)
    } else {
        via
    };
    Ok((prepared.apply(r), via))
}

/// `/v1/chat/completions`: the messages rendered as every door renders a conversation.
pub(crate) fn chat(
    body: &ChatRequest,
    common: &Common,
    label: &str,
    tok: &Tokenizer,
    info: &EngineInfo,
    cfg: &ApiConfig,
) -> Result<Plan, ErrorReply> {
    let err = core(Door::Chat, None);
    cfg.check_model(common.model.as_deref()).map_err(&err)?;
    let mut conversation = Conversation::new(
        body.messages
            .iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<_, _>>()?,
    );
    conversation.tools = tools(body)?;
    conversation.tool_choice = tool_choice(body.tool_choice.as_ref())?;
    conversation.add_generation_prompt = body.add_generation_prompt.unwrap_or(true);
    if let Some(kwargs) = &body.chat_template_kwargs {
        conversation.template_kwargs = kwargs.clone();
    }
    let logprobs = match (body.logprobs, body.top_logprobs) {
        (Some(true), top) => Some(top.unwrap_or(0) as usize),
        (_, Some(top)) if top > 0 => {
            return Err(ErrorReply::invalid(
                "top_logprobs",
                "needs `logprobs: true`",
            ));
        }
        _ => None,
    };
    let max_tokens = body.max_completion_tokens.or(common.max_tokens);
    let mut r = request(common, max_tokens, None, logprobs, info, cfg, Door::Chat)?;
    r.label = label.to_owned();
    let via = constraint_via(common, &r);
    let (reply, via) = render_into(
        &conversation,
        &mut r,
        via,
        (Door::Chat, &[]),
        (tok, info, cfg),
    )?;
    let mut plan = plan(common, vec![r], logprobs, via)?;
    plan.reply = reply;
    Ok(plan)
}

/// `tools`: OpenAI function tools.
fn tools(body: &ChatRequest) -> Result<Vec<Tool>, ErrorReply> {
    let Some(list) = &body.tools else {
        return Ok(Vec::new());
    };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let field = |f: &str| format!("tools[{i}]{f}");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ErrorReply::invalid(field(".type"), "must be \"function\""));
            }
            let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
                ErrorReply::invalid(field(".function"), "expected an object with `name`")
            })?;
            Ok(Tool {
                name: f
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                parameters: f.get("parameters").cloned(),
            })
        })
        .collect()
}

/// `tool_choice` (unset: the core's default for the tools given).
fn tool_choice(v: Option<&Value>) -> Result<Option<ToolChoice>, ErrorReply> {
    let bad = |why: String| ErrorReply::invalid("tool_choice", why);
    Ok(Some(match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "`{}` is not one of none, auto, required",
                    echo(other)
                )));
            }
        },
        Some(o @ Value::Object(_)) => {
            let name = o
                .pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad("expected {\"type\": \"function\", \"function\": {\"name\": ...}}".into())
                })?;
            ToolChoice::Function(name.to_owned())
        }
        Some(_) => return Err(bad("expected a string or an object".into())),
    }))
}

/// One message as the core reads it: its role, its content as one string, and the tool and
/// reasoning fields of a turn.
fn message(i: usize, m: &ChatMessageIn) -> Result<Message, ErrorReply> {
    let bad = |part: MessagePart, why: String| {
        let e = ApiError::invalid(Field::Message { index: i, part }, why);
        ErrorReply::from_api(&e, Door::Chat, None)
    };
    let role = Role::parse(&m.role).ok_or_else(|| {
        bad(
            MessagePart::Role,
            format!(
                "`{}` is not one of {}, function",
                echo(&m.role),
                Role::NAMES.join(", ")
            ),
        )
    })?;
    let content = match &m.content {
        Value::String(s) => s.clone(),
        Value::Null if role == Role::Assistant => String::new(),
        Value::Null => {
            return Err(bad(
                MessagePart::Content,
                "missing (only an assistant message may leave it out)".into(),
            ));
        }
        Value::Array(parts) => text_parts(parts, &format!("messages[{i}].content"))?,
        _ => {
            return Err(bad(
                MessagePart::Content,
                "expected a string or an array of content parts".into(),
            ));
        }
    };
    let mut out = Message::new(role, content);
    out.name = m.name.clone();
    out.tool_call_id = m.tool_call_id.clone();
    out.tool_calls = match &m.tool_calls {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) => calls
            .iter()
            .enumerate()
            .map(|(j, c)| past_call(c).ok_or_else(|| {
                ErrorReply::invalid(
                    format!("messages[{i}].tool_calls[{j}]"),
                    "expected {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
                )
            }))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad(MessagePart::ToolCalls, "expected an array".into())),
    };
    // vLLM's current name and DeepSeek's (llama.cpp, Open WebUI).
    out.reasoning = m.reasoning_content.clone().or_else(|| m.reasoning.clone());
    Ok(out)
}

/// A message's text parts joined as vLLM joins them.
fn text_parts(parts: &[Value], field: &str) -> Result<String, ErrorReply> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let field = format!("{field}[{j}]");
        match p.get("type").and_then(Value::as_str) {
            Some("text") => match p.get("text").and_then(Value::as_str) {
                Some(t) => texts.push(t),
                None => return Err(ErrorReply::invalid(field + ".text", "missing")),
            },
            Some(other) => {
                return Err(ErrorReply::invalid(
                    field + ".type",
                    format!(
                        "`{}` is not supported (this model reads text parts)",
                        echo(other)
                    ),
                ));
            }
            None => return Err(ErrorReply::invalid(field, "expected an object with `type`")),
        }
    }
    Ok(texts.join("\n"))
}

/// A call of an assistant turn in the history (`arguments` as JSON text, or as an object
/// some clients send).
fn past_call(c: &Value) -> Option<PastCall> {
    let f = c.get("function")?;
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => "{}".to_owned(),
        Some(other) => other.to_string(),
    };
    Some(PastCall {
        id: c
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        name: f.get("name")?.as_str()?.to_owned(),
        arguments,
    })
}

/// `/v1/completions`: one engine request per prompt.
pub(crate) fn completion(
    body: &CompletionRequest,
    common: &Common,
    label: &str,
    tok: &Tokenizer,
    info: &EngineInfo,
    cfg: &ApiConfig,
) -> Result<Plan, ErrorReply> {
    cfg.check_model(common.model.as_deref())
        .map_err(core(Door::Completions, None))?;
    let echo = body.echo.unwrap_or(false);
    if echo && common.stream == Some(true) && common.n.unwrap_or(1) > 1 {
        return Err(ErrorReply::invalid(
            "echo",
            "cannot be combined with `stream: true` and `n` > 1",
        ));
    }
    if body.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ErrorReply::invalid("suffix", "is not supported"));
    }
    if let Some(b) = body.best_of
        && b != common.n.unwrap_or(1)
    {
        return Err(ErrorReply::invalid(
            "best_of",
            "is not supported unless equal to n",
        ));
    }
    let prompts = prompts(&body.prompt)?;
    let logprobs = body.logprobs.map(|k| k as usize);
    let echoes = echo.then(|| prompts.iter().map(|p| echo_text(p, tok)).collect());
    if common.max_tokens == Some(0) && !echo && common.prompt_logprobs.is_none() {
        return Err(ErrorReply::invalid(
            "max_tokens",
            "must be at least 1, or 0 with `echo` (the prompt alone) or `prompt_logprobs`",
        ));
    }
    let mut template = request(
        common,
        common.max_tokens,
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        logprobs,
        info,
        cfg,
        Door::Completions,
    )?;
    if echo {
        // An echoed prompt's logprobs (and `max_tokens: 0`, the prompt alone) need the
        // prompt scored.
        let want = match (logprobs, common.max_tokens) {
            (Some(k), _) => Some(k),
            (None, Some(0)) => Some(0),
            (None, _) => None,
        };
        let o = &mut template.output;
        o.prompt_logprobs = o.prompt_logprobs.max(want);
    }
    let via = constraint_via(common, &template);
    let requests = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = template.clone();
            r.prompt = p;
            r.label = if i == 0 {
                label.to_owned()
            } else {
                format!("{label}-{i}")
            };
            r
        })
        .collect();
    let mut plan = plan(common, requests, logprobs, via)?;
    plan.echo = echoes;
    Ok(plan)
}

/// What `echo` shows of `prompt`: its text as sent, or its ids decoded (special tokens kept;
/// ids outside the vocabulary are the engine's to refuse, by field).
fn echo_text(prompt: &Prompt, tok: &Tokenizer) -> String {
    match prompt {
        Prompt::Text(text) => text.clone(),
        Prompt::TokenIds(ids) => {
            let keep = kiln_tokenizer::DecodeOptions {
                skip_special_tokens: false,
            };
            tok.decode_with(ids, keep).unwrap_or_default()
        }
    }
}

/// Which field the request's constraint came from.
fn constraint_via(c: &Common, r: &Request) -> Option<ConstraintVia> {
    r.constraint.as_ref().map(|_| {
        if c.structured_outputs.as_ref().is_some_and(|v| !v.is_null()) {
            ConstraintVia::StructuredOutputs
        } else {
            ConstraintVia::ResponseFormat
        }
    })
}

fn plan(
    c: &Common,
    requests: Vec<Request>,
    logprobs: Option<usize>,
    constraint_via: Option<ConstraintVia>,
) -> Result<Plan, ErrorReply> {
    let stream = c.stream.unwrap_or(false);
    let include_usage = c
        .stream_options
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ErrorReply::invalid(
            "stream_options",
            "only allowed with `stream: true`",
        ));
    }
    Ok(Plan {
        constraint_via,
        reply: ReplyFormat::default(),
        n: requests.first().map_or(1, |r| r.n),
        requests,
        stream,
        include_usage,
        logprobs,
        echo: None,
        prompt_logprobs: c.prompt_logprobs.map(|k| k as usize),
    })
}

/// `prompt`: a string, an array of strings, an array of token ids, or an array of those.
fn prompts(v: &Value) -> Result<Vec<Prompt>, ErrorReply> {
    let bad = |why: &str| ErrorReply::invalid("prompt", why);
    let ids = |items: &[Value]| -> Result<Vec<u32>, ErrorReply> {
        items
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| bad("token ids must be integers in 0..2^32"))
            })
            .collect()
    };
    match v {
        Value::String(s) => Ok(vec![Prompt::Text(s.clone())]),
        Value::Array(items) if items.is_empty() => Err(bad("is empty")),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|x| match x {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    _ => Err(bad("an array of strings holds something else")),
                })
                .collect(),
            Value::Number(_) => Ok(vec![Prompt::TokenIds(ids(items)?)]),
            Value::Array(_) => items
                .iter()
                .map(|x| match x {
                    Value::Array(inner) => Ok(Prompt::TokenIds(ids(inner)?)),
                    _ => Err(bad("an array of token-id arrays holds something else")),
                })
                .collect(),
            _ => Err(bad(
                "expected a string, an array of strings, an array of token ids, or an array of those",
            )),
        },
        Value::Null => Err(bad("missing")),
        _ => Err(bad(
            "expected a string, an array of strings, an array of token ids, or an array of those",
        )),
    }
}

/// The engine request both endpoints share (its prompt is set by the caller): the body's
/// sampling over the server's defaults, and its length under the server's limit.
fn request(
    c: &Common,
    max_tokens: Option<u32>,
    wire_default: Option<usize>,
    logprobs: Option<usize>,
    info: &EngineInfo,
    cfg: &ApiConfig,
    door: Door,
) -> Result<Request, ErrorReply> {
    let top_k = match c.top_k {
        None => None,
        Some(-1 | 0) => Some(0),
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(ErrorReply::invalid(
                "top_k",
                format!("must be -1 (off) or positive, got {k}"),
            ));
        }
    };
    let logit_bias = match &c.logit_bias {
        None => Default::default(),
        Some(map) => map
            .iter()
            .map(|(k, &v)| {
                k.parse::<u32>().map(|id| (id, v)).map_err(|_| {
                    ErrorReply::invalid(
                        "logit_bias",
                        format!("key `{}` is not a token id", echo(k)),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let overlay = SamplingOverlay {
        temperature: c.temperature,
        top_k,
        top_p: c.top_p,
        min_p: c.min_p,
        repetition_penalty: c.repetition_penalty,
        presence_penalty: c.presence_penalty,
        frequency_penalty: c.frequency_penalty,
        logit_bias,
    };
    let mut r = cfg
        .request(info, &overlay, max_tokens.map(|m| m as usize), wire_default)
        .map_err(core(door, None))?;
    r.stopping.stop = stop(c.stop.as_ref())?;
    r.stopping.min_new_tokens = c.min_tokens.map_or(0, |m| m as usize);
    r.stopping.stop_token_ids = c.stop_token_ids.clone().unwrap_or_default();
    r.stopping.include_stop_str_in_output = c.include_stop_str_in_output.unwrap_or(false);
    r.stopping.ignore_eos = c.ignore_eos.unwrap_or(false);
    // Any 64-bit integer seeds (negative ones too, as two's complement).
    r.seed = c.seed.map(|s| s as u64);
    r.n = c.n.map_or(1, |n| n as usize);
    r.output = OutputOptions {
        logprobs: logprobs.is_some(),
        top_logprobs: logprobs.unwrap_or(0),
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
        prompt_logprobs: c.prompt_logprobs.map(|k| k as usize),
    };
    r.constraint = constraint(c)?;
    Ok(r)
}

/// `stop`: a string or an array of strings.
fn stop(v: Option<&Value>) -> Result<Vec<String>, ErrorReply> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| ErrorReply::invalid("stop", "expected strings"))
            })
            .collect(),
        Some(_) => Err(ErrorReply::invalid(
            "stop",
            "expected a string or an array of strings",
        )),
    }
}

/// The constraint `response_format` or `structured_outputs` asks for (at most one of them);
/// the engine compiles it and refuses what does not compile.
fn constraint(c: &Common) -> Result<Option<Constraint>, ErrorReply> {
    let from_format = match &c.response_format {
        None | Some(Value::Null) => None,
        Some(f) => response_format(f)?,
    };
    let from_vllm = match &c.structured_outputs {
        None | Some(Value::Null) => None,
        Some(s) => structured_outputs(s)?,
    };
    match (from_format, from_vllm) {
        (Some(_), Some(_)) => Err(ErrorReply::invalid(
            "structured_outputs",
            "cannot be combined with a `response_format` other than text; use one",
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// OpenAI's `response_format`.
fn response_format(f: &Value) -> Result<Option<Constraint>, ErrorReply> {
    let ty = f.get("type").and_then(Value::as_str);
    match ty {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let Some(js) = f.get("json_schema").filter(|v| v.is_object()) else {
                return Err(ErrorReply::invalid(
                    "response_format.json_schema",
                    "expected an object with `name` and `schema`",
                ));
            };
            match js.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(Constraint::JsonSchema(schema.clone())))
                }
                Some(_) => Err(ErrorReply::invalid(
                    "response_format.json_schema.schema",
                    "expected a JSON Schema object",
                )),
                None => Err(ErrorReply::invalid(
                    "response_format.json_schema.schema",
                    "missing",
                )),
            }
        }
        Some(other) => Err(ErrorReply::invalid(
            "response_format.type",
            format!("`{other}` is not one of text, json_object, json_schema"),
        )),
        None => Err(ErrorReply::invalid(
            "response_format",
            "expected an object with `type`",
        )),
    }
}

/// vLLM's `structured_outputs` body extension: exactly one kind of constraint.
fn structured_outputs(s: &Value) -> Result<Option<Constraint>, ErrorReply> {
    let Value::Object(map) = s else {
        return Err(ErrorReply::invalid(
            "structured_outputs",
            "expected an object with one of json, regex, choice, grammar, json_object",
        ));
    };
    let field = |k: &str| format!("structured_outputs.{k}");
    let mut found = Vec::new();
    for (k, v) in map {
        if v.is_null() || v == &Value::Bool(false) {
            continue;
        }
        let c = match k.as_str() {
            "json" => match v {
                Value::String(text) => {
                    let schema = serde_json::from_str(text).map_err(|e| {
                        ErrorReply::invalid(field(k), format!("is not valid JSON: {e}"))
                    })?;
                    Constraint::JsonSchema(schema)
                }
                Value::Object(_) | Value::Bool(_) => Constraint::JsonSchema(v.clone()),
                _ => {
                    return Err(ErrorReply::invalid(
                        field(k),
                        "expected a JSON Schema (an object or JSON text)",
                    ));
                }
            },
            "regex" | "grammar" => {
                let text = v
                    .as_str()
                    .ok_or_else(|| ErrorReply::invalid(field(k), "expected a string"))?;
                if k == "regex" {
                    Constraint::Regex(text.to_owned())
                } else {
                    Constraint::Grammar(text.to_owned())
                }
            }
            "choice" => {
                let items = v
                    .as_array()
                    .ok_or_else(|| ErrorReply::invalid(field(k), "expected an array of strings"))?;
                let choices = items
                    .iter()
                    .map(|x| x.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| ErrorReply::invalid(field(k), "expected an array of strings"))?;
                Constraint::Choice(choices)
            }
            "json_object" if v == &Value::Bool(true) => Constraint::JsonObject,
            "json_object" => {
                return Err(ErrorReply::invalid(field(k), "expected true or false"));
            }
            other => {
                return Err(ErrorReply::invalid(
                    field(other),
                    "is not supported (kiln serves json, regex, choice, grammar, json_object)",
                ));
            }
        };
        found.push((k.clone(), c));
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop().map(|(_, c)| c)),
        _ => {
            let names: Vec<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
            Err(ErrorReply::invalid(
                "structured_outputs",
                format!(
                    "only one kind of constraint at a time, got {}",
                    names.join(", ")
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_shapes() {
        let p = |v: Value| prompts(&v);
        assert_eq!(p("hi".into()).ok(), Some(vec![Prompt::Text("hi".into())]));
        assert_eq!(
            p(serde_json::json!(["a", "b"])).ok(),
            Some(vec![Prompt::Text("a".into()), Prompt::Text("b".into())])
        );
        assert_eq!(
            p(serde_json::json!([1, 2])).ok(),
            Some(vec![Prompt::TokenIds(vec![1, 2])])
        );
        assert_eq!(
            p(serde_json::json!([[1], [2, 3]])).ok(),
            Some(vec![
                Prompt::TokenIds(vec![1]),
                Prompt::TokenIds(vec![2, 3])
            ])
        );
        for bad in [
            serde_json::json!([]),
            serde_json::json!(["a", 1]),
            serde_json::json!([1, -2]),
            serde_json::json!([1.5]),
            serde_json::json!([[1], "a"]),
            serde_json::json!({"text": "a"}),
            serde_json::json!(null),
            serde_json::json!([true]),
        ] {
            let err = p(bad.clone()).err();
            assert_eq!(
                err.and_then(|e| e.param).as_deref(),
                Some("prompt"),
                "{bad}"
            );
        }
    }

    #[test]
    fn message_content_forms() {
        let m = |v: Value| serde_json::from_value::<ChatMessageIn>(v).map_err(|e| e.to_string());
        let parts = m(serde_json::json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}));
        let out = parts.map(|p| message(0, &p).ok());
        assert_eq!(out.ok().flatten(), Some(Message::new(Role::User, "a\nb")));
        let tool = m(serde_json::json!({"role": "tool", "content": "42", "tool_call_id": "c1"}));
        assert_eq!(
            tool.map(|t| message(1, &t).ok()).ok().flatten(),
            Some(Message {
                tool_call_id: Some("c1".into()),
                ..Message::new(Role::Tool, "42")
            })
        );
        for (v, param) in [
            (
                serde_json::json!({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
                "messages[3].content[0].type",
            ),
            (
                serde_json::json!({"role": "wizard", "content": "x"}),
                "messages[3].role",
            ),
            (
                serde_json::json!({"role": "user", "content": null}),
                "messages[3].content",
            ),
            (
                serde_json::json!({"role": "user", "content": 5}),
                "messages[3].content",
            ),
        ] {
            let msg = m(v.clone()).ok();
            let err = msg.and_then(|msg| message(3, &msg).err());
            assert_eq!(err.and_then(|e| e.param).as_deref(), Some(param), "{v}");
        }
    }
}
