//! `profile` scenario: what a step costs, for the prefill of one prompt and for decode steps
//! at batch 1, 16 and 64:
//!
//! - on the engine itself: wall time of a step and its host time (recording its launches;
//!   encoding and submitting them, bind groups included; never the device wait);
//! - on a second device opened with profiling (timestamp queries, one pass a launch, a wait
//!   at every submit: a diagnostic, not a throughput mode): launches and device time per
//!   kernel.
//!
//! With the roofline's measured dispatch cost and copy bandwidth, [`budget`] models a step as
//! launches × dispatch + bytes read ÷ bandwidth, next to what it measured.

use std::time::Instant;

use anyhow::{Context, bail};
use kiln_engine::{EngineHandle, Event, Request, RequestStream};
use kiln_tensor::{BackendChoice, Device, DeviceOptions, HostStats};
use serde::Serialize;

use crate::stats::Prompts;
use crate::target::{self, EngineSizing};

/// Prompt tokens of each sequence in the batched decode profiles (short: 64 prompts are
/// prefilled first, on lavapipe at tens of tokens a second).
pub const BATCH_PROMPT: usize = 32;
/// Decode steps measured per batch size.
pub const BATCH_STEPS: usize = 16;

/// One kernel's share of a step.
#[derive(Debug, Clone, Serialize)]
pub struct KernelRow {
    pub name: String,
    pub launches_per_step: f64,
    pub us_per_launch: f64,
    pub ms_per_step: f64,
    pub share: f64,
}

/// What one kind of step costs.
#[derive(Debug, Clone, Serialize)]
pub struct StepProfile {
    /// Sequences in each step (1 for the prefill: one prompt).
    pub batch: usize,
    /// Tokens of context of each sequence, mean over the steps.
    pub context_tokens: usize,
    /// Steps measured (submits).
    pub steps: u64,
    pub launches_per_step: f64,
    /// Summed device time of a step's launches (the profiling device).
    pub device_ms_per_step: f64,
    /// Wall time of a step on the engine (no profiling).
    pub wall_ms_per_step: f64,
    /// Host time of a step on the engine: recording, then encoding and submitting.
    pub host_record_ms_per_step: f64,
    pub host_encode_ms_per_step: f64,
    /// Bind groups made and reused a step.
    pub bind_groups_made_per_step: f64,
    pub bind_groups_reused_per_step: f64,
    pub kernels: Vec<KernelRow>,
}

/// The prefill step and the decode steps at each batch size.
#[derive(Debug, Clone, Serialize)]
pub struct StreamProfile {
    pub prompt_tokens: usize,
    pub prefill: StepProfile,
    pub decode: Vec<StepProfile>,
}

/// A step's modelled cost: its launches at the measured launch cost, plus the larger of the
/// bytes it reads (every weight, each sequence's K/V) at the measured copy bandwidth and its
/// matmul FLOPs at kiln's measured best matmul rate; what the device took beyond that model is
/// the kernels' own inefficiency ("other").
#[derive(Debug, Clone, Serialize)]
pub struct Budget {
    pub batch: usize,
    pub launch_ms: f64,
    pub bytes: u64,
    pub bytes_ms: f64,
    pub gflop: f64,
    pub flops_ms: f64,
    pub budget_ms: f64,
    pub device_ms: f64,
    pub wall_ms: f64,
    /// The largest of launches, bytes, flops and other (device time past the budget).
    pub dominant: &'static str,
}

