//! Protobuf requests to engine requests (with the server's defaults and limits) and engine
//! output back to protobuf. The engine validates what it owns (vocabulary, sampling ranges,
//! context room); this edge checks what only the wire has (a missing prompt, another model,
//! the server's own limits).

use std::time::Instant;

use kiln_api::{
    ApiError, Conversation, Field, Finish, Message, MessagePart, PastCall, Prepared, Reply,
    ReplyFormat, ReplyStream, Role, SamplingOverlay, Tool, ToolPart, echo,
};
use kiln_engine::{
    Constraint, Delta, EngineInfo, OutputOptions, Prompt, Request, SamplingParams, SeqOutput,
    Timing, TokenLogprobs, Usage,
};
use kiln_tokenizer::{Tokenizer, ToolChoice};
use tonic::Status;

use crate::config::{DEFAULT_MAX_NEW_TOKENS, ServerConfig};
use crate::pb;
use crate::status::{from_api, invalid};

/// What the response side needs to know about the request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReplyOptions {
    /// How outputs read: the reasoning split off, calls read out when tools are on (a stream
    /// then holds each output's text until it ends).
    pub format: ReplyFormat,
    pub token_ids: bool,
    pub logprobs: bool,
    /// Tokens per streamed message (at least 1).
    pub stream_interval: usize,
    /// The request's constraint is a forced call's grammar (an error about it names
    /// `tool_choice`).
    pub forced_call: bool,
}

/// The chat prompt as the front doors' shared conversation.
fn conversation(chat: &pb::ChatMessages) -> Result<Conversation, ApiError> {
    let messages = chat
        .messages
        .iter()
        .enumerate()
        .map(|(index, m)| {
            let role = Role::parse(&m.role).ok_or_else(|| {
                ApiError::invalid(
                    Field::Message {
                        index,
                        part: MessagePart::Role,
                    },
                    format!(
                        "`{}` is not one of {}",
                        echo(&m.role),
                        Role::NAMES.join(", ")
                    ),
                )
            })?;
            let mut msg = Message::new(role, m.content.clone());
            msg.tool_call_id = (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone());
            msg.tool_calls = m
                .tool_calls
                .iter()
                .map(|c| PastCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                })
                .collect();
            msg.reasoning = (!m.reasoning.is_empty()).then(|| m.reasoning.clone());
            Ok(msg)
        })
        .collect::<Result<_, ApiError>>()?;
    let tools = chat
        .tools
        .iter()
        .enumerate()
        .map(|(index, t)| {
            let parameters = if t.parameters_json.trim().is_empty() {
                None
            } else {
                Some(serde_json::from_str(&t.parameters_json).map_err(|e| {
                    let part = ToolPart::Parameters;
                    ApiError::invalid_because(Field::Tool { index, part }, "is not valid JSON", e)
                })?)
            };
            Ok(Tool {
                name: t.name.clone(),
                description: (!t.description.is_empty()).then(|| t.description.clone()),
                parameters,
            })
        })
        .collect::<Result<_, ApiError>>()?;
    use pb::tool_choice::{Choice, Mode};
    let tool_choice = match chat.tool_choice.as_ref().and_then(|c| c.choice.as_ref()) {
        None => None,
        Some(Choice::Mode(m)) => Some(match Mode::try_from(*m) {
            Ok(Mode::None) => ToolChoice::None,
            Ok(Mode::Auto | Mode::Unspecified) => ToolChoice::Auto,
            Ok(Mode::Required) => ToolChoice::Required,
            Err(_) => {
                return Err(ApiError::invalid(
                    Field::ToolChoice,
                    format!("unknown mode {m}"),
                ));
            }
        }),
        Some(Choice::Function(name)) => Some(ToolChoice::Function(name.clone())),
    };
    let mut c = Conversation::new(messages);
    c.tools = tools;
    c.tool_choice = tool_choice;
    c.set_thinking(chat.enable_thinking);
    Ok(c)
}

