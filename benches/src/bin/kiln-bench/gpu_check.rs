//! `kiln-bench gpu-check` (what `cargo xtask gpu-check` bundles and runs): one check for a
//! machine with a real GPU, made for a short, offline session that carries little:
//!
//! 1. the adapter: none, or a CPU-type one (a software Vulkan driver on many cores is not a
//!    GPU result), is refused with the reason and a non-zero exit;
//! 2. the adapter's f16, subgroup sizes and cooperative-matrix configurations; the experimental
//!    kernels (`--kernels experimental`: the integer dot product matvec, and the cooperative
//!    matmul where the adapter has 16 × 16 f16 tiles) against the CPU reference; then the GPU
//!    kernel family against the CPU reference compiled into the same binary: every
//!    weight dtype through `linear` (plain, norm + gated, residual) at 1, 5, 9, 20 and 40 rows, a
//!    layer's K/V write and paged attention for every KV dtype (a prompt step, then a decode
//!    step whose keys split into runs), and the device sampler's picks
//!    over 48 rows of a 49152 vocabulary (greedy, temperature, top-k/p, min-p, edits, masks),
//!    with its time for 16 rows against reading them back and sampling on the host;
//! 3. the roofline microbenchmarks (copy bandwidth, launch cost, matmul rate), a 7B MLP weight
//!    times 1 to 128 rows of X, the matrix-vector kernel's layouts (`MatvecShape`) and the
//!    tiled kernel's split-K thresholds on weights of real shapes;
//! 4. models of real shapes with weights made from a seed (`SyntheticSource`: nothing to
//!    carry), SmolLM2-135M- and 7B-shaped: decode steps at batch 1, 16 and 64 (and batch 1
//!    at context 2048, where attention grows) with the bytes
//!    each reads as a share of the copy bandwidth, pp512 / tg128, the first step's time (its
//!    pipelines compiled: a cold start), and, on a second device with timestamp queries, the
//!    kernels of a decode step at batch 1 and 64 with their device time.
//!
//! It prints a report (a Markdown table for the README) and writes it as JSON to `--out`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use kiln_kv::{BlockId, KvDtype};
use kiln_model::{KvPoolConfig, Model, ModelConfig, ModelRunner, StepSeq, SyntheticSource};
use kiln_tensor::{BackendChoice, DType, Device, DeviceOptions, MatvecShape, Tensor};
use serde::Serialize;

use crate::kernel_checks::{
    Check, kernel_checks, random_blocks, sampling_check, sampling_times, values,
};

