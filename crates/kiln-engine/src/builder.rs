//! The one way to build an engine from a model path: open the files and the tokenizer
//! ([`Checkpoint::open`], quick, so a bad path fails before anything else starts), then
//! [`build`]: upload the weights, plan the KV pool, configure the scheduler, load the draft
//! model if speculation asks for one, and start the engine. `kiln serve`, `kiln generate`, the
//! benchmarks and the test harness all go through it; only what differs (the pool size, the
//! limits) differs in their [`EngineOptions`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_kv::{BlockManagerConfig, KvBudget, KvDtype, KvError, KvPlan, KvPlanConfig};
use kiln_model::{
    CpuExperts, LoadOptions, Model, ModelConfig, ModelError, ModelFiles, ModelSource,
};
use kiln_scheduler::SchedulerConfig;
use kiln_tensor::Device;
use kiln_tokenizer::{Tokenizer, TokenizerError};

use crate::{
    DeviceSampling, DraftModel, Engine, EngineConfig, EngineHandle, FaultPlan, SpeculativeConfig,
    StartError,
};

/// A model path opened: its config and tokenizer read, its weights not yet loaded.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    files: ModelFiles,
    tokenizer: Tokenizer,
}

impl Checkpoint {
    /// Opens a `.gguf` file (tokenizer from its metadata) or a Hugging Face folder (tokenizer
    /// files beside `config.json`). `load` applies to HF float weights only.
    pub fn open(path: &Path, load: LoadOptions) -> Result<Self, BuildError> {
        let files = ModelFiles::open(path, load)?;
        let tokenizer = match files.source() {
            ModelSource::Gguf(g) => Tokenizer::from_gguf_metadata(g.file().metadata()),
            ModelSource::Hf { dir, .. } => Tokenizer::from_hf_dir(dir),
        }
        .map_err(|source| BuildError::Tokenizer {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            files,
            tokenizer,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn config(&self) -> &ModelConfig {
        self.files.config()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The opened files (format, stored weight bytes).
    pub fn files(&self) -> &ModelFiles {
        &self.files
    }

    /// Uploads the weights to `device` (the experts `cpu_experts` covers to its CPU device
    /// instead), calling `progress(layers_done, layers)` after each layer; the file bytes are
    /// released afterwards.
    pub fn load(
        self,
        device: &Device,
        cpu_experts: Option<&CpuExperts>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Model, Tokenizer), BuildError> {
        let model = Model::load_with_progress(
            device,
            self.files.config().clone(),
            self.files.weights(),
            cpu_experts,
            progress,
        )
        .map_err(|source| BuildError::Weights {
            path: self.path.clone(),
            source: Box::new(source),
        })?;
        Ok((model, self.tokenizer))
    }
}

/// How large the KV pool is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSize {
    /// As many blocks as this many bytes of K and V buy (`--kv-cache-memory`).
    Bytes(u64),
    /// Exactly this many blocks.
    Blocks(u32),
    /// Room for one sequence of this many tokens (a one-shot `kiln generate`).
    Tokens(usize),
}

impl std::fmt::Display for KvSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvSize::Bytes(b) => write!(f, "{b} bytes"),
            KvSize::Blocks(n) => write!(f, "{n} blocks"),
            KvSize::Tokens(t) => write!(f, "room for {t} tokens"),
        }
    }
}

/// Everything but the model that shapes an engine. `None` keeps the scheduler's default.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub device: Device,
    pub kv_size: KvSize,
    pub kv_dtype: KvDtype,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Share of the pool admission leaves free for running sequences to grow into.
    pub watermark: Option<f32>,
    pub prefix_caching: bool,
    pub max_num_seqs: Option<usize>,
    pub max_num_batched_tokens: Option<usize>,
    pub max_waiting: Option<usize>,
    /// Prompt plus generated tokens at most (`None`: the model's context).
    pub max_model_len: Option<usize>,
    pub speculative: Option<SpeculativeConfig>,
    /// The draft model of `SpecMethod::Draft`, loaded onto `device` beside the target.
    pub draft_model: Option<PathBuf>,
    /// Where rows that need more than an argmax are sampled.
    pub device_sampling: DeviceSampling,
    /// Faults to inject (tests only).
    pub faults: FaultPlan,
    /// Record prefix-cache changes for [`EngineHandle::kv_events`](crate::EngineHandle::kv_events).
    pub kv_events: bool,
    /// Layers whose experts stay in host memory on the native CPU backend (`--cpu-moe`,
    /// `--n-cpu-moe N`), and that backend.
    pub cpu_experts: Option<CpuExperts>,
}

impl EngineOptions {
    /// The default KV pool: 512 MiB, ~22k tokens of the default model at f16.
    pub const DEFAULT_KV_BYTES: u64 = 512 << 20;

    /// `kiln serve`'s defaults on `device`: 512 MiB of f16 K/V in 16-token blocks, prefix
    /// caching on, no speculation.
    pub fn new(device: Device) -> Self {
        Self {
            device,
            kv_size: KvSize::Bytes(Self::DEFAULT_KV_BYTES),
            kv_dtype: KvDtype::F16,
            block_size: 16,
            watermark: None,
            prefix_caching: true,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            max_waiting: None,
            max_model_len: None,
            speculative: None,
            draft_model: None,
            device_sampling: DeviceSampling::Auto,
            faults: FaultPlan::default(),
            kv_events: false,
            cpu_experts: None,
        }
    }

