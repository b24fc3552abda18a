//! `kiln-bench deepseek-v4`: DeepSeek-V4's compressed attention at long contexts, on a small
//! random model of V4-Flash's structure (a sliding, a CSA and an HCA layer and a second CSA
//! one; CSA pooling every 4 tokens with a top-64 indexer, HCA every 128, a 128-token window,
//! 4 hyper-connection streams, a hash-routed first MoE layer), written from a seed.
//!
//! At each context length: the prompt is prefilled in chunks of 512 (timed), then `--steps`
//! tokens are decoded one at a time (timed: decode tokens/s). Beside the times, the bytes the
//! sequence's state holds after the prompt, cache by cache, measured on its tensors, and what
//! `kiln-kv`'s layout arithmetic says for the same length, with the same layers under dense
//! attention over their one K=V head for comparison. Figures go to
//! `<out>/kiln-bench-deepseek-v4-<unix-seconds>.json`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Parser;
use kiln_kv::KvDtype;
use kiln_model::v4::{V4Model, V4Sequence};
use kiln_model::{StDtype, encode_safetensors};
use kiln_tensor::{BackendChoice, Device, DeviceOptions, Recorder};
use serde::Serialize;

use crate::kernel_checks::values;

#[derive(Debug, Parser)]
#[command(
    name = "kiln-bench deepseek-v4",
    about = "DeepSeek-V4's compressed attention at long contexts: decode speed and KV bytes"
)]
struct Cli {
    /// Context lengths to measure at
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768")]
    contexts: Vec<usize>,
    /// Decode steps timed at each length
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// The backend: cpu (native), wgpu, reference
    #[arg(long, default_value = "cpu")]
    backend: BackendChoice,
    /// Seed of the weights and the prompts
    #[arg(long, default_value_t = 48)]
    seed: u64,
    /// Where the model and the report go
    #[arg(long, value_name = "DIR", default_value = "target/bench")]
    out: PathBuf,
}

/// The model's shape.
const HIDDEN: usize = 128;
const HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const Q_LORA: usize = 32;
const GROUPS: usize = 2;
const O_LORA: usize = 32;
const INDEX_HEADS: usize = 8;
const INDEX_DIM: usize = 32;
const EXPERTS: usize = 8;
const USED: usize = 2;
const FFN: usize = 64;
const VOCAB: usize = 256;
const STREAMS: usize = 4;
const LAYERS: [&str; 4] = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
];

fn config(max_positions: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS.len(),
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": Q_LORA,
        "o_groups": GROUPS,
        "o_lora_rank": O_LORA,
        "sliding_window": 128,
        "layer_types": LAYERS,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
        "index_n_heads": INDEX_HEADS,
        "index_head_dim": INDEX_DIM,
        "index_topk": 64,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": USED,
        "intermediate_size": FFN,
        "num_hash_layers": 1,
        "swiglu_limit": 10.0,
        "routed_scaling_factor": 1.5,
        "hc_mult": STREAMS,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": max_positions,
    })
}

