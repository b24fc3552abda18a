//! The command line, parsed by clap (derive): `kiln <command> --flag value ...`, where
//! `kiln <command> --help` lists every flag. A parse error becomes one line ([`message`]).

use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::TokenizeArgs;
use crate::export::ExportHfArgs;
use crate::generate::GenerateArgs;
use crate::info::InfoArgs;
use crate::perplexity::PerplexityArgs;
use crate::serve::ServeArgs;

/// Serve a Llama-family model over gRPC and OpenAI-compatible HTTP, generate text, tokenize,
/// describe a model.
#[derive(Debug, Parser)]
#[command(
    name = "kiln",
    version,
    // A flag given twice keeps its last value.
    args_override_self = true,
    after_help = "`kiln <COMMAND> --help` lists the flags of a command."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve a model over gRPC and OpenAI-compatible HTTP (health NOT_SERVING until it is
    /// loaded); SIGTERM or Ctrl-C drains
    Serve(Box<ServeArgs>),
    /// Generate text for one prompt, streamed to stdout (or one JSON object with --json)
    Generate(GenerateArgs),
    /// Print the token ids of a text as JSON
    Tokenize(TokenizeArgs),
    /// Describe a model, the device and the K/V memory plan
    Info(InfoArgs),
    /// Score a text file: mean negative log-likelihood and perplexity over fixed windows
    Perplexity(PerplexityArgs),
    /// Write a GGUF file as a Hugging Face folder (config, tokenizer, safetensors weights)
    ExportHf(ExportHfArgs),
}

/// The command line's definition: the derived one, with values that look like negative numbers
/// taken as values (`--max-tokens -1` is refused by the check that names `--max-tokens`, as
/// `--temperature -1` is, rather than read as a flag `-1`).
pub fn command() -> clap::Command {
    Cli::command().mut_subcommands(|sub| {
        sub.mut_args(|a| {
            let takes_value = a.get_action().takes_values();
            a.allow_negative_numbers(takes_value)
        })
    })
}

/// Parses `argv` (program name first).
pub fn parse(argv: &[OsString]) -> Result<Cli, clap::Error> {
    Cli::from_arg_matches(&command().try_get_matches_from(argv)?)
}

/// A clap parse error as one line in kiln's words; `argv` is what was parsed, program name
/// first. `--help` and `--version` (errors that do not `use_stderr`) are printed instead.
pub fn message(e: &clap::Error, argv: &[OsString]) -> String {
    let cli = command();
    // The command the error is about: clap stops before any command runs.
    let sub = argv.get(1).and_then(|c| cli.find_subcommand(c));
    let prefix = sub.map_or(String::new(), |s| format!("{}: ", s.get_name()));
    let text = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => s.as_str(),
        _ => "",
    };
    let strings = |kind| match e.get(kind) {
        Some(ContextValue::Strings(v)) => v.iter().map(|s| flag(s)).collect(),
        _ => Vec::new(),
    };
    let commands: Vec<&str> = cli
        .get_subcommands()
        .map(|c| c.get_name())
        .filter(|n| *n != "help")
        .collect();
    let arg = flag(text(ContextKind::InvalidArg));
    let value = text(ContextKind::InvalidValue);
    match e.kind() {
        ErrorKind::UnknownArgument => {
            let what = if arg.starts_with('-') {
                format!("unknown flag {arg}")
            } else {
                format!("unexpected argument `{arg}`")
            };
            let hint = match text(ContextKind::SuggestedArg) {
                "" => String::new(),
                s => format!(" (did you mean {s}?)"),
            };
            format!("{prefix}{what}{hint}")
        }
        ErrorKind::InvalidSubcommand => {
            let hint = match e.get(ContextKind::SuggestedSubcommand) {
                Some(ContextValue::String(s)) => format!(" (did you mean `{s}`?)"),
                Some(ContextValue::Strings(v)) if !v.is_empty() => {
                    format!(" (did you mean `{}`?)", v.join("` or `"))
                }
                _ => String::new(),
            };
            let cmd = text(ContextKind::InvalidSubcommand);
            let expected = one_of(&commands);
            format!("unknown command `{cmd}`{hint}: expected {expected}")
        }
        ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let expected = one_of(&commands);
            format!("missing command: {expected} (`kiln --help` says more)")
        }
        ErrorKind::MissingRequiredArgument => {
            format!("missing {}", strings(ContextKind::InvalidArg).join(", "))
        }
        ErrorKind::InvalidValue if value.is_empty() => format!("{prefix}{arg} needs a value"),
        ErrorKind::InvalidValue => {
            let expected = one_of(&strings(ContextKind::ValidValue));
            format!("{arg} {value}: expected {expected}")
        }
        ErrorKind::ValueValidation => {
            let reason = std::error::Error::source(e).map_or(String::new(), |s| s.to_string());
            match sub.and_then(|s| env_source(s, arg, argv)) {
                Some(var) => format!("{var}={value}: {reason}"),
                None => format!("{arg} {value}: {reason}"),
            }
        }
        // The rest (a value for a switch, bad UTF-8, ...): clap's own first line.
        _ => {
            let rendered = e.render().to_string();
            let line = rendered.lines().next().unwrap_or_default();
            format!("{prefix}{}", line.strip_prefix("error: ").unwrap_or(line))
        }
    }
}

