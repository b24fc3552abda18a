//! The caller's side: `EngineHandle` (submit, abort, stats, metrics, shutdown) and the
//! per-request `RequestStream`. Requests are validated and tokenized here, on the caller's
//! thread, so the step loop only ever sees well-formed work.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::task::{Context, Poll};
use std::thread::JoinHandle;

use kiln_kv::KvMetrics;
use kiln_tokenizer::Tokenizer;
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::EngineError;
use crate::constraint::{ConstraintCompiler, ConstraintError, Guide};
use crate::error::{InternalError, InvariantError};
use crate::field::Field;
use crate::metrics::EngineMetrics;
use crate::request::{Event, Output, OutputBuilder, Prompt, Request, RequestId};

/// Limits and facts a caller (or the server's model-info call) can read.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    /// Token ids run from 0 to this, exclusive.
    pub vocab_size: usize,
    /// Prompt plus generated tokens of one sequence, at most: the model's context (or the
    /// configured `max_model_len`) within what one sequence can hold of the KV pool.
    pub max_model_len: usize,
    /// Prompt text longer than this cannot fit `max_model_len` whatever its tokens, and is
    /// refused before it is tokenized.
    pub max_prompt_bytes: usize,
    pub bos: Option<u32>,
    /// Ids that end generation unless `ignore_eos`.
    pub eos_ids: Vec<u32>,
    pub max_n: usize,
    pub max_stop_strings: usize,
    pub max_top_logprobs: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
    pub kv_blocks: usize,
    pub block_size: usize,
    /// How K/V are stored (`f16`, `f32`, `int8`).
    pub kv_dtype: &'static str,
    /// Device bytes of K and V for one token over all layers.
    pub kv_bytes_per_token: u64,
    /// Blocks admission may use (the pool less the watermark).
    pub usable_blocks: usize,
    /// The device the model runs on.
    pub device: String,
}

/// Prompt text longer than any prompt that fits the context could be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{bytes} bytes of text cannot fit this model's maximum context length of {max_model_len} \
     tokens (at most {max_bytes} bytes)"
)]
pub struct PromptTooLong {
    pub bytes: usize,
    pub max_model_len: usize,
    pub max_bytes: usize,
}

/// How much normalization can shrink text before it is split into tokens: NFKC turns a
/// 3-byte full-width letter into 1 byte. A prompt's byte bound allows for it.
pub(crate) const NORMALIZED_SHRINK: usize = 4;

impl EngineInfo {
    /// Refuses, before tokenizing, prompt text too long for the context whatever its tokens
    /// (tokenizing megabytes costs seconds and gigabytes for a request that must fail).
    pub fn check_prompt_text(&self, text: &str) -> Result<(), PromptTooLong> {
        if text.len() > self.max_prompt_bytes {
            return Err(PromptTooLong {
                bytes: text.len(),
                max_model_len: self.max_model_len,
                max_bytes: self.max_prompt_bytes,
            });
        }
        Ok(())
    }
}

/// A snapshot taken between steps.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStats {
    /// Requests in flight (submitted, not yet finished).
    pub requests: usize,
    pub running: usize,
    pub waiting: usize,
    pub preempted: usize,
    pub preemptions: u64,
    pub steps: u64,
    /// Logits rows sampled on the device ([`crate::DeviceSampling`]) so far.
    pub device_sampled_rows: u64,
    pub kv: KvMetrics,
    /// The draft model's own KV pool (speculative decoding with a draft model).
    pub draft_kv: Option<KvMetrics>,
    /// The scheduler's and block manager's invariants (`Err` names what is broken).
    pub invariants: Result<(), InvariantError>,
}

/// How [`EngineHandle::shutdown`] treats requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Refuse new requests, finish those in flight, then stop.
    Drain,
    /// Refuse new requests, end those in flight with `Cancelled`, then stop.
    Cancel,
}

pub(crate) struct Submission {
    pub id: RequestId,
    pub request: Request,
    pub prompt_ids: Vec<u32>,
    pub seed: u64,
    pub tx: tmpsc::UnboundedSender<Event>,
    pub arrived: std::time::Instant,
    /// Output 0's constraint, compiled (its first mask is computing already).
    pub guide: Option<Guide>,
}

pub(crate) enum Command {
    Submit(Box<Submission>),
    Abort(RequestId),
    Stats(oneshot::Sender<EngineStats>),
    Shutdown(ShutdownMode, oneshot::Sender<()>),
}

