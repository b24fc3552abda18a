//! `kiln-bench moe` (`cargo xtask bench moe`): decode of a mixture of experts, kiln against
//! llama.cpp on the same GGUF, in one run.
//!
//! The model is Qwen3-MoE-shaped: 24 layers of 1024, 64 experts of 512 a layer, 4 used a
//! token: 2.6 B parameters, 0.26 B of them active a token. Its weights are random Q4_K blocks
//! made from a seed (norms ones, routers F32), its vocabulary the default model's (copied
//! from `--vocab-from`, so llama.cpp loads the file too); it is written once, to
//! `<out>/moe-q4_k-seed<N>.gguf`. At batch 1 and 16, on the native CPU backend and on
//! llama.cpp's (llama-cpp-python, its batch API, the same threads): each sequence's prompt is
//! prefilled, then `--steps` decode steps of the whole batch are timed: decode tokens/s. For
//! kiln also the share of the expert bytes its routed products read a step: an expert is read
//! once a step when any of the batch's tokens routes to it (llama.cpp's `mul_mat_id` reads the
//! same ones). Figures go to `<out>/kiln-bench-moe-<unix-seconds>.json`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Parser;
use kiln_gguf::GgufFile;
use kiln_kv::KvDtype;
use kiln_model::{
    Arch, KvPoolConfig, LayerAttention, Model, ModelConfig, ModelRunner, MoeConfig, RopeParams,
};
use kiln_tensor::{DType, Device, DeviceOptions, RopeLayout, RopeScaling, Router};
use serde::Serialize;

use crate::gpu_check::Decode;

#[derive(Debug, Parser)]
#[command(
    name = "kiln-bench moe",
    about = "Mixture-of-experts decode, kiln against llama.cpp"
)]
struct Cli {
    /// The GGUF whose vocabulary (its `tokenizer.*` metadata) the model takes: the default
    /// model's (`cargo xtask bench moe` passes it)
    #[arg(long, value_name = "PATH")]
    vocab_from: PathBuf,
    /// Seed of the weights and the prompts
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Where the model and the report go
    #[arg(long, value_name = "DIR", default_value = "target/bench")]
    out: PathBuf,
    /// Threads of both CPU backends [default: one a core]
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Decode steps timed at each batch size
    #[arg(long, value_name = "N", default_value_t = 32)]
    steps: usize,
    /// Prompt tokens of each sequence
    #[arg(long, value_name = "N", default_value_t = 32)]
    prompt: usize,
    /// kiln alone
    #[arg(long)]
    no_llama_cpp: bool,
}

/// Batch sizes measured.
const BATCHES: [usize; 2] = [1, 16];
/// Tokens per KV block.
const BLOCK: usize = 16;

/// The model's shape: Qwen3-30B-A3B's family at a tenth of its size.
fn config(vocab: usize) -> ModelConfig {
    let layers = 24;
    let rope = RopeParams {
        theta: 1_000_000.0,
        scaling: RopeScaling::None,
    };
    ModelConfig {
        arch: Arch::Qwen3Moe,
        hidden: 1024,
        layers,
        heads: 16,
        kv_heads: 4,
        head_dim: 64,
        ffn: 2048,
        vocab,
        rms_eps: 1e-6,
        rope_layout: RopeLayout::HalfSplit,
        max_position: 4096,
        tie_embeddings: false,
        attention: vec![LayerAttention { window: None, rope }; layers],
        qkv_bias: false,
        o_bias: false,
        attn_sinks: false,
        qk_norm: true,
        sandwich_norms: false,
        norm_offset: 0.0,
        activation: kiln_model::Activation::Silu,
        embed_scale: None,
        attn_scale: 1.0 / 8.0,
        final_logit_softcap: None,
        moe: Some(MoeConfig {
            experts: 64,
            used: 4,
            expert_ffn: 512,
            router: Router::SoftmaxTopK { renorm: true },
            biases: false,
            dense_layers: Vec::new(),
        }),
    }
}

