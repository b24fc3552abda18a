//! Protobuf requests to engine requests (with the server's defaults and limits) and engine
//! output back to protobuf. The engine validates what it owns (vocabulary, sampling ranges,
//! context room); this edge checks what only the wire has (a missing prompt, another model,
//! the server's own limits).

use std::time::Instant;

use kiln_engine::{
    Constraint, Delta, EngineInfo, FinishReason, OutputOptions, Prompt, Request, SamplingParams,
    SeqOutput, StoppingCriteria, Timing, TokenLogprobs, Usage,
};
use kiln_tokenizer::{
    ChatOptions, ChatTemplate, RenderedChat, Tokenizer, ToolChoice, ToolFormat, ToolSpec, push_tool,
};
use serde_json::{Value, json};
use tonic::Status;

use crate::config::ServerConfig;
use crate::pb;
use crate::status::{from_engine, invalid};

/// What the response side needs to know about the request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReplyOptions {
    /// Chat with tools on: replies are read for calls in this syntax (and a stream holds each
    /// output until it ends).
    pub tools: Option<ToolFormat>,
    pub token_ids: bool,
    pub logprobs: bool,
    /// Tokens per streamed message (at least 1).
    pub stream_interval: usize,
}

/// The largest `max_new_tokens` a request may ask for.
pub(crate) fn max_new_tokens_limit(cfg: &ServerConfig, info: &EngineInfo) -> usize {
    cfg.max_new_tokens
        .unwrap_or(info.max_model_len)
        .min(info.max_model_len)
}

/// A rendered chat prompt and its tools.
pub(crate) struct Chat {
    pub rendered: RenderedChat,
    /// Tools on: the syntax replies are read in.
    pub tools: Option<ToolFormat>,
    /// The functions a forced call picks among (empty: not forced).
    pub forced: Vec<ToolSpec>,
}

/// Renders with `--chat-template` when one was given, else the model's own (ChatML when the
/// model has none); with tools on, the tools go to the template as transformers passes
/// OpenAI tools.
pub(crate) fn chat(
    tok: &Tokenizer,
    chat: &pb::ChatMessages,
    field: &str,
    cfg: &ServerConfig,
) -> Result<Chat, Status> {
    if chat.messages.is_empty() {
        return Err(invalid(field, "has no messages"));
    }
    let mut specs: Vec<ToolSpec> = Vec::with_capacity(chat.tools.len());
    let mut tools_json = Vec::with_capacity(chat.tools.len());
    for (i, t) in chat.tools.iter().enumerate() {
        let at = |f: &str| format!("{field}.tools[{i}].{f}");
        let parameters =
            if t.parameters_json.trim().is_empty() {
                None
            } else {
                Some(serde_json::from_str(&t.parameters_json).map_err(|e| {
                    invalid(&at("parameters_json"), format!("is not valid JSON: {e}"))
                })?)
            };
        push_tool(&mut specs, &t.name, parameters).map_err(|(part, why)| {
            let part = if part == "parameters" {
                "parameters_json"
            } else {
                part
            };
            invalid(&at(part), why)
        })?;
        let parameters = specs
            .last()
            .map(|s| s.parameters.clone())
            .unwrap_or_default();
        let mut function = json!({"name": t.name, "parameters": parameters});
        if !t.description.is_empty() {
            function["description"] = Value::String(t.description.clone());
        }
        tools_json.push(json!({"type": "function", "function": function}));
    }
    use pb::tool_choice::{Choice, Mode};
    let choice = match chat.tool_choice.as_ref().and_then(|c| c.choice.as_ref()) {
        None => {
            if specs.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Choice::Mode(m)) => match Mode::try_from(*m) {
            Ok(Mode::None) => ToolChoice::None,
            Ok(Mode::Auto | Mode::Unspecified) => ToolChoice::Auto,
            Ok(Mode::Required) => ToolChoice::Required,
            Err(_) => {
                return Err(invalid(
                    &format!("{field}.tool_choice.mode"),
                    format!("unknown mode {m}"),
                ));
            }
        },
        Some(Choice::Function(name)) => ToolChoice::Function(name.clone()),
    };
    choice
        .check(&specs)
        .map_err(|e| invalid(&format!("{field}.tool_choice"), e))?;
    let on = choice.tools_on(&specs);
    let messages: Vec<Value> = chat
        .messages
        .iter()
        .map(|m| {
            let mut v = json!({"role": m.role, "content": m.content});
            if !m.tool_call_id.is_empty() {
                v["tool_call_id"] = Value::String(m.tool_call_id.clone());
            }
            if !m.tool_calls.is_empty() {
                v["tool_calls"] = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        json!({"id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}})
                    })
                    .collect();
            }
            v
        })
        .collect();
    let options = ChatOptions {
        add_generation_prompt: true,
    };
    let extra = if on {
        json!({"tools": tools_json})
    } else {
        json!({})
    };
    let template = cfg.chat_template.as_deref();
    let rendered = tok
        .render_chat_for_tokens(
            template,
            &messages,
            &options,
            &extra,
            cfg.special_tokens_in_content,
        )
        .map_err(|e| invalid(field, format!("chat template: {e}")))?;
    let source = template
        .map(ChatTemplate::source)
        .or_else(|| tok.default_chat_template_source());
    let format = ToolFormat::for_template(source.unwrap_or_default());
    Ok(Chat {
        rendered,
        tools: on.then_some(format),
        forced: choice.forced(&specs),
    })
}

