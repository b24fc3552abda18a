//! The speculative-decoding flags shared by `serve` and `generate`:
//! `--speculative ngram|draft`, `--draft-model PATH` (implies `draft`),
//! `--num-speculative-tokens K`, `--prompt-lookup-min N`, `--prompt-lookup-max N` and
//! `--speculative-disable-batch-size N`.

use kiln_engine::{DraftModel, SpecMethod, SpeculativeConfig};
use kiln_model::Model;
use kiln_tensor::Device;

use crate::cli::Args;

pub const FLAGS: &[&str] = &[
    "speculative",
    "draft-model",
    "num-speculative-tokens",
    "prompt-lookup-min",
    "prompt-lookup-max",
    "speculative-disable-batch-size",
];

/// The speculative config the flags ask for (`None`: off).
pub fn config(args: &Args) -> Result<Option<SpeculativeConfig>, String> {
    let method = match (args.get("speculative"), args.get("draft-model")) {
        (None | Some("off"), None) => {
            for f in &FLAGS[2..] {
                if args.get(f).is_some() {
                    return Err(format!(
                        "--{f} needs speculative decoding: add --speculative ngram or --draft-model PATH"
                    ));
                }
            }
            return Ok(None);
        }
        (Some("off"), Some(_)) => {
            return Err("--draft-model conflicts with --speculative off".into());
        }
        (Some("ngram"), Some(_)) => {
            return Err("--draft-model needs --speculative draft (or no --speculative)".into());
        }
        (Some("ngram"), None) => "ngram",
        (Some("draft") | None, Some(_)) => "draft",
        (Some("draft"), None) => return Err("--speculative draft needs --draft-model PATH".into()),
        (Some(other), _) => {
            return Err(format!(
                "--speculative {other}: expected ngram, draft or off"
            ));
        }
    };
    let mut cfg = if method == "ngram" {
        SpeculativeConfig::ngram()
    } else {
        SpeculativeConfig::draft()
    };
    if let Some(k) = args.parsed::<usize>("num-speculative-tokens")? {
        cfg.num_tokens = k;
    }
    if let Some(n) = args.parsed::<usize>("speculative-disable-batch-size")? {
        cfg.disable_batch_size = n;
    }
    let (min, max) = (
        args.parsed::<usize>("prompt-lookup-min")?,
        args.parsed::<usize>("prompt-lookup-max")?,
    );
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

/// Loads `--draft-model` onto `dev` (the target's device), if given.
pub fn draft(args: &Args, dev: &Device) -> Result<Option<DraftModel>, String> {
    let Some(path) = args.get("draft-model") else {
        return Ok(None);
    };
    let l = crate::load(path, kiln_model::LoadOptions::default())
        .map_err(|e| format!("--draft-model: {e}"))?;
    let model = Model::load(dev, l.cfg.clone(), l.files.weights())
        .map_err(|e| format!("--draft-model {path}: {e}"))?;
    Ok(Some(DraftModel {
        model,
        tokenizer: l.tokenizer,
    }))
}

/// `Engine::start_with_draft`'s error, naming the draft's file when it is about the draft.
pub fn start_error(args: &Args, target: &str, e: &kiln_engine::StartError) -> String {
    match (e, args.get("draft-model")) {
        (kiln_engine::StartError::Config { field, reason }, Some(path))
            if *field == "draft_model" =>
        {
            format!("--draft-model {path}: {reason}")
        }
        _ => format!("{target}: {e}"),
    }
}
