//! The step loop: one thread owns the model, the device KV cache and the scheduler. Each step
//! it takes commands, drops aborted, abandoned and expired requests (freeing their blocks),
//! asks the scheduler for a batch, records the whole forward pass into one submit, reads back
//! only what sampling needs, and sends each request its deltas.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use kiln_kv::device::{KvCache, KvCacheConfig};
use kiln_kv::{KvDtype, SeqId};
use kiln_model::{LogitsAt, Model, SeqInput};
use kiln_scheduler::{Schedule, Scheduler, SchedulerConfig, SeqParams};
use kiln_tensor::Recorder;
use kiln_tokenizer::Tokenizer;
use tokio::sync::oneshot;

use crate::draft::{DraftModel, DraftProposer, check_same_tokenizer};
use crate::handle::{
    Command, EngineHandle, EngineInfo, EngineStats, Shared, ShutdownMode, Submission,
};
use crate::metrics::EngineMetrics;
use crate::output::{ReqState, TokenOutcome};
use crate::request::{Event, Summary, Timing, Usage};
use crate::speculative::{NgramProposer, ProposeInput, Proposer, SpecMethod, SpeculativeConfig};
use crate::{EngineError, StartError};

/// Engine limits. The scheduler's config holds the batch limits and the KV pool.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// How K/V are stored on the device.
    pub kv_dtype: KvDtype,
    /// Cap on prompt plus generated tokens (`None`: the model's context length).
    pub max_model_len: Option<usize>,
    /// Outputs per request, at most.
    pub max_n: usize,
    pub max_stop_strings: usize,
    pub max_top_logprobs: usize,
    /// Speculative decoding (`None`: off).
    pub speculative: Option<SpeculativeConfig>,
}

impl EngineConfig {
    /// Defaults over a scheduler config (which sizes the KV pool).
    pub fn new(scheduler: SchedulerConfig) -> Self {
        Self {
            scheduler,
            kv_dtype: KvDtype::F16,
            max_model_len: None,
            max_n: 16,
            max_stop_strings: 16,
            max_top_logprobs: 20,
            speculative: None,
        }
    }
}

/// Starts the engine thread.
#[derive(Debug)]
pub struct Engine;