/// A chat prompt's token ids, its rendering's size checked against the context first.
pub(crate) fn chat_ids(
    tok: &Tokenizer,
    info: &EngineInfo,
    chat: &RenderedChat,
    field: &str,
) -> Result<Vec<u32>, Status> {
    info.check_prompt_text(field, chat.text())
        .map_err(from_engine)?;
    tok.encode_chat(chat).map_err(|e| invalid(field, e))
}

/// Builds the engine request; `deadline` comes from `grpc-timeout`.
pub(crate) fn request(
    r: &pb::GenerateRequest,
    label: String,
    tok: &Tokenizer,
    info: &EngineInfo,
    cfg: &ServerConfig,
    deadline: Option<Instant>,
) -> Result<(Request, ReplyOptions), Status> {
    if !r.model.is_empty() && r.model != cfg.model_id {
        return Err(Status::not_found(kiln_engine::model_not_served(
            &r.model,
            &cfg.model_id,
        )));
    }
    let mut tools = None;
    let mut forced = Vec::new();
    let prompt = match &r.prompt {
        None => return Err(invalid("prompt", "missing: set text, token_ids or chat")),
        Some(pb::generate_request::Prompt::Text(t)) => Prompt::Text(t.clone()),
        Some(pb::generate_request::Prompt::TokenIds(t)) => Prompt::TokenIds(t.ids.clone()),
        Some(pb::generate_request::Prompt::Chat(c)) => {
            let chat = chat(tok, c, "prompt.chat", cfg)?;
            tools = chat.tools;
            forced = chat.forced;
            Prompt::TokenIds(chat_ids(tok, info, &chat.rendered, "prompt.chat")?)
        }
    };
    let prompt = match r.truncate_prompt_tokens {
        None => prompt,
        Some(0) => return Err(invalid("truncate_prompt_tokens", "must be at least 1")),
        Some(keep) => {
            let mut ids = match prompt {
                Prompt::TokenIds(ids) => ids,
                Prompt::Text(t) if t.is_empty() => return Err(invalid("prompt", "is empty")),
                Prompt::Text(t) => tok.encode(&t).map_err(|e| invalid("prompt", e))?,
            };
            let keep = keep as usize;
            if ids.len() > keep {
                ids.drain(..ids.len() - keep);
            }
            Prompt::TokenIds(ids)
        }
    };

    let d = &cfg.default_sampling;
    let s = r.sampling.clone().unwrap_or_default();
    let sampling = SamplingParams {
        temperature: s.temperature.unwrap_or(d.temperature),
        top_k: s.top_k.map_or(d.top_k, |k| k as usize),
        top_p: s.top_p.unwrap_or(d.top_p),
        min_p: s.min_p.unwrap_or(d.min_p),
        repetition_penalty: s.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: s.frequency_penalty.unwrap_or(d.frequency_penalty),
        logit_bias: s.logit_bias.iter().map(|(&k, &v)| (k, v)).collect(),
    };

    let st = r.stopping.clone().unwrap_or_default();
    let limit = max_new_tokens_limit(cfg, info);
    let max_new = match st.max_new_tokens {
        Some(m) if m as usize > limit => {
            return Err(invalid(
                "stopping.max_new_tokens",
                format!("{m} exceeds the limit {limit}"),
            ));
        }
        m => m.map(|m| m as usize),
    };
    let stopping = StoppingCriteria {
        max_new_tokens: max_new,
        default_max_new_tokens: Some(cfg.default_max_new_tokens.min(limit)),
        min_new_tokens: st.min_new_tokens.unwrap_or(0) as usize,
        stop: st.stop,
        stop_token_ids: st.stop_token_ids,
        include_stop_str_in_output: st.include_stop_str_in_output,
        ignore_eos: st.ignore_eos,
    };

    let o = r.output.unwrap_or_default();
    let output = OutputOptions {
        logprobs: o.logprobs,
        top_logprobs: o.top_logprobs as usize,
        skip_special_tokens: o.skip_special_tokens.unwrap_or(true),
    };
    let reply = ReplyOptions {
        tools,
        token_ids: o.return_token_ids,
        logprobs: o.logprobs || o.top_logprobs > 0,
        stream_interval: (o.stream_interval as usize).max(1),
    };

    let mut req = match prompt {
        Prompt::Text(t) => Request::text(t),
        Prompt::TokenIds(ids) => Request::tokens(ids),
    };
    req.label = label;
    req.sampling = sampling;
    req.seed = s.seed;
    req.n = (s.n as usize).max(1);
    req.stopping = stopping;
    req.output = output;
    req.priority = r.priority;
    req.deadline = deadline;
    req.speculate = r.speculative.unwrap_or(true);
    req.constraint = constraint(r.constraint.as_ref())?;
    if let Some(format) = tools.filter(|_| !forced.is_empty()) {
        if req.constraint.is_some() {
            return Err(invalid(
                "prompt.chat.tool_choice",
                "a forced tool call cannot be combined with a constraint",
            ));
        }
        req.constraint = Some(Constraint::Grammar(format.call_grammar(&forced)));
    }
    Ok((req, reply))
}

