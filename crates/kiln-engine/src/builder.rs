//! The one way to build an engine from a model path: open the files and the tokenizer
//! ([`Checkpoint::open`], quick, so a bad path fails before anything else starts), then
//! [`build`]: upload the weights, plan the KV pool, configure the scheduler, load the draft
//! model if speculation asks for one, and start the engine. `kiln serve`, `kiln generate`, the
//! benchmarks and the test harness all go through it; only what differs (the pool size, the
//! limits) differs in their [`EngineOptions`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_kv::{
    BlockManagerConfig, KeptBudget, KeptPlan, KeptPlanConfig, KvBudget, KvDtype, KvError, KvPlan,
    KvPlanConfig,
};
use kiln_model::v4::{self, V4Model};
use kiln_model::{
    CpuExperts, DeepseekV4Config, GgufSource, LoadOptions, Model, ModelConfig, ModelError,
    ModelFiles, ModelSource, Network, NetworkConfig,
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
    /// The dense graph's files (DeepSeek-V4's load in one piece: `V4Model::load`).
    files: Option<ModelFiles>,
    config: NetworkConfig,
    tokenizer: Tokenizer,
}

impl Checkpoint {
    /// Opens a `.gguf` file (tokenizer from its metadata) or a Hugging Face folder (tokenizer
    /// files beside `config.json`). `load` applies to HF float weights only.
    pub fn open(path: &Path, load: LoadOptions) -> Result<Self, BuildError> {
        let tokenizer_error = |source| BuildError::Tokenizer {
            path: path.to_path_buf(),
            source,
        };
        if let Some(v4) = NetworkConfig::deepseek_v4(path)? {
            if load != LoadOptions::default() {
                return Err(BuildError::Model(ModelError::Config {
                    file: path.display().to_string(),
                    field: "load options".into(),
                    problem: format!(
                        "{load:?}: DeepSeek-V4 loads as stored (FP8 and FP4 stay packed)"
                    ),
                }));
            }
            let tokenizer = match path.is_file() {
                true => Tokenizer::from_gguf_metadata(GgufSource::open(path)?.file().metadata()),
                false => Tokenizer::from_hf_dir(path),
            }
            .map_err(tokenizer_error)?;
            return Ok(Self {
                path: path.to_path_buf(),
                files: None,
                config: NetworkConfig::DeepseekV4(Box::new(v4)),
                tokenizer,
            });
        }
        let files = ModelFiles::open(path, load)?;
        let tokenizer = match files.source() {
            ModelSource::Gguf(g) => Tokenizer::from_gguf_metadata(g.file().metadata()),
            ModelSource::Hf { dir, .. } => Tokenizer::from_hf_dir(dir),
        }
        .map_err(tokenizer_error)?;
        Ok(Self {
            path: path.to_path_buf(),
            config: NetworkConfig::Dense(files.config().clone()),
            files: Some(files),
            tokenizer,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The dense graph's opened files (format, stored weight bytes); `None` for DeepSeek-V4.
    pub fn files(&self) -> Option<&ModelFiles> {
        self.files.as_ref()
    }

    /// Bytes of weights as stored: the tensors' (DeepSeek-V4: its files').
    pub fn stored_bytes(&self) -> u64 {
        match &self.files {
            Some(f) => f.stored_bytes(),
            None => weight_files_bytes(&self.path),
        }
    }

    /// Uploads a dense model's weights to `device` (the experts `cpu_experts` covers to its
    /// CPU device instead), calling `progress(layers_done, layers)` after each layer; the
    /// file bytes are released afterwards.
    pub fn load(
        self,
        device: &Device,
        cpu_experts: Option<&CpuExperts>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Model, Tokenizer), BuildError> {
        let Some(files) = self.files else {
            return Err(BuildError::Weights {
                path: self.path.clone(),
                source: Box::new(ModelError::Config {
                    file: self.path.display().to_string(),
                    field: "architecture".into(),
                    problem: "deepseek_v4 runs through the engine (kiln serve, kiln generate)"
                        .into(),
                }),
            });
        };
        let model = Model::load_with_progress(
            device,
            files.config().clone(),
            files.weights(),
            cpu_experts,
            progress,
        )
        .map_err(|source| BuildError::Weights {
            path: self.path.clone(),
            source: Box::new(source),
        })?;
        Ok((model, self.tokenizer))
    }

    /// [`load`](Self::load) for any architecture; DeepSeek-V4 with rotary tables for
    /// `positions` positions, and no CPU experts.
    pub fn load_network(
        self,
        device: &Device,
        cpu_experts: Option<&CpuExperts>,
        positions: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Network, Tokenizer), BuildError> {
        if self.files.is_some() {
            let (model, tokenizer) = self.load(device, cpu_experts, progress)?;
            return Ok((model.into(), tokenizer));
        }
        let weights = |source| BuildError::Weights {
            path: self.path.clone(),
            source: Box::new(source),
        };
        if cpu_experts.is_some() {
            return Err(weights(ModelError::Config {
                file: self.path.display().to_string(),
                field: "cpu_moe".into(),
                problem: "DeepSeek-V4's experts stay on the model's device".into(),
            }));
        }
        let model = V4Model::load(&self.path, device, positions).map_err(weights)?;
        Ok((model.into(), self.tokenizer))
    }
}

/// Bytes of a GGUF file, or of a folder's safetensors files.
fn weight_files_bytes(path: &Path) -> u64 {
    let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    if path.is_file() {
        return len(path);
    }
    std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| len(&p))
        .sum()
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

    /// The pools these options give `model`: its K/V pool, or DeepSeek-V4's two.
    pub fn pool_plan(&self, model: &NetworkConfig) -> Result<PoolPlan, BuildError> {
        match model {
            NetworkConfig::Dense(c) => Ok(PoolPlan::Kv(self.kv_plan(c)?)),
            NetworkConfig::DeepseekV4(c) => Ok(PoolPlan::Kept(self.kept_plan(c)?)),
        }
    }

    /// DeepSeek-V4's main and kept pools: blocks of its own size (a multiple of every
    /// compression ratio), f32; the main pool holds the windows of the running sequences.
    fn kept_plan(&self, model: &DeepseekV4Config) -> Result<KeptPlan, BuildError> {
        let defaults = SchedulerConfig::new(BlockManagerConfig::new(1));
        let [main, kept] = v4::block_bytes(model);
        let max_len = self.max_model_len.unwrap_or(model.max_position);
        let cfg = KeptPlanConfig {
            block_size: v4::block_size(model) as u32,
            main_block_bytes: main.total(),
            kept_block_bytes: kept.total(),
            window: v4::main_window(model),
            max_num_seqs: self.max_num_seqs.unwrap_or(defaults.max_num_seqs),
            max_batched_tokens: self
                .max_num_batched_tokens
                .unwrap_or(defaults.max_num_batched_tokens),
            budget: match self.kv_size {
                KvSize::Bytes(b) => KeptBudget::Bytes(b),
                KvSize::Blocks(n) => KeptBudget::KeptBlocks(n),
                KvSize::Tokens(t) => KeptBudget::Tokens(t.min(max_len)),
            },
        };
        KeptPlan::new(&cfg).map_err(|source| BuildError::KvPlan {
            size: self.kv_size,
            source,
        })
    }

    /// The engine config for `model`'s pools `plan`.
    fn engine_config(&self, plan: &PoolPlan) -> EngineConfig {
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
        cfg.kv_dtype = match plan {
            PoolPlan::Kv(_) => self.kv_dtype,
            PoolPlan::Kept(_) => KvDtype::F32,
        };
        cfg.max_model_len = self.max_model_len;
        cfg.speculative = self.speculative;
        cfg.device_sampling = self.device_sampling;
        cfg.faults = self.faults.clone();
        cfg.kv_events = self.kv_events;
        cfg
    }
}

/// The pools an engine's state fills.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolPlan {
    /// One K/V pool.
    Kv(KvPlan),
    /// DeepSeek-V4's main and kept pools.
    Kept(KeptPlan),
}

impl PoolPlan {
    /// The block manager's config for these pools, defaults for the rest.
    pub fn block_manager_config(&self) -> BlockManagerConfig {
        match self {
            PoolPlan::Kv(p) => p.block_manager_config(),
            PoolPlan::Kept(p) => p.block_manager_config(),
        }
    }