/// The step budgets of a profile given the roofline's ceilings and the model.
pub fn budget(
    p: &StreamProfile,
    c: &crate::roofline::Ceilings,
    cfg: &kiln_model::ModelConfig,
    weight_bytes: u64,
    kv_bytes_per_token: u64,
) -> Vec<Budget> {
    let decode_flops = |batch: usize, ctx: usize| {
        let par = crate::roofline::params(cfg);
        let attn = 4.0 * (cfg.layers * cfg.heads * cfg.head_dim * ctx) as f64;
        batch as f64 * (2.0 * (par.layers + par.lm_head) as f64 + attn)
    };
    std::iter::once(&p.prefill)
        .chain(&p.decode)
        .enumerate()
        .map(|(i, s)| {
            let launch_ms = s.launches_per_step * c.dispatch_us / 1e3;
            let bytes = weight_bytes + kv_bytes_per_token * (s.batch * s.context_tokens) as u64;
            let bytes_ms = bytes as f64 / (c.copy_bandwidth_gb_s * 1e6);
            let flops = if i == 0 {
                crate::roofline::prefill_flops(cfg, s.context_tokens)
            } else {
                decode_flops(s.batch, s.context_tokens)
            };
            let flops_ms = flops / (c.matmul_gflop_s * 1e6);
            let budget_ms = launch_ms + bytes_ms.max(flops_ms);
            let other = s.device_ms_per_step - budget_ms;
            let terms = [
                ("launches", launch_ms),
                ("bytes", bytes_ms),
                ("flops", flops_ms),
                ("other", other),
            ];
            let dominant = terms
                .iter()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map_or("-", |t| t.0);
            Budget {
                batch: s.batch,
                launch_ms,
                bytes,
                bytes_ms,
                gflop: flops / 1e9,
                flops_ms,
                budget_ms,
                device_ms: s.device_ms_per_step,
                wall_ms: s.wall_ms_per_step,
                dominant,
            }
        })
        .collect()
}

/// What one measured run gave: steps, wall time, host statistics, kernel profile.
struct Measured {
    steps: u64,
    wall_ms: f64,
    host: HostStats,
    profile: Option<kiln_tensor::Profile>,
}

/// Waits for a stream's first token.
async fn first_token(s: &mut RequestStream) -> anyhow::Result<()> {
    while let Some(ev) = s.recv().await {
        match ev {
            Event::Delta(d) if !d.token_ids.is_empty() => return Ok(()),
            Event::Delta(_) | Event::PromptLogprobs(_) => {}
            Event::Finished(_) => bail!("a profiled request ended before its first token"),
            Event::Error(e) => return Err(anyhow::Error::new(e).context("profiled request")),
        }
    }
    bail!("a profiled request's stream closed early")
}

/// Drains a stream, counting its tokens.
async fn rest(s: &mut RequestStream) -> anyhow::Result<usize> {
    let mut n = 0;
    while let Some(ev) = s.recv().await {
        match ev {
            Event::Delta(d) => n += d.token_ids.len(),
            Event::PromptLogprobs(_) => {}
            Event::Finished(_) => return Ok(n),
            Event::Error(e) => return Err(anyhow::Error::new(e).context("profiled request")),
        }
    }
    bail!("a profiled request's stream closed early")
}

fn request(ids: Vec<u32>, new: usize) -> Request {
    let mut r = Request::tokens(ids).max_new_tokens(new);
    r.stopping.ignore_eos = true;
    r.speculate = false;
    r
}

/// `batch` fresh prompts of `prompt` tokens submitted together; once every one has its first
/// token (the prefills are done), the statistics are reset and `steps` decode steps of the
/// whole batch are measured.
async fn decode_steps(
    engine: &EngineHandle,
    dev: &Device,
    prompts: &mut Prompts,
    batch: usize,
    prompt: usize,
    steps: usize,
) -> anyhow::Result<Measured> {
    let mut streams = (0..batch)
        .map(|_| engine.submit(request(prompts.fresh(prompt), steps + 1)))
        .collect::<Result<Vec<_>, _>>()?;
    for s in &mut streams {
        first_token(s).await?;
    }
    dev.reset_profile();
    dev.reset_host_stats();
    let t0 = Instant::now();
    for s in &mut streams {
        let n = rest(s).await?;
        if n != steps {
            bail!("a profiled request gave {n} decode tokens, not {steps}");
        }
    }
    Ok(Measured {
        steps: steps as u64,
        wall_ms: t0.elapsed().as_secs_f64() * 1e3,
        host: dev.host_stats().unwrap_or_default(),
        profile: dev.profile(),
    })
}

