//! The step loop: one thread owns the model runner and the scheduler. Each step it takes
//! commands, drops aborted, abandoned and expired requests (freeing their blocks), asks the
//! proposer for drafts and the scheduler for a batch, runs the batch (`batch.rs`), samples, and
//! sends each request its deltas. A failed step ends that batch's requests with the same
//! internal error, cause attached; the loop goes on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

use kiln_kv::SeqId;
use kiln_model::ModelRunner;
use kiln_scheduler::{Schedule, Scheduler, SeqParams};
use kiln_tokenizer::Tokenizer;
use tokio::sync::oneshot;

use crate::EngineError;
use crate::error::{InternalError, InvariantError, error_chain};
use crate::field::Field;
use crate::handle::{Command, EngineInfo, EngineStats, KvEventBatch, ShutdownMode, Submission};
use crate::metrics::EngineMetrics;
use crate::output::ReqState;
use crate::request::{Event, RequestId, Summary, Timing, Usage};
use crate::speculative::Spec;

/// The engine thread's state: the model runner, the scheduler and every request in flight.
pub(crate) struct Loop {
    pub runner: ModelRunner,
    pub sched: Scheduler,
    pub tokenizer: Tokenizer,
    pub info: EngineInfo,
    pub metrics: Arc<EngineMetrics>,
    pub queued: Arc<AtomicUsize>,
    /// The scheduler's waiting capacity after the last step, for the handle's overload check.
    pub capacity: Arc<AtomicUsize>,
    pub requests: HashMap<RequestId, ReqState>,
    /// Which request and output index each sequence serves.
    pub owner: HashMap<SeqId, (RequestId, usize)>,
    pub next_seq: u64,
    pub steps: u64,
    pub rx: mpsc::Receiver<Command>,
    pub shutdown: Option<ShutdownMode>,
    pub waiters: Vec<oneshot::Sender<()>>,
    /// Speculative decoding, when configured.
    pub spec: Option<Spec>,
    /// Rows that need more than an argmax are sampled on the device.
    pub device_sampling: bool,
    /// Logits rows sampled on the device so far.
    pub device_sampled_rows: u64,
    /// Faults to inject (tests).
    pub faults: FaultPlan,
    /// Steps failed in a row.
    pub failed_steps: u32,
    /// Where prefix-cache changes go, when recorded.
    pub kv_events: Option<tokio::sync::mpsc::UnboundedSender<KvEventBatch>>,
}

/// The most bytes of logits one prompt-scoring prefill chunk reads back.
const SCORED_LOGITS_BYTES: usize = 256 << 20;

/// Tokens a prefill chunk scoring its prompt may hold: each reads back a vocabulary of f32
/// logits, so a long chunk of a large vocabulary would need gigabytes at once.
fn scored_chunk(vocab: usize) -> usize {
    (SCORED_LOGITS_BYTES / (vocab.max(1) * 4)).max(1)
}

/// Steps that may fail in a row before the engine gives up (a lost device fails them all).
const MAX_FAILED_STEPS: u32 = 3;

/// Faults to inject, for tests of what serving does when the device fails or hangs: every
/// step from `fail_from_step` on fails as a lost device's would, and the first step after
/// `gate` is armed waits there, as a hung one would, until the test releases it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    pub fail_from_step: Option<u64>,
    pub gate: Option<StepGate>,
}

/// A step a test holds, so that it sees the engine in the middle of a step without racing
/// it: once [`arm`](Self::arm)ed, the next step the loop runs says it has started
/// ([`wait_started`](Self::wait_started)) and waits for [`release`](Self::release). Clones
/// are the same gate.
#[derive(Debug, Clone, Default)]
pub struct StepGate {
    inner: Arc<(Mutex<GateState>, Condvar)>,
}

/// The longest a [`StepGate`] holds a step.
const GATE_HOLD: Duration = Duration::from_secs(120);

#[derive(Debug, Default)]
struct GateState {
    armed: bool,
    started: bool,
    released: bool,
}

