//! The model runner: a [`Model`] and its paged KV cache, running one forward step for a batch
//! and reading back only what the caller asks for. The engine's step loop and its speculative
//! draft model both step through it (and the golden test does), so batch assembly, the one
//! submit per step and the readback exist once.
//!
//! Block tables come from the caller (`kiln-kv`'s `BlockManager` decides which block holds
//! what); the runner only stores and reads K/V where they point.

use kiln_attention::{KvCache, KvCacheConfig, key_centres};
use kiln_kv::{BlockCopy, BlockId, KvDtype};
use kiln_tensor::sample::RowSampling;
use kiln_tensor::{Device, Recorder, Tensor};

use crate::model::{LogitsAt, Model, SeqInput};
use crate::v4::{V4Cache, V4CacheConfig, V4Input, V4Model};
use crate::{ModelConfig, ModelError, Result};

/// A short original text (prose, dialogue, a list, code, a question and answer) whose keys
/// centre an INT4 KV cache ([`ModelRunner::calibrated`]): tokenized by the model's tokenizer
/// without special tokens.
pub const KV_CALIBRATION_TEXT: &str = include_str!("kv_calibration.txt");

/// The most calibration tokens [`ModelRunner::calibrated`] runs.
pub const CALIBRATION_TOKENS: usize = 512;

/// Calibration tokens per forward step (bounds the activations).
const CALIBRATION_CHUNK: usize = 128;

/// The KV pool a runner allocates: the model gives layers, heads and head size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPoolConfig {
    pub block_size: u32,
    pub num_blocks: u32,
    pub dtype: KvDtype,
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    /// The tokens computed this step: a prompt chunk, the last sampled token, or that token
    /// followed by draft tokens to verify.
    pub tokens: &'a [u32],
    /// Its KV blocks in logical order, covering `context_len` tokens (DeepSeek-V4: its main
    /// pool's, [`BlockId::TRIMMED`] where the window has passed).
    pub block_table: &'a [BlockId],
    /// Its kept pool's blocks in logical order (DeepSeek-V4's entries and indexer keys;
    /// empty for other models, whose one pool is `block_table`'s).
    pub kept_table: &'a [BlockId],
    /// Tokens in the cache after this step (earlier tokens + `tokens.len()`).
    pub context_len: usize,
    /// Logits rows for the last this-many tokens (at least 1, at most `tokens.len()`): 1 for
    /// a plain step, `1 + k` when verifying `k` drafts.
    pub logits_rows: usize,
    /// Read those rows' logits back to the host (CPU sampling, logprobs). The device argmax
    /// of every row comes back either way.
    pub read_logits: bool,
    /// Sample these rows on the device, one [`RowSampling`] a logits row (`logits_rows` of
    /// them), reading back only the picks ([`StepOutput::sampled`]).
    pub sample: Option<&'a [RowSampling]>,
}

/// What a step read back.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutput {
    /// The device argmax of every logits row, sequences in order.
    argmax: Vec<u32>,
    /// The device sampler's pick of each logits row its sequence asked it for.
    sampled: Vec<Option<u32>>,
    /// The logits rows read back, `[read rows, vocab]`.
    logits: Vec<f32>,
    /// For each logits row, its place in `logits` (if read back).
    slot: Vec<Option<usize>>,
    /// For each sequence, its first logits row.
    first: Vec<usize>,
    vocab: usize,
}

impl StepOutput {
    /// The argmax of logits row `row` (0-based among its `logits_rows`) of sequence `seq`.
    pub fn argmax(&self, seq: usize, row: usize) -> Option<u32> {
        self.argmax.get(self.first.get(seq)? + row).copied()
    }

    /// The device sampler's pick for logits row `row` of sequence `seq`, if that sequence
    /// asked for it ([`kiln_tensor::sample::NO_TOKEN`] when nothing was possible).
    pub fn sampled(&self, seq: usize, row: usize) -> Option<u32> {
        self.sampled
            .get(self.first.get(seq)? + row)
            .copied()
            .flatten()
    }

    /// How many logits rows sequence `seq` has (its `logits_rows`).
    pub fn rows(&self, seq: usize) -> usize {
        let first = self.first.get(seq).copied().unwrap_or(0);
        let next = self
            .first
            .get(seq + 1)
            .copied()
            .unwrap_or(self.argmax.len());
        next.saturating_sub(first)
    }

    /// The argmax of every logits row, sequences in order (one per sequence when each asked
    /// for one row).
    pub fn into_argmax(self) -> Vec<u32> {
        self.argmax
    }

    /// Logits row `row` of sequence `seq`, if it asked for `read_logits`.
    pub fn logits(&self, seq: usize, row: usize) -> Option<&[f32]> {
        let k = self
            .slot
            .get(self.first.get(seq)? + row)
            .copied()
            .flatten()?;
        self.logits.get(k * self.vocab..(k + 1) * self.vocab)
    }
}

/// A model and its paged KV cache on one device.
pub struct ModelRunner {
    net: Net,
    device: Device,
}

