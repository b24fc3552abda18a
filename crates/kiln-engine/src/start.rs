//! Starting an engine: the config checks that must hold before the step loop runs (context
//! length, vocabulary, the speculative method and its draft model), the KV cache, and the
//! engine thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, mpsc};

use kiln_kv::KvDtype;
use kiln_model::v4::{V4CacheConfig, block_bytes, block_size, main_window};
use kiln_model::{KV_CALIBRATION_TEXT, KvPoolConfig, ModelRunner, Network};
use kiln_scheduler::{Scheduler, SchedulerConfig};
use kiln_tokenizer::Tokenizer;

use crate::handle::{EngineHandle, EngineInfo, NORMALIZED_SHRINK, Shared};
use crate::metrics::EngineMetrics;
use crate::speculative::{
    DraftModel, DraftProposer, NgramProposer, Proposer, Spec, SpecMethod, SpeculativeConfig,
    check_same_tokenizer,
};
use crate::step_loop::{FaultPlan, Loop};
use crate::{StartError, speculative};

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
    /// Where rows that need more than an argmax are sampled.
    pub device_sampling: DeviceSampling,
    /// Faults to inject (tests only; none by default).
    pub faults: FaultPlan,
    /// Record prefix-cache changes for [`EngineHandle::kv_events`] (routers that index which
    /// replica caches which prefix read them).
    pub kv_events: bool,
}

/// Where the engine samples a row that needs more than an argmax (temperature, top-k/p,
/// min-p, penalties, bias, `min_new_tokens`): on the device, reading back one id, or on the
/// host from the row read back. Rows with logprobs or a grammar's mask always come back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeviceSampling {
    /// On the device for GPU adapters; on the host for the CPU backend and CPU-type adapters
    /// (lavapipe), where a row read back costs a copy and the host samples faster.
    #[default]
    Auto,
    On,
    Off,
}

impl DeviceSampling {
    /// Whether rows are sampled on `device`.
    pub fn resolve(self, device: &kiln_tensor::Device) -> bool {
        match self {
            DeviceSampling::On => !device.is_cpu(),
            DeviceSampling::Off => false,
            DeviceSampling::Auto => !device.is_cpu() && device.info().device_type != "cpu",
        }
    }
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
            device_sampling: DeviceSampling::Auto,
            faults: FaultPlan::default(),
            kv_events: false,
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
        model: impl Into<Network>,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, StartError> {
        Self::start_with_draft(model, tokenizer, cfg, None)
    }

