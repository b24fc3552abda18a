//! Prompts' side of the scheduler: the next chunk of each running prompt, admission of
//! waiting and preempted sequences with their first chunk, and the main-pool reservations a
//! chunk takes.

use kiln_kv::{Admission, KvError, SeqId};

use super::{Key, Scheduler, Step};
use crate::{Result, ScheduledSeq, SchedulerError, SeqStatus};

impl Scheduler {
    /// The next chunk of each running prompt, as far as the budget (and the pool: see
    /// [`BlockManager::reserve`]) allows.
    pub(super) fn schedule_prefill_chunks(&mut self, step: &mut Step) {
        self.each_running(step, Self::schedule_prefill_chunk);
    }

    /// [`schedule_prefill_chunks`](Self::schedule_prefill_chunks) for one running sequence.
    fn schedule_prefill_chunk(&mut self, step: &mut Step, seq: SeqId) {
        if step.scheduled.contains(&seq) {
            return;
        }
        let (Some(e), Ok(reserved)) = (self.seqs.get(&seq), self.kv.seq_len(seq)) else {
            return;
        };
        let remaining = reserved - e.computed;
        if remaining == 0 {
            return;
        }
        let len = e.chunk(remaining, step.budget, &self.cfg);
        if len < remaining && !self.cfg.chunked_prefill {
            return;
        }
        let (start, prompt_done) = (e.computed, reserved == e.tokens.len());
        let Some(len) = self.reserve_chunk(seq, len, step) else {
            return;
        };
        step.push(ScheduledSeq {
            seq,
            start,
            len,
            samples: len == remaining && prompt_done,
            draft: 0,
        });
    }

    /// Takes the main pool's blocks for up to `len` next positions of `seq` (a no-op without
    /// a kept pool), as many as fit; where none does, preempts the latest running sequence
    /// and tries again. The chunk's length, or `None` where `seq` runs nothing this step.
    fn reserve_chunk(&mut self, seq: SeqId, len: usize, step: &mut Step) -> Option<usize> {
        loop {
            match self.reserve_fitting(seq, len) {
                Ok(Some(n)) => return Some(n),
                Ok(None) if !self.preempt_for(seq, step) => return None,
                Ok(None) => {}
                Err(e) => {
                    // A bookkeeping error for one sequence must not preempt the others.
                    self.drop_seq(seq);
                    step.out.rejected.push((seq, e));
                    return None;
                }
            }
        }
    }

    /// Reserves the longest chunk of up to `len` next positions of `seq` whose main blocks
    /// the pool has now (without chunked prefill, all `len` or none); its length.
    fn reserve_fitting(&mut self, seq: SeqId, len: usize) -> Result<Option<usize>> {
        let least = if self.cfg.chunked_prefill { 1 } else { len };
        let n = self.kv.reservable(seq, len)?;
        if n == 0 || n < least {
            return Ok(None);
        }
        self.kv.reserve(seq, n)?;
        Ok(Some(n))
    }

    /// Waiting and preempted sequences in order while the pool and the budget take them,
    /// each with its first chunk.
    pub(super) fn admit(&mut self, step: &mut Step) {
        let candidates: Vec<Key> = self
            .preempted
            .iter()
            .chain(self.waiting.iter())
            .copied()
            .collect();
        for key in candidates {
            let seq = key.2;
            if step.full(&self.cfg) {
                break;
            }
            let Some(e) = self.seqs.get(&seq) else {
                continue;
            };
            if self.reserved_seqs() + 1 + e.forks > self.cfg.max_num_seqs {
                break;
            }
            let opts = e.seq_config(&self.cfg);
            match self.kv.can_allocate(&e.tokens, opts) {
                Admission::Ok => {}
                // FCFS: nothing behind the head may overtake it.
                Admission::Later => break,
                Admission::Never => {
                    let err =
                        self.check_fits(seq, &e.tokens)
                            .err()
                            .unwrap_or(SchedulerError::TooLarge {
                                seq,
                                reason: "outgrew the KV pool".into(),
                            });
                    self.drop_seq(seq);
                    step.out.rejected.push((seq, err));
                    continue;
                }
            }
            let cached = self.kv.cached_prefix_tokens(&e.tokens, opts);
            let remaining = e.tokens.len() - cached.min(e.tokens.len() - 1);
            if remaining > step.budget && !self.cfg.chunked_prefill {
                break;
            }
            let alloc = match self.kv.allocate(seq, &e.tokens, opts) {
                Ok(a) => a,
                Err(KvError::OutOfBlocks { .. }) => break,
                Err(err) => {
                    self.drop_seq(seq);
                    step.out.rejected.push((seq, err.into()));
                    continue;
                }
            };
            let Some(e) = self.seqs.get_mut(&seq) else {
                continue;
            };
            self.waiting.remove(&key);
            self.preempted.remove(&key);
            self.running.insert(key);
            e.status = SeqStatus::Running;
            e.computed = alloc.cached_tokens;
            let remaining = e.tokens.len() - e.computed;
            let start = e.computed;
            let len = e.chunk(remaining, step.budget, &self.cfg);
            step.out.admitted.push((seq, alloc.cached_tokens));
            // Admission leaves the pool room for a first block (`can_allocate`); without one
            // the sequence waits for its first chunk.
            let Ok(Some(len)) = self.reserve_fitting(seq, len) else {
                continue;
            };
            step.push(ScheduledSeq {
                seq,
                start,
                len,
                samples: len == remaining,
                draft: 0,
            });
        }
    }
}