    /// Tokens of context the pools hold over every sequence.
    pub fn num_tokens(&self) -> u64 {
        match self {
            PoolPlan::Kv(p) => p.num_tokens(),
            PoolPlan::Kept(p) => p.num_tokens(),
        }
    }
}

impl std::fmt::Display for PoolPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolPlan::Kv(p) => p.fmt(f),
            PoolPlan::Kept(p) => p.fmt(f),
        }
    }
}

/// A started engine and what building it found out.
#[derive(Debug)]
pub struct Built {
    pub engine: EngineHandle,
    /// The model's config (normalised).
    pub config: NetworkConfig,
    /// Bytes of weights resident on the device, as stored (quantized stays quantized).
    pub weight_bytes: u64,
    /// How long uploading the weights took.
    pub load_time: Duration,
    pub kv: PoolPlan,
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
    let kv = opts.pool_plan(&config)?;
    // Rotary tables (DeepSeek-V4's) for the longest sequence the pools and options allow.
    let positions =
        (opts.max_model_len.unwrap_or(config.max_position()) as u64).min(kv.num_tokens()) as usize;
    let start = Instant::now();
    let (model, tokenizer) =
        checkpoint.load_network(&opts.device, opts.cpu_experts.as_ref(), positions, progress)?;
    let load_time = start.elapsed();
    let weight_bytes = model.weight_bytes();
    tracing::info!(
        weights_mib = weight_bytes as f64 / f64::from(1 << 20),
        device = %opts.device.info(),
        kv = %kv,
        ms = load_time.as_millis() as u64,
        "model loaded"
    );
    let (host_bytes, host_layers) = match &model {
        Network::Dense(m) => m.host_experts(),
        Network::DeepseekV4(_) => (0, &[][..]),
    };
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
