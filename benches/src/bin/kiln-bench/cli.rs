//! The command line of `kiln-bench` (what `cargo xtask bench` passes through): clap (derive)
//! parses the flags, [`parse`] settles them into [`Args`]; `kiln-bench --help` lists them.

use std::ffi::OsString;
use std::path::PathBuf;
use std::str::FromStr;

use anyhow::bail;
use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{ArgAction, CommandFactory, FromArgMatches, Parser};
use kiln_tensor::BackendChoice;

use crate::args::{Args, Compare, Scenarios, SpecChoice};

/// Runs kiln's serving benchmarks on the in-process engine (or a running `kiln serve` with
/// --grpc), prints a table per scenario and writes every figure as JSON to
/// <out>/kiln-bench-<unix-seconds>.json and <out>/latest.json.
///
/// Every flag is optional except --model, which `cargo xtask bench` fills in with the default
/// model.
#[derive(Debug, Parser)]
#[command(
    name = "kiln-bench",
    // A flag given twice keeps its last value.
    args_override_self = true,
    after_help = "Run it as `cargo xtask bench [FLAGS]`: a release build, the default model."
)]
struct Cli {
    /// .gguf file or Hugging Face folder
    #[arg(long, value_name = "PATH")]
    model: PathBuf,
    /// Device of the in-process engine
    #[arg(
        long,
        env = "KILN_BACKEND",
        value_name = "auto|cpu|wgpu",
        default_value = "auto",
        value_parser = backend
    )]
    backend: BackendChoice,
    /// Load a running `kiln serve` at ADDR instead (no roofline, no prefix run without the
    /// cache: the server's config is not ours)
    #[arg(long, value_name = "ADDR", value_parser = grpc_addr)]
    grpc: Option<String>,
    /// Any of single,sweep,prefix,roofline,profile,serve,structured,speculative [default: all but
    /// speculative; with --speculative: speculative only; `all` is every scenario but speculative]
    #[arg(long, value_name = "LIST")]
    scenarios: Option<Scenarios>,
    /// Concurrency levels of the sweep
    #[arg(
        long,
        value_name = "LIST",
        action = ArgAction::Set,
        value_delimiter = ',',
        default_value = "1,4,16,64",
        value_parser = positive::<usize>
    )]
    levels: Vec<usize>,
    /// Single stream: prompt length
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = positive::<usize>)]
    prompt_tokens: usize,
    /// Single stream: tokens to generate
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = positive::<usize>)]
    new_tokens: usize,
    /// Sweep: prompt length
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = positive::<usize>)]
    sweep_prompt_tokens: usize,
    /// Sweep: tokens to generate per request
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = positive::<usize>)]
    sweep_new_tokens: usize,
    /// Shared prefix: the common system prompt
    #[arg(long, value_name = "N", default_value_t = 400, value_parser = positive::<usize>)]
    prefix_tokens: usize,
    /// Shared prefix: each request's own question
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = positive::<usize>)]
    prefix_question_tokens: usize,
    /// Shared prefix: tokens to generate per request
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = positive::<usize>)]
    prefix_new_tokens: usize,
    /// Shared prefix: measured requests per run
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = positive::<usize>)]
    prefix_requests: usize,
    /// Speculative decoding: adds the speculative scenario [default of the scenario: ngram]
    ///
    /// The scenario measures decode tokens/s with and without speculation on an extractive and
    /// a free-generation chat prompt, acceptance rates, and whether the greedy output stayed
    /// the same. In-process the other scenarios never speculate; over --grpc the server's own
    /// speculative config applies.
    #[arg(long, value_enum, value_name = "METHOD")]
    speculative: Option<SpecChoice>,
    /// Draft: the draft model, sharing the target's tokenizer (implies --speculative draft)
    /// [default: the target model itself]
    #[arg(long, value_name = "PATH")]
    draft_model: Option<PathBuf>,
    /// Draft tokens per step, 1..=64 [default: 4]
    #[arg(long, value_name = "K", value_parser = positive::<usize>)]
    num_speculative_tokens: Option<usize>,
    /// Speculative: most tokens to generate per run, EOS stops earlier [default: 128]
    #[arg(long, value_name = "N", value_parser = positive::<usize>)]
    spec_new_tokens: Option<usize>,
    /// Threads of llama.cpp and of kiln's native CPU backend [default: the machine's
    /// available parallelism]
    #[arg(long, value_name = "N", value_parser = positive::<usize>)]
    threads: Option<usize>,
    /// llama-cpp: also run the single stream through llama-cpp-python (interpreter:
    /// $KILN_PYTHON, else python3) and print kiln/llama.cpp ratios; llama-server: also run
    /// llama.cpp's llama-bench (the table) and the serve workload through its llama-server
    #[arg(long, value_enum, value_name = "ENGINE")]
    compare: Option<Compare>,
    /// Where llama.cpp's `llama-server` and `llama-bench` are [default: $KILN_LLAMA_CPP_DIR,
    /// else target/llama.cpp/bin in the workspace, where `cargo xtask llama-cpp` builds them]
    #[arg(long, value_name = "DIR")]
    llama_cpp_dir: Option<PathBuf>,
    /// Layers llama.cpp offloads to its GPU backend (`-ngl N`, flash attention on), for a
    /// llama.cpp built with one (the GPU check's Vulkan build) [default: none, its CPU backend]
    #[arg(long, value_name = "N")]
    llama_gpu_layers: Option<usize>,
    /// kiln's GPU kernels: tested, or experimental too (`kiln serve --kernels`)
    #[arg(
        long,
        env = "KILN_KERNELS",
        value_name = "tested|experimental",
        default_value = "tested",
        value_parser = kiln_tensor::Kernels::from_str
    )]
    kernels: kiln_tensor::Kernels,
    /// Single stream: runs, for the mean ± std of the llama-bench style table
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = positive::<usize>)]
    repetitions: usize,
    /// Serve: requests per front door
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = positive::<usize>)]
    serve_requests: usize,
    /// Serve: most requests in flight
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = positive::<usize>)]
    serve_concurrency: usize,
    /// Serve: requests per second, Poisson arrivals [default: all at once]
    #[arg(long, value_name = "R", value_parser = positive::<f64>)]
    request_rate: Option<f64>,
    /// Serve: prompt length
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = positive::<usize>)]
    serve_prompt_tokens: usize,
    /// Serve: tokens to generate per request
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = positive::<usize>)]
    serve_output_tokens: usize,
    /// Where the JSON goes [default: target/bench in the workspace]
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// In-process KV pool in 16-token blocks [default: sized so every scenario fits, the
    /// largest sweep level included]
    #[arg(long, value_name = "N", value_parser = positive::<u32>)]
    kv_blocks: Option<u32>,
    /// In-process: sequences per step [default: max(64, largest level)]
    #[arg(long, value_name = "N", value_parser = positive::<usize>)]
    max_num_seqs: Option<usize>,
    /// In-process: tokens per step
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = positive::<usize>)]
    max_batched_tokens: usize,
}

