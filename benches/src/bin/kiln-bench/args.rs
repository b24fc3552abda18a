//! Command-line flags of `kiln-bench` (what `cargo xtask bench` passes through).

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{Context, bail};
use kiln_engine::SpeculativeConfig;
use kiln_tensor::BackendChoice;

pub const USAGE: &str = "\
usage: kiln-bench --model PATH [flags]        (or: cargo xtask bench [flags])

Runs the serving benchmarks of issue 8 on the in-process engine (or a running `kiln serve` with
--grpc), prints a table per scenario and writes every figure as JSON to
<out>/kiln-bench-<unix-seconds>.json and <out>/latest.json.

flags (all optional except --model, which `cargo xtask bench` fills in):
  --model PATH               .gguf file or Hugging Face folder
  --backend auto|cpu|wgpu    device of the in-process engine (default: $KILN_BACKEND, else auto)
  --grpc ADDR                load a running `kiln serve` at ADDR instead (no roofline, no
                             prefix run without the cache: the server's config is not ours)
  --scenarios LIST           any of single,sweep,prefix,roofline,profile,speculative
                             (default: all but speculative; with --speculative: speculative
                             only; `all` is every scenario but speculative)
  --levels LIST              concurrency levels of the sweep (default: 1,4,16,64)
  --prompt-tokens N          single stream: prompt length (default 512)
  --new-tokens N             single stream: tokens to generate (default 128)
  --sweep-prompt-tokens N    sweep: prompt length (default 128)
  --sweep-new-tokens N       sweep: tokens to generate per request (default 128)
  --prefix-tokens N          shared prefix: the common system prompt (default 400)
  --prefix-question-tokens N shared prefix: each request's own question (default 16)
  --prefix-new-tokens N      shared prefix: tokens to generate per request (default 8)
  --prefix-requests N        shared prefix: measured requests per run (default 8)
  --speculative ngram|draft  speculative decoding: adds the speculative scenario (decode tokens/s
                             with and without speculation on an extractive and a free-generation
                             chat prompt, acceptance rates, identical greedy output). Default of
                             the scenario: ngram. In-process the other scenarios never speculate;
                             over --grpc the server's own speculative config applies
  --draft-model PATH         draft: the draft model, sharing the target's tokenizer (implies
                             --speculative draft; default: the target model itself)
  --num-speculative-tokens K draft tokens per step (default 4; 1..=64)
  --spec-new-tokens N        speculative: most tokens to generate per run, EOS stops earlier
                             (default 128)
  --threads N                llama.cpp's threads (default: the machine's available parallelism)
  --compare llama-cpp        also run the single stream through llama-cpp-python (interpreter:
                             $KILN_PYTHON, else python3) and print kiln/llama.cpp ratios
  --out DIR                  where the JSON goes (default: target/bench in the workspace)
  --kv-blocks N              in-process KV pool in 16-token blocks (default: sized so every
                             scenario fits, the largest sweep level included)
  --max-num-seqs N           in-process: sequences per step (default: max(64, largest level))
  --max-batched-tokens N     in-process: tokens per step (default 512)
  -h, --help                 this text
";

/// Which scenarios run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenarios {
    pub single: bool,
    pub sweep: bool,
    pub prefix: bool,
    pub roofline: bool,
    pub profile: bool,
    pub speculative: bool,
}

impl Scenarios {
    /// Every scenario but `speculative`, which needs speculation configured.
    pub const ALL: Self = Self {
        single: true,
        sweep: true,
        prefix: true,
        roofline: true,
        profile: true,
        speculative: false,
    };

    pub const NONE: Self = Self {
        single: false,
        sweep: false,
        prefix: false,
        roofline: false,
        profile: false,
        speculative: false,
    };

    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.single, "single"),
            (self.sweep, "sweep"),
            (self.prefix, "prefix"),
            (self.roofline, "roofline"),
            (self.profile, "profile"),
            (self.speculative, "speculative"),
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
                "speculative" => out.speculative = true,
                "all" => {
                    out = Self {
                        speculative: out.speculative,
                        ..Self::ALL
                    }
                }
                other => {
                    bail!(
                        "unknown scenario {other:?} (expected single, sweep, prefix, roofline, \
                         profile, speculative)"
                    )
                }
            }
        }
        Ok(out)
    }
}