/// The model and the pools its state lies in. (One a runner, never moved in a step: its
/// size is of no account.)
#[allow(clippy::large_enum_variant)]
enum Net {
    Dense { model: Model, cache: KvCache },
    DeepseekV4 { model: V4Model, cache: V4Cache },
}

impl std::fmt::Debug for ModelRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.net {
            Net::Dense { model, cache } => write!(f, "ModelRunner({model:?}, {cache:?})"),
            Net::DeepseekV4 { model, cache } => write!(f, "ModelRunner({model:?}, {cache:?})"),
        }
    }
}

impl ModelRunner {
    /// Allocates the KV pool for `model` on its device.
    pub fn new(model: Model, pool: KvPoolConfig) -> Result<Self> {
        let cache = KvCache::new(model.device(), model.config().kv_cache_config(pool))?;
        Ok(Self {
            device: model.device().clone(),
            net: Net::Dense { model, cache },
        })
    }

    /// A DeepSeek-V4 model and its pools of `pools`' blocks, on its device (its state is
    /// F32: KV dtypes do not apply).
    pub fn deepseek_v4(model: V4Model, pools: V4CacheConfig) -> Result<Self> {
        let device = model.device().clone();
        let cache = V4Cache::new(&device, model.config(), pools)?;
        Ok(Self {
            device,
            net: Net::DeepseekV4 { model, cache },
        })
    }

    /// [`new`](Self::new), then for an INT4 pool its keys centred on the model's mean key
    /// before RoPE per layer and head ([`KvCache::set_key_centres`]), measured by running
    /// `calibration` (the tokens of [`KV_CALIBRATION_TEXT`], at most [`CALIBRATION_TOKENS`]
    /// of them) through the model once into a temporary F32 cache. Other KV dtypes store keys
    /// as they are and ignore `calibration`.
    pub fn calibrated(model: Model, pool: KvPoolConfig, calibration: &[u32]) -> Result<Self> {
        let mut runner = Self::new(model, pool)?;
        if pool.dtype == KvDtype::Int4
            && let Net::Dense { model, cache } = &mut runner.net
        {
            let centres = measure_key_centres(model, cache, calibration, pool.block_size as usize)?;
            cache.set_key_centres(&centres)?;
        }
        Ok(runner)
    }

    /// The runner's KV cache (`None` for DeepSeek-V4's pools).
    pub fn cache(&self) -> Option<&KvCache> {
        match &self.net {
            Net::Dense { cache, .. } => Some(cache),
            Net::DeepseekV4 { .. } => None,
        }
    }

    /// The dense graph (`None` for DeepSeek-V4).
    pub fn model(&self) -> Option<&Model> {
        match &self.net {
            Net::Dense { model, .. } => Some(model),
            Net::DeepseekV4 { .. } => None,
        }
    }

    /// The dense graph's config (`None` for DeepSeek-V4).
    pub fn config(&self) -> Option<&ModelConfig> {
        self.model().map(Model::config)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The KV cache's config (`None` for DeepSeek-V4's pools).
    pub fn cache_config(&self) -> Option<&KvCacheConfig> {
        self.cache().map(KvCache::config)
    }

    /// Logits a row.
    pub fn vocab(&self) -> usize {
        match &self.net {
            Net::Dense { model, .. } => model.config().vocab,
            Net::DeepseekV4 { model, .. } => model.config().vocab,
        }
    }

    /// Positions a sequence may reach.
    pub fn max_position(&self) -> usize {
        match &self.net {
            Net::Dense { model, .. } => model.config().max_position,
            Net::DeepseekV4 { model, .. } => model.max_positions(),
        }
    }