/// A `--backend` name (empty, as in `KILN_BACKEND=`, is `auto`), its error naming both sources.
fn backend(s: &str) -> Result<BackendChoice, String> {
    s.parse()
        .map_err(|e| format!("{e} (from --backend or $KILN_BACKEND)"))
}

fn grpc_addr(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("needs an address such as 127.0.0.1:50051".into());
    }
    Ok(s.to_owned())
}

fn positive<T: FromStr + Default + PartialOrd>(s: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    match s.trim().parse::<T>() {
        Ok(n) if n > T::default() => Ok(n),
        Ok(_) => Err("expected a positive integer".into()),
        Err(e) => Err(format!("expected a positive integer ({e})")),
    }
}

/// The workspace's `target/bench`.
/// The workspace's target folder.
fn target_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest)
        .join("target")
}

fn default_out() -> PathBuf {
    target_dir().join("bench")
}

/// Parses `argv` (program name first) into [`Args`]. The error is clap's, to print with
/// `print` (help and usage errors alike) and exit with its `exit_code`.
pub fn parse(argv: impl IntoIterator<Item = OsString>) -> Result<Args, clap::Error> {
    parse_with(Cli::command(), argv)
}

fn parse_with(
    mut cmd: clap::Command,
    argv: impl IntoIterator<Item = OsString>,
) -> Result<Args, clap::Error> {
    let matches = cmd.try_get_matches_from_mut(argv)?;
    // `--backend` means nothing with `--grpc`; `$KILN_BACKEND` is not worth a note.
    let backend_given = matches.value_source("backend") == Some(ValueSource::CommandLine);
    let cli = Cli::from_arg_matches(&matches)?;
    cli.settle(backend_given)
        .map_err(|e| cmd.error(ErrorKind::ArgumentConflict, format!("{e:#}")))
}

