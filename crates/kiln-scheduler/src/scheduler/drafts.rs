//! Speculative decoding's side of the scheduler: drafts stored for a running decode, appended
//! to its next step by [`Scheduler::schedule`], and the verdict that keeps the accepted ones.

use kiln_kv::SeqId;

use super::Scheduler;
use crate::{Result, SchedulerError};

impl Scheduler {
    /// Stores draft tokens (speculative decoding) for the next step of `seq`, which must be a
    /// running sequence with exactly one sampled token not yet computed. The next
    /// [`schedule`](Self::schedule) appends as many of them as fit the token budget and the
    /// pool to that decode (none when that would need a preemption); a sequence that is not
    /// scheduled as a plain decode keeps them for later. An empty draft clears it.
    pub fn propose(&mut self, seq: SeqId, draft: Vec<u32>) -> Result<()> {
        let e = self.running_with(
            seq,
            1,
            "drafts follow the one sampled token of a running decode",
        )?;
        e.draft = draft;
        Ok(())
    }

    /// The draft tokens the scheduled step of `seq` verifies (empty when none).
    pub fn verifying(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |e| e.verifying.as_slice())
    }

    /// Running sequences waiting to decode (one sampled token not yet computed), with their
    /// tokens: the ones a proposer may draft for.
    pub fn decoding(&self) -> impl Iterator<Item = (SeqId, &[u32])> + '_ {
        self.running.iter().filter_map(|k| {
            let e = self.seqs.get(&k.2)?;
            (e.computed + 1 == e.tokens.len()).then_some((k.2, e.tokens.as_slice()))
        })
    }

    /// After a completed step that verified draft tokens of `seq`: keeps the first `accepted`
    /// of them as tokens of the sequence (their K/V are already in the cache and are committed
    /// now, so only they can enter the prefix cache) and gives back the slots of the rest.
    /// Then push the token the target picked after them with
    /// [`push_token`](Self::push_token).
    pub fn accept_draft(&mut self, seq: SeqId, accepted: usize) -> Result<()> {
        let e = self.running_with(seq, 0, "drafts are accepted after their step completed")?;
        if accepted > e.verifying.len() {
            return Err(SchedulerError::WrongState {
                seq,
                reason: "more draft tokens accepted than were verified",
            });
        }
        let mut kept = std::mem::take(&mut e.verifying);
        kept.truncate(accepted);
        self.kv.commit(seq, &kept)?;
        let e = self.running_with(seq, 0, "drafts are accepted after their step completed")?;
        e.tokens.extend_from_slice(&kept);
        e.computed += accepted;
        let computed = e.computed;
        self.kv.truncate(seq, computed)?;
        Ok(())
    }
}