/// Writes the model as llama.cpp's converter would (`qwen3moe` keys, stacked experts).
fn write_model(cli: &Cli, path: &Path) -> anyhow::Result<()> {
    let vocab = GgufFile::open(&cli.vocab_from)
        .with_context(|| format!("reading {}", cli.vocab_from.display()))?;
    let cfg = config(crate::synthetic_gguf::vocab_size(&vocab)?);
    crate::synthetic_gguf::write(&cfg, DType::Q4_K, cli.seed, &vocab, path)
}

/// One engine at one batch size.
#[derive(Debug, Clone, Serialize)]
struct Row {
    engine: &'static str,
    batch: usize,
    decode_tokens_per_s: f64,
    /// kiln: the share of the expert bytes held that its routed products read a step.
    expert_bytes_read_share: Option<f64>,
}

/// kiln's decode at each batch size, on the native CPU backend.
fn kiln(cli: &Cli, path: &Path, threads: usize) -> anyhow::Result<Vec<Row>> {
    let dev = Device::new(&DeviceOptions {
        backend: kiln_tensor::BackendChoice::Cpu,
        threads: Some(threads),
        ..DeviceOptions::default()
    })?;
    let files = kiln_model::ModelFiles::open(path, kiln_model::LoadOptions::default())?;
    let cfg = files.config().clone();
    let model = Model::load(&dev, cfg.clone(), files.weights())?;
    let per_seq = (cli.prompt + cli.steps + 2).div_ceil(BLOCK);
    let mut runner = ModelRunner::new(
        model,
        KvPoolConfig {
            block_size: BLOCK as u32,
            num_blocks: (per_seq * BATCHES.iter().max().copied().unwrap_or(1)) as u32,
            dtype: KvDtype::F16,
        },
    )?;
    let mut rows = Vec::new();
    for b in BATCHES {
        let work = Decode {
            b,
            ctx: cli.prompt,
            per_seq,
            seed: cli.seed,
            vocab: cfg.vocab,
        };
        let s = work.run(&mut runner, cli.steps, || {
            let _ = dev.take_routed_stats();
        })?;
        let read = dev
            .take_routed_stats()
            .context("the native backend's counters")?;
        rows.push(Row {
            engine: "kiln",
            batch: b,
            decode_tokens_per_s: (b * cli.steps) as f64 / s,
            expert_bytes_read_share: Some(read.bytes_share()),
        });
    }
    Ok(rows)
}

/// llama.cpp's decode of the same work: each sequence's prompt (the same ids as kiln's) in
/// one `llama_decode`, then steps of one token a sequence, all sequences in one batch.
const SCRIPT: &str = r#"
import ctypes, json, sys, time
import llama_cpp as L

job = json.load(sys.stdin)
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(job["model"].encode(), mp)
if not model:
    sys.exit("llama.cpp cannot load " + job["model"])
out = []
for b, prompts in zip(job["batches"], job["prompts"]):
    cp = L.llama_context_default_params()
    cp.n_ctx = b * (len(prompts[0]) + job["steps"] + 8)
    cp.n_batch = max(512, b)
    cp.n_ubatch = max(512, b)
    cp.n_seq_max = b
    cp.n_threads = cp.n_threads_batch = job["threads"]
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(max(512, b), 0, b)

    def decode(items):
        batch.n_tokens = len(items)
        for i, (seq, pos, tok) in enumerate(items):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1
        if L.llama_decode(ctx, batch) != 0:
            sys.exit("llama_decode failed")

    ctx_len = len(prompts[0])
    for s, p in enumerate(prompts):
        decode([(s, i, t) for i, t in enumerate(p)])
    step = lambda k: decode([(s, ctx_len + k, p[k % ctx_len]) for s, p in enumerate(prompts)])
    step(0)
    start = time.perf_counter()
    for k in range(1, job["steps"] + 1):
        step(k)
    out.append({"batch": b, "seconds": time.perf_counter() - start})
    L.llama_batch_free(batch)
    L.llama_free(ctx)