pub(crate) struct Shared {
    pub tx: Mutex<mpsc::Sender<Command>>,
    pub tokenizer: Tokenizer,
    pub info: EngineInfo,
    /// Requests submitted and not yet admitted (or ended): the overload check.
    pub queued: Arc<AtomicUsize>,
    /// How many may be queued: `max_waiting` plus the free running slots, as the step loop
    /// last saw them.
    pub capacity: Arc<AtomicUsize>,
    pub closing: AtomicBool,
    pub next_id: AtomicU64,
    pub metrics: Arc<EngineMetrics>,
    /// Structured output's compiler, built on the first constrained request (`Err`: why this
    /// model cannot have one).
    pub grammars: OnceLock<Result<Arc<ConstraintCompiler>, ConstraintError>>,
    pub thread: Mutex<Option<JoinHandle<()>>>,
    /// The prefix-cache changes, until [`EngineHandle::kv_events`] takes them.
    pub kv_events: Mutex<Option<tmpsc::UnboundedReceiver<KvEventBatch>>>,
}

/// The prefix-cache changes of one engine step, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// When the step ended, in seconds since the Unix epoch.
    pub ts: f64,
    pub events: Vec<kiln_kv::CacheEvent>,
}

/// A cheap, cloneable, thread-safe handle to a running engine. Dropping the last one stops
/// the engine (requests in flight end with `Cancelled`).
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("info", &self.shared.info)
            .finish_non_exhaustive()
    }
}

/// A request [`EngineHandle::check`] accepted.
struct Checked {
    request: Request,
    prompt_ids: Vec<u32>,
    guide: Option<Guide>,
}

impl EngineHandle {
    /// Validates and queues a request; its events arrive on the returned stream. Refused at
    /// once when invalid (`InvalidArgument` naming the field), when the waiting queue is full
    /// (`Overloaded`) or while shutting down.
    pub fn submit(&self, request: Request) -> Result<RequestStream, EngineError> {
        let checked = self.check(request)?;
        self.enqueue(checked)
    }

