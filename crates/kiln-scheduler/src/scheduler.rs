//! The scheduling policy: who runs this step and with how many tokens.

use std::collections::{BTreeSet, HashMap};

mod drafts;
mod prefill;

use kiln_kv::{Admission, BlockManager, KvError, SeqConfig, SeqId};

use crate::{
    Result, Schedule, ScheduledSeq, SchedulerConfig, SchedulerError, SchedulerStats, SeqParams,
    SeqStatus,
};

/// Ordering key: priority, then arrival, then id (forks share their parent's arrival).
type Key = (i32, u64, SeqId);

/// A step being decided: what it runs so far, the tokens left in its budget, and the
/// sequences it already runs.
struct Step {
    out: Schedule,
    budget: usize,
    scheduled: BTreeSet<SeqId>,
}

impl Step {
    fn push(&mut self, s: ScheduledSeq) {
        self.budget -= s.len;
        self.scheduled.insert(s.seq);
        self.out.seqs.push(s);
    }

    /// No token or sequence slot is left.
    fn full(&self, cfg: &SchedulerConfig) -> bool {
        self.budget == 0 || self.out.seqs.len() >= cfg.max_num_seqs
    }
}

#[derive(Debug)]
struct Entry {
    /// Prompt plus the tokens sampled so far.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    priority: i32,
    arrival: u64,
    /// Forks still to come (reserved under `max_num_seqs`).
    forks: usize,
    /// Reuse no cached prefix until the tokens have been computed once.
    recompute_prefix: bool,
    /// Tokens a prefill chunk may hold at most (chunked prefill on).
    max_chunk: Option<usize>,
    status: SeqStatus,
    /// Draft tokens proposed for the next decode step ([`Scheduler::propose`]).
    draft: Vec<u32>,
    /// Draft tokens a scheduled step is verifying, until [`Scheduler::accept_draft`].
    verifying: Vec<u32>,
}

impl Entry {
    fn key(&self, id: SeqId) -> Key {
        (self.priority, self.arrival, id)
    }

    /// Its next prefill chunk's length for `remaining` tokens and `budget` left in the step.
    fn chunk(&self, remaining: usize, budget: usize, cfg: &SchedulerConfig) -> usize {
        let cap = match cfg.chunked_prefill {
            true => self.max_chunk.unwrap_or(usize::MAX).max(1),
            false => usize::MAX,
        };
        remaining.min(budget).min(cap)
    }

    /// How its blocks are allocated.
    fn seq_config(&self, cfg: &SchedulerConfig) -> SeqConfig {
        SeqConfig {
            sliding_window: cfg.sliding_window,
            recompute_prefix: self.recompute_prefix,
        }
    }
}

