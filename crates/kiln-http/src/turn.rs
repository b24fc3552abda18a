//! One assistant turn of the agent doors (Responses, Messages): a single output read as a
//! reply while it streams, whatever the door's event shapes. A door writes its events through
//! a [`Writer`]; [`TurnStream`] drives it from the engine's events, so the order (reasoning,
//! then content, then calls and the end) and the error path are the same on every door. The
//! stream owns the engine's request stream: a client that leaves drops it, and the engine
//! aborts the request (freeing its KV blocks) within one step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::sse;
use kiln_api::{ApiError, Reply, ReplyStream};
use kiln_engine::{EngineError, Event, RequestStream, Usage};
use tokio_stream::Stream;

/// What a door writes as its turn goes; each call queues the SSE events it makes.
pub(crate) trait Writer: Send + Unpin + 'static {
    /// The events before any token.
    fn start(&mut self, out: &mut Vec<sse::Event>);
    /// A piece of the reasoning.
    fn reasoning(&mut self, delta: &str, out: &mut Vec<sse::Event>);
    /// A piece of the reply's text.
    fn content(&mut self, delta: &str, out: &mut Vec<sse::Event>);
    /// The output ended: what was held back (text, reasoning), the calls, how it ended, and
    /// the usage.
    fn end(&mut self, rest: Reply, usage: &Usage, out: &mut Vec<sse::Event>);
    /// The turn failed after the headers went out.
    fn fail(&mut self, e: &ApiError, out: &mut Vec<sse::Event>);
}

/// The SSE body of a streamed turn.
pub(crate) struct TurnStream<W> {
    events: Option<RequestStream>,
    reader: ReplyStream,
    writer: W,
    queue: VecDeque<sse::Event>,
    /// What the reader held back, once the output's last delta came (usage comes after it).
    rest: Option<Reply>,
    started: bool,
    done: bool,
}

impl<W> std::fmt::Debug for TurnStream<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnStream")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<W: Writer> TurnStream<W> {
    pub(crate) fn new(events: RequestStream, reader: ReplyStream, writer: W) -> Self {
        Self {
            events: Some(events),
            reader,
            writer,
            queue: VecDeque::new(),
            rest: None,
            started: false,
            done: false,
        }
    }

    fn handle(&mut self, ev: Option<Event>) {
        let mut out = Vec::new();
        match ev {
            // The Responses and Messages doors never ask for them.
            Some(Event::PromptLogprobs(_)) => {}
            Some(Event::Delta(d)) => {
                let piece = self.reader.push(&d.text);
                if !piece.reasoning.is_empty() {
                    self.writer.reasoning(&piece.reasoning, &mut out);
                }
                if !piece.content.is_empty() {
                    self.writer.content(&piece.content, &mut out);
                }
                if let Some(f) = &d.finish {
                    self.rest = Some(self.reader.finish(Some(f)));
                }
            }
            Some(Event::Finished(s)) => {
                let rest = self.rest.take().unwrap_or_default();
                self.writer.end(rest, &s.usage, &mut out);
                self.done = true;
            }
            Some(Event::Error(e)) => self.fail(e, &mut out),
            None => self.fail(EngineError::ShuttingDown, &mut out),
        }
        self.queue.extend(out);
    }

    fn fail(&mut self, e: EngineError, out: &mut Vec<sse::Event>) {
        self.writer.fail(&ApiError::Engine(e), out);
        self.events = None;
        self.done = true;
    }
}

impl<W: Writer> Stream for TurnStream<W> {
    type Item = Result<sse::Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if !this.started {
            this.started = true;
            let mut out = Vec::new();
            this.writer.start(&mut out);
            this.queue.extend(out);
        }
        loop {
            if let Some(ev) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(ev)));
            }
            if this.done {
                this.events = None;
                return Poll::Ready(None);
            }
            let Some(events) = this.events.as_mut() else {
                return Poll::Ready(None);
            };
            match events.poll_recv(cx) {
                Poll::Ready(ev) => this.handle(ev),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// An SSE event with an `event:` line naming it (the Messages and Responses streams name
/// each event; Anthropic's client drops events without one).
pub(crate) fn named(name: &str, data: &serde_json::Value) -> sse::Event {
    sse::Event::default().event(name).data(data.to_string())
}
