//! OpenAI request bodies to engine requests, with the server's defaults and limits. The engine
//! validates what it owns (vocabulary, sampling ranges, context room, `n`); this edge checks
//! what only the wire has (shapes of `prompt`, `stop`, `messages`, another model's name).

use kiln_engine::{
    Constraint, EngineInfo, OutputOptions, Prompt, Request, SamplingParams, StoppingCriteria,
};
use kiln_tokenizer::{ChatOptions, Tokenizer, ToolChoice, ToolFormat, ToolSpec, push_tool};
use serde_json::{Map, Value};

use crate::config::HttpConfig;
use crate::error::{Api, ApiError};
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
    /// Which body field the constraint came from (`response_format`, `structured_outputs`
    /// or `tool_choice`), so the engine's refusal names it.
    pub constraint_via: Option<&'static str>,
    /// Chat with tools on: the syntax to read calls back in.
    pub tools: Option<ToolFormat>,
}

impl Plan {
    /// The body field an engine error about `constraint.<kind>` is about.
    pub(crate) fn constraint_param(&self, engine_field: &str) -> Option<String> {
        let kind = engine_field.strip_prefix("constraint.")?;
        Some(match (self.constraint_via?, kind) {
            ("response_format", "json_schema") => "response_format.json_schema.schema".into(),
            ("response_format", _) => "response_format".into(),
            ("tool_choice", _) => "tool_choice".into(),
            (via, "json_schema") => format!("{via}.json"),
            (via, kind) => format!("{via}.{kind}"),
        })
    }
}

pub(crate) fn check_model(c: &Common, cfg: &HttpConfig) -> Result<(), ApiError> {
    match &c.model {
        Some(m) if !m.is_empty() && *m != cfg.model_id => {
            Err(ApiError::model_not_found(m, &cfg.model_id))
        }
        _ => Ok(()),
    }
}

/// `/v1/chat/completions`: the messages rendered with the chat template (`--chat-template` over
/// the model's own) and tokenized as rendered (the template writes BOS itself when the model
/// wants one).
pub(crate) fn chat(
    body: &ChatRequest,
    common: &Common,
    label: &str,
    tok: &Tokenizer,
    info: &EngineInfo,
    cfg: &HttpConfig,
) -> Result<Plan, ApiError> {
    check_model(common, cfg)?;
    let (tools, specs) = tools(body)?;
    let choice = tool_choice(body.tool_choice.as_ref(), &specs)?;
    let template = cfg
        .chat_template
        .as_deref()
        .or_else(|| tok.chat_template())
        .ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "this model has no chat template (start the server with --chat-template FILE, \
                 or use /v1/completions)",
            )
        })?;
    if body.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "must hold at least one message",
        ));
    }
    let messages = body
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let options = ChatOptions {
        add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
    };
    let tools_on = choice.tools_on(&specs);
    let extra = if tools_on {
        serde_json::json!({"tools": tools})
    } else {
        serde_json::json!({})
    };
    let rendered = tok
        .render_chat_for_tokens(
            Some(template),
            &messages,
            &options,
            &extra,
            cfg.special_tokens_in_content,
        )
        .map_err(|e| ApiError::invalid("messages", e))?;
    info.check_prompt_text("messages", rendered.text())
        .map_err(|e| ApiError::from_engine(&e, Api::Chat))?;
    let format = ToolFormat::for_template(template.source());
    let ids = tok
        .encode_chat(&rendered)
        .map_err(|e| ApiError::invalid("messages", e))?;
    let logprobs = match (body.logprobs, body.top_logprobs) {
        (Some(true), top) => Some(top.unwrap_or(0) as usize),
        (_, Some(top)) if top > 0 => {
            return Err(ApiError::invalid("top_logprobs", "needs `logprobs: true`"));
        }
        _ => None,
    };
    let max_tokens = body.max_completion_tokens.or(common.max_tokens);
    let mut r = request(common, max_tokens, None, logprobs, info, cfg)?;
    r.prompt = Prompt::TokenIds(ids);
    r.label = label.to_owned();
    // A forced call is generated under a grammar of the function's parameter schema, so its
    // arguments always parse and validate.
    let forced = choice.forced(&specs);
    if !forced.is_empty() {
        if r.constraint.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a forced tool call cannot be combined with response_format or structured_outputs",
            ));
        }
        r.constraint = Some(Constraint::Grammar(format.call_grammar(&forced)));
    }
    let mut plan = plan(common, vec![r], logprobs)?;
    plan.tools = tools_on.then_some(format);
    if !forced.is_empty() {
        plan.constraint_via = Some("tool_choice");
    }
    Ok(plan)
}