/// Continuous batching over a paged KV pool: every step it runs all decodes first (so
/// inter-token latency stays flat), then spends the rest of the token budget on prefill chunks
/// of running prompts and on newly admitted ones, in (priority, arrival) order. Admission is
/// FCFS without skipping, so a large request at the head is never starved by small ones behind
/// it. When a decode needs a block and none is left, the lowest-priority, latest-arrived
/// running sequence is preempted: its blocks are freed and it recomputes later (prefix-cache
/// hits make that cheaper). Never touches the device.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: BlockManager,
    seqs: HashMap<SeqId, Entry>,
    waiting: BTreeSet<Key>,
    preempted: BTreeSet<Key>,
    running: BTreeSet<Key>,
    next_arrival: u64,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        let invalid = |field, reason: &str| SchedulerError::InvalidConfig {
            field,
            reason: reason.to_owned(),
        };
        if cfg.max_num_seqs == 0 {
            return Err(invalid("max_num_seqs", "must be at least 1"));
        }
        if cfg.max_num_batched_tokens < cfg.max_num_seqs {
            return Err(invalid(
                "max_num_batched_tokens",
                "must be at least max_num_seqs (every running decode needs one token a step)",
            ));
        }
        if cfg.blocks.kept.is_some() && cfg.sliding_window.is_some() {
            return Err(invalid(
                "sliding_window",
                "with a kept pool the window is the pool's (blocks.kept.window)",
            ));
        }
        let kv = BlockManager::new(cfg.blocks.clone())?;
        Ok(Self {
            cfg,
            kv,
            seqs: HashMap::new(),
            waiting: BTreeSet::new(),
            preempted: BTreeSet::new(),
            running: BTreeSet::new(),
            next_arrival: 0,
            preemptions: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The block manager (block tables and slots for building a batch).
    pub fn blocks(&self) -> &BlockManager {
        &self.kv
    }

    /// Starts recording prefix-cache changes for [`take_cache_events`](Self::take_cache_events).
    pub fn record_cache_events(&mut self, on: bool) {
        self.kv.record_cache_events(on);
    }

    /// The prefix-cache changes since the last call, in order (empty unless recording).
    pub fn take_cache_events(&mut self) -> Vec<kiln_kv::CacheEvent> {
        self.kv.take_cache_events()
    }

    /// Queues a new sequence. Refused when the waiting queue is full
    /// ([`SchedulerError::Overloaded`]) or when the prompt could never fit the pool or, with
    /// chunked prefill off, one step.
    pub fn add(&mut self, seq: SeqId, prompt: Vec<u32>, params: SeqParams) -> Result<()> {
        if self.seqs.contains_key(&seq) {
            return Err(SchedulerError::DuplicateSeq(seq));
        }
        if prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt(seq));
        }
        let limit = self.waiting_capacity();
        if self.waiting.len() >= limit {
            return Err(SchedulerError::Overloaded {
                waiting: self.waiting.len(),
                limit,
            });
        }
        self.check_fits(seq, &prompt)?;
        if params.forks > 0 && self.cfg.blocks.kept.is_some() {
            return Err(SchedulerError::TooLarge {
                seq,
                reason: format!(
                    "{} outputs: sequences with a kept KV pool cannot fork",
                    params.forks + 1
                ),
            });
        }
        if params.forks >= self.cfg.max_num_seqs {
            return Err(SchedulerError::TooLarge {
                seq,
                reason: format!(
                    "{} outputs exceed max_num_seqs {}",
                    params.forks + 1,
                    self.cfg.max_num_seqs
                ),
            });
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let entry = Entry {
            tokens: prompt,
            computed: 0,
            priority: params.priority,
            arrival,
            forks: params.forks,
            recompute_prefix: params.recompute_prefix,
            max_chunk: params.max_chunk,
            status: SeqStatus::Waiting,
            draft: Vec::new(),
            verifying: Vec::new(),
        };
        self.waiting.insert(entry.key(seq));
        self.seqs.insert(seq, entry);
        Ok(())
    }

    fn check_fits(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        // Whether a prompt can ever fit does not depend on the cache.
        if self.kv.can_allocate(tokens, SeqConfig::default()) == Admission::Never {
            return Err(SchedulerError::TooLarge {
                seq,
                reason: format!(
                    "{} tokens need {} KV blocks; the pool has {} (less the watermark)",
                    tokens.len(),
                    self.kv.blocks_for_tokens(tokens.len()),
                    self.cfg.blocks.num_blocks
                ),
            });
        }
        if !self.cfg.chunked_prefill && tokens.len() > self.cfg.max_num_batched_tokens {
            return Err(SchedulerError::TooLarge {
                seq,
                reason: format!(
                    "{} prompt tokens exceed max_num_batched_tokens {} and chunked prefill is off",
                    tokens.len(),
                    self.cfg.max_num_batched_tokens
                ),
            });
        }
        Ok(())
    }

    /// Decides the next step. Sequences it returns have slots reserved for their chunk; call
    /// [`complete`](Self::complete) once the step has run.
    pub fn schedule(&mut self) -> Schedule {
        let mut step = Step {
            out: Schedule::default(),
            budget: self.cfg.max_num_batched_tokens,
            scheduled: BTreeSet::new(),
        };
        self.drop_unverified_drafts();
        self.schedule_decodes(&mut step);
        step.out.decodes = step.out.seqs.len();
        self.schedule_prefill_chunks(&mut step);
        // None while memory is short this step.
        if step.out.preempted.is_empty() {
            self.admit(&mut step);
        }
        let out = step.out;
        tracing::trace!(
            seqs = out.seqs.len(),
            tokens = out.num_tokens(),
            decodes = out.num_decodes(),
            preempted = out.preempted.len(),
            "scheduled a step"
        );
        out
    }

    /// A verifying step whose outcome never came back keeps none of its drafts.
    fn drop_unverified_drafts(&mut self) {
        let stale: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, e)| !e.verifying.is_empty())
            .map(|(&id, _)| id)
            .collect();
        for seq in stale {
            let _ = self.accept_draft(seq, 0);
        }
    }

    /// Running sequences with a sampled token that has no slot yet, each given its slot (and
    /// what drafts fit), preempting the latest running sequences where blocks run out.
    fn schedule_decodes(&mut self, step: &mut Step) {
        self.each_running(step, Self::schedule_decode);
    }

    /// [`schedule_decodes`](Self::schedule_decodes) for one running sequence.
    fn schedule_decode(&mut self, step: &mut Step, seq: SeqId) {
        let Some(e) = self.seqs.get(&seq) else {
            return;
        };
        let Ok(reserved) = self.kv.seq_len(seq) else {
            return;
        };
        let need = e.tokens.len().saturating_sub(reserved);
        if need == 0 {
            return; // still in prefill: schedule_prefill_chunks'
        }
        let start = e.computed;
        let real = e.tokens.len() - start;
        if real > step.budget {
            return;
        }
        // Drafts only ride on a plain decode, and only as far as the budget allows.
        let mut draft = if real == 1 {
            e.draft.len().min(step.budget - real)
        } else {
            0
        };
        loop {
            match self.kv.append_slots(seq, need + draft) {
                Ok(copy) => {
                    step.out.copies.extend(copy);
                    step.push(ScheduledSeq {
                        seq,
                        start,
                        len: real + draft,
                        samples: true,
                        draft,
                    });
                    if let Some(e) = self.seqs.get_mut(&seq) {
                        e.draft.truncate(draft);
                        e.verifying = std::mem::take(&mut e.draft);
                    }
                    break;
                }
                // Speculation is never worth a preemption: drop the drafts first.
                Err(KvError::OutOfBlocks { .. }) if draft > 0 => draft = 0,
                Err(KvError::OutOfBlocks { .. }) => {
                    if !self.preempt_for(seq, step) {
                        break;
                    }
                }
                Err(e) => {
                    // A bookkeeping error for one sequence must not stop the others.
                    self.drop_seq(seq);
                    step.out.rejected.push((seq, e.into()));
                    break;
                }
            }
        }
    }

    /// Calls `each` for the running sequences in (priority, arrival) order, passing over any
    /// an earlier call preempted, until the step is full.
    fn each_running(&mut self, step: &mut Step, mut each: impl FnMut(&mut Self, &mut Step, SeqId)) {
        let order: Vec<Key> = self.running.iter().copied().collect();
        for key in order {
            if !self.running.contains(&key) {
                continue;
            }
            if step.full(&self.cfg) {
                break;
            }
            each(self, step, key.2);
        }
    }

    /// Preempts the latest running sequence not scheduled this step, for `seq` that found
    /// no block. Whether `seq` should try again (false: none to preempt, or it was `seq`).
    fn preempt_for(&mut self, seq: SeqId, step: &mut Step) -> bool {
        let victim = self
            .running
            .iter()
            .rev()
            .find(|k| !step.scheduled.contains(&k.2))
            .copied();
        match victim {
            Some(v) => {
                self.preempt(v);
                step.out.preempted.push(v.2);
                v.2 != seq
            }
            None => false,
        }
    }

    /// Running sequences plus the forks admitted ones will make.
    /// Sequences that may wait for admission now: `max_waiting` plus the running slots no
    /// running or preempted sequence holds, so an idle scheduler takes a burst of
    /// `max_waiting + max_num_seqs` (those it can run at once need not count as waiting).
    pub fn waiting_capacity(&self) -> usize {
        let held = self.reserved_seqs() + self.preempted.len();
        self.cfg.max_waiting + self.cfg.max_num_seqs.saturating_sub(held)
    }

    fn reserved_seqs(&self) -> usize {
        self.running
            .iter()
            .map(|k| 1 + self.seqs.get(&k.2).map_or(0, |e| e.forks))
            .sum()
    }

    fn preempt(&mut self, key: Key) {
        let seq = key.2;
        self.running.remove(&key);
        // Blocks go back to the pool; full ones stay in the prefix cache until evicted.
        let _ = self.kv.free(seq);
        if let Some(e) = self.seqs.get_mut(&seq) {
            e.computed = 0;
            e.draft.clear();
            e.verifying.clear();
            e.status = SeqStatus::Preempted;
            self.preempted.insert(key);
        }
        self.preemptions += 1;
        tracing::debug!(seq = seq.0, "preempted (will recompute)");
    }

    fn drop_seq(&mut self, seq: SeqId) {
        if let Some(e) = self.seqs.remove(&seq) {
            let key = e.key(seq);
            self.running.remove(&key);
            self.waiting.remove(&key);
            self.preempted.remove(&key);
        }
        if self.kv.contains(seq) {
            let _ = self.kv.free(seq);
        }
    }

    /// Records that `schedule`'s chunks ran: their K/V are in the cache now (full blocks enter
    /// the prefix cache). Sequences finished or preempted since are skipped.
    pub fn complete(&mut self, schedule: &Schedule) -> Result<()> {
        for s in &schedule.seqs {
            let Some(e) = self.seqs.get_mut(&s.seq) else {
                continue;
            };
            if e.status != SeqStatus::Running || e.computed != s.start {
                continue;
            }
            self.kv.commit(s.seq, &e.tokens[s.start..s.real_end()])?;
            e.computed = s.real_end();
            if s.samples {
                e.recompute_prefix = false;
            }
        }
        Ok(())
    }

    /// The entry of running `seq` whose tokens run exactly `uncomputed` past its computed ones;
    /// `WrongState` with `reason` otherwise.
    fn running_with(
        &mut self,
        seq: SeqId,
        uncomputed: usize,
        reason: &'static str,
    ) -> Result<&mut Entry> {
        let e = self
            .seqs
            .get_mut(&seq)
            .ok_or(SchedulerError::UnknownSeq(seq))?;
        if e.status != SeqStatus::Running || e.computed + uncomputed != e.tokens.len() {
            return Err(SchedulerError::WrongState { seq, reason });
        }
        Ok(e)
    }

    /// Appends a sampled token to a running sequence; the next step computes it.
    pub fn push_token(&mut self, seq: SeqId, token: u32) -> Result<()> {
        let e = self.running_with(
            seq,
            0,
            "a token can only follow a fully computed running sequence",
        )?;
        e.tokens.push(token);
        Ok(())
    }

    /// Gives `child` a copy of running `parent` sharing its KV blocks (for `n > 1`); call it
    /// after `complete` and before pushing either's next token.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.seqs.contains_key(&child) {
            return Err(SchedulerError::DuplicateSeq(child));
        }
        let p = self
            .seqs
            .get_mut(&parent)
            .ok_or(SchedulerError::UnknownSeq(parent))?;
        if p.status != SeqStatus::Running || p.computed != p.tokens.len() {
            return Err(SchedulerError::WrongState {
                seq: parent,
                reason: "only a fully computed running sequence can fork",
            });
        }
        let entry = Entry {
            tokens: p.tokens.clone(),
            computed: p.computed,
            priority: p.priority,
            arrival: p.arrival,
            forks: 0,
            recompute_prefix: false,
            max_chunk: None,
            status: SeqStatus::Running,
            draft: Vec::new(),
            verifying: Vec::new(),
        };
        p.forks = p.forks.saturating_sub(1);
        self.kv.fork(parent, child)?;
        self.running.insert(entry.key(child));
        self.seqs.insert(child, entry);
        Ok(())
    }

    /// Ends a sequence wherever it is (finished, aborted, expired) and frees its blocks before
    /// the next step. Returns whether it was known.
    pub fn finish(&mut self, seq: SeqId) -> bool {
        let known = self.seqs.contains_key(&seq);
        self.drop_seq(seq);
        known
    }

    pub fn status(&self, seq: SeqId) -> Option<SeqStatus> {
        self.seqs.get(&seq).map(|e| e.status)
    }

    /// Prompt plus sampled tokens of `seq`.
    pub fn tokens(&self, seq: SeqId) -> Option<&[u32]> {
        self.seqs.get(&seq).map(|e| e.tokens.as_slice())
    }

    /// Tokens of `seq` whose K/V are in the cache.
    pub fn computed(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|e| e.computed)
    }

    /// Sequences the scheduler holds, in any state.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            preempted: self.preempted.len(),
            preemptions: self.preemptions,
            kv: self.kv.metrics(),
        }
    }

    /// Checks the queues against the sequences and the block manager's own invariants
    /// (tests and debugging; O(sequences + blocks)).
    pub fn check_invariants(&self) -> Result<()> {
        let broken = |reason: &'static str| SchedulerError::WrongState {
            seq: SeqId(u64::MAX),
            reason,
        };
        if self.running.len() + self.waiting.len() + self.preempted.len() != self.seqs.len() {
            return Err(broken("queue sizes do not add up to the sequences held"));
        }
        for (&id, e) in &self.seqs {
            let key = e.key(id);
            let queued = match e.status {
                SeqStatus::Running => self.running.contains(&key),
                SeqStatus::Waiting => self.waiting.contains(&key),
                SeqStatus::Preempted => self.preempted.contains(&key),
            };
            if !queued {
                return Err(broken("a sequence is missing from its status queue"));
            }
            if (e.status == SeqStatus::Running) != self.kv.contains(id) {
                return Err(broken("exactly the running sequences hold block tables"));
            }
            if e.status == SeqStatus::Running && self.kv.computed_len(id)? != e.computed {
                return Err(broken("computed tokens disagree with the block manager"));
            }
        }
        if self.kv.seq_ids().count() != self.running.len() {
            return Err(broken(
                "the block manager holds tables of unknown sequences",
            ));
        }
        self.kv.check_invariants()?;
        Ok(())
    }
}