/// A chat prompt rendered and tokenized as every front door renders it.
pub(crate) fn chat(
    tok: &Tokenizer,
    info: &EngineInfo,
    chat: &pb::ChatMessages,
    cfg: &ServerConfig,
) -> Result<Prepared, ApiError> {
    conversation(chat)?.prepare(tok, info, &cfg.api)
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
    let api = &cfg.api;
    api.check_model(Some(&r.model)).map_err(|e| from_api(&e))?;
    let s = r.sampling.clone().unwrap_or_default();
    let overlay = SamplingOverlay {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k.map(|k| k as usize),
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: s.logit_bias.iter().map(|(&k, &v)| (k, v)).collect(),
    };
    let st = r.stopping.clone().unwrap_or_default();
    let mut req = api
        .request(
            info,
            &overlay,
            st.max_new_tokens.map(|m| m as usize),
            Some(DEFAULT_MAX_NEW_TOKENS),
        )
        .map_err(|e| from_api(&e))?;
    let mut format = ReplyFormat::default();
    let mut forced_call = false;
    match &r.prompt {
        None => return Err(invalid("prompt", "missing: set text, token_ids or chat")),
        Some(pb::generate_request::Prompt::Text(t)) => req.prompt = Prompt::Text(t.clone()),
        Some(pb::generate_request::Prompt::TokenIds(t)) => {
            req.prompt = Prompt::TokenIds(t.ids.clone());
        }
        Some(pb::generate_request::Prompt::Chat(c)) => {
            let prepared = chat(tok, info, c, cfg).map_err(|e| from_api(&e))?;
            forced_call = prepared.forced.is_some();
            format = prepared.apply(&mut req);
        }
    }
    if let Some(keep) = r.truncate_prompt_tokens {
        if keep == 0 {
            return Err(invalid("truncate_prompt_tokens", "must be at least 1"));
        }
        let mut ids = match std::mem::replace(&mut req.prompt, Prompt::TokenIds(Vec::new())) {
            Prompt::TokenIds(ids) => ids,
            Prompt::Text(t) if t.is_empty() => return Err(invalid("prompt", "is empty")),
            Prompt::Text(t) => tok.encode(&t).map_err(|e| invalid("prompt", e))?,
        };
        let keep = keep as usize;
        if ids.len() > keep {
            ids.drain(..ids.len() - keep);
        }
        req.prompt = Prompt::TokenIds(ids);
    }
    req.stopping.min_new_tokens = st.min_new_tokens.unwrap_or(0) as usize;
    req.stopping.stop = st.stop;
    req.stopping.stop_token_ids = st.stop_token_ids;
    req.stopping.include_stop_str_in_output = st.include_stop_str_in_output;
    req.stopping.ignore_eos = st.ignore_eos;
    let o = r.output.unwrap_or_default();
    req.output = OutputOptions {
        logprobs: o.logprobs,
        top_logprobs: o.top_logprobs as usize,
        skip_special_tokens: o.skip_special_tokens.unwrap_or(true),
        prompt_logprobs: o.prompt_logprobs.map(|k| k as usize),
    };
    req.label = label;
    req.seed = s.seed;
    req.n = (s.n as usize).max(1);
    req.priority = r.priority;
    req.deadline = deadline;
    req.speculate = r.speculative.unwrap_or(true);
    // A forced call's grammar, when the chat forced one, replaces the request's constraint.
    let asked = constraint(r.constraint.as_ref())?;
    if req.constraint.is_none() {
        req.constraint = asked;
    }
    let reply = ReplyOptions {
        format,
        token_ids: o.return_token_ids,
        logprobs: o.logprobs || o.top_logprobs > 0,
        stream_interval: (o.stream_interval as usize).max(1),
        forced_call,
    };
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

pub(crate) fn finish(f: &Finish) -> pb::FinishInfo {
    let (reason, stop_sequence, stop_token_id) = match f {
        Finish::Length => (pb::FinishReason::Length, String::new(), None),
        Finish::ContextLength => (pb::FinishReason::ContextLength, String::new(), None),
        Finish::Eos => (pb::FinishReason::EosToken, String::new(), None),
        Finish::ConstraintComplete => (pb::FinishReason::ConstraintComplete, String::new(), None),
        Finish::StopSequence(s) => (pb::FinishReason::StopSequence, s.clone(), None),
        Finish::StopToken(id) => (pb::FinishReason::StopToken, String::new(), Some(*id)),
        Finish::ToolCalls => (pb::FinishReason::ToolCalls, String::new(), None),
    };
    pb::FinishInfo {
        reason: reason.into(),
        stop_sequence,
        stop_token_id,
    }
}

pub(crate) fn logprobs(lp: &[TokenLogprobs]) -> Vec<pb::TokenLogprob> {
    lp.iter()
        .map(|t| pb::TokenLogprob {
            token_id: t.token,
            logprob: t.logprob,
            rank: u32::try_from(t.rank).unwrap_or(u32::MAX),
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

/// One output's message: its text read as a reply (reasoning split off, calls read out).
fn seq_output(
    index: usize,
    reply: Reply,
    token_ids: &[u32],
    lp: &[TokenLogprobs],
    opts: ReplyOptions,
) -> pb::SequenceOutput {
    let finish = reply.finish.as_ref().map(finish);
    let tool_calls = reply
        .calls
        .into_iter()
        .map(|c| pb::ToolCall {
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            name: c.name,
            arguments: c.arguments,
        })
        .collect();
    pb::SequenceOutput {
        index: u32_sat(index),
        text: reply.content.unwrap_or_default(),
        reasoning: reply.reasoning.unwrap_or_default(),
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

/// A streamed delta (or several merged) as one output of a message: what `reader` shows of
/// it now, and, on the output's last, what it held back.
pub(crate) fn delta(d: &Delta, reader: &mut ReplyStream, opts: ReplyOptions) -> pb::SequenceOutput {
    let piece = reader.push(&d.text);
    let mut reply = Reply {
        reasoning: Some(piece.reasoning),
        content: Some(piece.content),
        ..Reply::default()
    };
    if let Some(f) = &d.finish {
        let rest = reader.finish(Some(f));
        for (to, more) in [
            (&mut reply.reasoning, rest.reasoning),
            (&mut reply.content, rest.content),
        ] {
            if let (Some(to), Some(more)) = (to.as_mut(), more) {
                to.push_str(&more);
            }
        }
        reply.calls = rest.calls;
        reply.finish = rest.finish;
    }
    seq_output(d.index, reply, &d.token_ids, &d.logprobs, opts)
}

/// A whole output of a unary reply.
pub(crate) fn output(index: usize, o: &SeqOutput, opts: ReplyOptions) -> pb::SequenceOutput {
    let reply = opts.format.read(&o.text, o.finish.as_ref());
    seq_output(index, reply, &o.token_ids, &o.logprobs, opts)
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

/// `max_new_tokens` for a request that sets none, as `GetModelInfo` reports it.
pub(crate) fn default_max_new_tokens(cfg: &ServerConfig, info: &EngineInfo) -> usize {
    cfg.api
        .max_tokens(info, None, Some(DEFAULT_MAX_NEW_TOKENS))
        .ok()
        .and_then(|m| m.default)
        .unwrap_or(info.max_model_len)
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
