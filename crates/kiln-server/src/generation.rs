//! `kiln.v1.Generation`: unary `Generate` and server-streaming `GenerateStream` over one engine
//! request each. The response stream owns the engine's `RequestStream`, so a client that goes
//! away drops it and the engine aborts the request (freeing its KV blocks) within one step.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kiln_api::ReplyStream;
use kiln_api::edge::usable_request_id;
use kiln_engine::{Delta, EngineError, Event, Output, RequestStream, Summary};
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status};

use crate::convert::{self, ReplyOptions};
use crate::edge::{REQUEST_ID, parse_grpc_timeout};
use crate::pb;
use crate::server::State;
use crate::status::{from_engine, invalid, invalid_timeout, refused};

/// Tonic answers an expired `grpc-timeout` with CANCELLED from a timer started just before the
/// handler runs; ending the request this much earlier makes the answer DEADLINE_EXCEEDED.
const DEADLINE_MARGIN: Duration = Duration::from_millis(5);

const GENERATE: &str = "/kiln.v1.Generation/Generate";
const GENERATE_STREAM: &str = "/kiln.v1.Generation/GenerateStream";

#[derive(Debug)]
pub(crate) struct GenerationService {
    pub state: Arc<State>,
}

/// A validated call, submitted to the engine.
struct Call {
    request_id: String,
    events: RequestStream,
    reply: ReplyOptions,
    deadline: Option<Instant>,
}

impl GenerationService {
    /// Validates, renders, tokenizes and submits the call on tokio's blocking pool: CPU work
    /// that grows with the prompt must not hold up the async workers that answer health
    /// probes and stream other calls' tokens.
    async fn start(&self, req: Request<pb::GenerateRequest>) -> Result<Call, Status> {
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || Self::prepare(&state, &req))
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "preparing a request failed");
                Status::internal("preparing the request failed")
            })?
    }

    fn prepare(state: &State, req: &Request<pb::GenerateRequest>) -> Result<Call, Status> {
        let engine = state.engine()?;
        let body = req.get_ref();
        let request_id = if body.request_id.is_empty() {
            req.metadata()
                .get(REQUEST_ID)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        } else if usable_request_id(body.request_id.as_bytes()) {
            body.request_id.clone()
        } else {
            // Echoed in every streamed message and log line: bounded like `x-request-id`.
            return Err(invalid(
                "request_id",
                format!(
                    "is {} bytes; expected 1 to 128 printable ASCII characters",
                    body.request_id.len()
                ),
            ));
        };
        let deadline = match req.metadata().get("grpc-timeout") {
            None => None,
            Some(v) => {
                let v = v
                    .to_str()
                    .map_err(|_| invalid("grpc-timeout", "not ASCII"))?;
                let timeout = parse_grpc_timeout(v).map_err(|e| invalid_timeout(&e))?;
                Some(Instant::now() + timeout.saturating_sub(DEADLINE_MARGIN))
            }
        };
        let (request, reply) = convert::request(
            body,
            request_id.clone(),
            engine.tokenizer(),
            engine.info(),
            &state.cfg,
            deadline,
        )?;
        let events = engine
            .submit(request)
            .map_err(|e| refused(e, reply.forced_call))?;
        Ok(Call {
            request_id,
            events,
            reply,
            deadline,
        })
    }

    async fn unary(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<pb::GenerateResponse, Status> {
        let call = self.start(req).await?;
        let collect = call.events.collect();
        let out = match call.deadline {
            None => collect.await,
            // Dropping the collect future drops the request stream: the engine aborts it.
            Some(d) => tokio::time::timeout_at(d.into(), collect)
                .await
                .unwrap_or(Err(EngineError::DeadlineExceeded)),
        }
        .map_err(from_engine)?;
        log_done(&call.request_id, GENERATE, &out.usage, &out.timing);
        Ok(unary_response(call.request_id, &out, call.reply))
    }
}

fn unary_response(request_id: String, out: &Output, reply: ReplyOptions) -> pb::GenerateResponse {
    pb::GenerateResponse {
        request_id,
        outputs: out
            .outputs
            .iter()
            .enumerate()
            .map(|(i, o)| convert::output(i, o, reply))
            .collect(),
        usage: Some(convert::usage(&out.usage)),
        timing: Some(convert::timing(&out.timing)),
        prompt_logprobs: out
            .prompt_logprobs
            .as_ref()
            .map(|p| convert::logprobs(&p.scores))
            .unwrap_or_default(),
    }
}