    /// [`start`](Self::start) with a draft model for speculative decoding
    /// (`cfg.speculative` with [`SpecMethod::Draft`]). The draft must live on the same device
    /// and share the target's tokenizer (checked: a clear error names the first difference).
    pub fn start_with_draft(
        model: impl Into<Network>,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
        draft: Option<DraftModel>,
    ) -> Result<EngineHandle, StartError> {
        let network = model.into();
        let (max_position, vocab) = (network.max_position(), network.vocab());
        if let Some(len) = cfg.max_model_len
            && (len < 2 || len > max_position)
        {
            return Err(StartError::Config {
                field: "max_model_len",
                reason: format!("{len} must be in 2..={max_position} (the model's context)"),
            });
        }
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
        check_pools(&network, &cfg, &scfg)?;
        if let Network::Dense(m) = &network {
            scfg.sliding_window = m.config().kv_window();
        }
        let mut sched = Scheduler::new(scfg.clone())?;
        sched.record_cache_events(cfg.kv_events);
        let (kv_tx, kv_rx) = match cfg.kv_events {
            true => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        let blocks = &scfg.blocks;
        // A sequence's length is bounded by the pool that holds all of it: the kept one
        // where there are two.
        let whole = blocks.kept.map_or(blocks.num_blocks, |k| k.num_blocks);
        let watermark = (f64::from(blocks.watermark) * f64::from(whole)) as usize;
        let usable_blocks = (whole as usize).saturating_sub(watermark);
        let max_model_len = sequence_limit(&cfg, &scfg, max_position, usable_blocks)?;
        let pool = KvPoolConfig {
            block_size: blocks.block_size,
            num_blocks: blocks.num_blocks,
            dtype: cfg.kv_dtype,
        };
        let kv_bytes_per_token = kv_bytes_per_token(&network, cfg.kv_dtype)?;
        let device = network.device().info().name;
        // An INT4 cache centres its keys on the model's mean key over a calibration text
        // (the draft model's too: it shares the tokenizer).
        let calibration = match cfg.kv_dtype {
            KvDtype::Int4 => {
                tokenizer
                    .encode(KV_CALIBRATION_TEXT)
                    .map_err(|e| StartError::Config {
                        field: "tokenizer",
                        reason: format!("cannot encode the KV calibration text: {e}"),
                    })?
            }
            _ => Vec::new(),
        };
        let runner = match network {
            Network::Dense(model) => ModelRunner::calibrated(model, pool, &calibration),
            Network::DeepseekV4(model) => ModelRunner::deepseek_v4(
                model,
                V4CacheConfig {
                    main_blocks: blocks.num_blocks as usize,
                    kept_blocks: whole as usize,
                },
            ),
        }
        .map_err(StartError::KvCache)?;
        let device_sampling = cfg.device_sampling.resolve(runner.device());
        let specials = tokenizer.special_tokens();
        let info = EngineInfo {
            vocab_size: vocab,
            max_model_len,
            max_prompt_bytes: max_model_len
                .saturating_mul(tokenizer.longest_token_bytes())
                .saturating_mul(NORMALIZED_SHRINK),
            bos: specials.bos,
            eos_ids: specials.stop_ids.clone(),
            // Outputs past the first share the prompt's blocks by fork, which a kept pool's
            // sequences cannot.
            max_n: match blocks.kept {
                Some(_) => 1,
                None => cfg.max_n.min(scfg.max_num_seqs),
            },
            max_stop_strings: cfg.max_stop_strings,
            max_top_logprobs: cfg.max_top_logprobs,
            max_num_seqs: scfg.max_num_seqs,
            max_num_batched_tokens: scfg.max_num_batched_tokens,
            max_waiting: scfg.max_waiting,
            kv_blocks: whole as usize,
            block_size: blocks.block_size as usize,
            kv_dtype: cfg.kv_dtype.name(),
            kv_bytes_per_token,
            usable_blocks,
            device,
        };
        let spec = speculation(
            cfg.speculative,
            draft,
            &tokenizer,
            pool,
            &calibration,
            vocab,
        )?;
        let metrics = Arc::new(EngineMetrics::new());
        metrics.kv_total_blocks.set(i64::from(whole));
        let queued = Arc::new(AtomicUsize::new(0));
        let capacity = Arc::new(AtomicUsize::new(sched.waiting_capacity()));
        let (tx, rx) = mpsc::channel();
        let lp = Loop {
            runner,
            sched,
            tokenizer: tokenizer.clone(),
            info: info.clone(),
            metrics: metrics.clone(),
            queued: queued.clone(),
            capacity: capacity.clone(),
            requests: HashMap::new(),
            owner: HashMap::new(),
            next_seq: 0,
            steps: 0,
            rx,
            shutdown: None,
            waiters: Vec::new(),
            spec,
            device_sampling,
            device_sampled_rows: 0,
            faults: cfg.faults,
            failed_steps: 0,
            kv_events: kv_tx,
        };
        let thread = std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || lp.run())
            .map_err(StartError::Thread)?;
        Ok(EngineHandle {
            shared: Arc::new(Shared {
                tx: Mutex::new(tx),
                tokenizer,
                info,
                queued,
                capacity,
                closing: AtomicBool::new(false),
                next_id: AtomicU64::new(0),
                metrics,
                grammars: std::sync::OnceLock::new(),
                thread: Mutex::new(Some(thread)),
                kv_events: Mutex::new(kv_rx),
            }),
        })
    }
}

/// The proposer the speculative config asks for, checked against the draft model given (if
/// any): the method must match, and a draft must share the target's tokenizer. Its KV pool has
/// the target's blocks, so every running sequence fits.
/// The longest sequence (prompt plus generated tokens) this engine can always finish: the
/// model's context, or `cfg.max_model_len`, within what one sequence can hold of the KV pool
/// (the blocks admission may use) and, without chunked prefill, within one step's token budget
/// (a preempted sequence recomputes its prompt and output in one step). A longer sequence
/// would be accepted only to fail when it outgrew the pool, losing its output. An explicit
/// `max_model_len` beyond these is a config error; the model's own context is capped to them.
fn sequence_limit(
    cfg: &EngineConfig,
    scfg: &SchedulerConfig,
    context: usize,
    usable_blocks: usize,
) -> Result<usize, StartError> {
    let pool = usable_blocks.saturating_mul(scfg.blocks.block_size as usize);
    let (limit, why) = if !scfg.chunked_prefill && scfg.max_num_batched_tokens < pool {
        (
            scfg.max_num_batched_tokens,
            format!(
                "max_num_batched_tokens is {} and chunked prefill is off",
                scfg.max_num_batched_tokens
            ),
        )
    } else {
        (
            pool,
            format!(
                "the KV pool holds {pool} tokens of one sequence ({usable_blocks} usable blocks \
                 of {})",
                scfg.blocks.block_size
            ),
        )
    };
    match cfg.max_model_len {
        Some(len) if len > limit => Err(StartError::Config {
            field: "max_model_len",
            reason: format!(
                "{len} cannot be served: {why}; make the pool larger or max_model_len smaller"
            ),
        }),
        Some(len) => Ok(len),
        None if context > limit => {
            if limit < 2 {
                return Err(StartError::Config {
                    field: "kv_size",
                    reason: format!("no room for a sequence: {why}"),
                });
            }
            tracing::info!(
                context,
                max_model_len = limit,
                "max_model_len is below the model's context: {why}"
            );
            Ok(limit)
        }
        None => Ok(context),
    }
}

