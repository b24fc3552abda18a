//! The draft-model proposer: a smaller model with the target's tokenizer, on the same device,
//! with its own paged KV cache. Each step it catches up on the tokens it has not seen (the
//! target's accepted and corrected ones) and then drafts greedily, one batched forward pass per
//! draft token. The K/V of its own drafts stay uncommitted until the target's verdict: the next
//! step commits the ones that were accepted and gives back the rest's slots, so rejected tokens
//! never reach its prefix cache.

use std::collections::HashMap;

use kiln_kv::{BlockManager, BlockManagerConfig, KvError, KvMetrics, SeqConfig, SeqId};
use kiln_model::{KvPoolConfig, Model, ModelRunner, StepSeq};
use kiln_tokenizer::Tokenizer;

use super::{ProposeError, ProposeInput, Proposer};
use crate::InvariantError;

/// A draft model and the tokenizer it was trained with (checked against the target's).
pub struct DraftModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DraftModel({:?})", self.model)
    }
}

/// How a draft model's tokenizer differs from the target's (the first difference found).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizerMismatch {
    #[error("its tokenizer has {draft} tokens, the target's has {target}")]
    VocabSize { draft: u32, target: u32 },
    #[error("token {id} is {draft:?} in its tokenizer but {target:?} in the target's")]
    Token {
        id: u32,
        draft: Option<String>,
        target: Option<String>,
    },
    #[error("its end-of-sequence ids {draft:?} differ from the target's {target:?}")]
    Eos { draft: Vec<u32>, target: Vec<u32> },
}

/// Checks that a draft model can propose for the target: the same vocabulary, token for token,
/// and the same special tokens.
pub fn check_same_tokenizer(
    target: &Tokenizer,
    draft: &Tokenizer,
) -> Result<(), TokenizerMismatch> {
    if target.vocab_size() != draft.vocab_size() {
        return Err(TokenizerMismatch::VocabSize {
            draft: draft.vocab_size(),
            target: target.vocab_size(),
        });
    }
    for id in 0..target.vocab_size() {
        let (t, d) = (target.id_to_token(id), draft.id_to_token(id));
        if t != d {
            return Err(TokenizerMismatch::Token {
                id,
                draft: d,
                target: t,
            });
        }
    }
    let (ts, ds) = (target.special_tokens(), draft.special_tokens());
    if ts.stop_ids != ds.stop_ids {
        return Err(TokenizerMismatch::Eos {
            draft: ds.stop_ids.clone(),
            target: ts.stop_ids.clone(),
        });
    }
    Ok(())
}

struct DraftSeq {
    /// Tokens whose K/V the draft cache holds, committed (all real: the target's tokens).
    known: Vec<u32>,
    /// Draft tokens fed after `known` last step (K/V written, not committed).
    fed: Vec<u32>,
}

/// Drafts with a model: see the module docs.
pub struct DraftProposer {
    runner: ModelRunner,
    blocks: BlockManager,
    seqs: HashMap<SeqId, DraftSeq>,
    /// Target vocabulary: drafts of ids outside it are cut.
    target_vocab: usize,
}

impl std::fmt::Debug for DraftProposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DraftProposer({:?}, {} sequences)",
            self.runner,
            self.seqs.len()
        )
    }
}

impl DraftProposer {
    /// A draft cache shaped as the target's `pool` (so every running sequence fits), an
    /// INT4 one centred on the draft's keys over `calibration` ([`ModelRunner::calibrated`]).
    pub fn new(
        model: Model,
        pool: KvPoolConfig,
        calibration: &[u32],
        target_vocab: usize,
    ) -> Result<Self, ProposeError> {
        let KvPoolConfig {
            block_size,
            num_blocks,
            ..
        } = pool;
        let runner = ModelRunner::calibrated(model, pool, calibration)?;
        let blocks = BlockManager::new(BlockManagerConfig {
            block_size,
            watermark: 0.0,
            ..BlockManagerConfig::new(num_blocks)
        })?;
        Ok(Self {
            runner,
            blocks,
            seqs: HashMap::new(),
            target_vocab,
        })
    }