/// `--max-tokens` of clap's `--max-tokens <N>`.
fn flag(arg: &str) -> &str {
    arg.split([' ', '=']).next().unwrap_or(arg)
}

/// `a, b or c`.
fn one_of(names: &[&str]) -> String {
    match names {
        [] => "nothing".to_owned(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// The environment variable `flag` of command `sub` took its value from, if the command line
/// did not give the flag.
fn env_source(sub: &clap::Command, flag: &str, argv: &[OsString]) -> Option<String> {
    let given = argv.iter().skip(2).any(|a| {
        let a = a.to_string_lossy();
        a == flag || a.strip_prefix(flag).is_some_and(|v| v.starts_with('='))
    });
    if given {
        return None;
    }
    let long = flag.strip_prefix("--")?;
    let arg = sub.get_arguments().find(|a| a.get_long() == Some(long))?;
    Some(arg.get_env()?.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<OsString> {
        std::iter::once("kiln")
            .chain(s.split_whitespace())
            .map(OsString::from)
            .collect()
    }

    /// The one line `kiln ARGS` fails with.
    fn err(s: &str) -> String {
        let a = argv(s);
        let e = parse(&a).unwrap_err();
        assert!(e.use_stderr(), "{s}: {e}");
        let m = message(&e, &a);
        assert_eq!(m.lines().count(), 1, "{m}");
        m
    }

    #[test]
    fn flags_parse_into_typed_groups() {
        // Every command parses with only its required flags.
        for s in [
            "serve --model m",
            "generate --model m --prompt p",
            "tokenize --model m --text t",
            "info --model m",
        ] {
            parse(&argv(s)).unwrap();
        }
        let Command::Generate(g) = parse(&argv(
            "generate --model m.gguf --prompt hi --json --top-k=5 --speculative ngram \
             --backend cpu --quantize q4_1 --max-tokens 7 --max-tokens 9",
        ))
        .unwrap()
        .command
        else {
            panic!("not generate")
        };
        assert_eq!(g.model.model, "m.gguf");
        assert_eq!(g.prompt, "hi");
        assert!(g.json && !g.chat);
        assert_eq!(g.sampling.top_k, 5);
        // The last of a repeated flag wins, as it always did.
        assert_eq!(g.max_tokens, 9);
        assert_eq!(
            g.speculative.speculative,
            Some(crate::args::SpecMethodArg::Ngram)
        );
        assert_eq!(g.device.backend, kiln_tensor::BackendChoice::Cpu);
        assert_eq!(g.load.quantize, Some(crate::args::Quantize::Q4_1));
        // A prompt may start with a dash; temperatures may be negative (the engine refuses).
        let Command::Generate(g) = parse(&argv("generate --model m --prompt -5 --temperature -1"))
            .unwrap()
            .command
        else {
            panic!("not generate")
        };
        assert_eq!((g.prompt.as_str(), g.sampling.temperature), ("-5", -1.0));
        let Command::Serve(s) = parse(&argv(
            "serve --model dir/m.gguf --metrics-listen off --listen 0.0.0.0:1 --kv-dtype int8 \
             --device-sampling on",
        ))
        .unwrap()
        .command
        else {
            panic!("not serve")
        };
        assert_eq!(s.listen.to_string(), "0.0.0.0:1");
        assert!(s.metrics_listen.0.is_none());
        assert_eq!(
            s.http_listen.0.map(|a| a.to_string()).as_deref(),
            Some("127.0.0.1:8000")
        );
        assert_eq!(s.engine.kv_dtype, kiln_kv::KvDtype::Int8);
        let mut opts = kiln_engine::EngineOptions::new(kiln_tensor::Device::reference());
        s.engine.apply(&mut opts);
        assert_eq!(opts.device_sampling, kiln_engine::DeviceSampling::On);
        assert_eq!(s.engine.kv_cache_memory, 512 << 20);
    }

    #[test]
    fn errors_are_one_line_in_kilns_words() {
        assert_eq!(
            err("generate --model m --bogus 1"),
            "generate: unknown flag --bogus"
        );
        assert!(err("serve --model m --max-num-seq 4").contains("did you mean --max-num-seqs?"));
        assert_eq!(
            err("generate --model m --prompt x stray"),
            "generate: unexpected argument `stray`"
        );
        assert_eq!(
            err("generate --model m --prompt x --max-tokens lots"),
            "--max-tokens lots: invalid digit found in string"
        );
        assert_eq!(err("generate --prompt x"), "missing --model");
        assert_eq!(err("generate"), "missing --model, --prompt");
        assert_eq!(err("info --model"), "info: --model needs a value");
        assert_eq!(
            err("generate --model m --prompt x --speculative maybe"),
            "--speculative maybe: expected ngram, draft or off"
        );
        assert_eq!(
            err("generate --model m --prompt x --quantize q2_k"),
            "--quantize q2_k: expected q8_0, q4_0 or q4_1"
        );
        assert!(err("serve --model m --kv-dtype f8").starts_with("--kv-dtype f8: "));
        assert!(
            err("serve --model m --listen nowhere")
                .starts_with("--listen nowhere: invalid socket address syntax")
        );
        assert_eq!(
            err("serve --model m --listen off"),
            "--listen off: the gRPC server needs an address"
        );
        for bad in ["-1", "inf", "1e30"] {
            assert!(
                err(&format!("serve --model m --drain-timeout {bad}"))
                    .starts_with(&format!("--drain-timeout {bad}: expected seconds >= 0")),
            );
        }
        assert_eq!(
            err("generate --model m --prompt x --max-tokens -1"),
            "--max-tokens -1: invalid digit found in string"
        );
        assert!(err("info --model m --backend cuda").starts_with("--backend cuda: "));
        assert!(err("serve-nothing").starts_with("unknown command `serve-nothing`"));
        assert!(
            err("bake")
                .contains("expected serve, generate, tokenize, info, perplexity or export-hf")
        );
        assert!(err("").starts_with("missing command"));
        assert!(err("generate --model m --prompt x --json=yes").starts_with("generate: "));
    }

    #[test]
    fn help_and_version_are_printed_not_errors() {
        for s in [
            "--help",
            "-h",
            "--version",
            "serve --help",
            "generate -h",
            "help info",
        ] {
            let e = parse(&argv(s)).unwrap_err();
            assert!(!e.use_stderr(), "{s}");
        }
        let help = parse(&argv("serve --help")).unwrap_err().to_string();
        for flag in [
            "--kv-cache-memory",
            "--speculative",
            "--listen",
            "KILN_API_KEY",
        ] {
            assert!(help.contains(flag), "{flag}: {help}");
        }
    }

    #[test]
    fn the_command_definition_is_consistent() {
        command().debug_assert();
    }
}
