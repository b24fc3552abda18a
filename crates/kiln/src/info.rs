//! `kiln info`: what a model is and what serving it takes: its config, the device, the
//! weights' bytes, the KV cache a budget plans and its layout cache by cache. A DeepSeek-V4
//! model (a folder or a `deepseek4` GGUF) gets its config, its KV layout and its two pools,
//! read from the config alone.

use kiln_engine::{EngineOptions, KvSize, error_chain};
use kiln_kv::{KvDtype, KvLayout};
use kiln_model::{DeepseekV4Config, LoadOptions, NetworkConfig, V4Attention};

use crate::args::{DeviceArgs, ModelArgs};
use crate::{CmdResult, build_error, device, memory, open};

/// `kiln info`.
#[derive(Debug, Clone, clap::Args)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// K/V cache memory in bytes to plan for
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 30)]
    pub kv_cache_memory: u64,
    /// The context length the KV layout's total is given at [default: the model's]
    #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
    pub context_len: Option<u64>,
}

/// The KV layout of one sequence, 16-bit: what each kind of cache costs a token (or holds
/// whatever the length), and the total at `context` tokens.
fn print_layout(layout: &KvLayout, context: u64) {
    let dt = KvDtype::F16;
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "kv layout (f16, one sequence): {} values a token; at {context} tokens {} bytes ({:.1} MiB)",
        layout.values_per_token(),
        layout.bytes_at(context, dt),
        mib(layout.bytes_at(context, dt))
    );
    for (kind, bytes) in layout.by_kind(context, dt) {
        let per_token: f64 = layout
            .caches
            .iter()
            .filter(|c| c.kind == kind)
            .filter_map(|c| c.bytes_per_token(dt))
            .sum();
        let rate = if per_token > 0.0 {
            format!("{per_token} bytes a token")
        } else {
            "fixed".to_owned()
        };
        println!(
            "  {}: {rate}; {bytes} bytes ({:.1} MiB) at {context} tokens",
            kind.name(),
            mib(bytes)
        );
    }
}

/// A DeepSeek-V4 model's config, its layout cache by cache, and the two pools `kiln serve`
/// would plan (read from the config alone: no tokenizer or weights needed).
fn deepseek_v4_info(args: &InfoArgs, v4: DeepseekV4Config) -> CmdResult {
    let path = &args.model.model;
    println!("model: {path}");
    println!("architecture: deepseek_v4");
    println!("config: {v4:#?}");
    let count = |f: fn(&V4Attention) -> bool| v4.attention.iter().filter(|a| f(a)).count();
    println!(
        "attention: {} layers: {} sliding-window only, {} CSA, {} HCA; window {}",
        v4.layers,
        count(|a| matches!(a, V4Attention::Sliding)),
        count(|a| matches!(a, V4Attention::Csa { .. })),
        count(|a| matches!(a, V4Attention::Hca { .. })),
        v4.window
    );
    print_layout(
        &v4.kv_layout(),
        args.context_len.unwrap_or(v4.max_position as u64),
    );
    let opts = EngineOptions {
        kv_size: KvSize::Bytes(args.kv_cache_memory),
        ..EngineOptions::new(device(&args.device)?)
    };
    let plan = opts
        .pool_plan(&NetworkConfig::DeepseekV4(Box::new(v4)))
        .map_err(|e| build_error(&e, path, None))?;
    println!(
        "kv pools at --kv-cache-memory {}: {plan}",
        args.kv_cache_memory
    );
    Ok(())
}

pub(crate) fn run(args: &InfoArgs) -> CmdResult {
    let path = &args.model.model;
    let v4 = NetworkConfig::deepseek_v4(std::path::Path::new(path))
        .map_err(|e| format!("{path}: {}", error_chain(&e)))?;
    if let Some(v4) = v4 {
        return deepseek_v4_info(args, v4);
    }
    let c = open(path, LoadOptions::default())?;
    let Some(files) = c.files() else {
        return Err(format!(
            "{path}: {} has no dense graph's files",
            c.config().arch_name()
        ));
    };
    let cfg = files.config();
    let dev = device(&args.device)?;
    println!("model: {path}");
    println!("device: {}", dev.info());
    println!("config: {cfg:#?}");
    println!("attention: {}", cfg.attention_summary());
    if let Some(moe) = &cfg.moe {
        println!("experts: {}", moe.summary(cfg.layers));
    }
    let weights = files.stored_bytes();
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!(
        "weights: {weights} bytes ({:.1} MiB) as stored",
        mib(weights)
    );
    // `--cpu-moe` / `--n-cpu-moe`: which layers' experts stay in host memory, and the bytes
    // on each side.
    let placement = args.device.cpu_moe();
    if cfg.moe.is_some() && placement != kiln_model::CpuMoe::Off {
        let on_cpu = |l: usize| cfg.sparse_layer(l) && placement.covers(l);
        let layers = (0..cfg.layers).filter(|&l| on_cpu(l)).count();
        let host = files.stored_expert_bytes(on_cpu);
        if dev.is_cpu() {
            println!("experts: on the CPU with everything else (the device is the CPU)");
        } else {
            println!(
                "split: the experts of {layers} of {} layers on the CPU, {host} bytes ({:.1} MiB) \
                 in host memory; {} bytes ({:.1} MiB) on the device",
                cfg.layers,
                mib(host),
                weights - host,
                mib(weights - host)
            );
        }
    }
    // The pool `kiln serve --kv-cache-memory` would plan (its other defaults).
    let opts = EngineOptions {
        kv_size: KvSize::Bytes(args.kv_cache_memory),
        ..EngineOptions::new(dev)
    };
    let plan = opts.kv_plan(cfg).map_err(|e| build_error(&e, path, None))?;
    println!("kv cache: {}", plan.explain());
    print_layout(
        &KvLayout::dense(cfg.layers as u32, cfg.kv_heads as u32, cfg.head_dim as u32),
        args.context_len.unwrap_or(cfg.max_position as u64),
    );
    // What `--kv-dtype` buys in the same memory.
    let capacity: Vec<String> = KvDtype::ALL
        .iter()
        .map(|&kv_dtype| {
            EngineOptions {
                kv_dtype,
                ..opts.clone()
            }
            .kv_plan(cfg)
            .map_or_else(
                |e| format!("{kv_dtype} {}", error_chain(&e)),
                |p| format!("{kv_dtype} {} tokens", p.num_tokens()),
            )
        })
        .collect();
    println!(
        "kv capacity in {} bytes by --kv-dtype: {}",
        args.kv_cache_memory,
        capacity.join(", ")
    );
    // What opening the model cost this process (its head and tokenizer, not the weights).
    match memory::peak_rss_bytes() {
        Some(b) => println!(
            "peak rss: {b} bytes ({:.1} MiB)",
            b as f64 / f64::from(1 << 20)
        ),
        None => println!("peak rss: not measured on this system"),
    }
    Ok(())
}
