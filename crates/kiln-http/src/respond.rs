//! Engine output as OpenAI responses: whole (`chat.completion`, `text_completion`) or as a
//! Server-Sent Events stream of chunks ending with `data: [DONE]`. The stream owns the
//! engine's request streams, so a client that goes away drops them and the engine aborts its
//! requests (freeing their KV blocks) within one step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::sse;
use kiln_api::{Finish, Reply, ReplyFormat, ReplyStream};
use kiln_engine::{
    Delta, Event, Output, PromptLogprobs as Scores, RequestStream, SeqOutput, TokenLogprobs, Usage,
};
use kiln_tokenizer::{DecodeOptions, Tokenizer, ToolCall};
use serde::Serialize;
use serde_json::{Map, Value};
use tokio_stream::Stream;

use crate::error::{Door, ErrorReply};
use crate::openai::{
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatDelta,
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, Completion, CompletionChoice,
    CompletionLogprobs, FunctionCall, PromptLogprobs, ToolCallOut,
};

/// Shown as `system_fingerprint`: which build answered.
const FINGERPRINT: &str = concat!("kiln-", env!("CARGO_PKG_VERSION"));

/// What every object of one response repeats.
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub door: Door,
    /// Outputs per prompt (choice index = prompt index × n + output index).
    pub n: usize,
    /// Alternatives per token, when logprobs were asked for.
    pub logprobs: Option<usize>,
    pub tokenizer: Tokenizer,
    /// How outputs read: reasoning split off, calls read out with tools on (streamed content
    /// is then held until the output ends, and sent as one delta).
    pub reply: ReplyFormat,
    /// Completions' `echo`: each prompt's text, put in front of its outputs.
    pub echo: Option<Vec<String>>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token.
    pub prompt_logprobs: Option<usize>,
}

impl Ctx {
    /// A `chat.completion.chunk` of this response with `choices`.
    fn chunk_of(
        &self,
        choices: Vec<ChatChunkChoice>,
        usage: Option<Option<crate::openai::Usage>>,
    ) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: FINGERPRINT,
            choices,
            usage,
            prompt_logprobs: None,
        }
    }

    /// vLLM's `prompt_logprobs` of a prompt scored `scores`, when asked for.
    fn prompt_logprobs(&self, scores: Option<&Scores>) -> Option<PromptLogprobs> {
        let top = self.prompt_logprobs?;
        let lps = scores.map_or(&[][..], |s| &s.scores);
        Some(prompt_logprobs(&self.tokenizer, lps, top))
    }

    /// Echoed prompt `prompt`'s text, and its legacy logprobs (from `scores`) when asked for;
    /// `offset` moves past the text.
    fn echoed(
        &self,
        prompt: usize,
        scores: Option<&Scores>,
        offset: &mut usize,
    ) -> Option<(String, Option<CompletionLogprobs>)> {
        let text = self.echo.as_ref()?.get(prompt)?;
        let start = *offset;
        let logprobs = match (self.logprobs, scores) {
            (Some(top), Some(s)) => Some(echo_logprobs(&self.tokenizer, s, top, offset)),
            _ => None,
        };
        // The output's offsets count from the end of the echoed text.
        *offset = start + text.len();
        Some((text.clone(), logprobs))
    }

    /// A chunk carrying one choice's `delta`, its tokens' logprobs when asked for, and
    /// `end` (finish reason, stop reason) on its last.
    fn chat_chunk(
        &self,
        index: usize,
        delta: ChatDelta,
        logprobs: &[TokenLogprobs],
        end: (Option<&'static str>, Option<serde_json::Value>),
        usage: Option<Option<crate::openai::Usage>>,
    ) -> ChatChunk {
        let choice = ChatChunkChoice {
            index,
            delta,
            logprobs: self
                .logprobs
                .is_some()
                .then(|| chat_logprobs(&self.tokenizer, logprobs)),
            finish_reason: end.0,
            stop_reason: end.1,
        };
        self.chunk_of(vec![choice], usage)
    }
}