impl Cli {
    /// Every flag, defaults filled in and the speculative flags settled.
    fn settle(self, backend_given: bool) -> anyhow::Result<Args> {
        let spec_flags: Vec<&str> = [
            (
                "num-speculative-tokens",
                self.num_speculative_tokens.is_some(),
            ),
            ("spec-new-tokens", self.spec_new_tokens.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect();
        let mut a = Args {
            model: self.model,
            backend: self.backend,
            backend_given,
            grpc: self.grpc,
            scenarios: self.scenarios.unwrap_or(Scenarios::ALL),
            levels: self.levels,
            prompt_tokens: self.prompt_tokens,
            new_tokens: self.new_tokens,
            sweep_prompt_tokens: self.sweep_prompt_tokens,
            sweep_new_tokens: self.sweep_new_tokens,
            prefix_tokens: self.prefix_tokens,
            prefix_question_tokens: self.prefix_question_tokens,
            prefix_new_tokens: self.prefix_new_tokens,
            prefix_requests: self.prefix_requests,
            speculative: self.speculative,
            draft_model: self.draft_model,
            num_speculative_tokens: self.num_speculative_tokens.unwrap_or(4),
            spec_new_tokens: self.spec_new_tokens.unwrap_or(128),
            threads: self
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from)),
            compare: self.compare,
            llama_cpp_dir: self
                .llama_cpp_dir
                .or_else(|| std::env::var_os("KILN_LLAMA_CPP_DIR").map(PathBuf::from))
                .unwrap_or_else(|| target_dir().join("llama.cpp").join("bin")),
            llama_gpu_layers: self.llama_gpu_layers,
            kernels: self.kernels,
            repetitions: self.repetitions,
            serve_requests: self.serve_requests,
            serve_concurrency: self.serve_concurrency,
            request_rate: self.request_rate,
            serve_prompt_tokens: self.serve_prompt_tokens,
            serve_output_tokens: self.serve_output_tokens,
            out: self.out.unwrap_or_else(default_out),
            kv_blocks: self.kv_blocks,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
        };
        speculative_flags(&mut a, self.scenarios.is_some(), &spec_flags)?;
        if a.scenarios.names().is_empty() {
            bail!("--scenarios: name at least one scenario");
        }
        Ok(a)
    }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use kiln_engine::SpeculativeConfig;

    use super::*;

    /// Parses `kiln-bench S`, whatever `$KILN_BACKEND` the tests run under.
    fn parse_args(s: &str) -> Result<Args, clap::Error> {
        let cmd = Cli::command().mut_arg("backend", |a| a.env(None::<&str>));
        let argv = std::iter::once("kiln-bench")
            .chain(s.split_whitespace())
            .map(OsString::from);
        parse_with(cmd, argv)
    }

    fn err(s: &str) -> String {
        let e = parse_args(s).unwrap_err();
        assert!(e.use_stderr(), "{s}: {e}");
        e.to_string()
    }

