//! The flag groups the `kiln` commands share, each defined once and flattened
//! (`#[command(flatten)]`) into every command that takes it.

use clap::{Args, ValueEnum};
use kiln_engine::{DeviceSampling, EngineOptions, KvSize};
use kiln_kv::KvDtype;
use kiln_model::{CpuExperts, CpuMoe};
use std::str::FromStr;

use kiln_tensor::{BackendChoice, Device, DeviceOptions, Kernels};

/// `--model PATH`: what every command runs on.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A .gguf file or a Hugging Face folder (config.json, tokenizer files, model.safetensors
    /// or model.safetensors.index.json)
    #[arg(long, value_name = "PATH")]
    pub model: String,
}

/// How the weights of a Hugging Face folder are loaded (`serve`, `generate`).
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// Weight type of a Hugging Face folder's float tensors [default: as stored]
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub dtype: Option<WeightDtype>,
    /// Quantize a Hugging Face folder's weights while loading
    #[arg(long, value_enum, value_name = "TYPE")]
    pub quantize: Option<Quantize>,
}

/// `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WeightDtype {
    F16,
    F32,
}

/// `--quantize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Quantize {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
}

/// `--backend` (env `KILN_BACKEND`) and `--threads`.
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Device: `auto` takes the best GPU, else the native CPU backend; `wgpu` any adapter
    /// (CPU-type ones such as lavapipe included); `cpu` the native CPU backend; `reference`
    /// the plain CPU reference (tests, debugging)
    #[arg(
        long,
        env = "KILN_BACKEND",
        value_name = "auto|wgpu|cpu|reference",
        default_value = "auto",
        value_parser = BackendChoice::from_str
    )]
    pub backend: BackendChoice,
    /// Threads of the native CPU backend (default: one a core)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
    /// GPU kernels: `tested` runs only those checked against the CPU reference on a real GPU
    /// (`kiln-bench gpu-check`); `experimental` also those not yet checked there (today the
    /// tensor-core matmul on adapters with 16x16 f16 cooperative matrices)
    #[arg(
        long,
        env = "KILN_KERNELS",
        value_name = "tested|experimental",
        default_value = "tested",
        value_parser = Kernels::from_str
    )]
    pub kernels: Kernels,
    /// Mixture of experts on a GPU: keep every layer's expert weights in host memory and run
    /// them on the native CPU backend (attention, the routers and dense parts stay on the GPU)
    #[arg(long, conflicts_with = "n_cpu_moe")]
    pub cpu_moe: bool,
    /// Mixture of experts on a GPU: keep the experts of the first N layers on the CPU
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub n_cpu_moe: Option<u64>,
}

impl DeviceArgs {
    /// Which layers' experts stay on the CPU (`--cpu-moe`, `--n-cpu-moe N`).
    pub fn cpu_moe(&self) -> CpuMoe {
        match (self.cpu_moe, self.n_cpu_moe) {
            (true, _) => CpuMoe::All,
            (false, Some(n)) => CpuMoe::First(usize::try_from(n).unwrap_or(usize::MAX)),
            (false, None) => CpuMoe::Off,
        }
    }

    /// The native CPU backend (`--threads`) for the experts `--cpu-moe` / `--n-cpu-moe` put
    /// there, if either is given.
    pub fn cpu_experts(&self) -> Result<Option<CpuExperts>, String> {
        let layers = self.cpu_moe();
        if layers == CpuMoe::Off {
            return Ok(None);
        }
        let cpu = Device::new(&DeviceOptions {
            backend: BackendChoice::Cpu,
            threads: self.threads.map(|n| n as usize),
            ..DeviceOptions::default()
        })
        .map_err(|e| e.to_string())?;
        Ok(Some(CpuExperts { layers, cpu }))
    }
}

/// The engine's memory and batching limits (`serve`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Engine")]
pub struct EngineArgs {
    /// K/V cache memory in bytes (512 MiB: ~22k tokens of the default model at f16)
    #[arg(long, value_name = "BYTES", default_value_t = EngineOptions::DEFAULT_KV_BYTES)]
    pub kv_cache_memory: u64,
    /// K/V cache element type
    #[arg(long, value_name = "f16|f32|int8|int4", default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Tokens per K/V block
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub block_size: u32,
    /// Most sequences in one step [default: 64]
    #[arg(long, value_name = "N")]
    pub max_num_seqs: Option<usize>,
    /// Most tokens in one step [default: 512]
    #[arg(long, value_name = "N")]
    pub max_num_batched_tokens: Option<usize>,
    /// Most requests waiting for a slot [default: 256]
    #[arg(long, value_name = "N")]
    pub max_waiting: Option<usize>,
    /// Longest sequence, prompt and output [default: the model's context]
    #[arg(long, value_name = "N")]
    pub max_model_len: Option<usize>,
    /// Where rows that need more than an argmax (temperature, top-k/p, min-p, penalties) are
    /// sampled: `auto` is the device on GPU adapters, the host on CPU-type ones
    #[arg(long, value_enum, value_name = "auto|on|off", default_value = "auto")]
    pub device_sampling: DeviceSamplingArg,
}

/// `--device-sampling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceSamplingArg {
    Auto,
    On,
    Off,
}

impl EngineArgs {
    /// These limits, into the engine options.
    pub fn apply(&self, opts: &mut EngineOptions) {
        opts.kv_size = KvSize::Bytes(self.kv_cache_memory);
        opts.kv_dtype = self.kv_dtype;
        opts.block_size = self.block_size;
        opts.max_num_seqs = self.max_num_seqs;
        opts.max_num_batched_tokens = self.max_num_batched_tokens;
        opts.max_waiting = self.max_waiting;
        opts.max_model_len = self.max_model_len;
        opts.device_sampling = match self.device_sampling {
            DeviceSamplingArg::Auto => DeviceSampling::Auto,
            DeviceSamplingArg::On => DeviceSampling::On,
            DeviceSamplingArg::Off => DeviceSampling::Off,
        };
    }
}

/// Speculative decoding (`serve`, `generate`); the consistency rules are
/// `crate::speculative::config`'s.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Speculative decoding (off by default)")]
pub struct SpeculativeArgs {
    /// How drafts are made: prompt lookup, or a draft model
    #[arg(long, value_enum, value_name = "METHOD")]
    pub speculative: Option<SpecMethodArg>,
    /// The draft model (.gguf or Hugging Face folder) with the target's tokenizer; implies
    /// --speculative draft
    #[arg(long, value_name = "PATH")]
    pub draft_model: Option<String>,
    /// Tokens drafted per step, 1..=64 [default: 4]
    #[arg(long, value_name = "K")]
    pub num_speculative_tokens: Option<usize>,
    /// ngram: shortest n-gram looked up [default: 1]
    #[arg(long, value_name = "N")]
    pub prompt_lookup_min: Option<usize>,
    /// ngram: longest n-gram looked up [default: 3]
    #[arg(long, value_name = "N")]
    pub prompt_lookup_max: Option<usize>,
    /// No speculation in a step while more sequences than this run [default: 8]
    #[arg(long, value_name = "N")]
    pub speculative_disable_batch_size: Option<usize>,
}

/// `--speculative`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpecMethodArg {
    /// Prompt lookup: no second model
    Ngram,
    /// A draft model (--draft-model)
    Draft,
    /// No speculative decoding
    Off,
}
