//! The settled flags of `kiln-bench` ([`crate::cli`] parses them).

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::bail;
use clap::ValueEnum;
use kiln_engine::SpeculativeConfig;
use kiln_tensor::BackendChoice;

/// Which scenarios run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenarios {
    pub single: bool,
    pub sweep: bool,
    pub prefix: bool,
    pub roofline: bool,
    pub profile: bool,
    pub serve: bool,
    pub speculative: bool,
    pub structured: bool,
}

impl Scenarios {
    /// Every scenario but `speculative`, which needs speculation configured.
    pub const ALL: Self = Self {
        single: true,
        sweep: true,
        prefix: true,
        roofline: true,
        profile: true,
        serve: true,
        speculative: false,
        structured: true,
    };

    pub const NONE: Self = Self {
        single: false,
        sweep: false,
        prefix: false,
        roofline: false,
        profile: false,
        serve: false,
        speculative: false,
        structured: false,
    };

    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.single, "single"),
            (self.sweep, "sweep"),
            (self.prefix, "prefix"),
            (self.roofline, "roofline"),
            (self.profile, "profile"),
            (self.serve, "serve"),
            (self.speculative, "speculative"),
            (self.structured, "structured"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect()
    }
}

impl FromStr for Scenarios {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        let mut out = Self::NONE;
        for name in s.split(',').map(str::trim) {
            match name {
                "single" => out.single = true,
                "sweep" => out.sweep = true,
                "prefix" => out.prefix = true,
                "roofline" => out.roofline = true,
                "profile" => out.profile = true,
                "serve" => out.serve = true,
                "speculative" => out.speculative = true,
                "structured" => out.structured = true,
                "all" => {
                    out = Self {
                        speculative: out.speculative,
                        ..Self::ALL
                    }
                }
                other => {
                    bail!(
                        "unknown scenario {other:?} (expected single, sweep, prefix, roofline, \
                         profile, serve, speculative, structured)"
                    )
                }
            }
        }
        Ok(out)
    }
}

/// How the speculative scenario drafts (`--speculative`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpecChoice {
    /// Prompt lookup.
    Ngram,
    /// A draft model (`--draft-model`, else the target itself).
    Draft,
}

/// An engine to compare against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Compare {
    /// llama.cpp through llama-cpp-python
    #[value(name = "llama-cpp", alias = "llama.cpp", alias = "llamacpp")]
    LlamaCpp,
    /// llama.cpp's `llama-server` (the serve scenario) and `llama-bench` (the table)
    #[value(name = "llama-server")]
    LlamaServer,
}

/// Every flag, defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub model: PathBuf,
    pub backend: BackendChoice,
    /// Whether `--backend` was given (it means nothing with `--grpc`).
    pub backend_given: bool,
    pub grpc: Option<String>,
    pub scenarios: Scenarios,
    pub levels: Vec<usize>,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub sweep_prompt_tokens: usize,
    pub sweep_new_tokens: usize,
    pub prefix_tokens: usize,
    pub prefix_question_tokens: usize,
    pub prefix_new_tokens: usize,
    pub prefix_requests: usize,
    /// Set whenever the speculative scenario runs.
    pub speculative: Option<SpecChoice>,
    /// `None` with [`SpecChoice::Draft`]: the target model drafts for itself.
    pub draft_model: Option<PathBuf>,
    pub num_speculative_tokens: usize,
    pub spec_new_tokens: usize,
    pub threads: usize,
    pub compare: Option<Compare>,
    /// Where `llama-server` and `llama-bench` are (`--compare llama-server`).
    pub llama_cpp_dir: PathBuf,
    /// `-ngl` for llama.cpp (with flash attention on); `None` runs its CPU backend.
    pub llama_gpu_layers: Option<usize>,
    pub kernels: kiln_tensor::Kernels,
    /// Single-stream runs, for the mean ± std of the llama-bench style table.
    pub repetitions: usize,
    pub serve_requests: usize,
    pub serve_concurrency: usize,
    pub request_rate: Option<f64>,
    pub serve_prompt_tokens: usize,
    pub serve_output_tokens: usize,
    pub out: PathBuf,
    pub kv_blocks: Option<u32>,
    pub max_num_seqs: Option<usize>,
    pub max_batched_tokens: usize,
}

impl Args {
    /// The engine's speculative config for `--speculative` (`None`: the scenario is off).
    pub fn spec_config(&self) -> Option<SpeculativeConfig> {
        let mut cfg = match self.speculative? {
            SpecChoice::Ngram => SpeculativeConfig::ngram(),
            SpecChoice::Draft => SpeculativeConfig::draft(),
        };
        cfg.num_tokens = self.num_speculative_tokens;
        Some(cfg)
    }
}