    /// Bytes of weights resident on the device.
    pub fn weight_bytes(&self) -> u64 {
        match &self.net {
            Net::Dense { model, .. } => model.weight_bytes(),
            Net::DeepseekV4 { model, .. } => model.weight_bytes(),
        }
    }
    /// One forward step: the block copies `copies` (copy-on-write, before anything writes),
    /// then the model over `seqs`, recorded into one submit (one more for each layer whose
    /// experts run on the CPU beside a GPU: `CpuExperts`); reads back the argmax of every
    /// logits row and the rows whose sequence asked for them.
    pub fn step(&mut self, seqs: &[StepSeq<'_>], copies: &[BlockCopy]) -> Result<StepOutput> {
        let device = self.device.clone();
        device.run(|| self.run_step(seqs, copies))
    }

    /// The model over `seqs` into the step's recorder: the logits of each one's last
    /// `tails[i]` tokens.
    fn forward(
        &mut self,
        rec: &mut Recorder,
        seqs: &[StepSeq<'_>],
        copies: &[BlockCopy],
        tails: &[usize],
    ) -> Result<Tensor> {
        match &mut self.net {
            Net::Dense { model, cache } => {
                cache.copy_blocks(rec, copies)?;
                let inputs: Vec<SeqInput<'_>> = seqs
                    .iter()
                    .map(|s| SeqInput {
                        tokens: s.tokens,
                        block_table: s.block_table,
                        context_len: s.context_len,
                    })
                    .collect();
                // `forward` checks every sequence's rows against its tokens.
                model.forward(rec, cache, &inputs, LogitsAt::Tail(tails))
            }
            Net::DeepseekV4 { model, cache } => {
                if !copies.is_empty() {
                    return Err(ModelError::Batch(format!(
                        "{} block copies: DeepSeek-V4's blocks are never shared to write",
                        copies.len()
                    )));
                }
                let inputs: Vec<V4Input<'_>> = seqs
                    .iter()
                    .map(|s| V4Input {
                        tokens: s.tokens,
                        start: s.context_len.saturating_sub(s.tokens.len()),
                        main: s.block_table,
                        kept: s.kept_table,
                    })
                    .collect();
                model.step(rec, cache, &inputs, LogitsAt::Tail(tails))
            }
        }
    }

    fn run_step(&mut self, seqs: &[StepSeq<'_>], copies: &[BlockCopy]) -> Result<StepOutput> {
        let tails: Vec<usize> = seqs.iter().map(|s| s.logits_rows).collect();
        let mut first = Vec::with_capacity(seqs.len());
        let mut total = 0usize;
        for &n in &tails {
            first.push(total);
            total += n;
        }
        let need: Vec<u32> = seqs
            .iter()
            .zip(&first)
            .filter(|(s, _)| s.read_logits)
            .flat_map(|(s, &f)| (f..f + s.logits_rows).map(|r| r as u32))
            .collect();
        let mut sample_rows = Vec::new();
        for (s, &f) in seqs.iter().zip(&first) {
            if let Some(how) = s.sample {
                if how.len() != s.logits_rows {
                    return Err(ModelError::SampleRows {
                        got: how.len(),
                        want: s.logits_rows,
                    });
                }
                sample_rows.extend(how.iter().enumerate().map(|(j, h)| (f + j, h)));
            }
        }
        let mut rec = Recorder::new(&self.device);
        let logits = self.forward(&mut rec, seqs, copies, &tails)?;
        let best = rec.argmax(&logits)?;
        let drawn = match sample_rows.len() {
            0 => None,
            _ => Some(rec.sample(&logits, &sample_rows)?),
        };
        let picked = match need.len() {
            0 => None,
            n if n == total => Some(logits),
            // Gather the needed rows on the device (an exact copy) to read back less.
            _ => Some(rec.embedding(&logits, &need)?),
        };
        rec.submit()?;
        let argmax = best.to_u32_vec()?;
        if argmax.len() != total {
            return Err(ModelError::Readback {
                got: argmax.len(),
                want: total,
            });
        }
        let logits = match picked {
            Some(t) => t.to_f32_vec()?,
            None => Vec::new(),
        };
        let mut sampled = vec![None; total];
        if let Some(t) = drawn {
            let picks = t.to_u32_vec()?;
            if picks.len() != sample_rows.len() {
                return Err(ModelError::Readback {
                    got: picks.len(),
                    want: sample_rows.len(),
                });
            }
            for (&(row, _), pick) in sample_rows.iter().zip(picks) {
                sampled[row] = Some(pick);
            }
        }
        let mut slot = vec![None; total];
        for (k, &i) in need.iter().enumerate() {
            slot[i as usize] = Some(k);
        }
        Ok(StepOutput {
            argmax,
            sampled,
            logits,
            slot,
            first,
            vocab: self.vocab(),
        })
    }
}

/// The model's key centres per layer over `tokens` (truncated to [`CALIBRATION_TOKENS`]
/// and the model's context), skipping the first position, whose key (the attention
/// sink's) is unlike the rest.
fn measure_key_centres(
    model: &Model,
    cache: &KvCache,
    tokens: &[u32],
    block_size: usize,
) -> Result<Vec<kiln_attention::KeyCentre>> {
    let n = tokens
        .len()
        .min(CALIBRATION_TOKENS)
        .min(model.config().max_position);
    if n < 2 {
        return Err(ModelError::Calibration(format!(
            "{} calibration tokens: the INT4 KV cache needs at least 2",
            tokens.len()
        )));
    }
    let mut cfg = *cache.config();
    cfg.dtype = KvDtype::F32;
    cfg.num_blocks = n.div_ceil(block_size);
    let mut cache = KvCache::new(model.device(), cfg)?;
    let table: Vec<BlockId> = (0..cfg.num_blocks as u32).map(BlockId).collect();
    for start in (0..n).step_by(CALIBRATION_CHUNK) {
        let end = (start + CALIBRATION_CHUNK).min(n);
        let mut rec = Recorder::new(model.device());
        model.forward(
            &mut rec,
            &mut cache,
            &[SeqInput {
                tokens: &tokens[start..end],
                block_table: &table,
                context_len: end,
            }],
            LogitsAt::Last,
        )?;
        rec.submit()?;
    }
    // Block b holds positions b·block_size.., so position i is slot i.
    let positions: Vec<u32> = (1..n as u32).collect();
    let mut centres = Vec::new();
    for (layer, rope) in model.layer_ropes().iter().enumerate() {
        let keys = cache.keys(layer, &positions)?;
        centres.extend(key_centres(rope, &keys, &positions, cfg.kv_heads));
    }
    Ok(centres)
}