impl PartialEq for StepGate {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for StepGate {}

impl StepGate {
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, GateState> {
        // A panic while holding the lock leaves plain flags: still meaningful.
        self.inner.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds the next step the loop runs (arm it while no step is held).
    pub fn arm(&self) {
        *self.state() = GateState {
            armed: true,
            ..GateState::default()
        };
    }

    /// Blocks until the held step has started, at most `timeout`; whether it has.
    pub fn wait_started(&self, timeout: Duration) -> bool {
        let guard = self.state();
        let (guard, _) = self
            .inner
            .1
            .wait_timeout_while(guard, timeout, |g| !g.started)
            .unwrap_or_else(PoisonError::into_inner);
        guard.started
    }

    /// Lets the held step go on.
    pub fn release(&self) {
        self.state().released = true;
        self.inner.1.notify_all();
    }

    /// The step loop's side: when armed, says the step has started and waits for the
    /// release (disarming the gate), at most [`GATE_HOLD`]: a test that never releases it
    /// fails instead of leaving the engine unable to shut down.
    fn pass(&self) {
        let mut guard = self.state();
        if !guard.armed {
            return;
        }
        guard.started = true;
        self.inner.1.notify_all();
        let (mut guard, _) = self
            .inner
            .1
            .wait_timeout_while(guard, GATE_HOLD, |g| !g.released)
            .unwrap_or_else(PoisonError::into_inner);
        guard.armed = false;
    }
}

/// How a request ended early.
pub(crate) enum Ending {
    Error(EngineError),
    /// The receiver is gone: nobody to tell.
    Abandoned,
}

impl Loop {
    pub fn run(mut self) {
        loop {
            if self.sched.is_empty() {
                if self.shutdown.is_some() {
                    break;
                }
                self.metrics.step_clock.idle();
                let cmd = self.rx.recv();
                self.metrics.step_clock.turn();
                match cmd {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => break, // every handle dropped, nothing in flight
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        self.shutdown = Some(ShutdownMode::Cancel);
                        break;
                    }
                }
            }
            if self.shutdown == Some(ShutdownMode::Cancel) {
                let ids: Vec<_> = self.requests.keys().copied().collect();
                for id in ids {
                    self.end(
                        id,
                        Ending::Error(EngineError::Cancelled("engine shutting down".into())),
                    );
                }
            }
            self.reap();
            if self.sched.is_empty() {
                self.publish();
                continue;
            }
            let ran = self.step();
            if ran {
                self.metrics.step_clock.turn();
            }
            self.publish();
            if !ran {
                // Nothing could be scheduled (waiting on memory held by nobody should not
                // happen; wait for a command rather than spin).
                if let Ok(cmd) = self.rx.recv_timeout(Duration::from_millis(5)) {
                    self.command(cmd);
                }
            }
        }
        self.publish();
        for w in self.waiters.drain(..) {
            let _ = w.send(());
        }
        tracing::info!(steps = self.steps, "engine stopped");
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => self.admit_request(*sub),
            Command::Abort(id) => {
                self.end(id, Ending::Error(EngineError::Cancelled("aborted".into())));
            }
            Command::Stats(tx) => {
                let _ = tx.send(self.stats());
            }
            Command::Shutdown(mode, done) => {
                // Cancel wins over drain.
                if self.shutdown != Some(ShutdownMode::Cancel) {
                    self.shutdown = Some(mode);
                }
                self.waiters.push(done);
            }
        }
    }

    fn admit_request(&mut self, mut sub: Submission) {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let params = SeqParams {
            priority: sub.request.priority,
            forks: sub.request.n - 1,
            recompute_prefix: sub.request.output.prompt_logprobs.is_some(),
            max_chunk: sub
                .request
                .output
                .prompt_logprobs
                .map(|_| scored_chunk(self.info.vocab_size)),
        };
        if let Err(e) = self.sched.add(seq, sub.prompt_ids.clone(), params) {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            let err = match e {
                kiln_scheduler::SchedulerError::Overloaded { waiting, limit } => {
                    EngineError::Overloaded { waiting, limit }
                }
                other => EngineError::invalid_because(Field::Prompt, "cannot be scheduled", other),
            };
            let _ = sub.tx.send(Event::Error(err));
            return;
        }
        tracing::debug!(
            request = sub.id.0,
            label = %sub.request.label,
            prompt_tokens = sub.prompt_ids.len(),
            "request queued"
        );
        self.owner.insert(seq, (sub.id, 0));
        let state = ReqState::new(&mut sub, seq, &self.tokenizer, &self.info);
        self.requests.insert(sub.id, state);
    }

    /// Drops requests whose stream was dropped or whose deadline passed.
    fn reap(&mut self) {
        let now = Instant::now();
        let mut ended = Vec::new();
        for (&id, r) in &self.requests {
            if r.tx.is_closed() {
                ended.push((id, Ending::Abandoned));
            } else if r.deadline.is_some_and(|d| d <= now) {
                ended.push((id, Ending::Error(EngineError::DeadlineExceeded)));
            }
        }
        for (id, why) in ended {
            self.end(id, why);
        }
    }