    #[test]
    fn defaults_and_overrides() {
        let a = parse_args("--model m.gguf").unwrap();
        assert_eq!(a.levels, vec![1, 4, 16, 64]);
        assert_eq!((a.prompt_tokens, a.new_tokens), (512, 128));
        assert_eq!((a.sweep_prompt_tokens, a.sweep_new_tokens), (128, 128));
        assert_eq!(
            (
                a.prefix_tokens,
                a.prefix_question_tokens,
                a.prefix_new_tokens,
                a.prefix_requests
            ),
            (400, 16, 8, 8)
        );
        assert_eq!(a.scenarios, Scenarios::ALL);
        assert_eq!(a.backend, BackendChoice::Auto);
        assert!(!a.backend_given);
        assert!(a.out.ends_with("target/bench"));
        assert!(a.threads >= 1);
        assert_eq!(
            (a.kv_blocks, a.max_num_seqs, a.max_batched_tokens),
            (None, None, 512)
        );

        let a = parse_args(
            "--model m.gguf --backend=cpu --levels 1,4 --scenarios single,roofline \
             --compare llama-cpp --threads 2 --grpc 127.0.0.1:1 --kv-blocks 9 --out o",
        )
        .unwrap();
        assert_eq!(a.backend, BackendChoice::Cpu);
        assert!(a.backend_given);
        assert_eq!(a.levels, vec![1, 4]);
        assert_eq!(a.scenarios.names(), vec!["single", "roofline"]);
        assert_eq!(a.compare, Some(Compare::LlamaCpp));
        assert_eq!(a.threads, 2);
        assert_eq!(a.grpc.as_deref(), Some("127.0.0.1:1"));
        assert_eq!((a.kv_blocks, a.out), (Some(9), PathBuf::from("o")));
        // The old spellings of llama-cpp; the last of a repeated flag wins.
        let a = parse_args("--model m --compare llama.cpp --levels 2 --levels 3").unwrap();
        assert_eq!((a.compare, a.levels), (Some(Compare::LlamaCpp), vec![3]));
        let a = parse_args(
            "--model m --compare llama-server --llama-cpp-dir /l --serve-requests 8 \
             --serve-concurrency 4 --request-rate 2.5 --repetitions 2",
        )
        .unwrap();
        assert_eq!(a.compare, Some(Compare::LlamaServer));
        assert_eq!(a.llama_cpp_dir, PathBuf::from("/l"));
        assert_eq!(
            (a.llama_gpu_layers, a.kernels),
            (None, kiln_tensor::Kernels::Tested)
        );
        let g = parse_args("--model m --llama-gpu-layers 99 --kernels experimental").unwrap();
        assert_eq!(
            (g.llama_gpu_layers, g.kernels),
            (Some(99), kiln_tensor::Kernels::Experimental)
        );
        assert_eq!(
            (
                a.serve_requests,
                a.serve_concurrency,
                a.request_rate,
                a.repetitions
            ),
            (8, 4, Some(2.5), 2)
        );
        assert!(!parse_args("--model m -h").unwrap_err().use_stderr());
    }

    #[test]
    fn speculative_flags_settle_scenarios_and_method() {
        let p = |s: &str| parse_args(s).unwrap();
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
            assert_eq!(a.scenarios.names().len(), 8);
            assert_eq!(a.speculative, Some(SpecChoice::Ngram));
        }
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let e = err("--model m --speculative medusa");
        assert!(e.contains("medusa") && e.contains("ngram, draft"), "{e}");
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
        assert!(err("--model m --levels 1,x").contains("'x'"));
        assert!(err("--model m --levels 0").contains("positive integer"));
        assert!(err("--model m --prompt-tokens").contains("--prompt-tokens"));
        assert!(err("--model m --frobnicate 3").contains("--frobnicate"));
        assert!(err("--model m --scenarios single,warp").contains("\"warp\""));
        let e = err("--model m --backend cuda");
        assert!(e.contains("cuda") && e.contains("KILN_BACKEND"), "{e}");
        assert!(err("--model m --compare vllm").contains("llama-cpp"));
        assert!(err("--model m stray").contains("stray"));
        assert!(err("--model m --grpc=").contains("127.0.0.1:50051"));
        assert!(err("--model m --kv-blocks 5000000000").contains("positive integer"));
    }

    #[test]
    fn the_command_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