/// The prefill of one `prompt`-token prompt, as one step.
async fn prefill_step(
    engine: &EngineHandle,
    dev: &Device,
    prompts: &mut Prompts,
    prompt: usize,
) -> anyhow::Result<Measured> {
    dev.reset_profile();
    dev.reset_host_stats();
    let t0 = Instant::now();
    let mut s = engine.submit(request(prompts.fresh(prompt), 1))?;
    first_token(&mut s).await?;
    let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    let m = Measured {
        steps: 1,
        wall_ms,
        host: dev.host_stats().unwrap_or_default(),
        profile: dev.profile(),
    };
    rest(&mut s).await?;
    Ok(m)
}

fn step_profile(batch: usize, context: usize, wall: &Measured, prof: &Measured) -> StepProfile {
    let steps = wall.steps.max(1) as f64;
    let hsteps = wall.host.submits.max(1) as f64;
    let p = prof.profile.clone().unwrap_or_default();
    let psteps = p.submits.max(1) as f64;
    let total = p.total_ns();
    StepProfile {
        batch,
        context_tokens: context,
        steps: wall.steps,
        launches_per_step: p.dispatches as f64 / psteps,
        device_ms_per_step: total / 1e6 / psteps,
        wall_ms_per_step: wall.wall_ms / steps,
        host_record_ms_per_step: wall.host.record_ns as f64 / 1e6 / hsteps,
        host_encode_ms_per_step: wall.host.encode_ns as f64 / 1e6 / hsteps,
        bind_groups_made_per_step: wall.host.bind_groups_made as f64 / hsteps,
        bind_groups_reused_per_step: wall.host.bind_groups_reused as f64 / hsteps,
        kernels: p
            .kernels
            .iter()
            .map(|k| KernelRow {
                name: k.name.clone(),
                launches_per_step: k.launches as f64 / psteps,
                us_per_launch: k.total_ns / 1e3 / k.launches.max(1) as f64,
                ms_per_step: k.total_ns / 1e6 / psteps,
                share: if total > 0.0 { k.total_ns / total } else { 0.0 },
            })
            .collect(),
    }
}

/// Profiles the prefill of a `prompt`-token prompt and decode at each of `batches`, on the
/// engine (`engine` on `dev`) and on a second, profiling device. `Err` with a reason when the
/// device has nothing to profile.
pub async fn run(
    model: &std::path::Path,
    backend: BackendChoice,
    engine: &EngineHandle,
    dev: &Device,
    prompts: &mut Prompts,
    prompt: usize,
    batches: &[usize],
) -> anyhow::Result<Result<StreamProfile, String>> {
    let pdev = Device::new(&DeviceOptions {
        backend,
        profile: true,
        ..DeviceOptions::default()
    })
    .context("opening a profiling device")?;
    if pdev.is_cpu() || dev.is_cpu() {
        return Ok(Err("the CPU backend runs no kernels".into()));
    }
    if pdev.profile().is_none() {
        return Ok(Err(format!(
            "{} has no timestamp queries",
            pdev.info().name
        )));
    }
    let widest = batches.iter().copied().max().unwrap_or(1);
    let per_seq = |tokens: usize| tokens.div_ceil(16) + 1;
    let blocks = (per_seq(prompt + 2) + widest * per_seq(BATCH_PROMPT + BATCH_STEPS + 2)) * 2 + 8;
    let sizing = EngineSizing {
        kv_blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        max_num_seqs: widest,
        // The whole prompt in one step, so the prefill profile is one step.
        max_num_batched_tokens: prompt.max(64),
        max_waiting: widest,
        prefix_caching: false,
        speculative: None,
    };
    let pengine = target::start_engine(target::open(model)?, &pdev, &sizing, None)?.engine;
    let result = async {
        // Warm-up: every batch's pipelines compile outside the measured steps.
        for &b in batches {
            decode_steps(&pengine, &pdev, prompts, b, BATCH_PROMPT, 2).await?;
            decode_steps(engine, dev, prompts, b, BATCH_PROMPT, 2).await?;
        }
        prefill_step(&pengine, &pdev, prompts, prompt).await?;
        let prefill = step_profile(
            1,
            prompt,
            &prefill_step(engine, dev, prompts, prompt).await?,
            &prefill_step(&pengine, &pdev, prompts, prompt).await?,
        );
        let mut decode = Vec::new();
        for &b in batches {
            let wall = decode_steps(engine, dev, prompts, b, BATCH_PROMPT, BATCH_STEPS).await?;
            let prof = decode_steps(&pengine, &pdev, prompts, b, BATCH_PROMPT, BATCH_STEPS).await?;
            decode.push(step_profile(
                b,
                BATCH_PROMPT + BATCH_STEPS / 2,
                &wall,
                &prof,
            ));
        }
        Ok(StreamProfile {
            prompt_tokens: prompt,
            prefill,
            decode,
        })
    }
    .await;
    pengine.shutdown(kiln_engine::ShutdownMode::Drain).await;
    result.map(Ok)
}

