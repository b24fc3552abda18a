//! `kiln perplexity`: how well a model predicts a text, as `transformers`' perplexity guide
//! measures it (see `kiln_model::perplexity`): the quality guard for quantized weights, KV
//! dtypes and kernel changes.

use std::io::Write;
use std::time::Instant;

use kiln_engine::error_chain;
use kiln_kv::KvDtype;
use kiln_model::perplexity::{self, Perplexity, PerplexityConfig};
use kiln_model::{KV_CALIBRATION_TEXT, KvPoolConfig, ModelRunner};
use kiln_tokenizer::EncodeOptions;

use crate::args::{DeviceArgs, LoadArgs, ModelArgs};

/// Tokens per KV block of the scoring pool.
const BLOCK_SIZE: u32 = 16;

/// `kiln perplexity`.
#[derive(Debug, Clone, clap::Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    /// The text to score (UTF-8), tokenized without special tokens
    #[arg(long, value_name = "PATH")]
    pub file: String,
    /// Tokens per window
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub context: usize,
    /// Tokens between window starts [default: --context, non-overlapping windows]
    #[arg(long, value_name = "N")]
    pub stride: Option<usize>,
    /// Score only the first N windows [default: all]
    #[arg(long, value_name = "N")]
    pub chunks: Option<usize>,
    /// K/V cache element type the windows run through
    #[arg(long, value_name = "f16|f32|int8|int4", default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Print one JSON object per window, then the totals as the last line
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn run(args: &PerplexityArgs) -> Result<(), String> {
    let path = args.model.model.as_str();
    let cfg = PerplexityConfig {
        stride: args.stride.unwrap_or(args.context),
        ..PerplexityConfig::new(args.context)
    };
    // Flags first: a bad combination fails before any file is read.
    perplexity::windows(0, &cfg).map_err(|e| match e {
        kiln_model::ModelError::Perplexity { field, reason } => format!("--{field}: {reason}"),
        other => error_chain(&other),
    })?;
    if args.chunks == Some(0) {
        return Err("--chunks: must be at least 1".into());
    }
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| format!("--file {}: cannot read the text: {e}", args.file))?;
    let checkpoint = crate::open(path, crate::load_options(&args.load))?;
    let max_position = checkpoint.config().max_position();
    if args.context > max_position {
        return Err(format!(
            "--context {}: the model's context is {max_position} tokens",
            args.context
        ));
    }
    let ids = checkpoint
        .tokenizer()
        .encode_with(
            &text,
            EncodeOptions {
                add_special_tokens: false,
                offsets: false,
            },
        )
        .map_err(|e| format!("--file {}: {}", args.file, error_chain(&e)))?
        .ids;
    let mut windows = perplexity::windows(ids.len(), &cfg).map_err(|e| error_chain(&e))?;
    if let Some(n) = args.chunks {
        windows.truncate(n);
    }
    if windows.is_empty() {
        return Err(format!(
            "--file {}: {} tokens leave nothing to score (a window needs 2)",
            args.file,
            ids.len()
        ));
    }
    let calibration = match args.kv_dtype {
        KvDtype::Int4 => checkpoint
            .tokenizer()
            .encode(KV_CALIBRATION_TEXT)
            .map_err(|e| format!("{path}: the KV calibration text: {}", error_chain(&e)))?,
        _ => Vec::new(),
    };
    let dev = crate::device(&args.device)?;
    let (model, _) = checkpoint
        .load(&dev, args.device.cpu_experts()?.as_ref(), &mut |_, _| {})
        .map_err(|e| crate::build_error(&e, path, None))?;
    let weight_bytes = model.weight_bytes();
    let pool = KvPoolConfig {
        block_size: BLOCK_SIZE,
        num_blocks: args.context.div_ceil(BLOCK_SIZE as usize) as u32,
        dtype: args.kv_dtype,
    };
    let mut runner = ModelRunner::calibrated(model, pool, &calibration)
        .map_err(|e| format!("{path}: {}", error_chain(&e)))?;
    if !args.json {
        eprintln!(
            "kiln: {} tokens, {} windows of {} (stride {}), {} KV, {:.1} MiB of weights on {}",
            ids.len(),
            windows.len(),
            cfg.context,
            cfg.stride,
            args.kv_dtype,
            weight_bytes as f64 / f64::from(1 << 20),
            dev.info().name
        );
    }
    let start = Instant::now();
    let mut scores = Vec::with_capacity(windows.len());
    let mut stdout = std::io::stdout();
    for (i, &w) in windows.iter().enumerate() {
        let s = perplexity::score_window(&mut runner, &ids, w, cfg.chunk).map_err(|e| {
            format!(
                "{path}: window {} ({}..{}): {}",
                i + 1,
                w.0,
                w.1,
                error_chain(&e)
            )
        })?;
        scores.push(s);
        let running = Perplexity::of(&scores);
        if args.json {
            let v = serde_json::json!({
                "window": i,
                "begin": s.begin,
                "end": s.end,
                "scored_tokens": s.scored,
                "nll_sum": s.nll_sum,
                "mean_nll": s.mean_nll(),
                "ppl": s.mean_nll().exp(),
            });
            println!("{v}");
        } else {
            println!(
                "[{}/{}] tokens {}..{}: mean NLL {:.4}, PPL {:.4} (running PPL {:.4})",
                i + 1,
                windows.len(),
                s.begin,
                s.end,
                s.mean_nll(),
                s.mean_nll().exp(),
                running.ppl()
            );
        }
        let _ = stdout.flush();
    }
    let total = Perplexity::of(&scores);
    let secs = start.elapsed().as_secs_f64();
    let tokens: usize = scores.iter().map(|s| s.end - s.begin).sum();
    if args.json {
        let v = serde_json::json!({
            "ppl": total.ppl(),
            "mean_nll": total.mean_nll(),
            "scored_tokens": total.scored_tokens,
            "windows": scores.len(),
            "context": cfg.context,
            "stride": cfg.stride,
            "kv_dtype": args.kv_dtype.name(),
            "text_tokens": ids.len(),
            "backend": dev.info().backend,
            "tokens_per_s": tokens as f64 / secs,
        });
        println!("{v}");
    } else {
        println!(
            "PPL {:.4}, mean NLL {:.6} over {} scored tokens ({} windows, {:.0} tokens/s)",
            total.ppl(),
            total.mean_nll(),
            total.scored_tokens,
            scores.len(),
            tokens as f64 / secs
        );
    }
    Ok(())
}