/// The `constraint` oneof; what it says is compiled (and refused) by the engine.
fn constraint(c: Option<&pb::generate_request::Constraint>) -> Result<Option<Constraint>, Status> {
    use pb::generate_request::Constraint as C;
    Ok(Some(match c {
        None => return Ok(None),
        Some(C::JsonSchema(text)) => {
            let schema = serde_json::from_str(text).map_err(|e| {
                invalid("constraint.json_schema", format!("is not valid JSON: {e}"))
            })?;
            Constraint::JsonSchema(schema)
        }
        Some(C::JsonObject(true)) => Constraint::JsonObject,
        Some(C::JsonObject(false)) => {
            return Err(invalid("constraint.json_object", "must be true when set"));
        }
        Some(C::Regex(rx)) => Constraint::Regex(rx.clone()),
        Some(C::Choice(c)) => Constraint::Choice(c.choices.clone()),
        Some(C::Grammar(g)) => Constraint::Grammar(g.clone()),
    }))
}

pub(crate) fn finish(f: &FinishReason) -> pb::FinishInfo {
    let (reason, stop_sequence, stop_token_id) = match f {
        FinishReason::Length => (pb::FinishReason::Length, String::new(), None),
        FinishReason::ContextLength => (pb::FinishReason::ContextLength, String::new(), None),
        FinishReason::EosToken => (pb::FinishReason::EosToken, String::new(), None),
        FinishReason::StopSequence(s) => (pb::FinishReason::StopSequence, s.clone(), None),
        FinishReason::StopToken(id) => (pb::FinishReason::StopToken, String::new(), Some(*id)),
        FinishReason::ConstraintComplete => {
            (pb::FinishReason::ConstraintComplete, String::new(), None)
        }
    };
    pb::FinishInfo {
        reason: reason.into(),
        stop_sequence,
        stop_token_id,
    }
}