/// `tools`: as sent (for the template) and as specs (name and parameter schema).
fn tools(body: &ChatRequest) -> Result<(Vec<Value>, Vec<ToolSpec>), ApiError> {
    let Some(list) = &body.tools else {
        return Ok((Vec::new(), Vec::new()));
    };
    let mut specs: Vec<ToolSpec> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let field = |f: &str| format!("tools[{i}]{f}");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(field(".type"), "must be \"function\""));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            ApiError::invalid(field(".function"), "expected an object with `name`")
        })?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        push_tool(&mut specs, name, f.get("parameters").cloned())
            .map_err(|(part, why)| ApiError::invalid(field(&format!(".function.{part}")), why))?;
    }
    Ok((list.clone(), specs))
}

/// `tool_choice` against the tools given (unset: `auto` with tools, `none` without).
fn tool_choice(v: Option<&Value>, specs: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    let bad = |why: String| ApiError::invalid("tool_choice", why);
    let choice = match v {
        None | Some(Value::Null) if specs.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => return Err(bad(format!("`{other}` is not one of none, auto, required"))),
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
    };
    choice.check(specs).map_err(bad)?;
    Ok(choice)
}

/// One message as the template sees it: `role`, `content` as one string, and the tool fields
/// templates read.
fn message(i: usize, m: &ChatMessageIn) -> Result<Value, ApiError> {
    const ROLES: [&str; 6] = [
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
        "function",
    ];
    if !ROLES.contains(&m.role.as_str()) {
        return Err(ApiError::invalid(
            format!("messages[{i}].role"),
            format!("`{}` is not one of {}", m.role, ROLES.join(", ")),
        ));
    }
    let content = match &m.content {
        Value::String(s) => s.clone(),
        Value::Null if m.role == "assistant" => String::new(),
        Value::Null => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                "missing (only an assistant message may leave it out)",
            ));
        }
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let field = format!("messages[{i}].content[{j}]");
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => match p.get("text").and_then(Value::as_str) {
                        Some(t) => texts.push(t),
                        None => return Err(ApiError::invalid(field + ".text", "missing")),
                    },
                    Some(other) => {
                        return Err(ApiError::invalid(
                            field + ".type",
                            format!("`{other}` is not supported (this model reads text parts)"),
                        ));
                    }
                    None => {
                        return Err(ApiError::invalid(field, "expected an object with `type`"));
                    }
                }
            }
            // As vLLM joins a message's text parts.
            texts.join("\n")
        }
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                "expected a string or an array of content parts",
            ));
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), Value::String(m.role.clone()));
    out.insert("content".into(), Value::String(content));
    if let Some(n) = &m.name {
        out.insert("name".into(), Value::String(n.clone()));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    if let Some(calls) = &m.tool_calls {
        out.insert("tool_calls".into(), calls.clone());
    }
    Ok(Value::Object(out))
}

/// `/v1/completions`: one engine request per prompt.
pub(crate) fn completion(
    body: &CompletionRequest,
    common: &Common,
    label: &str,
    info: &EngineInfo,
    cfg: &HttpConfig,
) -> Result<Plan, ApiError> {
    check_model(common, cfg)?;
    if body.echo == Some(true) {
        return Err(ApiError::invalid("echo", "is not supported"));
    }
    if body.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "is not supported"));
    }
    if let Some(b) = body.best_of
        && b != common.n.unwrap_or(1)
    {
        return Err(ApiError::invalid(
            "best_of",
            "is not supported unless equal to n",
        ));
    }
    let prompts = prompts(&body.prompt)?;
    let logprobs = body.logprobs.map(|k| k as usize);
    let template = request(
        common,
        common.max_tokens,
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        logprobs,
        info,
        cfg,
    )?;
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
    plan(common, requests, logprobs)
}

fn plan(c: &Common, requests: Vec<Request>, logprobs: Option<usize>) -> Result<Plan, ApiError> {
    let stream = c.stream.unwrap_or(false);
    let include_usage = c
        .stream_options
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "only allowed with `stream: true`",
        ));
    }
    let constraint_via = requests
        .first()
        .and_then(|r| r.constraint.as_ref())
        .map(|_| {
            if c.structured_outputs.as_ref().is_some_and(|v| !v.is_null()) {
                "structured_outputs"
            } else {
                "response_format"
            }
        });
    Ok(Plan {
        constraint_via,
        tools: None,
        n: requests.first().map_or(1, |r| r.n),
        requests,
        stream,
        include_usage,
        logprobs,
    })
}

