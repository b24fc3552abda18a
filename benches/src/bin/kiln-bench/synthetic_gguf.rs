//! GGUF files of real shapes with weights made from a seed (`SyntheticSource`) and a real
//! vocabulary (another GGUF's `tokenizer.*` metadata), written with llama.cpp's converter's
//! keys so kiln and llama.cpp load the same file: `kiln-bench moe`'s model, and `kiln-bench
//! write-gguf`'s (the GPU check's 7B-shaped models, which the bundle writes on the GPU
//! machine instead of carrying them).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use kiln_gguf::{GgmlType, GgufFile, GgufWriter};
use kiln_model::{ExpertProj, ModelConfig, SyntheticSource, Weight, WeightSource};
use kiln_tensor::{DType, Device};

/// The number of tokens in `vocab`'s `tokenizer.ggml.tokens`.
pub(crate) fn vocab_size(vocab: &GgufFile) -> anyhow::Result<usize> {
    Ok(vocab
        .metadata()
        .get_strings("tokenizer.ggml.tokens")?
        .context("the vocabulary file has no tokenizer.ggml.tokens")?
        .len())
}

/// Writes `cfg` (a dense Llama-family model or a Qwen3-MoE one) with `dtype` weights from
/// `seed` (norms ones; routers F32, as llama.cpp's converter keeps them) and `vocab`'s
/// tokenizer to `path`, as llama.cpp's converter names tensors and keys.
pub(crate) fn write(
    cfg: &ModelConfig,
    dtype: DType,
    seed: u64,
    vocab: &GgufFile,
    path: &Path,
) -> anyhow::Result<()> {
    let src = SyntheticSource::new(cfg.clone(), dtype, seed)?;
    let mut w = GgufWriter::new();
    let a = cfg.arch.name();
    w.metadata("general.architecture", a).metadata(
        "general.name",
        format!("kiln-bench synthetic {a}, {dtype:?}, seed {seed}"),
    );
    let mut keys = vec![
        ("block_count", cfg.layers),
        ("context_length", cfg.max_position),
        ("embedding_length", cfg.hidden),
        ("feed_forward_length", cfg.ffn),
        ("attention.head_count", cfg.heads),
        ("attention.head_count_kv", cfg.kv_heads),
        ("attention.key_length", cfg.head_dim),
        ("attention.value_length", cfg.head_dim),
        ("rope.dimension_count", cfg.head_dim),
    ];
    if let Some(moe) = &cfg.moe {
        keys.extend([
            ("expert_count", moe.experts),
            ("expert_used_count", moe.used),
            ("expert_feed_forward_length", moe.expert_ffn),
        ]);
    }
    for (key, value) in keys {
        w.metadata(format!("{a}.{key}"), u32::try_from(value)?);
    }
    let theta = cfg.attention.first().map_or(10_000.0, |l| l.rope.theta);
    w.metadata(format!("{a}.rope.freq_base"), theta)
        .metadata(format!("{a}.attention.layer_norm_rms_epsilon"), cfg.rms_eps);
    for (key, value) in vocab.metadata().iter() {
        if key.starts_with("tokenizer.") {
            w.metadata(key, value.clone());
        }
    }
    // A tensor as the source gives it: its stored dtype, ggml's dimension order.
    let put = |w: &mut GgufWriter, name: String, t: kiln_tensor::Tensor| -> anyhow::Result<()> {
        let id = t.dtype().ggml().context("a GGUF type")?;
        let dims: Vec<u64> = t.shape().iter().rev().map(|&d| d as u64).collect();
        w.tensor(name, &dims, GgmlType(id), t.to_bytes()?);
        Ok(())
    };
    let dev = Device::Reference;
    let (h, d) = (cfg.hidden, cfg.head_dim);
    let (qd, kvd) = (cfg.heads * d, cfg.kv_heads * d);
    let mut top = vec![
        (Weight::Embed, vec![cfg.vocab, h]),
        (Weight::FinalNorm, vec![h]),
    ];
    if !cfg.tie_embeddings {
        top.push((Weight::LmHead, vec![cfg.vocab, h]));
    }
    for (weight, shape) in top {
        put(&mut w, weight.gguf_name(), src.load(&dev, weight, &shape)?)?;
    }
    for l in 0..cfg.layers {
        let mut layer = vec![
            (Weight::AttnNorm(l), vec![h]),
            (Weight::Q(l), vec![qd, h]),
            (Weight::K(l), vec![kvd, h]),
            (Weight::V(l), vec![kvd, h]),
            (Weight::O(l), vec![h, qd]),
            (Weight::FfnNorm(l), vec![h]),
        ];
        if cfg.qk_norm {
            layer.extend([(Weight::QNorm(l), vec![d]), (Weight::KNorm(l), vec![d])]);
        }
        if cfg.moe.is_none() {
            layer.extend([
                (Weight::Gate(l), vec![cfg.ffn, h]),
                (Weight::Up(l), vec![cfg.ffn, h]),
                (Weight::Down(l), vec![h, cfg.ffn]),
            ]);
        }
        for (weight, shape) in layer {
            put(&mut w, weight.gguf_name(), src.load(&dev, weight, &shape)?)?;
        }
        let Some(moe) = &cfg.moe else { continue };
        let (e, f) = (moe.experts, moe.expert_ffn);
        let router = src.load(&dev, Weight::Router(l), &[e, h])?.to_f32_vec()?;
        let router = kiln_tensor::Tensor::from_f32(&dev, &[e, h], &router)?;
        put(&mut w, Weight::Router(l).gguf_name(), router)?;
        for (proj, shape) in [
            (ExpertProj::Gate, [e, f, h]),
            (ExpertProj::Up, [e, f, h]),
            (ExpertProj::Down, [e, h, f]),
        ] {
            let name = format!("blk.{l}.ffn_{}_exps.weight", proj.gguf());
            put(&mut w, name, src.load_experts(&dev, l, proj, shape)?)?;
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("gguf.part");
    std::fs::write(&tmp, w.to_bytes()?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[derive(Debug, Parser)]
#[command(
    name = "kiln-bench write-gguf",
    about = "Write a GGUF of a real model's shape with weights from a seed"
)]
struct Cli {
    /// The shape: smollm2 (the default model's) or 7b (Llama-2-7B's)
    #[arg(long, required_unless_present = "vocab_only")]
    shape: Option<String>,
    /// The weights' format: any block format kiln quantizes to (Q4_0, Q4_1, Q8_0) or writes
    /// random blocks of (Q4_K)
    #[arg(long, value_name = "DTYPE", required_unless_present = "vocab_only")]
    dtype: Option<String>,
    /// No model: only the vocabulary's `tokenizer.*` metadata (what the GPU check's bundle
    /// carries instead of the default model)
    #[arg(long, conflicts_with_all = ["shape", "dtype"])]
    vocab_only: bool,
    /// The GGUF whose vocabulary (its `tokenizer.*` metadata) the model takes
    #[arg(long, value_name = "PATH")]
    vocab_from: PathBuf,
    /// Seed of the weights
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The file to write (kept when it exists)
    #[arg(long, value_name = "PATH")]
    out: PathBuf,
}

/// The weight formats `write-gguf` writes: those llama.cpp's GPU backends and kiln's load.
const DTYPES: [DType; 4] = [DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q4_K];

/// Writes `vocab`'s `tokenizer.*` metadata alone to `path`.
fn write_vocab(vocab: &GgufFile, path: &Path) -> anyhow::Result<()> {
    let mut w = GgufWriter::new();
    for (key, value) in vocab.metadata().iter() {
        if key.starts_with("tokenizer.") {
            w.metadata(key, value.clone());
        }
    }
    std::fs::write(path, w.to_bytes()?).with_context(|| format!("writing {}", path.display()))
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    let vocab = GgufFile::open(&cli.vocab_from)
        .with_context(|| format!("--vocab-from {}", cli.vocab_from.display()))?;
    let (Some(shape), Some(dtype)) = (&cli.shape, &cli.dtype) else {
        write_vocab(&vocab, &cli.out)?;
        println!("wrote {} (the vocabulary alone)", cli.out.display());
        return Ok(ExitCode::SUCCESS);
    };
    let Some(dtype) = DTYPES
        .into_iter()
        .find(|d| format!("{d:?}").eq_ignore_ascii_case(dtype))
    else {
        bail!(
            "--dtype {dtype:?}: expected one of {}",
            DTYPES.map(|d| format!("{d:?}")).join(", ")
        );
    };
    if cli.out.is_file() {
        println!("{} exists; kept", cli.out.display());
        return Ok(ExitCode::SUCCESS);
    }
    let cfg = crate::gpu_check::shape(shape, Some(vocab_size(&vocab)?))?;
    write(&cfg, dtype, cli.seed, &vocab, &cli.out)?;
    println!(
        "wrote {} ({shape} shape, {dtype:?}, seed {})",
        cli.out.display(),
        cli.seed
    );
    Ok(ExitCode::SUCCESS)
}

pub fn main(argv: Vec<std::ffi::OsString>) -> ExitCode {
    crate::gpu_check::subcommand(argv, "write-gguf", |cli: Cli| run(&cli))
}