/// How the speculative scenario drafts (`--speculative`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecChoice {
    /// Prompt lookup.
    Ngram,
    /// A draft model (`--draft-model`, else the target itself).
    Draft,
}

/// An engine to compare against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compare {
    LlamaCpp,
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
    pub out: PathBuf,
    pub kv_blocks: Option<u32>,
    pub max_num_seqs: Option<usize>,
    pub max_batched_tokens: usize,
}

/// The workspace's `target/bench`.
fn default_out() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest)
        .join("target")
        .join("bench")
}

/// Parses `argv` (without the program name); `Ok(None)` when help was asked for.
/// `env_backend` is `$KILN_BACKEND`, the default of `--backend`.
pub fn parse(argv: &[String], env_backend: Option<&str>) -> anyhow::Result<Option<Args>> {
    let backend = match env_backend {
        Some(v) if !v.trim().is_empty() => v
            .parse::<BackendChoice>()
            .with_context(|| format!("KILN_BACKEND={v}"))?,
        _ => BackendChoice::Auto,
    };
    let mut a = Args {
        model: PathBuf::new(),
        backend,
        backend_given: false,
        grpc: None,
        scenarios: Scenarios::ALL,
        levels: vec![1, 4, 16, 64],
        prompt_tokens: 512,
        new_tokens: 128,
        sweep_prompt_tokens: 128,
        sweep_new_tokens: 128,
        prefix_tokens: 400,
        prefix_question_tokens: 16,
        prefix_new_tokens: 8,
        prefix_requests: 8,
        speculative: None,
        draft_model: None,
        num_speculative_tokens: 4,
        spec_new_tokens: 128,
        threads: std::thread::available_parallelism().map_or(1, usize::from),
        compare: None,
        out: default_out(),
        kv_blocks: None,
        max_num_seqs: None,
        max_batched_tokens: 512,
    };
    let mut model = None;
    let mut scenarios_given = false;
    let mut spec_flags = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        let arg = &argv[i];
        i += 1;
        if matches!(arg.as_str(), "-h" | "--help") {
            return Ok(None);
        }
        let Some(flag) = arg.strip_prefix("--") else {
            bail!("unexpected argument {arg:?} (flags start with --; see --help)");
        };
        let (name, value) = match flag.split_once('=') {
            Some((n, v)) => (n, v.to_owned()),
            None => {
                let Some(v) = argv.get(i) else {
                    bail!("--{flag} needs a value");
                };
                i += 1;
                (flag, v.clone())
            }
        };
        match name {
            "model" => model = Some(PathBuf::from(value)),
            "backend" => {
                a.backend = value
                    .parse()
                    .with_context(|| format!("--backend {value}"))?;
                a.backend_given = true;
            }
            "grpc" => {
                if value.trim().is_empty() {
                    bail!("--grpc needs an address such as 127.0.0.1:50051");
                }
                a.grpc = Some(value);
            }
            "scenarios" => {
                a.scenarios = value.parse().context("--scenarios")?;
                scenarios_given = true;
            }
            "levels" => a.levels = positive_list(name, &value)?,
            "prompt-tokens" => a.prompt_tokens = positive(name, &value)?,
            "new-tokens" => a.new_tokens = positive(name, &value)?,
            "sweep-prompt-tokens" => a.sweep_prompt_tokens = positive(name, &value)?,
            "sweep-new-tokens" => a.sweep_new_tokens = positive(name, &value)?,
            "prefix-tokens" => a.prefix_tokens = positive(name, &value)?,
            "prefix-question-tokens" => a.prefix_question_tokens = positive(name, &value)?,
            "prefix-new-tokens" => a.prefix_new_tokens = positive(name, &value)?,
            "prefix-requests" => a.prefix_requests = positive(name, &value)?,
            "speculative" => {
                a.speculative = Some(match value.as_str() {
                    "ngram" => SpecChoice::Ngram,
                    "draft" => SpecChoice::Draft,
                    other => bail!("--speculative {other}: expected ngram or draft"),
                });
            }
            "draft-model" => a.draft_model = Some(PathBuf::from(value)),
            "num-speculative-tokens" => {
                a.num_speculative_tokens = positive(name, &value)?;
                spec_flags.push(name);
            }
            "spec-new-tokens" => {
                a.spec_new_tokens = positive(name, &value)?;
                spec_flags.push(name);
            }
            "threads" => a.threads = positive(name, &value)?,
            "compare" => match value.as_str() {
                "llama-cpp" | "llama.cpp" | "llamacpp" => a.compare = Some(Compare::LlamaCpp),
                other => bail!("--compare {other}: expected llama-cpp"),
            },
            "out" => a.out = PathBuf::from(value),
            "kv-blocks" => {
                let n = positive(name, &value)?;
                a.kv_blocks =
                    Some(u32::try_from(n).with_context(|| format!("--kv-blocks {n}: too large"))?);
            }
            "max-num-seqs" => a.max_num_seqs = Some(positive(name, &value)?),
            "max-batched-tokens" => a.max_batched_tokens = positive(name, &value)?,
            other => bail!("unknown flag --{other} (see --help)"),
        }
    }
    a.model = model.context("--model PATH is required (`cargo xtask bench` fills it in)")?;
    speculative_flags(&mut a, scenarios_given, &spec_flags)?;
    if a.scenarios.names().is_empty() {
        bail!("--scenarios: name at least one scenario");
    }
    Ok(Some(a))
}