fn logprobs(lp: &[TokenLogprobs]) -> Vec<pb::TokenLogprob> {
    lp.iter()
        .map(|t| pb::TokenLogprob {
            token_id: t.token,
            logprob: t.logprob,
            top_logprobs: t
                .top
                .iter()
                .map(|a| pb::TopLogprob {
                    token_id: a.token,
                    logprob: a.logprob,
                })
                .collect(),
        })
        .collect()
}

fn seq_output(
    index: usize,
    text: &str,
    token_ids: &[u32],
    lp: &[TokenLogprobs],
    finish_reason: Option<&FinishReason>,
    opts: ReplyOptions,
) -> pb::SequenceOutput {
    let parsed = opts
        .tools
        .map(|f| f.parse(text))
        .filter(|p| !p.calls.is_empty());
    let mut finish = finish_reason.map(finish);
    let (text, tool_calls) = match parsed {
        None => (text.to_owned(), Vec::new()),
        Some(p) => {
            if let Some(f) = &mut finish
                && matches!(
                    finish_reason,
                    Some(FinishReason::EosToken | FinishReason::ConstraintComplete)
                )
            {
                f.reason = pb::FinishReason::ToolCalls.into();
            }
            let calls = p
                .calls
                .into_iter()
                .map(|c| pb::ToolCall {
                    id: format!("call_{:024x}", rand::random::<u128>() >> 32),
                    name: c.name,
                    arguments: c.arguments,
                })
                .collect();
            (p.content.unwrap_or_default(), calls)
        }
    };
    pb::SequenceOutput {
        index: u32_sat(index),
        text,
        tool_calls,
        token_ids: if opts.token_ids {
            token_ids.to_vec()
        } else {
            Vec::new()
        },
        logprobs: if opts.logprobs {
            logprobs(lp)
        } else {
            Vec::new()
        },
        finish,
    }
}

/// A streamed delta (or several merged) as one output of a message.
pub(crate) fn delta(d: &Delta, opts: ReplyOptions) -> pb::SequenceOutput {
    seq_output(
        d.index,
        &d.text,
        &d.token_ids,
        &d.logprobs,
        d.finish.as_ref(),
        opts,
    )
}

/// A whole output of a unary reply.
pub(crate) fn output(index: usize, o: &SeqOutput, opts: ReplyOptions) -> pb::SequenceOutput {
    seq_output(
        index,
        &o.text,
        &o.token_ids,
        &o.logprobs,
        o.finish.as_ref(),
        opts,
    )
}

pub(crate) fn u32_sat(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub(crate) fn usage(u: &Usage) -> pb::Usage {
    pb::Usage {
        prompt_tokens: u32_sat(u.prompt_tokens),
        completion_tokens: u32_sat(u.completion_tokens),
        cached_prompt_tokens: u32_sat(u.cached_prompt_tokens),
    }
}

pub(crate) fn timing(t: &Timing) -> pb::Timing {
    let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    pb::Timing {
        queue_ns: ns(t.queue),
        time_to_first_token_ns: ns(t.time_to_first_token),
        decode_ns: ns(t.decode),
        total_ns: ns(t.total),
        spec_proposed_tokens: t.speculative.proposed_tokens,
        spec_accepted_tokens: t.speculative.accepted_tokens,
        spec_verify_steps: t.speculative.verify_steps,
        spec_acceptance_rate: t.speculative.acceptance_rate(),
        spec_mean_accepted_length: t.speculative.mean_accepted_length(),
    }
}

/// The effective defaults, as `GetModelInfo` reports them.
pub(crate) fn default_sampling(d: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: Some(d.temperature),
        top_p: Some(d.top_p),
        top_k: Some(u32_sat(d.top_k)),
        min_p: Some(d.min_p),
        repetition_penalty: Some(d.repetition_penalty),
        presence_penalty: Some(d.presence_penalty),
        frequency_penalty: Some(d.frequency_penalty),
        seed: None,
        n: 1,
        logit_bias: Default::default(),
    }
}