    /// [`submit`](Self::submit) for a batch (one call's prompts): every request is checked
    /// before any is queued, so a bad one refuses the whole batch with nothing run; the
    /// error comes with the index of the request it is about. (Refused for overload midway,
    /// the streams queued so far are dropped, which aborts their requests.)
    pub fn submit_all(
        &self,
        requests: Vec<Request>,
    ) -> Result<Vec<RequestStream>, (usize, EngineError)> {
        let checked = requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| self.check(r).map_err(|e| (i, e)))
            .collect::<Result<Vec<_>, _>>()?;
        checked
            .into_iter()
            .enumerate()
            .map(|(i, c)| self.enqueue(c).map_err(|e| (i, e)))
            .collect()
    }

    /// A request validated, with its prompt ids and its constraint's guide.
    fn check(&self, request: Request) -> Result<Checked, EngineError> {
        if self.shared.closing.load(Ordering::Acquire) {
            return Err(EngineError::ShuttingDown);
        }
        let prompt_ids = self.validate(&request)?;
        let guide = match &request.constraint {
            Some(c) => {
                let g = self.grammars().map_err(|e| {
                    EngineError::invalid_because(
                        Field::Constraint(c.kind()),
                        "structured output is not available for this model",
                        e,
                    )
                })?;
                Some(Guide::new(g.compile(c)?, g.eos()))
            }
            None => None,
        };
        Ok(Checked {
            request,
            prompt_ids,
            guide,
        })
    }

    /// Queues a checked request.
    fn enqueue(&self, checked: Checked) -> Result<RequestStream, EngineError> {
        let Checked {
            request,
            prompt_ids,
            guide,
        } = checked;
        let s = &self.shared;
        if s.closing.load(Ordering::Acquire) {
            return Err(EngineError::ShuttingDown);
        }
        // Count ourselves in first, then read the limit: the step loop lowers the capacity
        // before it takes admitted requests off `queued`, so a count that already lacks them
        // is always read with the capacity that lacks their slots (never a stale, larger one).
        let waiting = s.queued.fetch_add(1, Ordering::AcqRel);
        let limit = s.capacity.load(Ordering::Acquire);
        if waiting >= limit {
            s.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Overloaded { waiting, limit });
        }
        let id = RequestId(s.next_id.fetch_add(1, Ordering::Relaxed));
        let seed = request.seed.unwrap_or_else(rand::random);
        let (tx, rx) = tmpsc::unbounded_channel();
        let sub = Submission {
            id,
            request,
            prompt_ids,
            seed,
            tx,
            arrived: std::time::Instant::now(),
            guide,
        };
        if self.send(Command::Submit(Box::new(sub))).is_err() {
            s.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::ShuttingDown);
        }
        Ok(RequestStream { id, rx })
    }

    /// The engine's prefix-cache changes, one batch per step that changed anything, for a
    /// publisher to send on (see `kiln_server::KvEventPublisher`). `Some` once, and only when
    /// the engine was started with `kv_events`; the channel closes when the engine stops.
    pub fn kv_events(&self) -> Option<tmpsc::UnboundedReceiver<KvEventBatch>> {
        self.shared
            .kv_events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Ends a request: its stream gets `Cancelled` and its KV blocks are freed before the next
    /// step. Dropping the stream does the same. Unknown or finished ids are ignored.
    pub fn abort(&self, id: RequestId) {
        let _ = self.send(Command::Abort(id));
    }

    /// Queue depths, KV figures and an invariant check, taken between steps.
    pub async fn stats(&self) -> Result<EngineStats, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Stats(tx))?;
        rx.await.map_err(|_| EngineError::ShuttingDown)
    }

    /// [`stats`](Self::stats) for synchronous callers (not from inside an async runtime).
    pub fn stats_blocking(&self) -> Result<EngineStats, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Stats(tx))?;
        rx.blocking_recv().map_err(|_| EngineError::ShuttingDown)
    }

    /// Stops taking requests, then drains or cancels those in flight; resolves once the step
    /// loop has exited.
    pub async fn shutdown(&self, mode: ShutdownMode) {
        let rx = self.begin_shutdown(mode);
        if let Some(rx) = rx {
            let _ = rx.await;
        }
        self.join();
    }

    /// [`shutdown`](Self::shutdown) for synchronous callers.
    pub fn shutdown_blocking(&self, mode: ShutdownMode) {
        if let Some(rx) = self.begin_shutdown(mode) {
            let _ = rx.blocking_recv();
        }
        self.join();
    }

    fn begin_shutdown(&self, mode: ShutdownMode) -> Option<oneshot::Receiver<()>> {
        self.shared.closing.store(true, Ordering::Release);
        let (tx, rx) = oneshot::channel();
        self.send(Command::Shutdown(mode, tx)).ok().map(|()| rx)
    }

    fn join(&self) {
        let thread = self.shared.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// Whether the step loop has exited.
    pub fn is_stopped(&self) -> bool {
        self.shared
            .thread
            .lock()
            .map(|t| t.as_ref().is_none_or(JoinHandle::is_finished))
            .unwrap_or(true)
    }

    /// Whether new requests are refused (shutdown begun).
    pub fn is_closing(&self) -> bool {
        self.shared.closing.load(Ordering::Acquire)
    }

    pub fn info(&self) -> &EngineInfo {
        &self.shared.info
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.shared.tokenizer
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.shared.metrics
    }

    /// How long the step loop has gone without turning while it holds work (a step running,
    /// requests waiting); `None` while it waits idle. What a watchdog reads.
    pub fn stalled_for(&self) -> Option<std::time::Duration> {
        self.shared.metrics.step_clock.stalled_for()
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        let tx = self
            .shared
            .tx
            .lock()
            .map_err(|_| EngineError::ShuttingDown)?;
        tx.send(cmd).map_err(|_| EngineError::ShuttingDown)
    }

    /// The structured-output compiler, built on first use.
    fn grammars(&self) -> Result<Arc<ConstraintCompiler>, ConstraintError> {
        let s = &self.shared;
        s.grammars
            .get_or_init(|| ConstraintCompiler::new(&s.tokenizer, &s.info.eos_ids).map(Arc::new))
            .clone()
    }

    /// Checks every field against the model and the engine's limits; returns the prompt ids.
    fn validate(&self, r: &Request) -> Result<Vec<u32>, EngineError> {
        let info = &self.shared.info;
        let vocab = info.vocab_size;
        let ids = match &r.prompt {
            Prompt::Text(t) => {
                if t.is_empty() {
                    return Err(EngineError::invalid(Field::Prompt, "is empty"));
                }
                info.check_prompt_text(t)
                    .map_err(|e| EngineError::invalid_because(Field::Prompt, "is too long", e))?;
                self.shared.tokenizer.encode(t).map_err(|e| {
                    EngineError::invalid_because(Field::Prompt, "cannot be tokenized", e)
                })?
            }
            Prompt::TokenIds(ids) => ids.clone(),
        };
        if ids.is_empty() {
            return Err(EngineError::invalid(Field::Prompt, "has no tokens"));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::invalid(
                Field::PromptTokenIds,
                format!("token id {bad} is outside the vocabulary (0..{vocab})"),
            ));
        }
        // Scoring a prompt alone (max_new_tokens 0) needs no room after it.
        let scores_only = r.stopping.max_new_tokens == Some(0);
        if ids.len() > info.max_model_len || (ids.len() == info.max_model_len && !scores_only) {
            return Err(EngineError::invalid(
                Field::Prompt,
                format!(
                    "{} tokens leave no room to generate: this model's maximum context length \
                     is {} tokens",
                    ids.len(),
                    info.max_model_len
                ),
            ));
        }
        r.sampling
            .validate(vocab)
            .map_err(|e| EngineError::invalid(e.field, e.reason))?;
        if r.n == 0 || r.n > info.max_n {
            return Err(EngineError::invalid(
                Field::N,
                format!("{} is outside 1..={}", r.n, info.max_n),
            ));
        }
        let st = &r.stopping;
        let room = info.max_model_len - ids.len();
        if let Some(max) = st.max_new_tokens {
            if max == 0 && r.output.prompt_logprobs.is_none() {
                return Err(EngineError::invalid(
                    Field::MaxNewTokens,
                    "must be at least 1 (0, scoring the prompt alone, needs prompt_logprobs)",
                ));
            }
            // Accepted, it would end early or outgrow the KV pool: refuse it now, in the words
            // clients and routers already match on ("maximum context length").
            if max > room {
                return Err(EngineError::invalid(
                    Field::MaxNewTokens,
                    format!(
                        "this model's maximum context length is {} tokens; the request asks \
                         for {} ({} in the prompt, {max} to generate)",
                        info.max_model_len,
                        ids.len() + max,
                        ids.len()
                    ),
                ));
            }
        }
        let max_new = st.max_new_tokens(room);
        if st.min_new_tokens > max_new {
            return Err(EngineError::invalid(
                Field::MinNewTokens,
                format!("{} exceeds max_new_tokens {max_new}", st.min_new_tokens),
            ));
        }
        if st.stop.len() > info.max_stop_strings {
            return Err(EngineError::invalid(
                Field::Stop,
                format!(
                    "{} stop strings; at most {}",
                    st.stop.len(),
                    info.max_stop_strings
                ),
            ));
        }
        if st.stop.iter().any(String::is_empty) {
            return Err(EngineError::invalid(Field::Stop, "empty stop string"));
        }
        if let Some(bad) = st.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::invalid(
                Field::StopTokenIds,
                format!("{bad} is outside the vocabulary (0..{vocab})"),
            ));
        }
        if st.min_new_tokens > 0 {
            // Until min_new_tokens exist, EOS and the stop ids are banned: all of them at once
            // would leave nothing to sample.
            let mut banned: std::collections::HashSet<u32> =
                st.stop_token_ids.iter().copied().collect();
            if !st.ignore_eos {
                banned.extend(&info.eos_ids);
            }
            if banned.len() >= vocab {
                return Err(EngineError::invalid(
                    Field::StopTokenIds,
                    format!(
                        "with min_new_tokens {} they and EOS ban all {vocab} tokens: nothing \
                         could be generated",
                        st.min_new_tokens
                    ),
                ));
            }
        }
        if r.output.top_logprobs > info.max_top_logprobs {
            return Err(EngineError::invalid(
                Field::TopLogprobs,
                format!(
                    "{} exceeds the limit {}",
                    r.output.top_logprobs, info.max_top_logprobs
                ),
            ));
        }
        if let Some(n) = r.output.prompt_logprobs
            && n > info.max_top_logprobs
        {
            return Err(EngineError::invalid(
                Field::PromptLogprobs,
                format!("{n} exceeds the limit {}", info.max_top_logprobs),
            ));
        }
        Ok(ids)
    }
}

/// The events of one request: deltas, then one `Finished` or `Error`. Dropping it aborts the
/// request within one step.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    rx: tmpsc::UnboundedReceiver<Event>,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event; `None` after the last.
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// [`recv`](Self::recv) for synchronous callers (not from inside an async runtime).
    pub fn blocking_recv(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }

    /// For `Stream` adapters.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.rx.poll_recv(cx)
    }

    /// Waits for the whole result.
    pub async fn collect(mut self) -> Result<Output, EngineError> {
        let mut b = OutputBuilder::default();
        while let Some(ev) = self.rx.recv().await {
            if let Some(done) = b.push(ev) {
                return done;
            }
        }
        Err(closed())
    }

    /// [`collect`](Self::collect) for synchronous callers.
    pub fn blocking_collect(mut self) -> Result<Output, EngineError> {
        let mut b = OutputBuilder::default();
        while let Some(ev) = self.rx.blocking_recv() {
            if let Some(done) = b.push(ev) {
                return done;
            }
        }
        Err(closed())
    }
}

fn closed() -> EngineError {
    InternalError::StreamClosed.into()
}