    /// The KV pool these options give `model`.
    pub fn kv_plan(&self, model: &ModelConfig) -> Result<KvPlan, BuildError> {
        let shape = model.kv_shape(self.kv_dtype);
        let bytes = match self.kv_size {
            KvSize::Bytes(b) => b,
            KvSize::Blocks(n) => {
                let per_block = shape
                    .bytes_per_token()?
                    .saturating_mul(u64::from(self.block_size));
                per_block.saturating_mul(u64::from(n))
            }
            KvSize::Tokens(t) => {
                let capped = t.min(self.max_model_len.unwrap_or(model.max_position));
                // One block more than the tokens need: a full last block still appends.
                let blocks = capped.div_ceil(self.block_size.max(1) as usize) + 1;
                let per_block = shape
                    .bytes_per_token()?
                    .saturating_mul(u64::from(self.block_size));
                per_block.saturating_mul(blocks as u64)
            }
        };
        KvPlan::new(&KvPlanConfig {
            shape,
            block_size: self.block_size,
            max_seq_len: self.max_model_len.unwrap_or(model.max_position),
            budget: KvBudget::Bytes(bytes),
        })
        .map_err(|source| BuildError::KvPlan {
            size: self.kv_size,
            source,
        })
    }

    /// The engine config for `model`'s pool `plan`.
    fn engine_config(&self, plan: &KvPlan) -> EngineConfig {
        let mut blocks: BlockManagerConfig = plan.block_manager_config();
        blocks.enable_prefix_caching = self.prefix_caching;
        if let Some(w) = self.watermark {
            blocks.watermark = w;
        }
        let mut sched = SchedulerConfig::new(blocks);
        if let Some(n) = self.max_num_seqs {
            sched.max_num_seqs = n;
        }
        if let Some(n) = self.max_num_batched_tokens {
            sched.max_num_batched_tokens = n;
        }
        if let Some(n) = self.max_waiting {
            sched.max_waiting = n;
        }
        let mut cfg = EngineConfig::new(sched);
        cfg.kv_dtype = self.kv_dtype;
        cfg.max_model_len = self.max_model_len;
        cfg.speculative = self.speculative;
        cfg.device_sampling = self.device_sampling;
        cfg.faults = self.faults.clone();
        cfg.kv_events = self.kv_events;
        cfg
    }
}

/// A started engine and what building it found out.
#[derive(Debug)]
pub struct Built {
    pub engine: EngineHandle,
    /// The model's config (normalised).
    pub config: ModelConfig,
    /// Bytes of weights resident on the device, as stored (quantized stays quantized).
    pub weight_bytes: u64,
    /// How long uploading the weights took.
    pub load_time: Duration,
    pub kv: KvPlan,
}

/// Loads `checkpoint`'s weights onto `opts.device` and starts an engine over them (see the
/// module docs). `progress` sees `(layers_done, layers)` while the weights upload.
pub fn build(
    checkpoint: Checkpoint,
    opts: &EngineOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Built, BuildError> {
    let config = checkpoint.config().clone();
    // Plan first: a pool that cannot exist fails before the weights upload.
    let kv = opts.kv_plan(&config)?;
    let start = Instant::now();
    let (model, tokenizer) = checkpoint.load(&opts.device, opts.cpu_experts.as_ref(), progress)?;
    let load_time = start.elapsed();
    let weight_bytes = model.weight_bytes();
    tracing::info!(
        weights_mib = weight_bytes as f64 / f64::from(1 << 20),
        device = %opts.device.info(),
        kv = %kv.explain(),
        ms = load_time.as_millis() as u64,
        "model loaded"
    );
    let (host_bytes, host_layers) = model.host_experts();
    if !host_layers.is_empty() {
        tracing::info!(
            layers = host_layers.len(),
            host_mib = host_bytes as f64 / f64::from(1 << 20),
            "experts in host memory, on the native CPU backend"
        );
    }
    let draft = match &opts.draft_model {
        None => None,
        Some(path) => {
            let draft = Checkpoint::open(path, LoadOptions::default())
                .and_then(|c| c.load(&opts.device, None, &mut |_, _| {}))
                .map_err(|source| BuildError::Draft {
                    path: path.clone(),
                    source: Box::new(source),
                })?;
            Some(DraftModel {
                model: draft.0,
                tokenizer: draft.1,
            })
        }
    };
    if let Some(s) = &opts.speculative {
        tracing::info!(
            method = ?s.method,
            k = s.num_tokens,
            off_above = s.disable_batch_size,
            "speculative decoding"
        );
    }
    let engine = Engine::start_with_draft(model, tokenizer, opts.engine_config(&kv), draft)?;
    Ok(Built {
        engine,
        config,
        weight_bytes,
        load_time,
        kv,
    })
}

/// Why an engine could not be built; each names the file or setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The model path: missing, unreadable, malformed config or weights index.
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{}: tokenizer", path.display())]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: TokenizerError,
    },
    #[error("{}: loading the weights", path.display())]
    Weights {
        path: PathBuf,
        #[source]
        source: Box<ModelError>,
    },
    /// The KV pool the options ask for cannot exist.
    #[error("KV cache of {size}")]
    KvPlan {
        size: KvSize,
        #[source]
        source: KvError,
    },
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The draft model could not be opened or loaded (its own error names the file).
    #[error("draft model")]
    Draft {
        path: PathBuf,
        #[source]
        source: Box<BuildError>,
    },
    /// The engine refused the configuration (see [`StartError`]).
    #[error(transparent)]
    Start(Box<StartError>),
}

impl From<StartError> for BuildError {
    fn from(e: StartError) -> Self {
        Self::Start(Box::new(e))
    }
}