#[derive(Debug, Parser)]
#[command(
    name = "kiln-bench gpu-check",
    about = "Check and measure kiln on a real GPU"
)]
struct Cli {
    /// Model shapes to measure: any of smollm2, 7b; none for the kernel checks and sweeps only
    #[arg(long, value_delimiter = ',', default_value = "smollm2,7b")]
    shapes: Vec<String>,
    /// Seed of the synthetic weights and inputs
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the JSON goes [default: $OUT, else the current folder]
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run on a CPU-type adapter anyway, its figures marked as not a GPU result (to try
    /// the check itself where no GPU is)
    #[arg(long)]
    allow_cpu_adapter: bool,
    /// Fewer steps and smaller batches (to try the check itself)
    #[arg(long)]
    quick: bool,
    /// The tiny DeepSeek-V4 model and its transformers goldens (kiln-model's test fixture
    /// folder `deepseek_v4`, which the bundle carries)
    #[arg(long, default_value = crate::v4_checks::FIXTURES)]
    v4_fixtures: PathBuf,
}

/// One model shape's figures.
#[derive(Debug, Clone, Serialize)]
struct ShapeRun {
    shape: String,
    weight_bytes: u64,
    kv_bytes_per_token: u64,
    /// `(batch, context, ms per step, GB/s read, share of the copy bandwidth)`.
    decode: Vec<(usize, usize, f64, f64, f64)>,
    /// Prompt tokens of the pp test and tokens of the tg test (512 and 128 but with --quick).
    pp_tokens: usize,
    tg_tokens: usize,
    pp_tokens_per_s: f64,
    tg_tokens_per_s: f64,
    /// The first pp step, its pipelines compiled: what a cold start costs.
    first_step_s: f64,
    load_s: f64,
    /// Kernel profiles of decode steps (when the adapter has timestamp queries).
    kernels: Vec<KernelProfile>,
}

#[derive(Debug, Clone, Serialize)]
struct Report {
    adapter: String,
    device_type: String,
    backend: String,
    driver: String,
    subgroup_size: (u32, u32),
    /// The adapter's cooperative-matrix configurations (`16x16x16 f16->f32`, ...).
    cooperative_matrix: Vec<String>,
    gpu_result: bool,
    checks: Vec<Check>,
    /// Picking a token from each of 16 rows of 49152 logits (temperature, top-k, top-p): on
    /// the device, and read back and sampled on the host; milliseconds, median of 9.
    sampling_16_rows_ms: (f64, f64),
    ceilings: crate::roofline::Ceilings,
    /// One 7B MLP weight (Q4_1, 11008 × 4096) times m rows, for the m each kernel is chosen
    /// at: `(m, microseconds, weight GB/s)`.
    matmul_sweep: Vec<(usize, f64, f64)>,
    /// The matrix-vector kernel's layouts (`MatvecShape`) at one row of X over weights of
    /// real shapes: the chosen layout's figures beside the alternatives'.
    matvec_shapes: Vec<MatvecRun>,
    /// The tiled matmul by the tiles below which k splits (`DeviceOptions::split_k_workgroups`).
    split_k: Vec<SplitRun>,
    /// The experimental kernels against the tested ones (`--kernels experimental`).
    experimental: Vec<AbRun>,
    shapes: Vec<ShapeRun>,
}

/// An experimental kernel against the tested one it replaces, on one weight.
#[derive(Debug, Clone, Serialize)]
struct AbRun {
    kernel: String,
    weight: String,
    m: usize,
    tested_us: f64,
    experimental_us: f64,
}

/// One split-K threshold on one weight.
#[derive(Debug, Clone, Serialize)]
struct SplitRun {
    target: u32,
    weight: String,
    m: usize,
    us: f64,
}

/// One layout of the matrix-vector kernel on one weight.
#[derive(Debug, Clone, Serialize)]
struct MatvecRun {
    threads_per_row: u32,
    rows_per_thread: u32,
    /// Whether `MatvecShape::choose` picks this layout for this weight.
    default: bool,
    /// The dtype and the weight's rows × k.
    dtype: String,
    m: usize,
    us: f64,
    weight_gb_s: f64,
}

/// `kiln-bench gpu-check [FLAGS]`.
pub fn main(argv: Vec<std::ffi::OsString>) -> ExitCode {
    subcommand(argv, "gpu-check", |cli: Cli| run(&cli))
}

/// A `kiln-bench` subcommand (`gpu-check`, `moe`): its flags parsed from `argv` (`--help` to
/// stdout and 0; a usage error to stderr and 2), then `run`, whose error is printed after
/// the subcommand's `name`.
pub fn subcommand<C: Parser>(
    argv: Vec<std::ffi::OsString>,
    name: &str,
    run: impl FnOnce(C) -> anyhow::Result<ExitCode>,
) -> ExitCode {
    let cli = match C::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{name}: {}", kiln_engine::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    // The GPU kernel family, also when trying the check on a CPU-type adapter.
    let dev = match Device::new(&DeviceOptions {
        backend: BackendChoice::Wgpu,
        cpu_shaped_kernels: Some(false),
        ..DeviceOptions::default()
    }) {
        Ok(d) => d,
        Err(e) => {
            eprintln!(
                "gpu-check: refusing to report: no GPU adapter ({e}); VK_LOADER_DEBUG=driver \
                 shows why the Vulkan loader found no driver"
            );
            return Ok(ExitCode::from(2));
        }
    };
    let info = dev.info();
    let gpu = info.device_type != "cpu";
    println!(
        "gpu-check: {} ({}, {}, {})",
        info.name, info.device_type, info.backend, info.driver
    );
    if !gpu {
        if !cli.allow_cpu_adapter {
            eprintln!(
                "gpu-check: refusing to report: {} is a CPU-type adapter (a software Vulkan \
                 driver on this machine's cores is not a GPU result)",
                info.name
            );
            return Ok(ExitCode::from(3));
        }
        println!("gpu-check: --allow-cpu-adapter: NOT A GPU RESULT");
    }
    // What the tensor-core and dp4a paths depend on, first (run.sh has printed the driver's
    // integer dot product support before this).
    println!(
        "gpu-check: f16 shaders {}, subgroup sizes {:?}, cooperative matrix configurations [{}]",
        info.shader_f16,
        info.subgroup_size,
        crate::kernel_checks::configs(&info)
    );
    let mut checks = crate::kernel_checks::experimental_checks(cli.seed)?;
    checks.extend(kernel_checks(&dev, cli.seed)?);
    checks.extend(crate::v4_checks::v4_checks(&dev, cli.seed)?);
    checks.extend(crate::v4_checks::v4_model_checks(&dev, &cli.v4_fixtures)?);
    checks.push(sampling_check(&dev, cli.seed)?);
    let sampling_16_rows_ms = sampling_times(&dev, cli.seed)?;
    for c in &checks {
        println!(
            "  {} {:<60} max |error| {:.3e} (bound {:.1e})",
            if c.ok { "ok  " } else { "FAIL" },
            c.what,
            c.max_error,
            c.bound
        );
    }
    let failed = checks.iter().filter(|c| !c.ok).count();
    println!(
        "kernel checks: {} of {} within bounds",
        checks.len() - failed,
        checks.len()
    );
    let ceilings = crate::roofline::measure(&dev).context("roofline microbenchmarks")?;
    println!(
        "copy bandwidth {:.1} GB/s, launch cost {:.1} us, best matmul {:.1} GFLOP/s ({})",
        ceilings.copy_bandwidth_gb_s,
        ceilings.dispatch_us,
        ceilings.matmul_gflop_s,
        ceilings.matmul_best
    );
    let matmul_sweep = matmul_sweep(&dev, cli).context("matmul sweep")?;
    let matvec_shapes = matvec_shapes(cli).context("matrix-vector layouts")?;
    let split_k = split_k_sweep(cli).context("split-K thresholds")?;
    let experimental = experimental_ab(&dev, cli).context("experimental kernels' timings")?;
    // A second device with timestamp queries for kernel profiles (each submit waits there, so
    // the timed runs use the first).
    let pdev = Device::new(&DeviceOptions {
        backend: BackendChoice::Wgpu,
        cpu_shaped_kernels: Some(false),
        profile: true,
        ..DeviceOptions::default()
    })
    .ok()
    .filter(|d| d.profile().is_some());
    if pdev.is_none() {
        println!("gpu-check: no timestamp queries on this adapter: no kernel profiles");
    }
    let mut shapes = Vec::new();
    for name in cli.shapes.iter().filter(|s| *s != "none") {
        let cfg = shape(name, None)?;
        match measure_shape(&dev, pdev.as_ref(), name, cfg, cli, &ceilings) {
            Ok(s) => shapes.push(s),
            Err(e) => {
                checks.push(Check {
                    what: format!("{name}: ran"),
                    max_error: f32::NAN,
                    bound: 0.0,
                    ok: false,
                });
                eprintln!("gpu-check: {name}: {e:#}");
            }
        }
    }
    let report = Report {
        adapter: info.name.clone(),
        device_type: info.device_type.clone(),
        backend: info.backend.clone(),
        driver: info.driver.clone(),
        subgroup_size: info.subgroup_size,
        cooperative_matrix: info
            .cooperative_matrix
            .iter()
            .map(ToString::to_string)
            .collect(),
        gpu_result: gpu,
        checks,
        sampling_16_rows_ms,
        ceilings,
        matmul_sweep,
        matvec_shapes,
        split_k,
        experimental,
        shapes,
    };
    print_table(&report);
    let out = cli
        .out
        .clone()
        .or_else(|| std::env::var_os("OUT").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&out).ok();
    let path = out.join("gpu-check.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    let bad = report.checks.iter().any(|c| !c.ok);
    Ok(if bad {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// [`Report::matmul_sweep`]: the time of `Recorder::matmul` with a 7B MLP weight (Q4_1,
/// 11008 × 4096) over rows of X, for where each kernel takes over.
fn matmul_sweep(dev: &Device, cli: &Cli) -> anyhow::Result<Vec<(usize, f64, f64)>> {
    let (n, k) = if cli.quick {
        (1024, 1024)
    } else {
        (11008, 4096)
    };
    let ws = sweep_weight(dev, DType::Q4_1, n, k, cli.seed, cli.quick)?;
    let bytes = DType::Q4_1.bytes_for(n * k).context("weight size")? as f64;
    let mut out = Vec::new();
    println!(
        "matmul, Q4_1 weight {n} x {k} ({} copies in turn: read from memory):",
        ws.len()
    );
    for m in [1usize, 2, 4, 8, 9, 16, 32, 64, 128] {
        let x = Tensor::from_f32(dev, &[m, k], &values(cli.seed ^ m as u64, m * k))?;
        let s = crate::roofline::matmul_seconds_over(dev, &x, &ws)?;
        let gb_s = bytes / s / 1e9;
        println!(
            "  m {m:>3}: {:>9.1} us, weight read at {gb_s:>7.1} GB/s, {:>8.1} GFLOP/s",
            s * 1e6,
            2.0 * (m * n * k) as f64 / s / 1e9
        );
        out.push((m, s * 1e6, gb_s));
    }
    Ok(out)
}

/// [`Report::experimental`]: each experimental kernel against the tested one it replaces, on
/// a 7B MLP weight read from memory: the integer dot product matvec at 1 and 4 rows of X over
/// Q4_0 and Q8_0, and, where the adapter has it, the cooperative matmul at 64 and 512 rows over
/// Q4_0, Q4_K and F16. Microseconds a launch, tested then experimental.
fn experimental_ab(dev: &Device, cli: &Cli) -> anyhow::Result<Vec<AbRun>> {
    let exp = Device::new(&DeviceOptions {
        backend: BackendChoice::Wgpu,
        cpu_shaped_kernels: Some(dev.cpu_shaped_kernels()),
        kernels: kiln_tensor::Kernels::Experimental,
        ..DeviceOptions::default()
    })?;
    let (n, k) = if cli.quick {
        (1024, 1024)
    } else {
        (11008, 4096)
    };
    let mut cases: Vec<(&str, DType, usize)> = Vec::new();
    for dtype in [DType::Q4_0, DType::Q8_0] {
        cases.extend([("dp4a matvec", dtype, 1), ("dp4a matvec", dtype, 4)]);
    }
    if exp.info().coop_matmul {
        for dtype in [DType::Q4_0, DType::Q4_K, DType::F16] {
            cases.extend([("coop matmul", dtype, 64), ("coop matmul", dtype, 512)]);
        }
    }
    println!("experimental kernels against the tested ones, {n} x {k} weights, us a launch:");
    let mut out = Vec::new();
    for (kernel, dtype, m) in cases {
        let x = values(cli.seed ^ m as u64, m * k);
        let mut us = [0f64; 2];
        for (slot, d) in [dev, &exp].into_iter().enumerate() {
            let ws = sweep_weight(d, dtype, n, k, cli.seed, cli.quick)?;
            let xt = Tensor::from_f32(d, &[m, k], &x)?;
            us[slot] = crate::roofline::matmul_seconds_over(d, &xt, &ws)? * 1e6;
        }
        println!(
            "  {kernel:<12} {dtype:?} m {m:>3}: tested {:>9.1}, experimental {:>9.1} ({:.2}x)",
            us[0],
            us[1],
            us[0] / us[1]
        );
        out.push(AbRun {
            kernel: kernel.to_owned(),
            weight: format!("{dtype:?} {n}x{k}"),
            m,
            tested_us: us[0],
            experimental_us: us[1],
        });
    }
    Ok(out)
}

/// The weights (rows × k) the layout and split sweeps time: a 7B model's MLP up and down,
/// its attention output, and SmolLM2's MLP down and up.
fn sweep_weights(quick: bool) -> Vec<(usize, usize)> {
    if quick {
        vec![(1024, 512), (512, 1024)]
    } else {
        vec![
            (11008, 4096),
            (4096, 11008),
            (4096, 4096),
            (576, 1536),
            (1536, 576),
        ]
    }
}

/// Bytes of weight copies a sweep cycles through: well past a GPU's last-level cache (50 MB
/// on an H200), so that each launch reads its weight from memory as a model's step does.
const SWEEP_BYTES: usize = 256 << 20;

/// Copies of a random weight of `dtype`, `n` × `k`, on `dev`: as many as fill
/// [`SWEEP_BYTES`] (at most 64; one with --quick).
fn sweep_weight(
    dev: &Device,
    dtype: DType,
    n: usize,
    k: usize,
    seed: u64,
    quick: bool,
) -> anyhow::Result<Vec<Tensor>> {
    let blocks = n * k / dtype.block_elems();
    let bytes = random_blocks(dtype, blocks, seed);
    let copies = if quick {
        1
    } else {
        SWEEP_BYTES.div_ceil(bytes.len()).clamp(1, 64)
    };
    (0..copies)
        .map(|_| Ok(Tensor::from_bytes(dev, dtype, &[n, k], &bytes)?))
        .collect()
}

/// [`Report::matvec_shapes`]: each layout on a device of its own, over [`sweep_weights`] (each
/// read from memory, [`sweep_weight`]) at
/// one row of X (Q4_1, and Q4_K on the first two), beside the layout `MatvecShape::choose`
/// picks for each weight.
fn matvec_shapes(cli: &Cli) -> anyhow::Result<Vec<MatvecRun>> {
    let weights = sweep_weights(cli.quick);
    let mut runs: Vec<(DType, usize, usize)> =
        weights.iter().map(|&(n, k)| (DType::Q4_1, n, k)).collect();
    runs.extend(weights.iter().take(2).map(|&(n, k)| (DType::Q4_K, n, k)));
    let layouts = [
        (16, 1),
        (16, 2),
        (16, 4),
        (32, 1),
        (32, 2),
        (32, 4),
        (32, 8),
        (64, 1),
        (64, 2),
        (64, 4),
    ];
    println!(
        "matrix-vector kernel layouts, 1 row of X, us (threads a row x rows a thread; * marks the chosen):"
    );
    let mut head = String::from("  layout ");
    for (dtype, n, k) in &runs {
        head.push_str(&format!(" {:>16}", format!("{dtype:?} {n}x{k}")));
    }
    println!("{head}");
    let mut out = Vec::new();
    for (t, r) in layouts {
        let shape = MatvecShape {
            threads_per_row: t,
            rows_per_thread: r,
        };
        let dev = Device::new(&DeviceOptions {
            backend: BackendChoice::Wgpu,
            cpu_shaped_kernels: Some(false),
            matvec_shape: Some(shape),
            ..DeviceOptions::default()
        })?;
        let mut line = format!("  {t:>2} x {r}  ");
        for &(dtype, n, k) in &runs {
            let ws = sweep_weight(&dev, dtype, n, k, cli.seed, cli.quick)?;
            let x = Tensor::from_f32(&dev, &[1, k], &values(cli.seed ^ 1, k))?;
            let s = crate::roofline::matmul_seconds_over(&dev, &x, &ws)?;
            let bytes = dtype.bytes_for(n * k).context("weight size")? as f64;
            let chosen = MatvecShape::choose(false, n) == shape;
            line.push_str(&format!(
                " {:>15.1}{}",
                s * 1e6,
                if chosen { "*" } else { " " }
            ));
            out.push(MatvecRun {
                threads_per_row: t,
                rows_per_thread: r,
                default: chosen,
                dtype: format!("{dtype:?} {n}x{k}"),
                m: 1,
                us: s * 1e6,
                weight_gb_s: bytes / s / 1e9,
            });
        }
        println!("{line}");
    }
    Ok(out)
}

/// [`Report::split_k`]: the tiled matmul at 16 and 64 rows of X over [`sweep_weights`] (Q4_1),
/// on devices that split k below 0 (never), 128, 256 and 512 tiles.
fn split_k_sweep(cli: &Cli) -> anyhow::Result<Vec<SplitRun>> {
    let weights = sweep_weights(cli.quick);
    println!(
        "tiled matmul, Q4_1, us, by the tiles below which k splits (0: never; * the default):"
    );
    let mut out = Vec::new();
    for target in [0u32, 128, 256, 512] {
        let dev = Device::new(&DeviceOptions {
            backend: BackendChoice::Wgpu,
            cpu_shaped_kernels: Some(false),
            split_k_workgroups: Some(target),
            ..DeviceOptions::default()
        })?;
        let default = target == kiln_tensor::DEFAULT_SPLIT_K_WORKGROUPS;
        let mut line = format!("  {target:>4}{}", if default { "*" } else { " " });
        for &(n, k) in &weights {
            let ws = sweep_weight(&dev, DType::Q4_1, n, k, cli.seed, cli.quick)?;
            for m in [16usize, 64] {
                let x = Tensor::from_f32(&dev, &[m, k], &values(cli.seed ^ m as u64, m * k))?;
                let s = crate::roofline::matmul_seconds_over(&dev, &x, &ws)?;
                line.push_str(&format!("  {n}x{k} m{m} {:>7.1}", s * 1e6));
                out.push(SplitRun {
                    target,
                    weight: format!("{n}x{k}"),
                    m,
                    us: s * 1e6,
                });
            }
        }
        println!("{line}");
    }
    Ok(out)
}

/// The model shape `name` (`smollm2`, `7b`) as its `config.json` states it, with `vocab`
/// tokens where given (a model written with another file's vocabulary).
pub(crate) fn shape(name: &str, vocab: Option<usize>) -> anyhow::Result<ModelConfig> {
    let json = match name {
        "smollm2" => {
            r#"{"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
            "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": true}"#
        }
        "7b" => {
            r#"{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
            "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": false}"#
        }
        other => bail!("unknown shape {other:?} (expected smollm2, 7b)"),
    };
    let mut cfg = ModelConfig::from_hf_json(name, json)?;
    if let Some(v) = vocab {
        cfg.vocab = v;
    }
    Ok(cfg)
}

/// Blocks `[first, first + n)`.
pub(crate) fn table(first: u32, n: usize) -> Vec<BlockId> {
    (first..first + n as u32).map(BlockId).collect()
}

/// A decode workload: `b` sequences of `ctx` prompt tokens each, blocks of `per_seq`.
pub(crate) struct Decode {
    pub b: usize,
    pub ctx: usize,
    pub per_seq: usize,
    pub seed: u64,
    pub vocab: usize,
}

impl Decode {
    pub fn ids(&self, n: usize, s: u64) -> Vec<u32> {
        values(s, n)
            .iter()
            .map(|v| ((v + 1.0) * 0.5 * (self.vocab - 1) as f32) as u32)
            .collect()
    }

    /// Prefills every sequence (at most 2048 tokens a step), runs one step (this batch size's
    /// pipelines), calls `warm`, then `steps` steps of the whole batch: their seconds.
    pub fn run(
        &self,
        runner: &mut ModelRunner,
        steps: usize,
        warm: impl FnOnce(),
    ) -> anyhow::Result<f64> {
        let (b, ctx) = (self.b, self.ctx);
        let tables: Vec<Vec<BlockId>> = (0..b)
            .map(|i| table((i * self.per_seq) as u32, self.per_seq))
            .collect();
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|i| self.ids(ctx, self.seed ^ i as u64))
            .collect();
        for chunk in (0..b).collect::<Vec<_>>().chunks((2048 / ctx).max(1)) {
            let seqs: Vec<StepSeq<'_>> = chunk
                .iter()
                .map(|&i| StepSeq {
                    tokens: &prompts[i],
                    block_table: &tables[i],
                    kept_table: &[],
                    context_len: ctx,
                    logits_rows: 1,
                    read_logits: false,
                    sample: None,
                })
                .collect();
            runner.step(&seqs, &[])?;
        }
        let mut run_steps = |n: usize, from: usize| -> anyhow::Result<f64> {
            let start = Instant::now();
            for s in 0..n {
                let seqs: Vec<StepSeq<'_>> = (0..b)
                    .map(|i| StepSeq {
                        tokens: &prompts[i][s % ctx..s % ctx + 1],
                        block_table: &tables[i],
                        kept_table: &[],
                        context_len: ctx + from + s + 1,
                        logits_rows: 1,
                        read_logits: false,
                        sample: None,
                    })
                    .collect();
                runner.step(&seqs, &[])?;
            }
            Ok(start.elapsed().as_secs_f64())
        };
        run_steps(1, 0)?;
        warm();
        run_steps(steps, 1)
    }
}

/// The kernels of one decode step at a batch, from a profiling device (timestamp queries).
#[derive(Debug, Clone, Serialize)]
struct KernelProfile {
    batch: usize,
    launches_per_step: f64,
    device_ms_per_step: f64,
    /// `(kernel, launches per step, ms per step)`, longest first.
    kernels: Vec<(String, f64, f64)>,
}

fn measure_shape(
    dev: &Device,
    pdev: Option<&Device>,
    name: &str,
    cfg: ModelConfig,
    cli: &Cli,
    c: &crate::roofline::Ceilings,
) -> anyhow::Result<ShapeRun> {
    let (batches, steps, ctx): (&[usize], usize, usize) = if cli.quick {
        (&[1, 4], 4, 32)
    } else {
        (&[1, 16, 64], 32, 128)
    };
    let (pp, tg): (usize, usize) = if cli.quick { (64, 8) } else { (512, 128) };
    // One sequence at a long context too: decode where attention, not weights, grows.
    let long_ctx = if cli.quick { 256 } else { 2048 };
    let widest = batches.iter().copied().max().unwrap_or(1);
    let per_seq = |ctx: usize| (ctx + steps + 2).div_ceil(16);
    let blocks = (widest * per_seq(ctx))
        .max(per_seq(long_ctx))
        .max((pp + tg + 2).div_ceil(16))
        + 1;
    let src = SyntheticSource::new(cfg.clone(), DType::Q4_1, cli.seed)?;
    let pool = KvPoolConfig {
        block_size: 16,
        num_blocks: u32::try_from(blocks)?,
        dtype: KvDtype::F16,
    };
    let load = |d: &Device| -> anyhow::Result<ModelRunner> {
        Ok(ModelRunner::new(Model::load(d, cfg.clone(), &src)?, pool)?)
    };
    let t0 = Instant::now();
    let mut runner = load(dev)?;
    let weight_bytes = runner.weight_bytes();
    let kv_bytes_per_token = 2
        * (cfg.layers * cfg.kv_heads) as u64
        * KvDtype::F16.head_bytes(u32::try_from(cfg.head_dim)?);
    let load_s = t0.elapsed().as_secs_f64();
    println!(
        "{name}: {:.1} MB of Q4_1 weights loaded in {load_s:.1} s",
        weight_bytes as f64 / 1e6
    );
    let workload = |b: usize, ctx: usize| Decode {
        b,
        ctx,
        per_seq: per_seq(ctx),
        seed: cli.seed,
        vocab: cfg.vocab,
    };
    // pp / tg: one sequence, the prompt in one step, then tg decode steps.
    let t = table(0, (pp + tg + 2).div_ceil(16));
    let prompt = workload(1, ctx).ids(pp, cli.seed ^ 0x99);
    fn one<'a>(tokens: &'a [u32], t: &'a [BlockId], ctx_len: usize) -> StepSeq<'a> {
        StepSeq {
            tokens,
            block_table: t,
            kept_table: &[],
            context_len: ctx_len,
            logits_rows: 1,
            read_logits: false,
            sample: None,
        }
    }
    // The first step compiles its pipelines: what a cold start costs.
    let start = Instant::now();
    runner.step(&[one(&prompt, &t, pp)], &[])?;
    let first_step_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    runner.step(&[one(&prompt, &t, pp)], &[])?;
    let pp_s = start.elapsed().as_secs_f64();
    println!("  first step (pp{pp}, pipelines compiled): {first_step_s:.2} s, then {pp_s:.3} s");
    let start = Instant::now();
    for i in 0..tg {
        runner.step(&[one(&prompt[i % pp..i % pp + 1], &t, pp + 1 + i)], &[])?;
    }
    let tg_s = start.elapsed().as_secs_f64();
    let mut decode = Vec::new();
    let runs = batches.iter().map(|&b| (b, ctx)).chain([(1, long_ctx)]);
    for (b, ctx) in runs {
        let secs = workload(b, ctx).run(&mut runner, steps, || {})?;
        let ms = secs * 1e3 / steps as f64;
        let mean_ctx = ctx + 1 + steps / 2;
        let bytes = weight_bytes + kv_bytes_per_token * (b * mean_ctx) as u64;
        let gb_s = bytes as f64 / (ms * 1e6);
        decode.push((b, mean_ctx, ms, gb_s, gb_s / c.copy_bandwidth_gb_s));
        println!(
            "  decode batch {b:>3} (context {mean_ctx}): {ms:.2} ms/step, {:.0} tokens/s, {gb_s:.1} GB/s read = {:.0}% of the copy bandwidth",
            b as f64 * 1e3 / ms,
            gb_s / c.copy_bandwidth_gb_s * 100.0
        );
    }
    drop(runner);
    // Where a decode step's device time goes, at batch 1 and the widest batch.
    let mut kernels = Vec::new();
    if let Some(pdev) = pdev {
        let mut prunner = load(pdev)?;
        for b in [1, widest] {
            let n = 4;
            workload(b, ctx).run(&mut prunner, n, || pdev.reset_profile())?;
            let Some(p) = pdev.profile() else { break };
            let per = p.submits.max(1) as f64;
            let kp = KernelProfile {
                batch: b,
                launches_per_step: p.dispatches as f64 / per,
                device_ms_per_step: p.total_ns() / 1e6 / per,
                kernels: p
                    .kernels
                    .iter()
                    .map(|k| {
                        (
                            k.name.clone(),
                            k.launches as f64 / per,
                            k.total_ns / 1e6 / per,
                        )
                    })
                    .collect(),
            };
            println!(
                "  kernels, decode batch {b}: {:.0} launches, {:.2} ms of device time a step",
                kp.launches_per_step, kp.device_ms_per_step
            );
            for (k, l, ms) in kp.kernels.iter().take(8) {
                println!(
                    "    {k:<32} {l:>5.0} launches {ms:>8.3} ms  {:>5.1} us each",
                    ms * 1e3 / l.max(1.0)
                );
            }
            kernels.push(kp);
        }
    }
    Ok(ShapeRun {
        shape: name.to_owned(),
        weight_bytes,
        kv_bytes_per_token,
        decode,
        pp_tokens: pp,
        tg_tokens: tg,
        pp_tokens_per_s: pp as f64 / pp_s,
        tg_tokens_per_s: tg as f64 / tg_s,
        first_step_s,
        load_s,
        kernels,
    })
}

fn print_table(r: &Report) {
    println!();
    println!(
        "{} ({}, {}){}: copy {:.1} GB/s, launch {:.1} us, matmul {:.1} GFLOP/s; kernel checks {}/{}",
        r.adapter,
        r.backend,
        r.driver,
        if r.gpu_result {
            ""
        } else {
            " — NOT A GPU RESULT"
        },
        r.ceilings.copy_bandwidth_gb_s,
        r.ceilings.dispatch_us,
        r.ceilings.matmul_gflop_s,
        r.checks.iter().filter(|c| c.ok).count(),
        r.checks.len()
    );
    println!(
        "sampling 16 rows of 49152 (temperature 0.8, top-k 50, top-p 0.95): device {:.2} ms, \
         read back + host {:.2} ms",
        r.sampling_16_rows_ms.0, r.sampling_16_rows_ms.1
    );
    println!("| shape | weights | test | t/s | ms/step | share of copy bandwidth |");
    println!("| --- | ---: | --- | ---: | ---: | ---: |");
    for s in &r.shapes {
        let mb = format!("{:.0} MB", s.weight_bytes as f64 / 1e6);
        println!(
            "| {} | {mb} | pp{} | {:.1} | | |",
            s.shape, s.pp_tokens, s.pp_tokens_per_s
        );
        println!(
            "| {} | {mb} | tg{} | {:.1} | | |",
            s.shape, s.tg_tokens, s.tg_tokens_per_s
        );
        for (b, ctx, ms, _, share) in &s.decode {
            println!(
                "| {} | {mb} | decode batch {b} (context {ctx}) | {:.1} | {ms:.2} | {:.0}% |",
                s.shape,
                *b as f64 * 1e3 / ms,
                share * 100.0
            );
        }
    }
}