fn speculation(
    cfg: Option<SpeculativeConfig>,
    draft: Option<DraftModel>,
    tokenizer: &Tokenizer,
    pool: KvPoolConfig,
    calibration: &[u32],
    vocab: usize,
) -> Result<Option<Spec>, StartError> {
    let draft_error = |reason: String| StartError::Config {
        field: "draft_model",
        reason,
    };
    let Some(sc) = cfg else {
        return match draft {
            None => Ok(None),
            Some(_) => Err(draft_error(
                "a draft model was given but the speculative method is not `draft`".into(),
            )),
        };
    };
    if matches!(sc.method, SpecMethod::Ngram { .. }) && draft.is_some() {
        return Err(draft_error(
            "a draft model was given but the speculative method is not `draft`".into(),
        ));
    }
    sc.validate()
        .map_err(|(field, reason)| StartError::Config { field, reason })?;
    let proposer: Box<dyn Proposer> = match (sc.method, draft) {
        (SpecMethod::Ngram { min_n, max_n }, _) => Box::new(NgramProposer { min_n, max_n }),
        (SpecMethod::Draft, None) => {
            return Err(draft_error(
                "speculative method `draft` needs a draft model".into(),
            ));
        }
        (SpecMethod::Draft, Some(d)) => {
            // A mismatch is a leaf fact (no cause to keep): its text is the reason.
            if let Err(mismatch) = check_same_tokenizer(tokenizer, &d.tokenizer) {
                return Err(draft_error(mismatch.to_string()));
            }
            let dv = d.model.config().vocab;
            if (d.tokenizer.vocab_size() as usize) > dv {
                return Err(draft_error(format!(
                    "{} tokens, more than its vocabulary of {dv}",
                    d.tokenizer.vocab_size()
                )));
            }
            Box::new(
                DraftProposer::new(d.model, pool, calibration, vocab).map_err(StartError::Draft)?,
            )
        }
    };
    Ok(Some(speculative::Spec { cfg: sc, proposer }))
}

/// The scheduler's blocks checked against the pools `network`'s state lies in: a dense
/// model has one K/V pool; DeepSeek-V4 its main and kept pools, in blocks of its own size,
/// with a window that covers what its steps read, f32, and no speculation (its blocks are
/// not rolled back).
fn check_pools(
    network: &Network,
    cfg: &EngineConfig,
    scfg: &SchedulerConfig,
) -> Result<(), StartError> {
    let bad = |field, reason: String| Err(StartError::Config { field, reason });
    let blocks = &scfg.blocks;
    let Network::DeepseekV4(m) = network else {
        return match blocks.kept {
            None => Ok(()),
            Some(_) => bad(
                "scheduler.blocks.kept",
                "a kept pool is DeepSeek-V4's; this model has one K/V pool".into(),
            ),
        };
    };
    let c = m.config();
    let (block, window) = (block_size(c), main_window(c));
    match blocks.kept {
        None => bad(
            "scheduler.blocks.kept",
            "DeepSeek-V4 keeps its entries in a kept pool beside the main one".into(),
        ),
        Some(k) if k.window < window => bad(
            "scheduler.blocks.kept.window",
            format!(
                "{} tokens; DeepSeek-V4's steps read the last {window}",
                k.window
            ),
        ),
        Some(_) if blocks.block_size as usize != block => bad(
            "scheduler.blocks.block_size",
            format!(
                "{}; DeepSeek-V4's blocks hold {block} tokens, a multiple of every \
                 compression ratio",
                blocks.block_size
            ),
        ),
        Some(_) if cfg.kv_dtype != KvDtype::F32 => bad(
            "kv_dtype",
            format!("{}; DeepSeek-V4's state is f32", cfg.kv_dtype),
        ),
        Some(_) if cfg.speculative.is_some() => bad(
            "speculative",
            "DeepSeek-V4 does not verify drafts yet".into(),
        ),
        Some(_) => Ok(()),
    }
}

/// Bytes a token of context adds: its K/V, or (DeepSeek-V4) its share of a kept block.
fn kv_bytes_per_token(network: &Network, dtype: KvDtype) -> Result<u64, StartError> {
    Ok(match network {
        Network::Dense(m) => m.config().kv_shape(dtype).bytes_per_token()?,
        Network::DeepseekV4(m) => {
            let [_, kept] = block_bytes(m.config());
            kept.total().div_ceil(block_size(m.config()) as u64)
        }
    })
}
