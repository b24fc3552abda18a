//! The speculative-decoding flags shared by `serve` and `generate`:
//! `--speculative ngram|draft|off`, `--draft-model PATH` (implies `draft`),
//! `--num-speculative-tokens K`, `--prompt-lookup-min N`, `--prompt-lookup-max N` and
//! `--speculative-disable-batch-size N` ([`SpeculativeArgs`]). Rules that tie flags together
//! are checked here, with messages that name the flags.

use std::path::PathBuf;

use kiln_engine::{EngineOptions, SpecMethod, SpeculativeConfig};

use crate::args::{SpecMethodArg, SpeculativeArgs};

/// The speculative config the flags ask for (`None`: off).
pub fn config(args: &SpeculativeArgs) -> Result<Option<SpeculativeConfig>, String> {
    let mut cfg = match (args.speculative, &args.draft_model) {
        (None | Some(SpecMethodArg::Off), None) => {
            let tuning = [
                ("num-speculative-tokens", args.num_speculative_tokens),
                ("prompt-lookup-min", args.prompt_lookup_min),
                ("prompt-lookup-max", args.prompt_lookup_max),
                (
                    "speculative-disable-batch-size",
                    args.speculative_disable_batch_size,
                ),
            ];
            if let Some((f, _)) = tuning.iter().find(|(_, v)| v.is_some()) {
                return Err(format!(
                    "--{f} needs speculative decoding: add --speculative ngram or --draft-model PATH"
                ));
            }
            return Ok(None);
        }
        (Some(SpecMethodArg::Off), Some(_)) => {
            return Err("--draft-model conflicts with --speculative off".into());
        }
        (Some(SpecMethodArg::Ngram), Some(_)) => {
            return Err("--draft-model needs --speculative draft (or no --speculative)".into());
        }
        (Some(SpecMethodArg::Ngram), None) => SpeculativeConfig::ngram(),
        (Some(SpecMethodArg::Draft) | None, Some(_)) => SpeculativeConfig::draft(),
        (Some(SpecMethodArg::Draft), None) => {
            return Err("--speculative draft needs --draft-model PATH".into());
        }
    };
    if let Some(k) = args.num_speculative_tokens {
        cfg.num_tokens = k;
    }
    if let Some(n) = args.speculative_disable_batch_size {
        cfg.disable_batch_size = n;
    }
    let (min, max) = (args.prompt_lookup_min, args.prompt_lookup_max);
    match &mut cfg.method {
        SpecMethod::Ngram { min_n, max_n } => {
            *min_n = min.unwrap_or(*min_n);
            *max_n = max.unwrap_or(*max_n.max(min_n));
        }
        SpecMethod::Draft => {
            if min.is_some() || max.is_some() {
                return Err("--prompt-lookup-min/max apply to --speculative ngram only".into());
            }
        }
    }
    cfg.validate().map_err(|(field, reason)| {
        let flag = match field {
            "num_speculative_tokens" => "--num-speculative-tokens",
            _ => "--prompt-lookup-min/max",
        };
        format!("{flag}: {reason}")
    })?;
    Ok(Some(cfg))
}

/// Speculative decoding as the flags ask for it, into the engine options: the method and,
/// for a draft model, its path (the builder loads it beside the target).
pub fn apply(args: &SpeculativeArgs, opts: &mut EngineOptions) -> Result<(), String> {
    opts.speculative = config(args)?;
    opts.draft_model = args.draft_model.as_ref().map(PathBuf::from);
    Ok(())
}