pub fn print(p: &StreamProfile, budgets: Option<&[Budget]>) {
    println!(
        "profile: a {}-token prefill, then decode steps at {}-token prompts (device time from timestamp queries, one pass a launch; wall and host time on the engine)",
        p.prompt_tokens, BATCH_PROMPT
    );
    println!(
        "  {:<8} {:>6} {:>9} {:>11} {:>11} {:>10} {:>9} {:>13}",
        "step",
        "batch",
        "launches",
        "host rec ms",
        "host enc ms",
        "device ms",
        "wall ms",
        "bind made/re"
    );
    for (i, s) in std::iter::once(&p.prefill).chain(&p.decode).enumerate() {
        println!(
            "  {:<8} {:>6} {:>9.1} {:>11.3} {:>11.3} {:>10.2} {:>9.2} {:>6.0}/{:<6.0}",
            if i == 0 { "prefill" } else { "decode" },
            s.batch,
            s.launches_per_step,
            s.host_record_ms_per_step,
            s.host_encode_ms_per_step,
            s.device_ms_per_step,
            s.wall_ms_per_step,
            s.bind_groups_made_per_step,
            s.bind_groups_reused_per_step,
        );
    }
    if let Some(b) = budgets {
        println!(
            "  budget: launches x launch cost + max(bytes read / copy bandwidth, FLOPs / best matmul rate)"
        );
        println!(
            "  {:<8} {:>6} {:>10} {:>8} {:>9} {:>7} {:>9} {:>10} {:>10} {:>9}  dominant",
            "step",
            "batch",
            "launch ms",
            "MB read",
            "bytes ms",
            "GFLOP",
            "flops ms",
            "budget ms",
            "device ms",
            "wall ms"
        );
        for (i, x) in b.iter().enumerate() {
            println!(
                "  {:<8} {:>6} {:>10.2} {:>8.1} {:>9.2} {:>7.2} {:>9.2} {:>10.2} {:>10.2} {:>9.2}  {}",
                if i == 0 { "prefill" } else { "decode" },
                x.batch,
                x.launch_ms,
                x.bytes as f64 / 1e6,
                x.bytes_ms,
                x.gflop,
                x.flops_ms,
                x.budget_ms,
                x.device_ms,
                x.wall_ms,
                x.dominant
            );
        }
    }
    for (i, s) in std::iter::once(&p.prefill).chain(&p.decode).enumerate() {
        println!(
            "  kernels of a {} step at batch {}:",
            if i == 0 { "prefill" } else { "decode" },
            s.batch
        );
        println!(
            "    {:<24} {:>9} {:>11} {:>10} {:>7}",
            "kernel", "per step", "us/launch", "ms/step", "share"
        );
        for k in &s.kernels {
            println!(
                "    {:<24} {:>9.1} {:>11.1} {:>10.3} {:>6.1}%",
                k.name,
                k.launches_per_step,
                k.us_per_launch,
                k.ms_per_step,
                k.share * 100.0
            );
        }
    }
    println!();
}