/// Settles `--speculative`, `--draft-model` and `--scenarios` against each other: a method
/// adds the speculative scenario (alone when `--scenarios` was not given), the scenario
/// defaults to ngram, and a draft model implies `draft`.
fn speculative_flags(
    a: &mut Args,
    scenarios_given: bool,
    spec_flags: &[&str],
) -> anyhow::Result<()> {
    if a.draft_model.is_some() {
        match a.speculative {
            Some(SpecChoice::Ngram) => {
                bail!("--draft-model needs --speculative draft (ngram drafts from the prompt)")
            }
            Some(SpecChoice::Draft) => {}
            None => a.speculative = Some(SpecChoice::Draft),
        }
    }
    if a.speculative.is_some() {
        if scenarios_given {
            a.scenarios.speculative = true;
        } else {
            a.scenarios = Scenarios {
                speculative: true,
                ..Scenarios::NONE
            };
        }
    } else if a.scenarios.speculative {
        a.speculative = Some(SpecChoice::Ngram);
    } else if let Some(flag) = spec_flags.first() {
        bail!("--{flag} needs the speculative scenario: add --speculative ngram|draft");
    }
    if let Some(cfg) = a.spec_config() {
        cfg.validate()
            .map_err(|(_, reason)| anyhow::anyhow!("--num-speculative-tokens {reason}"))?;
    }
    Ok(())
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

fn positive(name: &str, value: &str) -> anyhow::Result<usize> {
    match value.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => bail!("--{name} {value:?}: expected a positive integer"),
    }
}