impl Engine {
    /// Moves `model` onto a dedicated thread with a KV cache sized by `cfg` and returns the
    /// handle that talks to it.
    pub fn start(
        model: Model,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, StartError> {
        Self::start_with_draft(model, tokenizer, cfg, None)
    }

    /// [`start`](Self::start) with a draft model for speculative decoding
    /// (`cfg.speculative` with [`SpecMethod::Draft`]). The draft must live on the same device
    /// and share the target's tokenizer (checked: a clear error names the first difference).
    pub fn start_with_draft(
        model: Model,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
        draft: Option<DraftModel>,
    ) -> Result<EngineHandle, StartError> {
        let mcfg = model.config().clone();
        let max_model_len = cfg.max_model_len.unwrap_or(mcfg.max_position);
        if max_model_len < 2 || max_model_len > mcfg.max_position {
            return Err(StartError::Config {
                field: "max_model_len",
                reason: format!(
                    "{max_model_len} must be in 2..={} (the model's context)",
                    mcfg.max_position
                ),
            });
        }
        let vocab = mcfg.vocab;
        if (tokenizer.vocab_size() as usize) > vocab {
            return Err(StartError::Config {
                field: "tokenizer",
                reason: format!(
                    "{} tokens, more than the model's vocabulary of {vocab}",
                    tokenizer.vocab_size()
                ),
            });
        }
        let mut scfg = cfg.scheduler.clone();
        scfg.sliding_window = mcfg.sliding_window;
        let sched = Scheduler::new(scfg.clone())?;
        let blocks = &scfg.blocks;
        let cache = KvCache::new(
            model.device(),
            KvCacheConfig {
                layers: mcfg.layers,
                kv_heads: mcfg.kv_heads,
                head_dim: mcfg.head_dim,
                block_size: blocks.block_size as usize,
                num_blocks: blocks.num_blocks as usize,
                dtype: cfg.kv_dtype,
            },
        )?;
        let kv_bytes_per_token = mcfg.kv_shape(cfg.kv_dtype).bytes_per_token()?;
        let specials = tokenizer.special_tokens();
        let watermark = (f64::from(blocks.watermark) * f64::from(blocks.num_blocks)) as usize;
        let info = EngineInfo {
            vocab_size: vocab,
            max_model_len,
            bos: specials.bos,
            eos_ids: specials.stop_ids.clone(),
            max_n: cfg.max_n.min(scfg.max_num_seqs),
            max_stop_strings: cfg.max_stop_strings,
            max_top_logprobs: cfg.max_top_logprobs,
            max_num_seqs: scfg.max_num_seqs,
            max_num_batched_tokens: scfg.max_num_batched_tokens,
            max_waiting: scfg.max_waiting,
            kv_blocks: blocks.num_blocks as usize,
            block_size: blocks.block_size as usize,
            kv_dtype: cfg.kv_dtype.name(),
            kv_bytes_per_token,
            usable_blocks: (blocks.num_blocks as usize).saturating_sub(watermark),
            device: model.device().info().name,
        };
        let spec = match (cfg.speculative, draft) {
            (None, None) => None,
            (None, Some(_))
            | (
                Some(SpeculativeConfig {
                    method: SpecMethod::Ngram { .. },
                    ..
                }),
                Some(_),
            ) => {
                return Err(StartError::Config {
                    field: "draft_model",
                    reason: "a draft model was given but the speculative method is not `draft`"
                        .into(),
                });
            }
            (Some(sc), draft) => {
                sc.validate()
                    .map_err(|(field, reason)| StartError::Config { field, reason })?;
                let proposer: Box<dyn Proposer> = match (sc.method, draft) {
                    (SpecMethod::Ngram { min_n, max_n }, _) => {
                        Box::new(NgramProposer { min_n, max_n })
                    }
                    (SpecMethod::Draft, None) => {
                        return Err(StartError::Config {
                            field: "draft_model",
                            reason: "speculative method `draft` needs a draft model".into(),
                        });
                    }
                    (SpecMethod::Draft, Some(d)) => {
                        check_same_tokenizer(&tokenizer, &d.tokenizer).map_err(|reason| {
                            StartError::Config {
                                field: "draft_model",
                                reason,
                            }
                        })?;
                        let dv = d.model.config().vocab;
                        if (d.tokenizer.vocab_size() as usize) > dv {
                            return Err(StartError::Config {
                                field: "draft_model",
                                reason: format!(
                                    "{} tokens, more than its vocabulary of {dv}",
                                    d.tokenizer.vocab_size()
                                ),
                            });
                        }
                        Box::new(
                            DraftProposer::new(
                                d.model,
                                blocks.num_blocks,
                                blocks.block_size,
                                cfg.kv_dtype,
                                vocab,
                            )
                            .map_err(|reason| StartError::Config {
                                field: "draft_model",
                                reason,
                            })?,
                        )
                    }
                };
                Some(Spec { cfg: sc, proposer })
            }
        };
        let metrics = Arc::new(EngineMetrics::new());
        metrics.kv_total_blocks.set(i64::from(blocks.num_blocks));
        let queued = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::channel();
        let lp = Loop {
            model,
            cache,
            sched,
            tokenizer: tokenizer.clone(),
            info: info.clone(),
            metrics: metrics.clone(),
            queued: queued.clone(),
            requests: HashMap::new(),
            owner: HashMap::new(),
            next_seq: 0,
            steps: 0,
            rx,
            shutdown: None,
            waiters: Vec::new(),
            spec,
        };
        let thread = std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || lp.run())
            .map_err(|e| StartError::Thread(e.to_string()))?;
        Ok(EngineHandle {
            shared: Arc::new(Shared {
                tx: Mutex::new(tx),
                tokenizer,
                info,
                queued,
                closing: AtomicBool::new(false),
                next_id: AtomicU64::new(0),
                metrics,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }
}

struct Loop {
    model: Model,
    cache: KvCache,
    sched: Scheduler,
    tokenizer: Tokenizer,
    info: EngineInfo,
    metrics: Arc<EngineMetrics>,
    queued: Arc<AtomicUsize>,
    requests: HashMap<crate::RequestId, ReqState>,
    /// Which request and output index each sequence serves.
    owner: HashMap<SeqId, (crate::RequestId, usize)>,
    next_seq: u64,
    steps: u64,
    rx: mpsc::Receiver<Command>,
    shutdown: Option<ShutdownMode>,
    waiters: Vec<oneshot::Sender<()>>,
    spec: Option<Spec>,
}

/// Speculative decoding in the step loop.
struct Spec {
    cfg: SpeculativeConfig,
    proposer: Box<dyn Proposer>,
}

/// How a request ended early.
enum Ending {
    Error(EngineError),
    /// The receiver is gone: nobody to tell.
    Abandoned,
}

impl Loop {
    fn run(mut self) {
        loop {
            if self.sched.is_empty() {
                if self.shutdown.is_some() {
                    break;
                }
                match self.rx.recv() {
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

    fn admit_request(&mut self, sub: Submission) {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let params = SeqParams {
            priority: sub.request.priority,
            forks: sub.request.n - 1,
        };
        if let Err(e) = self.sched.add(seq, sub.prompt_ids.clone(), params) {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            let err = match e {
                kiln_scheduler::SchedulerError::Overloaded { waiting, limit } => {
                    EngineError::Overloaded { waiting, limit }
                }
                other => EngineError::invalid("prompt", other.to_string()),
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
        let state = ReqState::new(&sub, seq, &self.tokenizer, &self.info);
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
    fn end(&mut self, id: crate::RequestId, why: Ending) {
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
        tracing::debug!(request = id.0, label, "request ended early");
        if let Ending::Error(e) = why {
            let _ = r.tx.send(Event::Error(e));
        }
    }

    /// A sequence is done: its blocks (and its draft model's) go back before the next step.
    fn finish_seq(&mut self, seq: SeqId) {
        self.sched.finish(seq);
        self.owner.remove(&seq);
        if let Some(spec) = &mut self.spec {
            spec.proposer.release(seq);
        }
    }

    /// Drafts tokens for the sequences about to decode, unless the batch is too large for
    /// speculation to pay ([`SpeculativeConfig::disable_batch_size`]) or the request opted out.
    fn propose(&mut self) {
        let Some(spec) = &mut self.spec else {
            return;
        };
        if self.sched.stats().running > spec.cfg.disable_batch_size {
            return;
        }
        let max_model_len = self.info.max_model_len;
        let mut batch = Vec::new();
        for (seq, tokens) in self.sched.decoding() {
            let Some(r) = self
                .owner
                .get(&seq)
                .and_then(|&(rid, idx)| Some((self.requests.get(&rid)?, idx)))
            else {
                continue;
            };
            // k + 1 new tokens at most, within the request's and the context's limits.
            let k =
                r.0.draft_room(r.1)
                    .min(spec.cfg.num_tokens)
                    .min(max_model_len.saturating_sub(tokens.len() + 1));
            if k > 0 {
                batch.push(ProposeInput {
                    seq,
                    tokens,
                    max_tokens: k,
                });
            }
        }
        if batch.is_empty() {
            return;
        }
        let drafts = match spec.proposer.propose(&batch) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "proposer failed; decoding without drafts this step");
                return;
            }
        };
        let vocab = self.info.vocab_size as u32;
        let proposals: Vec<(SeqId, Vec<u32>)> = batch
            .iter()
            .zip(drafts)
            .map(|(b, mut d)| {
                d.truncate(b.max_tokens);
                if let Some(bad) = d.iter().position(|&t| t >= vocab) {
                    d.truncate(bad);
                }
                (b.seq, d)
            })
            .collect();
        drop(batch);
        for (seq, d) in proposals {
            if let Err(e) = self.sched.propose(seq, d) {
                tracing::warn!(seq = seq.0, error = %e, "draft refused");
            }
        }
    }

    /// One forward step. Returns whether anything ran.
    fn step(&mut self) -> bool {
        self.propose();
        let schedule = self.sched.schedule();
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
        for (seq, err) in &schedule.rejected {
            if let Some(&(rid, _)) = self.owner.get(seq) {
                let reason = format!("no longer fits the KV pool: {err}");
                self.end(rid, Ending::Error(EngineError::Internal(reason)));
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
        match self.forward(&schedule) {
            Ok(rows) => {
                if let Err(e) = self.sched.complete(&schedule) {
                    self.fail_batch(&schedule, &format!("KV bookkeeping: {e}"));
                    return true;
                }
                self.sample_all(&schedule, &rows);
            }
            Err(e) => self.fail_batch(&schedule, &e),
        }
        true
    }

    /// Every request in a failed batch ends with an internal error; the loop goes on.
    fn fail_batch(&mut self, schedule: &Schedule, why: &str) {
        tracing::error!(error = why, "step failed");
        for s in &schedule.seqs {
            if let Some(&(rid, _)) = self.owner.get(&s.seq) {
                self.end(
                    rid,
                    Ending::Error(EngineError::Internal(format!("forward step: {why}"))),
                );
            }
        }
    }

    /// Runs the model; returns, per scheduled sequence, the argmax id and (when sampling
    /// needs it) the logits row.
    fn forward(&mut self, schedule: &Schedule) -> Result<Rows, String> {
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(schedule.seqs.len());
        for s in &schedule.seqs {
            let table = self
                .sched
                .blocks()
                .block_table(s.seq)
                .map_err(|e| e.to_string())?;
            tables.push(table.iter().map(|b| b.0).collect());
        }
        // A decode that verifies drafts computes its sampled token followed by the drafts.
        let mut with_drafts: Vec<Vec<u32>> = Vec::new();
        for s in schedule.seqs.iter().filter(|s| s.draft > 0) {
            let mut t = self
                .sched
                .tokens(s.seq)
                .and_then(|t| t.get(s.start..s.real_end()))
                .ok_or_else(|| format!("sequence {:?} lost its tokens", s.seq))?
                .to_vec();
            t.extend_from_slice(self.sched.verifying(s.seq));
            with_drafts.push(t);
        }
        let mut drafted = with_drafts.iter();
        let mut inputs = Vec::with_capacity(schedule.seqs.len());
        for (s, table) in schedule.seqs.iter().zip(&tables) {
            let tokens = if s.draft > 0 {
                drafted.next().map(Vec::as_slice)
            } else {
                self.sched
                    .tokens(s.seq)
                    .and_then(|t| t.get(s.start..s.end()))
            }
            .filter(|t| t.len() == s.len)
            .ok_or_else(|| format!("sequence {:?} lost its tokens", s.seq))?;
            inputs.push(SeqInput {
                tokens,
                block_table: table,
                context_len: s.end(),
            });
        }
        // Logits rows: one per sequence, plus one per draft token it verifies.
        let tails: Vec<usize> = schedule.seqs.iter().map(|s| 1 + s.draft).collect();
        let mut first = Vec::with_capacity(tails.len());
        let mut total = 0usize;
        for &n in &tails {
            first.push(total);
            total += n;
        }
        // Rows whose sequence samples on the CPU; only those come back.
        let need: Vec<u32> = schedule
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.samples && self.needs_row(s.seq))
            .flat_map(|(i, s)| (first[i]..first[i] + 1 + s.draft).map(|r| r as u32))
            .collect();
        let mut rec = Recorder::new(self.model.device());
        if !schedule.copies.is_empty() {
            let pairs: Vec<(u32, u32)> =
                schedule.copies.iter().map(|c| (c.src.0, c.dst.0)).collect();
            self.cache
                .copy_blocks(&mut rec, &pairs)
                .map_err(|e| e.to_string())?;
        }
        let logits = self
            .model
            .forward(&mut rec, &mut self.cache, &inputs, LogitsAt::Tail(&tails))
            .map_err(|e| e.to_string())?;
        let best = rec.argmax(&logits).map_err(|e| e.to_string())?;
        let picked = match need.len() {
            0 => None,
            n if n == total => Some(logits),
            // Gather the needed rows on the device (an exact copy) to read back less.
            _ => Some(rec.embedding(&logits, &need).map_err(|e| e.to_string())?),
        };
        rec.submit().map_err(|e| e.to_string())?;
        let argmax = best.to_u32_vec().map_err(|e| e.to_string())?;
        let logits = match picked {
            Some(t) => t.to_f32_vec().map_err(|e| e.to_string())?,
            None => Vec::new(),
        };
        let mut slot = vec![None; total];
        for (k, &i) in need.iter().enumerate() {
            slot[i as usize] = Some(k);
        }
        Ok(Rows {
            argmax,
            logits,
            slot,
            first,
            vocab: self.info.vocab_size,
        })
    }

    fn needs_row(&self, seq: SeqId) -> bool {
        self.owner
            .get(&seq)
            .and_then(|(rid, idx)| Some((self.requests.get(rid)?, *idx)))
            .is_some_and(|(r, idx)| r.needs_row(idx))
    }

    fn sample_all(&mut self, schedule: &Schedule, rows: &Rows) {
        let now = Instant::now();
        for (row, s) in schedule.seqs.iter().enumerate() {
            if !s.samples {
                continue;
            }
            let Some(&(rid, idx)) = self.owner.get(&s.seq) else {
                continue; // ended during this step
            };
            // n > 1: the prompt is done, so the other outputs fork from it now.
            if idx == 0
                && self.requests.get(&rid).is_some_and(ReqState::wants_forks)
                && let Err(e) = self.fork(rid, s.seq)
            {
                self.end(rid, Ending::Error(e));
                continue;
            }
            if s.draft > 0 {
                self.verify(rid, idx, row, s, rows, now);
                continue;
            }
            let Some(r) = self.requests.get_mut(&rid) else {
                continue;
            };
            let indices: Vec<usize> = if idx == 0 && r.first_token.is_none() {
                (0..r.outs.len()).collect()
            } else {
                vec![idx]
            };
            let mut ended = None;
            for i in indices {
                let outcome =
                    r.on_row(i, rows.row(row, 0), rows.argmax(row, 0), now, &self.metrics);
                let seq = r.outs[i].seq;
                match outcome {
                    Ok(TokenOutcome::Continue(token)) => {
                        if let Err(e) = self.sched.push_token(seq, token) {
                            ended = Some(EngineError::Internal(e.to_string()));
                            break;
                        }
                    }
                    Ok(TokenOutcome::Finished) => {
                        // `finish_seq`, spelled out: `r` still borrows the requests.
                        self.sched.finish(seq);
                        self.owner.remove(&seq);
                        if let Some(spec) = &mut self.spec {
                            spec.proposer.release(seq);
                        }
                    }
                    Err(e) => {
                        ended = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = ended {
                self.end(rid, Ending::Error(e));
                continue;
            }
            self.flush(rid);
        }
    }

    /// Sampling for a decode that verified drafts: the accepted drafts and the target's own
    /// next token go out; the rejected drafts' slots go back.
    fn verify(
        &mut self,
        rid: crate::RequestId,
        idx: usize,
        row: usize,
        s: &kiln_scheduler::ScheduledSeq,
        rows: &Rows,
        now: Instant,
    ) {
        let Some(r) = self.requests.get_mut(&rid) else {
            return;
        };
        let draft = self.sched.verifying(s.seq).to_vec();
        let outcome = r.on_draft_rows(
            idx,
            &draft,
            |j| rows.row(row, j),
            |j| rows.argmax(row, j),
            now,
            &self.metrics,
        );
        let result = match outcome {
            Ok((TokenOutcome::Continue(token), accepted)) => self
                .sched
                .accept_draft(s.seq, accepted)
                .and_then(|()| self.sched.push_token(s.seq, token))
                .map_err(|e| EngineError::Internal(e.to_string())),
            Ok((TokenOutcome::Finished, _)) => {
                self.finish_seq(s.seq);
                Ok(())
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => self.flush(rid),
            Err(e) => self.end(rid, Ending::Error(e)),
        }
    }

    fn fork(&mut self, rid: crate::RequestId, parent: SeqId) -> Result<(), EngineError> {
        let Some(r) = self.requests.get_mut(&rid) else {
            return Ok(());
        };
        for index in 1..r.n {
            let child = SeqId(self.next_seq);
            self.next_seq += 1;
            self.sched
                .fork(parent, child)
                .map_err(|e| EngineError::Internal(format!("fork: {e}")))?;
            r.add_output(child, &self.tokenizer);
            self.owner.insert(child, (rid, index));
        }
        Ok(())
    }

    /// Sends pending deltas; a request whose outputs all finished gets its summary and goes.
    fn flush(&mut self, rid: crate::RequestId) {
        let Some(r) = self.requests.get_mut(&rid) else {
            return;
        };
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

    fn stats(&self) -> EngineStats {
        let s = self.sched.stats();
        EngineStats {
            requests: self.requests.len(),
            running: s.running,
            waiting: s.waiting,
            preempted: s.preempted,
            preemptions: s.preemptions,
            steps: self.steps,
            kv: s.kv,
            draft_kv: self.spec.as_ref().and_then(|p| p.proposer.kv_metrics()),
            invariants: self
                .sched
                .check_invariants()
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    if self.owner.len() == self.sched.len() {
                        Ok(())
                    } else {
                        Err(format!(
                            "{} sequences have owners, the scheduler holds {}",
                            self.owner.len(),
                            self.sched.len()
                        ))
                    }
                })
                .and_then(|()| match &self.spec {
                    Some(p) => p.proposer.check(&|seq| self.owner.contains_key(&seq)),
                    None => Ok(()),
                }),
        }
    }

    fn publish(&self) {
        let s = self.sched.stats();
        let m = &self.metrics;
        m.running.set(s.running as i64);
        m.waiting.set(s.waiting as i64);
        m.preempted.set(s.preempted as i64);
        m.kv_usage.set(s.kv.usage());
        m.kv_used_blocks.set(s.kv.used_blocks as i64);
        let hits = m.prefix_hit_tokens.get();
        m.prefix_hit_tokens
            .inc_by(s.kv.prefix_hit_tokens.saturating_sub(hits));
        let queries = m.prefix_query_tokens.get();
        m.prefix_query_tokens
            .inc_by(s.kv.prefix_query_tokens.saturating_sub(queries));
    }
}

/// What a step read back.
struct Rows {
    /// The device argmax of every logits row.
    argmax: Vec<u32>,
    /// The logits rows sampling needs, `[needed, vocab]`.
    logits: Vec<f32>,
    /// For each logits row, its place in `logits` (if read back).
    slot: Vec<Option<usize>>,
    /// For each scheduled sequence, its first logits row (one more per draft token).
    first: Vec<usize>,
    vocab: usize,
}

impl Rows {
    /// Logits row `j` of scheduled sequence `i`.
    fn row(&self, i: usize, j: usize) -> Option<&[f32]> {
        let k = self.slot.get(self.first.get(i)? + j).copied().flatten()?;
        self.logits.get(k * self.vocab..(k + 1) * self.vocab)
    }

    fn argmax(&self, i: usize, j: usize) -> Option<u32> {
        self.argmax.get(self.first.get(i)? + j).copied()
    }
}