    /// Brings `seq`'s draft cache up to `tokens` (all but what must be fed now) and reserves
    /// slots for the tokens to feed plus `k - 1` drafts. Returns where feeding starts, or
    /// `None` when the pool has no room (no draft for it this step).
    fn prepare(&mut self, seq: SeqId, tokens: &[u32], k: usize) -> Result<Option<usize>, KvError> {
        let len = tokens.len();
        let known = match self.seqs.get_mut(&seq) {
            Some(s) if s.known.len() < len && tokens.starts_with(&s.known) => {
                // Keep last step's drafts that turned out to be the real tokens, always leaving
                // the newest token to feed.
                let room = len - 1 - s.known.len();
                let kept = s
                    .fed
                    .iter()
                    .zip(&tokens[s.known.len()..])
                    .take(room)
                    .take_while(|(a, b)| a == b)
                    .count();
                let fed = std::mem::take(&mut s.fed);
                self.blocks.commit(seq, &fed[..kept])?;
                s.known.extend_from_slice(&fed[..kept]);
                let known = s.known.len();
                self.blocks.truncate(seq, known)?;
                Some(known)
            }
            Some(_) => {
                // Nothing new to feed (the target skipped last step's draft) or not a
                // continuation: start over; the prefix cache has its blocks.
                self.release(seq);
                None
            }
            None => None,
        };
        let start = match known {
            Some(known) => match self.blocks.append_slots(seq, len - known + k - 1) {
                Ok(_) => known,
                Err(KvError::OutOfBlocks { .. }) => {
                    self.release(seq);
                    return Ok(None);
                }
                Err(e) => return Err(e),
            },
            None => {
                let alloc = match self.blocks.allocate(seq, tokens, SeqConfig::default()) {
                    Ok(a) => a,
                    Err(KvError::OutOfBlocks { .. }) => return Ok(None),
                    Err(e) => return Err(e),
                };
                self.seqs.insert(
                    seq,
                    DraftSeq {
                        known: tokens[..alloc.cached_tokens].to_vec(),
                        fed: Vec::new(),
                    },
                );
                if k > 1 && self.blocks.append_slots(seq, k - 1).is_err() {
                    self.release(seq);
                    return Ok(None);
                }
                alloc.cached_tokens
            }
        };
        Ok(Some(start))
    }

    /// One batched forward over `feeds` (sequence, tokens to feed, context after them);
    /// returns each sequence's greedy next token.
    fn forward(&mut self, feeds: &[(SeqId, Vec<u32>, usize)]) -> Result<Vec<u32>, ProposeError> {
        let mut batch = Vec::with_capacity(feeds.len());
        for (seq, tokens, ctx) in feeds {
            batch.push(StepSeq {
                tokens,
                block_table: self.blocks.block_table(*seq)?,
                kept_table: &[],
                context_len: *ctx,
                logits_rows: 1,
                read_logits: false,
                sample: None,
            });
        }
        // One logits row per sequence: the argmax of each, in order.
        Ok(self.runner.step(&batch, &[])?.into_argmax())
    }
}

impl Proposer for DraftProposer {
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Vec<u32>>, ProposeError> {
        let mut out = vec![Vec::new(); batch.len()];
        let max_pos = self.runner.max_position();
        // (batch index, k) of the sequences that draft this step.
        let mut active = Vec::new();
        let mut feeds = Vec::new();
        for (i, b) in batch.iter().enumerate() {
            let len = b.tokens.len();
            let k = b.max_tokens.min(max_pos.saturating_sub(len));
            if k == 0 || len == 0 {
                continue;
            }
            let Some(start) = self.prepare(b.seq, b.tokens, k)? else {
                continue;
            };
            active.push((i, k));
            feeds.push((b.seq, b.tokens[start..].to_vec(), len));
        }
        if feeds.is_empty() {
            return Ok(out);
        }
        // Round 0 catches up on the real tokens; they are committed whatever happens next.
        let mut next = self.forward(&feeds)?;
        for (seq, fed, _) in &feeds {
            self.blocks.commit(*seq, fed)?;
            if let Some(s) = self.seqs.get_mut(seq) {
                // `fed` starts where `known` ends: now it holds all of the sequence's tokens.
                s.known.extend_from_slice(fed);
            }
        }
        for r in 0.. {
            let mut feeds = Vec::new();
            let mut still = Vec::new();
            for (&(i, k), &tok) in active.iter().zip(&next) {
                if tok as usize >= self.target_vocab {
                    continue; // outside the target's vocabulary: the draft ends here
                }
                out[i].push(tok);
                if r + 1 < k {
                    let seq = batch[i].seq;
                    if let Some(s) = self.seqs.get_mut(&seq) {
                        s.fed.push(tok);
                    }
                    feeds.push((seq, vec![tok], batch[i].tokens.len() + r + 1));
                    still.push((i, k));
                }
            }
            if feeds.is_empty() {
                break;
            }
            next = self.forward(&feeds)?;
            active = still;
        }
        Ok(out)
    }

    fn release(&mut self, seq: SeqId) {
        if self.seqs.remove(&seq).is_some() {
            let _ = self.blocks.free(seq);
        }
    }

    fn kv_metrics(&self) -> Option<KvMetrics> {
        Some(self.blocks.metrics())
    }

    fn check(&self, alive: &dyn Fn(SeqId) -> bool) -> Result<(), InvariantError> {
        self.blocks
            .check_invariants()
            .map_err(InvariantError::DraftKv)?;
        if let Some(dead) = self.blocks.seq_ids().find(|&s| !alive(s)) {
            return Err(InvariantError::DraftLeak(dead));
        }
        let tables = self.blocks.seq_ids().count();
        if tables != self.seqs.len() {
            return Err(InvariantError::DraftTables {
                seqs: self.seqs.len(),
                tables,
            });
        }
        Ok(())
    }
}