fn log_done(request_id: &str, method: &str, usage: &kiln_engine::Usage, t: &kiln_engine::Timing) {
    tracing::info!(
        request_id,
        method,
        prompt_tokens = usage.prompt_tokens,
        completion_tokens = usage.completion_tokens,
        cached_prompt_tokens = usage.cached_prompt_tokens,
        ttft_ms = t.time_to_first_token.as_secs_f64() * 1e3,
        total_ms = t.total.as_secs_f64() * 1e3,
        "request finished"
    );
}

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let result = self.unary(request).await;
        self.state.record(GENERATE, result.as_ref().err());
        result.map(Response::new)
    }

    type GenerateStreamStream =
        Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send + 'static>>;

    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        let call = match self.start(request).await {
            Ok(c) => c,
            Err(s) => {
                self.state.record(GENERATE_STREAM, Some(&s));
                return Err(s);
            }
        };
        let stream = GenStream {
            pending: Vec::new(),
            readers: Vec::new(),
            deadline: call
                .deadline
                .map(|d| Box::pin(tokio::time::sleep_until(d.into()))),
            events: Some(call.events),
            request_id: call.request_id,
            reply: call.reply,
            state: self.state.clone(),
        };
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The response stream of one `GenerateStream` call.
struct GenStream {
    /// `None` once the call ended (dropping it aborts an unfinished request).
    events: Option<RequestStream>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    request_id: String,
    reply: ReplyOptions,
    /// Per output index: tokens not sent yet (`stream_interval` > 1).
    pending: Vec<Option<Delta>>,
    /// Per output index: how its text reads so far.
    readers: Vec<ReplyStream>,
    state: Arc<State>,
}

impl GenStream {
    fn message(&self, outputs: Vec<pb::SequenceOutput>) -> pb::GenerateResponse {
        pb::GenerateResponse {
            request_id: self.request_id.clone(),
            outputs,
            usage: None,
            timing: None,
            prompt_logprobs: Vec::new(),
        }
    }

    /// Adds a delta to its output's pending tokens; returns a message when they are due.
    fn reader(&mut self, index: usize) -> &mut ReplyStream {
        let format = self.reply.format;
        if self.readers.len() <= index {
            self.readers.resize_with(index + 1, || format.stream());
        }
        &mut self.readers[index]
    }

    fn push(&mut self, d: Delta) -> Option<pb::GenerateResponse> {
        let i = d.index;
        if self.pending.len() <= i {
            self.pending.resize_with(i + 1, || None);
        }
        let slot = &mut self.pending[i];
        match slot {
            None => *slot = Some(d),
            Some(p) => {
                p.text.push_str(&d.text);
                p.token_ids.extend(d.token_ids);
                p.logprobs.extend(d.logprobs);
                p.finish = d.finish;
            }
        }
        // With tools on, an output is held until it ends, then read for calls.
        let held = self.reply.format.tools.is_some();
        let due = slot.as_ref().is_some_and(|p| {
            p.finish.is_some() || (!held && p.token_ids.len() >= self.reply.stream_interval)
        });
        if !due {
            return None;
        }
        let p = slot.take()?;
        let reply = self.reply;
        let out = convert::delta(&p, self.reader(i), reply);
        Some(self.message(vec![out]))
    }

    /// The last message: what is still pending, usage and timing.
    fn last(&mut self, s: &Summary) -> pb::GenerateResponse {
        let outputs = std::mem::take(&mut self.pending)
            .into_iter()
            .flatten()
            .map(|p| {
                let reply = self.reply;
                convert::delta(&p, self.reader(p.index), reply)
            })
            .collect();
        let mut msg = self.message(outputs);
        msg.usage = Some(convert::usage(&s.usage));
        msg.timing = Some(convert::timing(&s.timing));
        msg
    }

    fn end(&mut self, err: Option<&Status>) {
        self.events = None;
        self.deadline = None;
        self.state.record(GENERATE_STREAM, err);
    }
}

impl Stream for GenStream {
    type Item = Result<pb::GenerateResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.events.is_none() {
            return Poll::Ready(None);
        }
        if let Some(d) = this.deadline.as_mut()
            && d.as_mut().poll(cx).is_ready()
        {
            let status = from_engine(EngineError::DeadlineExceeded);
            this.end(Some(&status));
            return Poll::Ready(Some(Err(status)));
        }
        loop {
            let Some(events) = this.events.as_mut() else {
                return Poll::Ready(None);
            };
            let ev = match events.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(ev) => ev,
            };
            match ev {
                Some(Event::PromptLogprobs(lp)) => {
                    let mut msg = this.message(Vec::new());
                    msg.prompt_logprobs = convert::logprobs(&lp.scores);
                    return Poll::Ready(Some(Ok(msg)));
                }
                Some(Event::Delta(d)) => {
                    if let Some(msg) = this.push(d) {
                        return Poll::Ready(Some(Ok(msg)));
                    }
                }
                Some(Event::Finished(s)) => {
                    log_done(&this.request_id, GENERATE_STREAM, &s.usage, &s.timing);
                    let msg = this.last(&s);
                    this.end(None);
                    return Poll::Ready(Some(Ok(msg)));
                }
                Some(Event::Error(e)) => {
                    let status = from_engine(e);
                    this.end(Some(&status));
                    return Poll::Ready(Some(Err(status)));
                }
                None => {
                    let status =
                        Status::internal("the engine closed the request without finishing it");
                    this.end(Some(&status));
                    return Poll::Ready(Some(Err(status)));
                }
            }
        }
    }
}

impl Drop for GenStream {
    fn drop(&mut self) {
        if self.events.is_some() {
            // The client went away mid-stream; dropping `events` aborts the request.
            tracing::debug!(request_id = %self.request_id, "stream dropped by the client");
            self.state.record(
                GENERATE_STREAM,
                Some(&Status::new(Code::Cancelled, "client left")),
            );
        }
    }
}