fn positive_list(name: &str, value: &str) -> anyhow::Result<Vec<usize>> {
    let list = value
        .split(',')
        .map(|v| positive(name, v))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if list.is_empty() {
        bail!("--{name}: expected a comma-separated list of positive integers");
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn err(s: &str) -> String {
        format!("{:#}", parse(&argv(s), None).unwrap_err())
    }

    #[test]
    fn defaults_and_overrides() {
        let a = parse(&argv("--model m.gguf"), None).unwrap().unwrap();
        assert_eq!(a.levels, vec![1, 4, 16, 64]);
        assert_eq!((a.prompt_tokens, a.new_tokens), (512, 128));
        assert_eq!(a.scenarios, Scenarios::ALL);
        assert_eq!(a.backend, BackendChoice::Auto);
        assert!(a.out.ends_with("target/bench"));

        let a = parse(
            &argv(
                "--model m.gguf --backend=cpu --levels 1,4 --scenarios single,roofline \
                 --compare llama-cpp --threads 2 --grpc 127.0.0.1:1",
            ),
            Some("wgpu"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(a.backend, BackendChoice::Cpu);
        assert_eq!(a.levels, vec![1, 4]);
        assert_eq!(a.scenarios.names(), vec!["single", "roofline"]);
        assert_eq!(a.compare, Some(Compare::LlamaCpp));
        assert_eq!(a.threads, 2);
        assert_eq!(a.grpc.as_deref(), Some("127.0.0.1:1"));
        // $KILN_BACKEND is the default.
        let a = parse(&argv("--model m"), Some("cpu")).unwrap().unwrap();
        assert_eq!(a.backend, BackendChoice::Cpu);
        assert!(parse(&argv("--model m -h"), None).unwrap().is_none());
    }

    #[test]
    fn speculative_flags_settle_scenarios_and_method() {
        let p = |s: &str| parse(&argv(s), None).unwrap().unwrap();
        // No speculation unless asked for.
        let a = p("--model m");
        assert_eq!((a.speculative, a.spec_config()), (None, None));
        assert!(!a.scenarios.speculative);
        // A method alone runs only its scenario, with the defaults.
        let a = p("--model m --speculative ngram");
        assert_eq!(a.scenarios.names(), vec!["speculative"]);
        assert_eq!((a.num_speculative_tokens, a.spec_new_tokens), (4, 128));
        assert_eq!(a.spec_config(), Some(SpeculativeConfig::ngram()));
        // With --scenarios it is added to them.
        let a = p(
            "--model m --scenarios single --speculative draft --num-speculative-tokens 6 \
             --spec-new-tokens 64",
        );
        assert_eq!(a.scenarios.names(), vec!["single", "speculative"]);
        assert_eq!(
            (a.speculative, a.draft_model.as_ref()),
            (Some(SpecChoice::Draft), None)
        );
        let cfg = a.spec_config().unwrap();
        assert_eq!(
            (cfg.method, cfg.num_tokens),
            (SpeculativeConfig::draft().method, 6)
        );
        assert_eq!(a.spec_new_tokens, 64);
        // A draft model implies draft.
        let a = p("--model m --draft-model d.gguf");
        assert_eq!(a.speculative, Some(SpecChoice::Draft));
        assert_eq!(a.draft_model, Some(PathBuf::from("d.gguf")));
        assert_eq!(a.scenarios.names(), vec!["speculative"]);
        // The scenario by name defaults to ngram; `all` keeps it either side.
        for list in ["all,speculative", "speculative,all"] {
            let a = p(&format!("--model m --scenarios {list}"));
            assert_eq!(a.scenarios.names().len(), 6);
            assert_eq!(a.speculative, Some(SpecChoice::Ngram));
        }
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        assert!(err("--model m --speculative medusa").contains("expected ngram or draft"));
        assert!(
            err("--model m --speculative ngram --draft-model d")
                .contains("--draft-model needs --speculative draft")
        );
        assert!(
            err("--model m --num-speculative-tokens 3")
                .contains("--num-speculative-tokens needs the speculative scenario")
        );
        assert!(
            err("--model m --speculative ngram --num-speculative-tokens 65").contains("1..=64")
        );
        assert!(err("--model m --spec-new-tokens 0").contains("positive integer"));
        assert!(err("").contains("--model"));
        assert!(err("--model m --levels 1,x").contains("--levels \"x\""));
        assert!(err("--model m --levels 0").contains("positive integer"));
        assert!(err("--model m --prompt-tokens").contains("needs a value"));
        assert!(err("--model m --frobnicate 3").contains("unknown flag --frobnicate"));
        assert!(err("--model m --scenarios single,warp").contains("\"warp\""));
        assert!(err("--model m --backend cuda").contains("cuda"));
        assert!(err("--model m --compare vllm").contains("llama-cpp"));
        assert!(err("--model m stray").contains("stray"));
        assert!(
            format!("{:#}", parse(&argv("--model m"), Some("tpu")).unwrap_err())
                .contains("KILN_BACKEND")
        );
    }
}
