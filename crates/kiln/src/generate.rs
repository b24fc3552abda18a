//! `kiln generate`: one prompt through the engine, streamed to stdout.

use std::io::{IsTerminal, Write};

use kiln_engine::{
    EngineError, EngineOptions, Event, Field, KvSize, Request, SamplingParams, error_chain,
};
use kiln_tokenizer::{ChatMessage, ChatOptions};

use crate::args::{DeviceArgs, LoadArgs, ModelArgs, SpeculativeArgs};

/// Prompt tokens per forward step: bounds activation memory for long prompts.
const PREFILL_CHUNK: usize = 512;
/// Files above this size get a loading progress bar.
const PROGRESS_BYTES: u64 = 256 << 20;

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `kiln generate`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    /// The prompt (with --chat: the user's message)
    #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
    pub prompt: String,
    /// Most tokens to generate
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub max_tokens: usize,
    /// Stop generating at this text
    #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
    pub stop: Option<String>,
    /// Sampling seed
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Apply the model's chat template to the prompt
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object (text, token ids, timings) instead of streaming the text
    #[arg(long)]
    pub json: bool,
    // The groups with a heading of their own come last: a heading holds for the flags after it.
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

/// The sampling flags (`--temperature` 0 is greedy, the default).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// 0 is greedy
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the K most likely tokens (0: all)
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this probability mass
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens below P times the most likely one's probability
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalize tokens already in the prompt or output (1: off)
    #[arg(long, value_name = "R", default_value_t = 1.0)]
    pub repetition_penalty: f32,
}

fn sampling(args: &SamplingArgs) -> SamplingParams {
    SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        ..SamplingParams::default()
    }
}

/// Engine errors in the words of the flags that caused them.
fn flag_error(e: EngineError) -> String {
    match e {
        EngineError::InvalidArgument {
            field,
            reason,
            source,
        } => {
            let flag = match field {
                Field::Temperature => "--temperature",
                Field::TopP => "--top-p",
                Field::MinP => "--min-p",
                Field::RepetitionPenalty => "--repetition-penalty",
                Field::MaxNewTokens => "--max-tokens",
                Field::Stop => "--stop",
                Field::Prompt | Field::PromptTokenIds => "--prompt",
                other => other.path(),
            };
            match source {
                Some(cause) => format!("{flag}: {reason}: {}", error_chain(cause.as_ref())),
                None => format!("{flag}: {reason}"),
            }
        }
        other => error_chain(&other),
    }
}

pub fn run(args: &GenerateArgs) -> Result<(), String> {
    let path = args.model.model.as_str();
    // Flags first: a bad combination fails before any file is read.
    crate::speculative::config(&args.speculative)?;
    let prompt = args.prompt.as_str();
    let max_tokens = args.max_tokens;
    let params = sampling(&args.sampling);
    let seed = args.seed;
    let json = args.json;

    let checkpoint = crate::open(path, crate::load_options(&args.load))?;
    let dev = crate::device(&args.device)?;
    let tokenizer = checkpoint.tokenizer();
    let text = if args.chat {
        tokenizer
            .apply_chat_template(
                &[ChatMessage::new("user", prompt)],
                &ChatOptions {
                    add_generation_prompt: true,
                },
            )
            .map_err(|e| format!("{path}: chat template: {}", error_chain(&e)))?
    } else {
        prompt.to_string()
    };
    let prompt_ids = tokenizer.encode(&text).map_err(|e| error_chain(&e))?;
    // A pool for this one sequence: prompt plus generated tokens (capped by the context), one
    // sequence a step, long prompts in chunks (bounding activation memory).
    let mut opts = EngineOptions {
        kv_size: KvSize::Tokens(prompt_ids.len().saturating_add(max_tokens)),
        watermark: Some(0.0),
        max_num_seqs: Some(1),
        max_num_batched_tokens: Some(PREFILL_CHUNK),
        cpu_experts: args.device.cpu_experts()?,
        ..EngineOptions::new(dev.clone())
    };
    crate::speculative::apply(&args.speculative, &mut opts)?;
    // A progress bar for files that take a while, when a person is watching.
    let show_progress =
        !json && std::io::stderr().is_terminal() && checkpoint.stored_bytes() > PROGRESS_BYTES;
    let mut progress = |done: usize, total: usize| {
        if show_progress {
            let width = 40;
            let filled = done * width / total.max(1);
            eprint!(
                "\rloading weights [{}{}] {done}/{total} layers",
                "#".repeat(filled),
                " ".repeat(width - filled)
            );
            if done == total {
                eprintln!();
            }
        }
    };
    let built = kiln_engine::build(checkpoint, &opts, &mut progress)
        .map_err(|e| crate::build_error(&e, path, args.speculative.draft_model.as_deref()))?;
    let load_ms = ms(built.load_time);
    let weight_bytes = built.weight_bytes;
    let engine = built.engine;
    if !json {
        eprintln!(
            "kiln: {:.1} MiB of weights on {} in {load_ms:.0} ms",
            weight_bytes as f64 / f64::from(1 << 20),
            dev.info().name
        );
    }
    let mut request = Request::tokens(prompt_ids.clone()).sampling(params, seed);
    request.stopping.max_new_tokens = Some(max_tokens);
    if let Some(stop) = &args.stop {
        request.stopping.stop = vec![stop.clone()];
    }
    let mut stream = engine.submit(request).map_err(flag_error)?;

    let mut out_ids = Vec::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout();
    let summary = loop {
        match stream.blocking_recv() {
            Some(Event::Delta(d)) => {
                if !json {
                    print!("{}", d.text);
                    let _ = stdout.flush();
                }
                text.push_str(&d.text);
                out_ids.extend(d.token_ids);
            }
            // `kiln generate` never asks for them.
            Some(Event::PromptLogprobs(_)) => {}
            Some(Event::Finished(s)) => break s,
            Some(Event::Error(e)) => return Err(flag_error(e)),
            None => return Err("the engine stopped without finishing".into()),
        }
    };
    engine.shutdown_blocking(kiln_engine::ShutdownMode::Drain);
    let finish = summary.finish.first().map_or("length", |f| f.name());
    let t = summary.timing;
    let gaps = out_ids.len().saturating_sub(1);
    let decode_s = t.decode.as_secs_f64();
    if json {
        let v = serde_json::json!({
            "text": text,
            "token_ids": out_ids,
            "prompt_token_ids": prompt_ids,
            "finish_reason": finish,
            "ttft_ms": ms(t.time_to_first_token),
            "itl_ms": if gaps > 0 { decode_s * 1e3 / gaps as f64 } else { 0.0 },
            "prefill_tokens_per_s": prompt_ids.len() as f64 / t.time_to_first_token.as_secs_f64(),
            "decode_tokens_per_s": if decode_s > 0.0 { gaps as f64 / decode_s } else { 0.0 },
            "backend": dev.info().backend,
            "weight_bytes": weight_bytes,
            "load_ms": load_ms,
            "cached_prompt_tokens": summary.usage.cached_prompt_tokens,
            "spec_proposed_tokens": t.speculative.proposed_tokens,
            "spec_accepted_tokens": t.speculative.accepted_tokens,
            "spec_acceptance_rate": t.speculative.acceptance_rate(),
            "spec_mean_accepted_length": t.speculative.mean_accepted_length(),
            // Loading and generating: null where the system does not say.
            "peak_rss_bytes": crate::memory::peak_rss_bytes(),
        });
        println!("{v}");
    } else {
        println!();
    }
    Ok(())
}
