//! `kiln-bench` (run it as `cargo xtask bench`): what LLM operators measure a serving engine
//! by, on the in-process engine or a running `kiln serve` (`--grpc`):
//!
//! - single stream: TTFT and prefill tokens/s of one prompt, ITL p50/p99 and decode tokens/s
//!   of its continuation;
//! - concurrency sweep: aggregate output tokens/s, TTFT and ITL percentiles per level;
//! - shared prefix: prefix-cache hit rate and TTFT with and without the cache;
//! - roofline: measured copy bandwidth and matmul FLOP/s, and the share of each that decode
//!   and prefill reach;
//! - `--compare llama-cpp`: the single stream through llama-cpp-python, with ratios;
//! - `--speculative ngram|draft`: decode tokens/s with and without speculative decoding on an
//!   extractive and a free-generation chat prompt, acceptance rates, and whether the greedy
//!   output stayed the same.
//!
//! Prompts are synthetic token ids (distinct per request), decoding is greedy with EOS
//! ignored (the speculative scenario's chat prompts stop at EOS), and times are taken where
//! the tokens arrive (the client side). Percentiles are nearest-rank. Every figure goes to
//! `<out>/kiln-bench-<unix-seconds>.json` and `<out>/latest.json`.

mod args;
mod cli;
mod deepseek_v4;
mod gpu_check;
mod kernel_checks;
mod llama_cpp;
mod llama_server;
mod moe;
mod paired;
mod profile;
mod report;
mod roofline;
mod scenarios;
mod serve;
mod speculative;
mod stats;
mod structured;
mod synthetic_gguf;
mod table;
mod target;
mod v4_checks;

use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use kiln_engine::SpecMethod;
use kiln_model::ModelConfig;
use kiln_tensor::{Device, DeviceOptions};

use crate::args::{Args, Compare, SpecChoice};
use crate::llama_server::BenchTests;
use crate::report::{DeviceFacts, EngineFacts, Report, Workload};
use crate::scenarios::{Prefix, PrefixWorkload, ratio};
use crate::stats::Prompts;
use crate::target::{EngineSizing, Target};

/// Tokens per KV block (the engine's default).
const BLOCK: usize = 16;
/// The warm-up prompt: long enough for the prefill kernels.
const WARM_PROMPT: usize = 64;
/// Widest warm-up batch: wide enough for the batched decode kernels.
const WARM_BATCH: usize = 16;
/// Room for a chat template's own tokens (headers, a default system prompt).
const CHAT_TEMPLATE_TOKENS: usize = 64;
/// Decode batch sizes the profile measures.
const PROFILE_BATCHES: [usize; 3] = [1, 16, 64];

fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "gpu-check") {
        return gpu_check::main(argv[1..].to_vec());
    }
    if argv.get(1).is_some_and(|a| a == "moe") {
        return moe::main(argv[1..].to_vec());
    }
    if argv.get(1).is_some_and(|a| a == "deepseek-v4") {
        return deepseek_v4::main(argv[1..].to_vec());
    }
    if argv.get(1).is_some_and(|a| a == "write-gguf") {
        return synthetic_gguf::main(argv[1..].to_vec());
    }
    let args = match cli::parse(argv) {
        Ok(a) => a,
        // `--help` (stdout, 0) or a usage error (stderr, 2).
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .and_then(|rt| rt.block_on(bench(args)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The whole chain, each cause once.
            eprintln!("kiln-bench: {}", kiln_engine::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// The in-process engine's model facts the roofline needs.
struct InProcess {
    device: Device,
    config: ModelConfig,
    weight_bytes: u64,
    kv_bytes_per_token: u64,
    sizing: EngineSizing,
}

/// Blocks one sequence of `tokens` tokens holds (one spare for the token being appended).
fn blocks(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK) + 1
}

/// A pool that holds every scenario's sequences at once, over the 1% watermark;
/// `spec_tokens` is the speculative scenario's sequence (prompt, new tokens and a draft).
fn kv_blocks_needed(a: &Args, max_level: usize, warm_batch: usize, spec_tokens: usize) -> u32 {
    let s = &a.scenarios;
    let need = [
        blocks(WARM_PROMPT + 4) + warm_batch * blocks(16 + 3),
        if s.single {
            blocks(a.prompt_tokens + a.new_tokens)
        } else {
            0
        },
        if s.sweep {
            max_level * blocks(a.sweep_prompt_tokens + a.sweep_new_tokens)
        } else {
            0
        },
        if s.prefix {
            3 * blocks(a.prefix_tokens + a.prefix_question_tokens + a.prefix_new_tokens)
        } else {
            0
        },
        if s.speculative {
            blocks(spec_tokens)
        } else {
            0
        },
        if s.serve {
            // The paired pass runs `serve_concurrency` streams through gRPC and as many through
            // one HTTP door; a text door's prompt is the ids decoded, re-encoded and rendered
            // through the chat template, so give it room to grow.
            a.serve_concurrency
                * (blocks(a.serve_prompt_tokens + a.serve_output_tokens)
                    + blocks(
                        2 * a.serve_prompt_tokens + CHAT_TEMPLATE_TOKENS + a.serve_output_tokens,
                    ))
        } else {
            0
        },
        if s.structured {
            structured::STREAMS * blocks(structured::LONGEST)
        } else {
            0
        },
        if s.profile {
            blocks(a.prompt_tokens + 2)
                + PROFILE_BATCHES.iter().max().copied().unwrap_or(1)
                    * blocks(profile::BATCH_PROMPT + profile::BATCH_STEPS + 3)
        } else {
            0
        },
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    u32::try_from((need as f64 / 0.99).ceil() as usize + 8).unwrap_or(u32::MAX)
}

async fn bench(a: Args) -> anyhow::Result<()> {
    let unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let max_level = if a.scenarios.sweep {
        a.levels.iter().copied().max().unwrap_or(1)
    } else {
        1
    }
    .max(if a.scenarios.structured {
        structured::STREAMS
    } else {
        1
    });
    let warm_batch = max_level.min(WARM_BATCH);
    let longest = [
        a.prompt_tokens + a.new_tokens,
        a.sweep_prompt_tokens + a.sweep_new_tokens,
        a.prefix_tokens + a.prefix_question_tokens + a.prefix_new_tokens,
        WARM_PROMPT + 4,
        if a.scenarios.structured {
            structured::LONGEST
        } else {
            0
        },
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let new_max = a
        .new_tokens
        .max(a.sweep_new_tokens)
        .max(a.prefix_new_tokens)
        .max(if a.scenarios.speculative {
            a.spec_new_tokens
        } else {
            0
        });
    let mut notes = Vec::new();

    let (target, vocab, device, engine, inproc, is_gguf) = match &a.grpc {
        Some(addr) => {
            if a.backend_given {
                notes.push("--backend ignored: the server chose its device".to_owned());
            }
            let (client, info) = target::connect(addr).await?;
            let limits = info.limits.unwrap_or_default();
            let kv = info.kv_cache.unwrap_or_default();
            if longest > info.context_length as usize {
                bail!(
                    "--grpc {addr}: a scenario needs {longest} tokens of context, the server allows {}",
                    info.context_length
                );
            }
            if limits.max_new_tokens != 0 && new_max > limits.max_new_tokens as usize {
                bail!(
                    "--grpc {addr}: a scenario asks for {new_max} new tokens, the server allows {} \
                     (kiln serve --max-new-tokens)",
                    limits.max_new_tokens
                );
            }
            if max_level > limits.max_num_seqs as usize {
                notes.push(format!(
                    "the server runs at most {} sequences at once: higher levels queue",
                    limits.max_num_seqs
                ));
            }
            let device = DeviceFacts {
                name: info.device.clone(),
                backend: "remote".into(),
                device_type: "remote".into(),
                driver: String::new(),
                threads: 0,
                cpu_isa: String::new(),
            };
            let engine = EngineFacts {
                kv_blocks: kv.total_blocks as usize,
                block_size: kv.block_size as usize,
                kv_dtype: kv.dtype.clone(),
                kv_bytes_per_token: kv.bytes_per_token,
                max_num_seqs: limits.max_num_seqs as usize,
                max_num_batched_tokens: limits.max_num_batched_tokens as usize,
            };
            let is_gguf = a
                .model
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
            (
                Target::Grpc(client),
                info.vocab_size as usize,
                device,
                Some(engine),
                None,
                is_gguf,
            )
        }
        None => {
            let dev = Device::new(&DeviceOptions {
                backend: a.backend,
                threads: Some(a.threads),
                kernels: a.kernels,
                ..DeviceOptions::default()
            })
            .context("opening the device")?;
            let info = dev.info();
            eprintln!("kiln-bench: loading {} on {}", a.model.display(), info.name);
            let checkpoint = target::open(&a.model)?;
            // The speculative scenario's sequence: its chat prompt, its new tokens, a draft.
            let spec_tokens = if a.scenarios.speculative {
                speculative::longest_prompt(checkpoint.tokenizer())?
                    + a.spec_new_tokens
                    + a.num_speculative_tokens
            } else {
                0
            };
            let longest = longest.max(spec_tokens);
            let max_position = checkpoint.config().max_position();
            if longest > max_position {
                bail!(
                    "{}: a scenario needs {longest} tokens of context, the model has {max_position}",
                    a.model.display()
                );
            }
            let sizing = EngineSizing {
                kv_blocks: a
                    .kv_blocks
                    .unwrap_or_else(|| kv_blocks_needed(&a, max_level, warm_batch, spec_tokens)),
                max_num_seqs: a.max_num_seqs.unwrap_or(max_level.max(64).max(
                    if a.scenarios.serve {
                        2 * a.serve_concurrency
                    } else {
                        1
                    },
                )),
                max_num_batched_tokens: a.max_batched_tokens,
                max_waiting: max_level.max(256),
                prefix_caching: true,
                speculative: a.spec_config(),
            };
            let is_gguf = target::is_gguf(&checkpoint);
            let built = target::start_engine(checkpoint, &dev, &sizing, draft_path(&a))?;
            let Some(config) = built.config.dense().cloned() else {
                bail!(
                    "{}: kiln-bench measures the dense graph; this is {}",
                    a.model.display(),
                    built.config.arch_name()
                );
            };
            let (engine, weight_bytes) = (built.engine, built.weight_bytes);
            let ei = engine.info().clone();
            let device = DeviceFacts {
                name: info.name.clone(),
                backend: info.backend.clone(),
                device_type: info.device_type.clone(),
                driver: info.driver.clone(),
                threads: info.threads,
                cpu_isa: info.cpu_isa.clone(),
            };
            let facts = EngineFacts {
                kv_blocks: ei.kv_blocks,
                block_size: ei.block_size,
                kv_dtype: ei.kv_dtype.to_owned(),
                kv_bytes_per_token: ei.kv_bytes_per_token,
                max_num_seqs: ei.max_num_seqs,
                max_num_batched_tokens: ei.max_num_batched_tokens,
            };
            let inproc = InProcess {
                device: dev,
                config,
                weight_bytes,
                kv_bytes_per_token: ei.kv_bytes_per_token,
                sizing,
            };
            (
                Target::Engine(engine),
                ei.vocab_size,
                device,
                Some(facts),
                Some(inproc),
                is_gguf,
            )
        }
    };

    let mut r = Report {
        tool: "kiln-bench",
        unix_time: unix,
        date_utc: report::utc(unix),
        model: a.model.display().to_string(),
        mode: if a.grpc.is_some() {
            "grpc"
        } else {
            "in-process"
        },
        grpc: a.grpc.clone(),
        device,
        engine,
        threads: a.threads,
        host_parallelism: std::thread::available_parallelism().map_or(1, usize::from),
        lp_num_threads: std::env::var("LP_NUM_THREADS").ok(),
        workload: Workload {
            scenarios: a.scenarios.names(),
            levels: a.levels.clone(),
            prompt_tokens: a.prompt_tokens,
            new_tokens: a.new_tokens,
            sweep_prompt_tokens: a.sweep_prompt_tokens,
            sweep_new_tokens: a.sweep_new_tokens,
            prefix_tokens: a.prefix_tokens,
            prefix_question_tokens: a.prefix_question_tokens,
            prefix_new_tokens: a.prefix_new_tokens,
            prefix_requests: a.prefix_requests,
            spec_new_tokens: a.spec_new_tokens,
        },
        single: None,
        sweep: None,
        prefix: None,
        roofline: None,
        profile: None,
        budget: None,
        speculative: None,
        llama_cpp: None,
        table: Vec::new(),
        serve: Vec::new(),
        serve_paired: None,
        serve_paired_doors: Vec::new(),
        structured: None,
        notes: Vec::new(),
    };
    report::print_header(&r);
    for n in notes {
        r.note(n);
    }

    let result = run_scenarios(
        &a,
        &target,
        inproc.as_ref(),
        vocab,
        warm_batch,
        is_gguf,
        &mut r,
    )
    .await;
    target.shutdown().await;
    result?;
    let path = r.write(&a.out)?;
    println!("wrote {} (and latest.json beside it)", path.display());
    Ok(())
}

async fn run_scenarios(
    a: &Args,
    target: &Target,
    inproc: Option<&InProcess>,
    vocab: usize,
    warm_batch: usize,
    is_gguf: bool,
    r: &mut Report,
) -> anyhow::Result<()> {
    let mut prompts = Prompts::new(vocab);
    eprintln!("kiln-bench: warming up (pipelines compile on first use)");
    scenarios::warm_up(target, &mut prompts, WARM_PROMPT, warm_batch).await?;

    if a.scenarios.single {
        let mut runs = Vec::with_capacity(a.repetitions);
        for _ in 0..a.repetitions {
            let s = scenarios::single(target, &mut prompts, a.prompt_tokens, a.new_tokens).await?;
            report::print_single(&s);
            runs.push(s);
        }
        r.table = bench_table(a, inproc, &runs, is_gguf, r);
        table::print(&r.table);
        r.single = runs.into_iter().next();
    }

    if a.scenarios.sweep {
        report::print_sweep_header(a.sweep_prompt_tokens, a.sweep_new_tokens);
        let single_decode = r.single.as_ref().and_then(|s| s.decode_tokens_per_s);
        let sw = scenarios::sweep(
            target,
            &mut prompts,
            &a.levels,
            a.sweep_prompt_tokens,
            a.sweep_new_tokens,
            single_decode,
            report::print_level,
        )
        .await?;
        println!();
        r.sweep = Some(sw);
    }

    if a.scenarios.prefix {
        let w = PrefixWorkload::new(
            &mut prompts,
            a.prefix_tokens,
            a.prefix_question_tokens,
            a.prefix_requests,
            a.prefix_new_tokens,
        );
        let with_cache = scenarios::prefix_run(target, &w, true).await?;
        let (without_cache, note) = match inproc {
            None => (
                None,
                Some(
                    "without the cache: skipped over --grpc (the server's config is not ours)"
                        .to_owned(),
                ),
            ),
            Some(ip) => (Some(prefix_without_cache(a, ip, &w).await?), None),
        };
        let p = Prefix {
            prefix_tokens: a.prefix_tokens,
            question_tokens: a.prefix_question_tokens,
            new_tokens: a.prefix_new_tokens,
            ttft_speedup: ratio(
                without_cache.as_ref().and_then(|w| w.ttft_mean_ms),
                with_cache.ttft_mean_ms,
            ),
            with_cache,
            without_cache,
            note,
        };
        report::print_prefix(&p);
        r.prefix = Some(p);
    }

    if a.scenarios.speculative {
        let s = speculative::run(target, spec_setup(a, inproc.is_some())).await?;
        report::print_speculative(&s);
        r.speculative = Some(s);
    }

    if a.scenarios.roofline {
        match inproc {
            None => {
                r.note("roofline: skipped over --grpc (it measures the device in this process)")
            }
            Some(ip) => {
                eprintln!("kiln-bench: measuring copy bandwidth and matmul FLOP/s");
                let c = roofline::measure(&ip.device).context("roofline microbenchmarks")?;
                let rl = roofline::relate(
                    c,
                    &ip.config,
                    ip.weight_bytes,
                    ip.kv_bytes_per_token,
                    r.single.as_ref(),
                    a.prompt_tokens,
                    a.new_tokens,
                );
                report::print_roofline(&rl);
                r.roofline = Some(rl);
            }
        }
    }

    if a.scenarios.profile {
        match (inproc, target) {
            (Some(ip), Target::Engine(engine)) => {
                eprintln!("kiln-bench: profiling steps (and a second, profiling device)");
                match profile::run(
                    &a.model,
                    a.backend,
                    engine,
                    &ip.device,
                    &mut prompts,
                    a.prompt_tokens,
                    &PROFILE_BATCHES,
                )
                .await?
                {
                    Ok(p) => {
                        let budgets = r.roofline.as_ref().map(|rl| {
                            profile::budget(
                                &p,
                                &rl.ceilings,
                                &ip.config,
                                ip.weight_bytes,
                                ip.kv_bytes_per_token,
                            )
                        });
                        profile::print(&p, budgets.as_deref());
                        r.profile = Some(p);
                        r.budget = budgets;
                    }
                    Err(why) => r.note(format!("profile: skipped: {why}")),
                }
            }
            _ => r.note("profile: skipped over --grpc (it profiles a device in this process)"),
        }
    }

    if a.scenarios.structured {
        match target {
            Target::Engine(e) => {
                let s = structured::run(e, structured::NEW_TOKENS).await?;
                structured::print(&s);
                r.structured = Some(s);
            }
            _ => r.note("structured: skipped over --grpc (it compiles constraints in-process)"),
        }
    }

    if a.scenarios.serve {
        r.serve = serve_doors(a, target, is_gguf, &mut prompts, r).await?;
        serve::print(&r.serve);
        paired::print(&r.serve_paired_doors);
    }

    if a.compare == Some(Compare::LlamaCpp) {
        compare_llama_cpp(a, is_gguf, r);
    }
    Ok(())
}

/// kiln's llama-bench style rows, and llama-bench's own with `--compare llama-server`.
fn bench_table(
    a: &Args,
    inproc: Option<&InProcess>,
    runs: &[scenarios::Single],
    is_gguf: bool,
    r: &mut Report,
) -> Vec<table::Row> {
    let model = a.model.file_stem().map_or_else(
        || a.model.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    let (size, params, backend, threads) = match inproc {
        Some(ip) => {
            let info = ip.device.info();
            let threads = match (&ip.device, info.device_type.as_str()) {
                (Device::Cpu(_), _) => info.threads.to_string(),
                (Device::Reference, _) => "1".to_owned(),
                (_, "cpu") => std::env::var("LP_NUM_THREADS")
                    .unwrap_or_else(|_| r.host_parallelism.to_string()),
                _ => "-".to_owned(),
            };
            let backend = match &ip.device {
                Device::Cpu(_) => format!("kiln cpu ({})", info.cpu_isa),
                Device::Reference => "kiln reference".to_owned(),
                Device::Wgpu(_) => format!("kiln wgpu {} ({})", info.backend, info.name),
            };
            (
                ip.weight_bytes,
                roofline::params(&ip.config).total,
                backend,
                threads,
            )
        }
        None => (0, 0, "kiln (gRPC)".to_owned(), "-".to_owned()),
    };
    let mut rows = table::kiln_rows(runs, &model, size, params, &backend, &threads);
    if a.compare == Some(Compare::LlamaServer) {
        let first = &runs[0];
        if !is_gguf {
            r.note("--compare llama-server: llama.cpp loads GGUF files only; no llama-bench rows");
        } else {
            eprintln!("kiln-bench: running llama-bench ({} threads)", a.threads);
            // Prefill from an empty context; decode after as many tokens as kiln's follows.
            let (p, n) = (first.prompt_tokens, first.new_tokens);
            for tests in [
                BenchTests {
                    pp: p,
                    tg: 0,
                    depth: 0,
                },
                BenchTests {
                    pp: 0,
                    tg: n,
                    depth: p,
                },
            ] {
                let l = llama_server::llama_bench(
                    &a.llama_cpp_dir,
                    &a.model,
                    a.threads,
                    a.llama_gpu_layers,
                    tests,
                    a.repetitions,
                );
                match l {
                    Ok(l) => rows.extend(table::llama_rows(&l)),
                    Err(e) => r.note(format!("--compare llama-server: llama-bench: {e:#}")),
                }
            }
        }
    }
    rows
}

/// The serve workload through kiln's gRPC and OpenAI HTTP front doors (started here over the
/// bench's engine; the server's over --grpc), and through llama-server with `--compare
/// llama-server`; in-process, then the paired pass of each HTTP door against gRPC.
async fn serve_doors(
    a: &Args,
    target: &Target,
    is_gguf: bool,
    prompts: &mut Prompts,
    r: &mut Report,
) -> anyhow::Result<Vec<serve::Summary>> {
    let w = serve::Workload {
        requests: a.serve_requests,
        concurrency: a.serve_concurrency,
        rate: a.request_rate,
        prompt_tokens: a.serve_prompt_tokens,
        output_tokens: a.serve_output_tokens,
    };
    let mut out = Vec::new();
    // llama-server first: nothing of kiln's has run through the front doors yet.
    if a.compare == Some(Compare::LlamaServer) {
        if !is_gguf {
            r.note("--compare llama-server: llama.cpp loads GGUF files only; skipped");
        } else {
            let log = a.out.join("llama-server.log");
            std::fs::create_dir_all(&a.out).ok();
            eprintln!(
                "kiln-bench: starting llama-server ({} threads, {} slots)",
                a.threads, a.serve_concurrency
            );
            match llama_server::LlamaServer::start(
                &a.llama_cpp_dir,
                &a.model,
                a.threads,
                a.llama_gpu_layers,
                a.serve_concurrency,
                a.serve_prompt_tokens + a.serve_output_tokens + 16,
                &log,
            )
            .await
            {
                Ok(server) => {
                    let door = serve::Door::Http {
                        addr: server.addr,
                        model: "llama".to_owned(),
                        api: serve::Api::Completions,
                        tokenizer: None,
                    };
                    // Its first request pays for warm-up, as kiln's did in the warm-up.
                    let warm = serve::Workload {
                        requests: 1,
                        concurrency: 1,
                        rate: None,
                        prompt_tokens: 16,
                        output_tokens: 4,
                    };
                    serve::run(&door, "warm-up", &warm, prompts).await;
                    let cpu = stats::process_cpu_s();
                    out.push(serve::run(&door, "llama-server", &w, prompts).await);
                    if let (Some(before), Some(after)) = (cpu, stats::process_cpu_s()) {
                        // The client's own share: what this process took from llama-server.
                        r.note(format!(
                            "serve: kiln-bench used {:.1} s of CPU while llama-server ran its workload",
                            after - before
                        ));
                    }
                    drop(server);
                }
                Err(e) => r.note(format!("--compare llama-server: {e:#}")),
            }
        }
    }
    match target {
        Target::Grpc(c) => {
            eprintln!("kiln-bench: serving workload over gRPC");
            out.push(serve::run(&serve::Door::Grpc(c.clone()), "kiln gRPC", &w, prompts).await);
        }
        Target::Engine(engine) => {
            let fronts = target::front_doors(engine.clone()).await?;
            eprintln!("kiln-bench: serving workload over gRPC, then the OpenAI HTTP API");
            let completions = fronts.http_door(serve::Api::Completions);
            out.push(serve::run(&fronts.grpc_door(), "kiln gRPC", &w, prompts).await);
            out.push(serve::run(&completions, "kiln HTTP", &w, prompts).await);
            for api in serve::Api::ALL {
                eprintln!(
                    "kiln-bench: the paired pass of {} (gRPC and HTTP streams in one batch)",
                    api.path()
                );
                match paired::run(
                    &fronts.grpc_door(),
                    &fronts.http_door(api),
                    a.serve_concurrency,
                    a.serve_prompt_tokens,
                    a.serve_output_tokens,
                    prompts,
                )
                .await
                {
                    Ok(p) => {
                        if api == serve::Api::Completions {
                            r.serve_paired = Some(p.clone());
                        }
                        r.serve_paired_doors.push(p);
                    }
                    Err(e) => r.note(format!(
                        "serve: the paired pass of {} failed: {e:#}",
                        api.path()
                    )),
                }
            }
            fronts.close().await;
        }
    }
    Ok(out)
}

/// The same shared-prefix workload on a second engine with the prefix cache off.
async fn prefix_without_cache(
    a: &Args,
    ip: &InProcess,
    w: &PrefixWorkload,
) -> anyhow::Result<scenarios::PrefixRun> {
    eprintln!("kiln-bench: starting a second engine without the prefix cache");
    let checkpoint = target::open(&a.model)?;
    let sizing = EngineSizing {
        kv_blocks: u32::try_from(
            2 * blocks(a.prefix_tokens + a.prefix_question_tokens + a.prefix_new_tokens) + 8,
        )
        .unwrap_or(u32::MAX),
        max_num_seqs: 4,
        prefix_caching: false,
        speculative: None,
        ..ip.sizing
    };
    let t = Target::Engine(target::start_engine(checkpoint, &ip.device, &sizing, None)?.engine);
    let run = scenarios::prefix_run(&t, w, false).await;
    t.shutdown().await;
    run
}

/// The draft model of `--speculative draft`: `--draft-model`, else the target itself.
fn draft_path(a: &Args) -> Option<&std::path::Path> {
    if a.speculative != Some(SpecChoice::Draft) {
        return None;
    }
    let path = a.draft_model.as_ref().unwrap_or(&a.model);
    eprintln!("kiln-bench: the draft model is {}", path.display());
    Some(path)
}

/// How the speculative scenario describes what drafts.
fn spec_setup(a: &Args, in_process: bool) -> speculative::Setup {
    let mut notes = Vec::new();
    let cfg = a.spec_config().filter(|_| in_process);
    let method = match cfg.map(|c| c.method) {
        None => {
            notes.push(
                "over --grpc the server drafts as `kiln serve --speculative ...` set it up; \
                 --speculative, --draft-model and --num-speculative-tokens do not apply"
                    .to_owned(),
            );
            "the server's speculative decoding".to_owned()
        }
        Some(SpecMethod::Ngram { min_n, max_n }) => format!("ngram (n {min_n}..={max_n})"),
        Some(SpecMethod::Draft) => "draft model".to_owned(),
    };
    let draft_model = match (cfg.map(|c| c.method), &a.draft_model) {
        (Some(SpecMethod::Draft), Some(p)) => Some(p.display().to_string()),
        (Some(SpecMethod::Draft), None) => {
            notes.push(
                "no --draft-model: the target drafts for itself, so nearly every draft is \
                 accepted and the speed-up shows the verifying path, not a small draft's gain"
                    .to_owned(),
            );
            Some(format!("{} (the target itself)", a.model.display()))
        }
        _ => None,
    };
    speculative::Setup {
        method,
        num_speculative_tokens: cfg.map(|c| c.num_tokens),
        draft_model,
        max_new_tokens: a.spec_new_tokens,
        notes,
    }
}

fn compare_llama_cpp(a: &Args, is_gguf: bool, r: &mut Report) {
    let Some(single) = r.single.clone() else {
        r.note("--compare llama-cpp: needs the single scenario (add it to --scenarios)");
        return;
    };
    if !is_gguf {
        r.note("--compare llama-cpp: llama.cpp loads GGUF files only; skipped");
        return;
    }
    let python = llama_cpp::python();
    if let Err(e) = llama_cpp::check_importable(&python) {
        r.note(format!("--compare llama-cpp: skipped: {e:#}"));
        return;
    }
    eprintln!(
        "kiln-bench: running the single stream through llama-cpp-python ({} threads)",
        a.threads
    );
    match llama_cpp::run(
        &python,
        &a.model,
        &single.prompt_ids,
        single.new_tokens,
        a.threads,
        &single,
    ) {
        Ok(l) => {
            report::print_llama_cpp(&l, &single);
            r.llama_cpp = Some(l);
        }
        Err(e) => r.note(format!("--compare llama-cpp: failed: {e:#}")),
    }
}