/// Every tensor of the model, DeepSeek's names, F32 (random weights scaled by 1/√cols, norms
/// and mHC scales one, biases zero) but the hash table (I32).
fn tensors(seed: u64) -> Vec<(String, StDtype, Vec<usize>, Vec<u8>)> {
    let mut out = Vec::new();
    let mut n = 0u64;
    let mut add = |name: String, shape: Vec<usize>, fill: Option<f32>| {
        n += 1;
        let count: usize = shape.iter().product();
        let cols = *shape.last().unwrap_or(&1) as f32;
        let v: Vec<f32> = match fill {
            Some(x) => vec![x; count],
            None => values(seed ^ (n << 20), count)
                .into_iter()
                .map(|x| x / cols.sqrt())
                .collect(),
        };
        out.push((
            name,
            StDtype::F32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    };
    let mix = (2 + STREAMS) * STREAMS;
    add("embed.weight".into(), vec![VOCAB, HIDDEN], None);
    add("norm.weight".into(), vec![HIDDEN], Some(1.0));
    add("head.weight".into(), vec![VOCAB, HIDDEN], None);
    add("hc_head_fn".into(), vec![STREAMS, STREAMS * HIDDEN], None);
    add("hc_head_base".into(), vec![STREAMS], Some(0.0));
    add("hc_head_scale".into(), vec![1], Some(1.0));
    for (i, kind) in LAYERS.iter().enumerate() {
        let p = format!("layers.{i}.");
        for which in ["attn", "ffn"] {
            add(
                format!("{p}hc_{which}_fn"),
                vec![mix, STREAMS * HIDDEN],
                None,
            );
            add(format!("{p}hc_{which}_base"), vec![mix], Some(0.0));
            add(format!("{p}hc_{which}_scale"), vec![3], Some(1.0));
            add(format!("{p}{which}_norm.weight"), vec![HIDDEN], Some(1.0));
        }
        let a = format!("{p}attn.");
        add(format!("{a}wq_a.weight"), vec![Q_LORA, HIDDEN], None);
        add(format!("{a}q_norm.weight"), vec![Q_LORA], Some(1.0));
        add(
            format!("{a}wq_b.weight"),
            vec![HEADS * HEAD_DIM, Q_LORA],
            None,
        );
        add(format!("{a}wkv.weight"), vec![HEAD_DIM, HIDDEN], None);
        add(format!("{a}kv_norm.weight"), vec![HEAD_DIM], Some(1.0));
        let group = HEADS * HEAD_DIM / GROUPS;
        add(
            format!("{a}wo_a.weight"),
            vec![GROUPS * O_LORA, group],
            None,
        );
        add(
            format!("{a}wo_b.weight"),
            vec![HIDDEN, GROUPS * O_LORA],
            None,
        );
        add(format!("{a}attn_sink"), vec![HEADS], None);
        let mut compressor = |c: String, width: usize, ratio: usize, halves: usize| {
            add(format!("{c}wkv.weight"), vec![halves * width, HIDDEN], None);
            add(
                format!("{c}wgate.weight"),
                vec![halves * width, HIDDEN],
                None,
            );
            add(format!("{c}ape"), vec![ratio, halves * width], None);
            add(format!("{c}norm.weight"), vec![width], Some(1.0));
        };
        match *kind {
            "compressed_sparse_attention" => {
                compressor(format!("{a}compressor."), HEAD_DIM, 4, 2);
                compressor(format!("{a}indexer.compressor."), INDEX_DIM, 4, 2);
                add(
                    format!("{a}indexer.wq_b.weight"),
                    vec![INDEX_HEADS * INDEX_DIM, Q_LORA],
                    None,
                );
                add(
                    format!("{a}indexer.weights_proj.weight"),
                    vec![INDEX_HEADS, HIDDEN],
                    None,
                );
            }
            "heavily_compressed_attention" => {
                compressor(format!("{a}compressor."), HEAD_DIM, 128, 1)
            }
            _ => {}
        }
        let f = format!("{p}ffn.");
        add(format!("{f}gate.weight"), vec![EXPERTS, HIDDEN], None);
        if i > 0 {
            add(format!("{f}gate.bias"), vec![EXPERTS], Some(0.0));
        }
        for e in 0..EXPERTS {
            for (w, shape) in [
                ("w1", [FFN, HIDDEN]),
                ("w2", [HIDDEN, FFN]),
                ("w3", [FFN, HIDDEN]),
            ] {
                add(format!("{f}experts.{e}.{w}.weight"), shape.to_vec(), None);
            }
        }
        for (w, shape) in [
            ("w1", [FFN, HIDDEN]),
            ("w2", [HIDDEN, FFN]),
            ("w3", [FFN, HIDDEN]),
        ] {
            add(
                format!("{f}shared_experts.{w}.weight"),
                shape.to_vec(),
                None,
            );
        }
    }
    let table: Vec<i32> = (0..VOCAB * USED)
        .map(|i| ((i / USED * 3 + i % USED * 5) % EXPERTS) as i32)
        .collect();
    out.push((
        "layers.0.ffn.gate.tid2eid".into(),
        StDtype::I32,
        vec![VOCAB, USED],
        table.iter().flat_map(|x| x.to_le_bytes()).collect(),
    ));
    out
}

fn write_model(dir: &Path, seed: u64, max_positions: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("config.json"), config(max_positions).to_string())?;
    let bytes = encode_safetensors(&tensors(seed), &Default::default())?;
    std::fs::write(dir.join("model.safetensors"), bytes)?;
    Ok(())
}

#[derive(Debug, Serialize)]
struct Row {
    context: usize,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    /// Measured on the sequence's tensors after the prompt.
    window_bytes: u64,
    entry_bytes: u64,
    index_key_bytes: u64,
    pending_bytes: u64,
    /// `kiln-kv`'s arithmetic for the same model and length, f32 elements.
    layout_bytes: u64,
    /// The same layers with dense attention over their one K=V head.
    dense_bytes: u64,
}

fn bench(cli: &Cli) -> anyhow::Result<()> {
    let device = Device::new(&DeviceOptions {
        backend: cli.backend,
        ..DeviceOptions::default()
    })?;
    let longest = cli.contexts.iter().copied().max().unwrap_or(0) + cli.steps + 1;
    let dir = cli.out.join(format!("deepseek-v4-small-seed{}", cli.seed));
    write_model(&dir, cli.seed, longest)?;
    let model = V4Model::load(&dir, &device, longest)?;
    let layout = model.config().kv_layout();
    let mut rows = Vec::new();
    println!(
        "| context | prefill tok/s | decode tok/s | window | entries | indexer keys | pending | total | kiln-kv layout | dense K=V | share of dense |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &ctx in &cli.contexts {
        let prompt: Vec<u32> = values(cli.seed ^ ctx as u64, ctx)
            .iter()
            .map(|v| ((v + 1.0) * 0.5 * VOCAB as f32) as u32 % VOCAB as u32)
            .collect();
        let mut seq = V4Sequence::new(&model, ctx + cli.steps, 512)?;
        let t0 = Instant::now();
        let mut last = 0;
        for chunk in prompt.chunks(512) {
            let mut rec = Recorder::new(&device);
            let logits = model.forward(&mut rec, chunk, &mut seq)?;
            let best = rec.argmax(&logits)?;
            rec.submit()?;
            last = *best.to_u32_vec()?.last().unwrap_or(&0);
        }
        let prefill = t0.elapsed().as_secs_f64();
        let held = seq.bytes();
        let t1 = Instant::now();
        for _ in 0..cli.steps {
            let mut rec = Recorder::new(&device);
            let logits = model.forward(&mut rec, &[last], &mut seq)?;
            let best = rec.argmax(&logits)?;
            rec.submit()?;
            last = best.to_u32_vec()?[0];
        }
        let decode = t1.elapsed().as_secs_f64();
        let dense = (LAYERS.len() * ctx * HEAD_DIM * 4) as u64;
        let row = Row {
            context: ctx,
            prefill_tokens_per_s: ctx as f64 / prefill,
            decode_tokens_per_s: cli.steps as f64 / decode,
            window_bytes: held.window,
            entry_bytes: held.entries,
            index_key_bytes: held.index_keys,
            pending_bytes: held.pending,
            layout_bytes: layout.bytes_at(ctx as u64, KvDtype::F32),
            dense_bytes: dense,
        };
        let kib = |b: u64| format!("{:.1} KiB", b as f64 / 1024.0);
        println!(
            "| {} | {:.0} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {:.1}% |",
            ctx,
            row.prefill_tokens_per_s,
            row.decode_tokens_per_s,
            kib(row.window_bytes),
            kib(row.entry_bytes),
            kib(row.index_key_bytes),
            kib(row.pending_bytes),
            kib(held.total()),
            kib(row.layout_bytes),
            kib(row.dense_bytes),
            100.0 * held.total() as f64 / dense as f64,
        );
        rows.push(row);
    }
    std::fs::create_dir_all(&cli.out)?;
    let secs = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let file = cli.out.join(format!("kiln-bench-deepseek-v4-{secs}.json"));
    let report = serde_json::json!({
        "backend": format!("{:?}", cli.backend),
        "device": device.info().name,
        "steps": cli.steps,
        "rows": rows,
    });
    std::fs::write(&file, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", file.display());
    Ok(())
}

pub fn main(argv: Vec<std::ffi::OsString>) -> ExitCode {
    crate::gpu_check::subcommand(argv, "deepseek-v4", |cli: Cli| {
        bench(&cli).map(|()| ExitCode::SUCCESS)
    })
}