    /// Ends a request early: frees every sequence, tells the caller if it still listens.
    pub fn end(&mut self, id: RequestId, why: Ending) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        for seq in r.seqs() {
            self.finish_seq(seq);
        }
        if r.admitted.is_none() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        let label = match &why {
            Ending::Abandoned => "abandoned",
            Ending::Error(EngineError::DeadlineExceeded) => "deadline",
            Ending::Error(EngineError::Cancelled(_)) => "cancelled",
            Ending::Error(_) => "error",
        };
        self.metrics.finished(label);
        self.metrics.e2e.observe(r.arrived.elapsed().as_secs_f64());
        match &why {
            // What failed inside, with its causes: once per request it ended.
            Ending::Error(e @ EngineError::Internal(_)) => {
                tracing::error!(request = id.0, error = %error_chain(e), "request failed");
            }
            _ => tracing::debug!(request = id.0, label, "request ended early"),
        }
        if let Ending::Error(e) = why {
            let _ = r.tx.send(Event::Error(e));
        }
    }

    /// A sequence is done: its blocks (and its draft model's) go back before the next step.
    pub fn finish_seq(&mut self, seq: SeqId) {
        self.sched.finish(seq);
        self.owner.remove(&seq);
        if let Some(spec) = &mut self.spec {
            spec.proposer.release(seq);
        }
    }

    /// One forward step. Returns whether anything ran.
    fn step(&mut self) -> bool {
        self.propose();
        let schedule = self.sched.schedule();
        // Before the step's first tokens reach anyone: a caller who saw one must find the
        // slot its request took already counted.
        self.publish_capacity();
        self.steps += 1;
        let now = Instant::now();
        for &(seq, cached) in &schedule.admitted {
            let Some(&(rid, _)) = self.owner.get(&seq) else {
                continue;
            };
            if let Some(r) = self.requests.get_mut(&rid)
                && r.admitted.is_none()
            {
                r.admitted = Some(now);
                r.cached_tokens = cached;
                self.queued.fetch_sub(1, Ordering::AcqRel);
                self.metrics
                    .queue_time
                    .observe((now - r.arrived).as_secs_f64());
                self.metrics.prompt_tokens.inc_by(r.prompt_len as u64);
            }
        }
        self.metrics
            .preemptions
            .inc_by(schedule.preempted.len() as u64);
        if let Some(spec) = &mut self.spec {
            // A preempted sequence recomputes later; its draft cache goes back now.
            for &seq in &schedule.preempted {
                spec.proposer.release(seq);
            }
        }
        for (seq, err) in schedule.rejected.iter().cloned() {
            if let Some(&(rid, _)) = self.owner.get(&seq) {
                let e = InternalError::NoLongerFits(err);
                self.end(rid, Ending::Error(e.into()));
            }
        }
        if schedule.is_empty() {
            return false;
        }
        let _span = tracing::debug_span!(
            "step",
            n = self.steps,
            seqs = schedule.seqs.len(),
            tokens = schedule.num_tokens(),
            decodes = schedule.num_decodes(),
            preempted = schedule.preempted.len()
        )
        .entered();
        self.metrics
            .step_tokens
            .observe(schedule.num_tokens() as f64);
        if let Some(gate) = &self.faults.gate {
            gate.pass();
        }
        let prompt_rows = self.prompt_rows(&schedule);
        let out = match self.faults.fail_from_step {
            Some(from) if self.steps >= from => Err(InternalError::Injected(self.steps)),
            _ => self.forward(&schedule, &prompt_rows),
        }
        .and_then(|out| {
            self.sched
                .complete(&schedule)
                .map_err(InternalError::Scheduler)?;
            Ok(out)
        });
        match out {
            Ok(out) => {
                self.failed_steps = 0;
                self.score_prompts(&schedule, &prompt_rows, &out);
                self.sample_all(&schedule, &out);
            }
            Err(e) => {
                self.failed_steps += 1;
                if self.failed_steps >= MAX_FAILED_STEPS {
                    // A device lost or out of memory fails every step: stop, so health says
                    // so and the server exits for an orchestrator to restart it.
                    tracing::error!(
                        steps = self.failed_steps,
                        error = %error_chain(&e),
                        "steps keep failing: the engine stops"
                    );
                    self.shutdown = Some(ShutdownMode::Cancel);
                }
                self.fail_batch(&schedule, e);
            }
        }
        true
    }

    /// Every request in a failed batch ends with the same internal error; the loop goes on.
    fn fail_batch(&mut self, schedule: &Schedule, e: InternalError) {
        // One error shared by every request of the batch; each is logged as it ends.
        let e = EngineError::from(e);
        for s in &schedule.seqs {
            if let Some(&(rid, _)) = self.owner.get(&s.seq) {
                self.end(rid, Ending::Error(e.clone()));
            }
        }
    }

    /// Outputs `1..n` of a request fork from its finished prompt.
    pub fn fork(&mut self, rid: RequestId, parent: SeqId) -> Result<(), EngineError> {
        let Some(r) = self.requests.get_mut(&rid) else {
            return Ok(());
        };
        for index in 1..r.n {
            let guide = r.fork_guide(&self.metrics)?;
            let child = SeqId(self.next_seq);
            self.next_seq += 1;
            self.sched
                .fork(parent, child)
                .map_err(InternalError::Fork)?;
            r.add_output(child, &self.tokenizer, guide);
            self.owner.insert(child, (rid, index));
        }
        Ok(())
    }

    /// Sends the prompt's log-probabilities once all are known (before any delta), then the
    /// pending deltas; a request whose outputs all finished gets its summary and goes.
    pub fn flush(&mut self, rid: RequestId) {
        let Some(r) = self.requests.get_mut(&rid) else {
            return;
        };
        if let Some(lp) = r.take_prompt_logprobs() {
            let _ = r.tx.send(Event::PromptLogprobs(lp));
        } else if r.awaits_prompt_logprobs() {
            // A sequence that sampled has computed its whole prompt: every score is known.
            let e = InternalError::State("prompt scored only in part");
            self.end(rid, Ending::Error(e.into()));
            return;
        }
        for d in r.take_deltas() {
            let _ = r.tx.send(Event::Delta(d));
        }
        if !r.all_finished() {
            return;
        }
        let Some(r) = self.requests.remove(&rid) else {
            return;
        };
        let end = Instant::now();
        let first = r.first_token.unwrap_or(end);
        let admitted = r.admitted.unwrap_or(end);
        let summary = Summary {
            finish: r.outs.iter().filter_map(|o| o.finish.clone()).collect(),
            usage: Usage {
                prompt_tokens: r.prompt_len,
                completion_tokens: r.outs.iter().map(|o| o.generated.len()).sum(),
                cached_prompt_tokens: r.cached_tokens,
            },
            timing: Timing {
                queue: admitted - r.arrived,
                time_to_first_token: first - r.arrived,
                decode: end - first,
                total: end - r.arrived,
                speculative: r.spec,
            },
        };
        for f in &summary.finish {
            self.metrics.finished(f.name());
        }
        self.metrics.e2e.observe(summary.timing.total.as_secs_f64());
        let _ = r.tx.send(Event::Finished(summary));
    }

    /// Queue depths, KV figures and the invariant checks, between steps.
    fn stats(&self) -> EngineStats {
        let s = self.sched.stats();
        EngineStats {
            requests: self.requests.len(),
            running: s.running,
            waiting: s.waiting,
            preempted: s.preempted,
            preemptions: s.preemptions,
            steps: self.steps,
            device_sampled_rows: self.device_sampled_rows,
            kv: s.kv,
            draft_kv: self.spec.as_ref().and_then(|p| p.proposer.kv_metrics()),
            invariants: self
                .sched
                .check_invariants()
                .map_err(InvariantError::Scheduler)
                .and_then(|()| {
                    if self.owner.len() == self.sched.len() {
                        Ok(())
                    } else {
                        Err(InvariantError::Owners {
                            owners: self.owner.len(),
                            held: self.sched.len(),
                        })
                    }
                })
                .and_then(|()| match &self.spec {
                    Some(p) => p.proposer.check(&|seq| self.owner.contains_key(&seq)),
                    None => Ok(()),
                }),
        }
    }

    /// The step's prefix-cache changes, to whoever takes [`EngineHandle::kv_events`]. A
    /// receiver that went away stops the recording.
    fn send_kv_events(&mut self) {
        let Some(tx) = &self.kv_events else {
            return;
        };
        let events = self.sched.take_cache_events();
        if events.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if tx.send(KvEventBatch { ts, events }).is_err() {
            self.kv_events = None;
            self.sched.record_cache_events(false);
        }
    }

    /// How many requests may be queued now, for the handle's overload check.
    fn publish_capacity(&self) {
        self.capacity
            .store(self.sched.waiting_capacity(), Ordering::Release);
    }

    /// The gauges and counters of the metrics registry, after every step.
    fn publish(&mut self) {
        self.send_kv_events();
        let s = self.sched.stats();
        self.publish_capacity();
        let m = &self.metrics;
        m.running.set(s.running as i64);
        m.waiting.set(s.waiting as i64);
        m.preempted.set(s.preempted as i64);
        m.queued.set((s.waiting + s.preempted) as i64);
        m.kv_usage.set(s.kv.usage());
        m.kv_used_blocks.set(s.kv.whole_sequences().0 as i64);
        let hits = m.prefix_hit_tokens.get();
        m.prefix_hit_tokens
            .inc_by(s.kv.prefix_hit_tokens.saturating_sub(hits));
        let queries = m.prefix_query_tokens.get();
        m.prefix_query_tokens
            .inc_by(s.kv.prefix_query_tokens.saturating_sub(queries));
    }
}