print(json.dumps({"runs": out, "version": getattr(L, "__version__", "?")}))
"#;

#[derive(Debug, serde::Deserialize)]
struct LlamaRuns {
    runs: Vec<LlamaRun>,
    version: String,
}

#[derive(Debug, serde::Deserialize)]
struct LlamaRun {
    batch: usize,
    seconds: f64,
}

/// llama.cpp's decode at each batch size, through llama-cpp-python; with its version.
fn llama_cpp(cli: &Cli, path: &Path, threads: usize) -> anyhow::Result<(Vec<Row>, String)> {
    let python = crate::llama_cpp::python();
    crate::llama_cpp::check_importable(&python)?;
    let vocab = kiln_model::ModelFiles::open(path, kiln_model::LoadOptions::default())?
        .config()
        .vocab;
    let prompts: Vec<Vec<Vec<u32>>> = BATCHES
        .iter()
        .map(|&b| {
            let work = Decode {
                b,
                ctx: cli.prompt,
                per_seq: 0,
                seed: cli.seed,
                vocab,
            };
            (0..b)
                .map(|i| work.ids(cli.prompt, cli.seed ^ i as u64))
                .collect()
        })
        .collect();
    let job = serde_json::json!({
        "model": path, "batches": BATCHES, "prompts": prompts, "steps": cli.steps,
        "threads": threads,
    });
    let r: LlamaRuns = crate::llama_cpp::run_script(&python, SCRIPT, &job)?;
    let rows = r
        .runs
        .iter()
        .map(|run| Row {
            engine: "llama.cpp",
            batch: run.batch,
            decode_tokens_per_s: (run.batch * cli.steps) as f64 / run.seconds,
            expert_bytes_read_share: None,
        })
        .collect();
    Ok((rows, r.version))
}

/// The report written to `<out>`.
#[derive(Debug, Serialize)]
struct Report {
    model: PathBuf,
    seed: u64,
    threads: usize,
    prompt_tokens: usize,
    steps: usize,
    llama_cpp_python: Option<String>,
    rows: Vec<Row>,
}

fn bench(cli: &Cli) -> anyhow::Result<()> {
    let path = cli.out.join(format!("moe-q4_k-seed{}.gguf", cli.seed));
    if !path.is_file() {
        eprintln!(
            "writing {} (random Q4_K weights from seed {})",
            path.display(),
            cli.seed
        );
        write_model(cli, &path)?;
    }
    let threads = cli.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let mut rows = kiln(cli, &path, threads)?;
    let mut version = None;
    if !cli.no_llama_cpp {
        let (llama, v) = llama_cpp(cli, &path, threads)?;
        rows.extend(llama);
        version = Some(v);
    }
    println!("| engine | batch | decode tok/s | vs llama.cpp | expert bytes read a step |");
    println!("|---|---|---|---|---|");
    for r in &rows {
        let base = rows
            .iter()
            .find(|o| o.engine == "llama.cpp" && o.batch == r.batch)
            .map(|o| o.decode_tokens_per_s);
        let ratio = base.map_or("—".into(), |b| {
            format!("{:.2}×", r.decode_tokens_per_s / b)
        });
        let share = r
            .expert_bytes_read_share
            .map_or("—".into(), |s| format!("{:.1}%", 100.0 * s));
        println!(
            "| {} | {} | {:.1} | {ratio} | {share} |",
            r.engine, r.batch, r.decode_tokens_per_s
        );
    }
    let report = Report {
        model: path,
        seed: cli.seed,
        threads,
        prompt_tokens: cli.prompt,
        steps: cli.steps,
        llama_cpp_python: version,
        rows,
    };
    let secs = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let file = cli.out.join(format!("kiln-bench-moe-{secs}.json"));
    std::fs::write(&file, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", file.display());
    Ok(())
}

pub fn main(argv: Vec<std::ffi::OsString>) -> ExitCode {
    crate::gpu_check::subcommand(argv, "moe", |cli: Cli| {
        bench(&cli).map(|()| ExitCode::SUCCESS)
    })
}
