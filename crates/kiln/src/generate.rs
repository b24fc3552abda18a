//! `kiln generate`: one prompt through the model with a paged KV cache, streamed to stdout.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use kiln_kv::device::{KvCache, KvCacheConfig};
use kiln_kv::{BlockManager, BlockManagerConfig, KvDtype, SeqConfig, SeqId};
use kiln_model::{LogitsAt, Model, SeqInput};
use kiln_tensor::Recorder;
use kiln_tokenizer::{ChatMessage, ChatOptions, DecodeOptions};

use crate::cli::Args;
use crate::sample::{Sampler, SamplingParams};

/// Prompt tokens per forward step: bounds activation memory for long prompts.
const PREFILL_CHUNK: usize = 512;
const BLOCK: usize = 16;
/// Files above this size get a loading progress bar.
const PROGRESS_BYTES: u64 = 256 << 20;

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn run(args: &Args) -> Result<(), String> {
    let path = args.required("model")?;
    let prompt = args.required("prompt")?;
    let max_tokens = args.parsed::<usize>("max-tokens")?.unwrap_or(128);
    let params = SamplingParams {
        temperature: args.parsed::<f32>("temperature")?.unwrap_or(0.0),
        top_k: args.parsed::<usize>("top-k")?.unwrap_or(0),
        top_p: args.parsed::<f32>("top-p")?.unwrap_or(1.0),
    };
    params.validate()?;
    let seed = args.parsed::<u64>("seed")?.unwrap_or(0);
    let json = args.switch("json");

    let crate::Loaded {
        files,
        cfg,
        tokenizer,
    } = crate::load(path, crate::load_options(args)?)?;
    let dev = crate::device(args)?;
    let text = if args.switch("chat") {
        tokenizer
            .apply_chat_template(
                &[ChatMessage::new("user", prompt)],
                &ChatOptions {
                    add_generation_prompt: true,
                },
            )
            .map_err(|e| format!("{path}: chat template: {e}"))?
    } else {
        prompt.to_string()
    };
    let prompt_ids = tokenizer.encode(&text).map_err(|e| e.to_string())?;
    if prompt_ids.is_empty() {
        return Err("--prompt encodes to no tokens".into());
    }
    if prompt_ids.len() >= cfg.max_position {
        return Err(format!(
            "--prompt is {} tokens; the model's context is {}",
            prompt_ids.len(),
            cfg.max_position
        ));
    }
    let context = (prompt_ids.len() + max_tokens).min(cfg.max_position);
    let load_start = Instant::now();
    // A progress bar for files that take a while, when a person is watching.
    let show_progress =
        !json && std::io::stderr().is_terminal() && files.stored_bytes() > PROGRESS_BYTES;
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
    let model = Model::load_with_progress(&dev, cfg.clone(), files.weights(), &mut progress)
        .map_err(|e| e.to_string())?;
    let load_ms = ms(load_start.elapsed());
    // The weights live on the device now (or in the model's own host tensors on the CPU
    // backend): release the file bytes.
    drop(files);
    if !json {
        eprintln!(
            "kiln: {:.1} MiB of weights on {} in {load_ms:.0} ms",
            model.weight_bytes() as f64 / f64::from(1 << 20),
            dev.info().name
        );
    }

    let blocks = context.div_ceil(BLOCK) + 1;
    let mut kv = BlockManager::new(BlockManagerConfig {
        block_size: BLOCK as u32,
        ..BlockManagerConfig::new(blocks as u32)
    })
    .map_err(|e| e.to_string())?;
    let kvc = KvCacheConfig {
        layers: cfg.layers,
        kv_heads: cfg.kv_heads,
        head_dim: cfg.head_dim,
        block_size: BLOCK,
        num_blocks: blocks,
        dtype: KvDtype::F16,
    };
    let mut cache = KvCache::new(&dev, kvc).map_err(|e| e.to_string())?;
    let seq = SeqId(0);
    kv.allocate(
        seq,
        &prompt_ids,
        SeqConfig {
            sliding_window: cfg.sliding_window,
        },
    )
    .map_err(|e| e.to_string())?;

    let mut sampler = Sampler::new(params, seed);
    let mut detok = tokenizer.detokenizer(DecodeOptions {
        skip_special_tokens: true,
    });
    let stop_ids = tokenizer.special_tokens().stop_ids.clone();
    let step = |model: &Model,
                cache: &mut KvCache,
                kv: &BlockManager,
                tokens: &[u32],
                context_len: usize,
                sampler: &mut Sampler|
     -> Result<u32, String> {
        let table: Vec<u32> = kv
            .block_table(seq)
            .map_err(|e| e.to_string())?
            .iter()
            .map(|b| b.0)
            .collect();
        let mut rec = Recorder::new(&dev);
        let logits = model
            .forward(
                &mut rec,
                cache,
                &[SeqInput {
                    tokens,
                    block_table: &table,
                    context_len,
                }],
                LogitsAt::Last,
            )
            .map_err(|e| e.to_string())?;
        if params.is_greedy() {
            // Only the token id comes back to the CPU.
            let best = rec.argmax(&logits).map_err(|e| e.to_string())?;
            rec.submit().map_err(|e| e.to_string())?;
            Ok(best.to_u32_vec().map_err(|e| e.to_string())?[0])
        } else {
            rec.submit().map_err(|e| e.to_string())?;
            Ok(sampler.sample(&logits.to_f32_vec().map_err(|e| e.to_string())?))
        }
    };

    let start = Instant::now();
    let mut next = 0;
    let mut done = 0;
    while done < prompt_ids.len() {
        let end = (done + PREFILL_CHUNK).min(prompt_ids.len());
        next = step(
            &model,
            &mut cache,
            &kv,
            &prompt_ids[done..end],
            end,
            &mut sampler,
        )?;
        done = end;
    }
    kv.commit(seq, &prompt_ids).map_err(|e| e.to_string())?;
    let ttft = start.elapsed();
    let mut out_ids = Vec::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout();
    let mut finish = "length";
    let mut last_tick = Instant::now();
    let mut itls = Vec::new();
    loop {
        if stop_ids.contains(&next) {
            finish = "eos_token";
            break;
        }
        out_ids.push(next);
        let delta = detok.push(next).map_err(|e| e.to_string())?;
        if !json {
            print!("{delta}");
            let _ = stdout.flush();
        }
        text.push_str(&delta);
        if out_ids.len() >= max_tokens {
            break;
        }
        let len = prompt_ids.len() + out_ids.len();
        if len >= context {
            finish = if len >= cfg.max_position {
                "context_length"
            } else {
                "length"
            };
            break;
        }
        kv.append_slots(seq, 1).map_err(|e| e.to_string())?;
        next = step(&model, &mut cache, &kv, &[next], len, &mut sampler)?;
        kv.commit(seq, &out_ids[out_ids.len() - 1..])
            .map_err(|e| e.to_string())?;
        itls.push(ms(last_tick.elapsed()));
        last_tick = Instant::now();
    }
    let tail = detok.finish().map_err(|e| e.to_string())?;
    text.push_str(&tail);
    kv.free(seq).map_err(|e| e.to_string())?;
    let decode_s: f64 = itls.iter().sum::<f64>() / 1e3;
    if json {
        let itl = if itls.is_empty() {
            0.0
        } else {
            itls.iter().sum::<f64>() / itls.len() as f64
        };
        let v = serde_json::json!({
            "text": text,
            "token_ids": out_ids,
            "prompt_token_ids": prompt_ids,
            "finish_reason": finish,
            "ttft_ms": ms(ttft),
            "itl_ms": itl,
            "prefill_tokens_per_s": prompt_ids.len() as f64 / ttft.as_secs_f64(),
            "decode_tokens_per_s": if decode_s > 0.0 { itls.len() as f64 / decode_s } else { 0.0 },
            "backend": dev.info().backend,
            "weight_bytes": model.weight_bytes(),
            "load_ms": load_ms,
        });
        println!("{v}");
    } else {
        println!("{tail}");
    }
    Ok(())
}