/// `prompt`: a string, an array of strings, an array of token ids, or an array of those.
fn prompts(v: &Value) -> Result<Vec<Prompt>, ApiError> {
    let bad = |why: &str| ApiError::invalid("prompt", why);
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
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

/// The engine request both endpoints share (its prompt is set by the caller).
fn request(
    c: &Common,
    max_tokens: Option<u32>,
    endpoint_default: Option<usize>,
    logprobs: Option<usize>,
    info: &EngineInfo,
    cfg: &HttpConfig,
) -> Result<Request, ApiError> {
    let d = SamplingParams::default();
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
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
                    ApiError::invalid("logit_bias", format!("key `{k}` is not a token id"))
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(d.temperature),
        top_k,
        top_p: c.top_p.unwrap_or(d.top_p),
        min_p: c.min_p.unwrap_or(d.min_p),
        repetition_penalty: c.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: c.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: c.frequency_penalty.unwrap_or(d.frequency_penalty),
        logit_bias,
    };
    let stop = match &c.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| ApiError::invalid("stop", "expected strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "expected a string or an array of strings",
            ));
        }
    };
    let limit = cfg
        .max_tokens
        .unwrap_or(info.max_model_len)
        .min(info.max_model_len);
    let max_new_tokens = match max_tokens {
        Some(m) if m as usize > limit => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("{m} exceeds the limit {limit}"),
            ));
        }
        m => m.map(|m| m as usize),
    };
    let mut r = Request::tokens(Vec::new());
    r.sampling = sampling;
    // Any 64-bit integer seeds (negative ones too, as two's complement).
    r.seed = c.seed.map(|s| s as u64);
    r.n = c.n.map_or(1, |n| n as usize);
    r.stopping = StoppingCriteria {
        max_new_tokens,
        // Unset: the server's default, else the endpoint's, else up to the context.
        default_max_new_tokens: cfg
            .default_max_tokens
            .or(endpoint_default)
            .map(|m| m.min(limit)),
        min_new_tokens: c.min_tokens.map_or(0, |m| m as usize),
        stop,
        stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
        include_stop_str_in_output: c.include_stop_str_in_output.unwrap_or(false),
        ignore_eos: c.ignore_eos.unwrap_or(false),
    };
    r.output = OutputOptions {
        logprobs: logprobs.is_some(),
        top_logprobs: logprobs.unwrap_or(0),
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
    };
    r.constraint = constraint(c)?;
    Ok(r)
}

/// The constraint `response_format` or `structured_outputs` asks for (at most one of them);
/// the engine compiles it and refuses what does not compile.
fn constraint(c: &Common) -> Result<Option<Constraint>, ApiError> {
    let from_format = match &c.response_format {
        None | Some(Value::Null) => None,
        Some(f) => response_format(f)?,
    };
    let from_vllm = match &c.structured_outputs {
        None | Some(Value::Null) => None,
        Some(s) => structured_outputs(s)?,
    };
    match (from_format, from_vllm) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "structured_outputs",
            "cannot be combined with a `response_format` other than text; use one",
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// OpenAI's `response_format`.
fn response_format(f: &Value) -> Result<Option<Constraint>, ApiError> {
    let ty = f.get("type").and_then(Value::as_str);
    match ty {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let Some(js) = f.get("json_schema").filter(|v| v.is_object()) else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "expected an object with `name` and `schema`",
                ));
            };
            match js.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(Constraint::JsonSchema(schema.clone())))
                }
                Some(_) => Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "expected a JSON Schema object",
                )),
                None => Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "missing",
                )),
            }
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!("`{other}` is not one of text, json_object, json_schema"),
        )),
        None => Err(ApiError::invalid(
            "response_format",
            "expected an object with `type`",
        )),
    }
}

/// vLLM's `structured_outputs` body extension: exactly one kind of constraint.
fn structured_outputs(s: &Value) -> Result<Option<Constraint>, ApiError> {
    let Value::Object(map) = s else {
        return Err(ApiError::invalid(
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
                        ApiError::invalid(field(k), format!("is not valid JSON: {e}"))
                    })?;
                    Constraint::JsonSchema(schema)
                }
                Value::Object(_) | Value::Bool(_) => Constraint::JsonSchema(v.clone()),
                _ => {
                    return Err(ApiError::invalid(
                        field(k),
                        "expected a JSON Schema (an object or JSON text)",
                    ));
                }
            },
            "regex" | "grammar" => {
                let text = v
                    .as_str()
                    .ok_or_else(|| ApiError::invalid(field(k), "expected a string"))?;
                if k == "regex" {
                    Constraint::Regex(text.to_owned())
                } else {
                    Constraint::Grammar(text.to_owned())
                }
            }
            "choice" => {
                let items = v
                    .as_array()
                    .ok_or_else(|| ApiError::invalid(field(k), "expected an array of strings"))?;
                let choices = items
                    .iter()
                    .map(|x| x.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| ApiError::invalid(field(k), "expected an array of strings"))?;
                Constraint::Choice(choices)
            }
            "json_object" if v == &Value::Bool(true) => Constraint::JsonObject,
            "json_object" => {
                return Err(ApiError::invalid(field(k), "expected true or false"));
            }
            other => {
                return Err(ApiError::invalid(
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
            Err(ApiError::invalid(
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
        assert_eq!(
            out.ok().flatten(),
            Some(serde_json::json!({"role": "user", "content": "a\nb"}))
        );
        let tool = m(serde_json::json!({"role": "tool", "content": "42", "tool_call_id": "c1"}));
        assert_eq!(
            tool.map(|t| message(1, &t).ok()).ok().flatten(),
            Some(serde_json::json!({"role": "tool", "content": "42", "tool_call_id": "c1"}))
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