/// Calls read from a reply, as OpenAI's `tool_calls` (with `index` in a stream delta).
pub(crate) fn tool_calls(calls: Vec<ToolCall>, streamed: bool) -> Option<Vec<ToolCallOut>> {
    if calls.is_empty() {
        return None;
    }
    let calls = calls
        .into_iter()
        .enumerate()
        .map(|(index, c)| ToolCallOut {
            index: streamed.then_some(index),
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            kind: "function",
            function: FunctionCall {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect();
    Some(calls)
}

/// OpenAI's `finish_reason` and vLLM's `stop_reason` (the stop string or token id).
pub(crate) fn finish(f: &Finish) -> (&'static str, Option<Value>) {
    match f {
        Finish::Length | Finish::ContextLength => ("length", None),
        Finish::Eos | Finish::ConstraintComplete => ("stop", None),
        Finish::StopSequence(s) => ("stop", Some(Value::String(s.clone()))),
        Finish::StopToken(id) => ("stop", Some(Value::from(*id))),
        Finish::ToolCalls => ("tool_calls", None),
    }
}

/// A token's text as logprobs show it (special tokens kept).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    let keep = DecodeOptions {
        skip_special_tokens: false,
    };
    tok.decode_with(&[id], keep).unwrap_or_default()
}

fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs]) -> ChatLogprobs {
    let entry = |id: u32| {
        let token = token_text(tok, id);
        let bytes = token.as_bytes().to_vec();
        (token, bytes)
    };
    ChatLogprobs {
        content: lps
            .iter()
            .map(|t| {
                let (token, bytes) = entry(t.token);
                ChatTokenLogprob {
                    token,
                    logprob: t.logprob,
                    bytes,
                    top_logprobs: t
                        .top
                        .iter()
                        .map(|a| {
                            let (token, bytes) = entry(a.token);
                            ChatTopLogprob {
                                token,
                                logprob: a.logprob,
                                bytes,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// The legacy layout; `offset` is where this part's text starts in the whole output.
fn completion_logprobs(
    tok: &Tokenizer,
    lps: &[TokenLogprobs],
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in lps {
        push_legacy(&mut out, tok, t, t.top.len(), offset);
    }
    out
}

/// One token in the legacy layout: its text, offset and logprob, and `top` alternatives
/// with the token itself (OpenAI's "the most likely tokens, as well as the chosen one"),
/// keyed by text.
fn push_legacy(
    out: &mut CompletionLogprobs,
    tok: &Tokenizer,
    t: &TokenLogprobs,
    top: usize,
    offset: &mut usize,
) {
    let text = token_text(tok, t.token);
    out.text_offset.push(*offset);
    *offset += text.len();
    let mut alternatives = Map::new();
    for a in t.top.iter().take(top) {
        alternatives.insert(token_text(tok, a.token), Value::from(wire(a.logprob)));
    }
    alternatives
        .entry(text.clone())
        .or_insert_with(|| Value::from(wire(t.logprob)));
    out.tokens.push(text);
    out.token_logprobs.push(Some(wire(t.logprob)));
    out.top_logprobs.push(Some(alternatives));
}

/// A logprob as the wire carries it: JSON has no -inf (a token a NaN or -inf logit rules out
/// would read `null`, which sums fail on), so such a value is vLLM's -9999.
fn wire(logprob: f32) -> f64 {
    if logprob.is_finite() {
        f64::from(logprob)
    } else {
        -9999.0
    }
}

/// An echoed prompt in the legacy layout: its first token with `null`s (nothing predicts
/// it), then each later one as `scores` has it, with `top` alternatives.
fn echo_logprobs(
    tok: &Tokenizer,
    scores: &Scores,
    top: usize,
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let text = token_text(tok, scores.first);
    out.text_offset.push(*offset);
    *offset += text.len();
    out.tokens.push(text);
    out.token_logprobs.push(None);
    out.top_logprobs.push(None);
    for t in &scores.scores {
        push_legacy(&mut out, tok, t, top, offset);
    }
    out
}

/// vLLM's `prompt_logprobs`: `null` for the first token, then per position the prompt token
/// and its `top` alternatives, by token id: `{logprob, rank, decoded_token}`.
fn prompt_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs], top: usize) -> PromptLogprobs {
    let entry = |id: u32, logprob: f32, rank: usize| {
        serde_json::json!({
            "logprob": wire(logprob),
            "rank": rank,
            "decoded_token": token_text(tok, id),
        })
    };
    let mut out = vec![None];
    for t in lps {
        let mut m = Map::new();
        for (i, a) in t.top.iter().take(top).enumerate() {
            m.insert(a.token.to_string(), entry(a.token, a.logprob, i + 1));
        }
        m.insert(t.token.to_string(), entry(t.token, t.logprob, t.rank));
        out.push(Some(m));
    }
    out
}

/// Each prompt's outputs, read as replies, as choices (index = prompt × n + output), and
/// the summed usage.
fn choices<T>(
    ctx: &Ctx,
    outs: &[Output],
    mut choice: impl FnMut(usize, &SeqOutput, Reply) -> T,
) -> (Vec<T>, Usage) {
    let mut all = Vec::new();
    for (p, out) in outs.iter().enumerate() {
        for (i, o) in out.outputs.iter().enumerate() {
            let reply = ctx.reply.read(&o.text, o.finish.as_ref());
            all.push(choice(p * ctx.n + i, o, reply));
        }
    }
    (all, total_usage(outs))
}

/// The usage of every prompt's request, summed.
pub(crate) fn total_usage(outs: &[Output]) -> Usage {
    let mut total = Usage::default();
    for o in outs {
        add_usage(&mut total, &o.usage);
    }
    total
}

/// A whole chat completion (chat has one prompt).
pub(crate) fn chat_completion(ctx: &Ctx, outs: &[Output]) -> ChatCompletion {
    let (choices, usage) = choices(ctx, outs, |index, o, reply| {
        let (finish_reason, stop_reason) = reply.finish.as_ref().map(finish).unzip();
        ChatChoice {
            index,
            message: AssistantMessage {
                role: "assistant",
                content: reply.content,
                reasoning_content: reply.reasoning.clone(),
                reasoning: reply.reasoning,
                tool_calls: tool_calls(reply.calls, false),
            },
            logprobs: ctx
                .logprobs
                .is_some()
                .then(|| chat_logprobs(&ctx.tokenizer, &o.logprobs)),
            finish_reason,
            stop_reason: stop_reason.flatten(),
        }
    });
    let scores = outs.first().and_then(|o| o.prompt_logprobs.as_ref());
    ChatCompletion {
        prompt_logprobs: ctx.prompt_logprobs(scores),
        id: ctx.id.clone(),
        object: "chat.completion",
        created: ctx.created,
        model: ctx.model.clone(),
        system_fingerprint: FINGERPRINT,
        choices,
        usage: usage.into(),
    }
}

/// A whole text completion, choices of every prompt in order (each after its prompt, with
/// `echo`).
pub(crate) fn completion(ctx: &Ctx, outs: &[Output]) -> Completion {
    let (choices, usage) = choices(ctx, outs, |index, o, reply| {
        let (finish_reason, stop_reason) = reply.finish.as_ref().map(finish).unzip();
        let scores = outs
            .get(index / ctx.n)
            .and_then(|out| out.prompt_logprobs.as_ref());
        let mut offset = 0;
        let (mut text, mut logprobs) = ctx
            .echoed(index / ctx.n, scores, &mut offset)
            .unwrap_or_default();
        text.push_str(&o.text);
        if ctx.logprobs.is_some() {
            let generated = completion_logprobs(&ctx.tokenizer, &o.logprobs, &mut offset);
            logprobs = Some(join_legacy(logprobs, generated));
        }
        CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason,
            stop_reason: stop_reason.flatten(),
            prompt_logprobs: ctx.prompt_logprobs(scores),
        }
    });
    Completion {
        id: ctx.id.clone(),
        object: "text_completion",
        created: ctx.created,
        model: ctx.model.clone(),
        system_fingerprint: FINGERPRINT,
        choices,
        usage: Some(Some(usage.into())),
    }
}

/// `tail` after `head` (an echoed prompt's logprobs, then the output's).
fn join_legacy(head: Option<CompletionLogprobs>, tail: CompletionLogprobs) -> CompletionLogprobs {
    let Some(mut all) = head else {
        return tail;
    };
    all.tokens.extend(tail.tokens);
    all.token_logprobs.extend(tail.token_logprobs);
    all.top_logprobs.extend(tail.top_logprobs);
    all.text_offset.extend(tail.text_offset);
    all
}

fn add_usage(total: &mut Usage, u: &Usage) {
    total.prompt_tokens += u.prompt_tokens;
    total.completion_tokens += u.completion_tokens;
    total.cached_prompt_tokens += u.cached_prompt_tokens;
}

/// Called once with the summed usage when every request of a stream finished.
pub(crate) type OnFinish = Box<dyn FnOnce(&Usage) + Send>;

/// The SSE body of a streamed call: chunks as tokens arrive, a usage chunk when asked for,
/// then `[DONE]`; an engine error after the headers is one `data: {"error": ...}` event, and
/// the stream ends.
pub(crate) struct EventStream {
    ctx: Ctx,
    /// Per prompt; `None` once that request finished.
    streams: Vec<Option<RequestStream>>,
    /// Where the next poll starts, so no prompt's stream starves the others.
    next: usize,
    queue: VecDeque<sse::Event>,
    usage: Usage,
    include_usage: bool,
    /// Per choice: whether its first chunk (carrying the role) went out.
    started: Vec<bool>,
    /// Per choice: bytes of text sent so far (completions' `text_offset`).
    offsets: Vec<usize>,
    /// Per choice: how its text reads so far (reasoning, held tool calls).
    readers: Vec<ReplyStream>,
    /// Per choice, tools on: logprobs held until the output ends.
    held_logprobs: Vec<Vec<TokenLogprobs>>,
    /// Per prompt: its scores, when asked for (they come before its first delta).
    prompt_scores: Vec<Option<Scores>>,
    done: bool,
    /// Called once with the summed usage when every request finished.
    on_finish: Option<OnFinish>,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("id", &self.ctx.id)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl EventStream {
    pub(crate) fn new(
        ctx: Ctx,
        streams: Vec<RequestStream>,
        include_usage: bool,
        on_finish: OnFinish,
    ) -> Self {
        let streams_len = streams.len();
        let choices = streams_len * ctx.n;
        Self {
            readers: (0..choices).map(|_| ctx.reply.stream()).collect(),
            ctx,
            streams: streams.into_iter().map(Some).collect(),
            next: 0,
            queue: VecDeque::new(),
            usage: Usage::default(),
            include_usage,
            started: vec![false; choices],
            offsets: vec![0; choices],
            held_logprobs: vec![Vec::new(); choices],
            prompt_scores: vec![None; streams_len],
            done: false,
            on_finish: Some(on_finish),
        }
    }

    fn send(&mut self, body: &impl Serialize) {
        match serde_json::to_string(body) {
            Ok(json) => self.queue.push_back(sse::Event::default().data(json)),
            Err(e) => tracing::error!(error = %e, "cannot encode a chunk"),
        }
    }

    /// `null` on every chunk when a usage chunk will follow; absent otherwise.
    fn usage_slot(&self) -> Option<Option<crate::openai::Usage>> {
        self.include_usage.then_some(None)
    }

    fn delta(&mut self, prompt: usize, d: Delta) {
        let index = prompt * self.ctx.n + d.index;
        if d.text.is_empty() && d.finish.is_none() && d.logprobs.is_empty() {
            // Text held back (a possible stop string, half a character): nothing to show yet.
            return;
        }
        match self.ctx.door {
            Door::Completions => self.completion_delta(index, d),
            _ => self.chat_delta(index, d),
        }
    }

    /// A chat delta read as the reply goes: reasoning and content as they come (content held
    /// to the end with tools on, then sent with the calls in one chunk).
    fn chat_delta(&mut self, index: usize, d: Delta) {
        let reader = &mut self.readers[index];
        let piece = reader.push(&d.text);
        let mut reasoning = piece.reasoning;
        let mut content = piece.content;
        let mut end = Reply::default();
        if let Some(f) = &d.finish {
            end = reader.finish(Some(f));
            reasoning.push_str(end.reasoning.as_deref().unwrap_or_default());
            content.push_str(end.content.as_deref().unwrap_or_default());
        }
        let lps = if self.ctx.reply.tools.is_some() {
            self.held_logprobs[index].extend(d.logprobs);
            if d.finish.is_none() {
                if reasoning.is_empty() {
                    return;
                }
                Vec::new()
            } else {
                std::mem::take(&mut self.held_logprobs[index])
            }
        } else {
            d.logprobs
        };
        let first = !std::mem::replace(&mut self.started[index], true);
        let (reason, stop) = end.finish.as_ref().map(finish).unzip();
        let reasoning = (!reasoning.is_empty()).then_some(reasoning);
        let delta = ChatDelta {
            role: first.then_some("assistant"),
            content: (first || !content.is_empty()).then_some(content),
            reasoning_content: reasoning.clone(),
            reasoning,
            tool_calls: tool_calls(end.calls, true),
        };
        let (ctx, usage) = (&self.ctx, self.usage_slot());
        let mut chunk = ctx.chat_chunk(index, delta, &lps, (reason, stop.flatten()), usage);
        if first {
            let scores = self
                .prompt_scores
                .get(index / ctx.n)
                .and_then(Option::as_ref);
            chunk.prompt_logprobs = ctx.prompt_logprobs(scores);
        }
        self.send(&chunk);
    }

    fn completion_delta(&mut self, index: usize, d: Delta) {
        let end = d
            .finish
            .as_ref()
            .map(|f| self.readers[index].finish(Some(f)));
        let (reason, stop) = end.and_then(|e| e.finish).as_ref().map(finish).unzip();
        let first = !std::mem::replace(&mut self.started[index], true);
        let (ctx, usage) = (&self.ctx, self.usage_slot());
        let offset = &mut self.offsets[index];
        // A choice's first chunk starts with its echoed prompt and carries the prompt's scores.
        let (scores, mut text, mut logprobs) = match first {
            true => {
                let scores = self
                    .prompt_scores
                    .get(index / ctx.n)
                    .and_then(Option::as_ref);
                let (text, logprobs) = ctx
                    .echoed(index / ctx.n, scores, offset)
                    .unwrap_or_default();
                (ctx.prompt_logprobs(scores), text, logprobs)
            }
            false => Default::default(),
        };
        text.push_str(&d.text);
        if ctx.logprobs.is_some() {
            let generated = completion_logprobs(&ctx.tokenizer, &d.logprobs, offset);
            logprobs = Some(join_legacy(logprobs, generated));
        }
        let chunk = Completion {
            id: ctx.id.clone(),
            object: "text_completion",
            created: ctx.created,
            model: ctx.model.clone(),
            system_fingerprint: FINGERPRINT,
            choices: vec![CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason: reason,
                stop_reason: stop.flatten(),
                prompt_logprobs: scores,
            }],
            usage,
        };
        self.send(&chunk);
    }

    fn finished(&mut self, prompt: usize, usage: &Usage) {
        self.streams[prompt] = None;
        add_usage(&mut self.usage, usage);
        if self.streams.iter().any(Option::is_some) {
            return;
        }
        if self.include_usage {
            let ctx = &self.ctx;
            let usage = Some(Some(self.usage.into()));
            match ctx.door {
                Door::Completions => {
                    let chunk = Completion {
                        id: ctx.id.clone(),
                        object: "text_completion",
                        created: ctx.created,
                        model: ctx.model.clone(),
                        system_fingerprint: FINGERPRINT,
                        choices: Vec::new(),
                        usage,
                    };
                    self.send(&chunk);
                }
                _ => {
                    let chunk = ctx.chunk_of(Vec::new(), usage);
                    self.send(&chunk);
                }
            }
        }
        self.queue.push_back(sse::Event::default().data("[DONE]"));
        self.done = true;
        if let Some(f) = self.on_finish.take() {
            f(&self.usage);
        }
    }

    /// Ends the stream with an error event; the other prompts' requests are aborted.
    fn fail(&mut self, e: &ErrorReply) {
        self.streams.clear();
        self.queue
            .push_back(sse::Event::default().data(e.body_json()));
        self.done = true;
    }

    fn handle(&mut self, prompt: usize, ev: Option<Event>) {
        match ev {
            Some(Event::PromptLogprobs(lp)) => {
                if let Some(slot) = self.prompt_scores.get_mut(prompt) {
                    *slot = Some(lp);
                }
            }
            Some(Event::Delta(d)) => self.delta(prompt, d),
            Some(Event::Finished(s)) => self.finished(prompt, &s.usage),
            Some(Event::Error(e)) => {
                self.fail(&ErrorReply::from_api(&e.into(), self.ctx.door, None))
            }
            None => self.fail(&ErrorReply::from_api(
                &kiln_engine::EngineError::ShuttingDown.into(),
                self.ctx.door,
                None,
            )),
        }
    }
}

impl Stream for EventStream {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(ev) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(ev)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            let len = this.streams.len();
            let mut got = None;
            for k in 0..len {
                let p = (this.next + k) % len;
                if let Some(s) = this.streams[p].as_mut()
                    && let Poll::Ready(ev) = s.poll_recv(cx)
                {
                    got = Some((p, ev));
                    break;
                }
            }
            match got {
                Some((p, ev)) => {
                    this.next = (p + 1) % len.max(1);
                    this.handle(p, ev);
                }
                None => return Poll::Pending,
            }
        }
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if !self.done {
            // The client went away mid-stream; dropping the request streams aborts them.
            tracing::debug!(id = %self.ctx.id, "stream dropped by the client");
        }
    }
}
