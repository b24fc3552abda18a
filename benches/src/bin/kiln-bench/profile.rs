//! `profile` scenario: where a step's device time goes, per kernel, from timestamp queries
//! (`DeviceOptions::profile`). It opens a second device with profiling on, loads the model
//! there, runs one stream (the single scenario's prompt length, then 32 decode steps), and
//! reports launches per step and device time per kernel for the prefill step and for the
//! decode steps apart. Profiling puts every launch in its own pass and waits at every submit,
//! so its wall time per step is not the engine's ITL; the device time per kernel is what it is
//! for.

use std::time::Instant;

use anyhow::{Context, bail};
use kiln_engine::{Event, Request};
use kiln_tensor::{BackendChoice, Device, DeviceOptions};
use serde::Serialize;

use crate::stats::Prompts;
use crate::target::{self, EngineSizing};

/// One kernel's share of a decode step.
#[derive(Debug, Clone, Serialize)]
pub struct KernelRow {
    pub name: String,
    pub launches_per_step: f64,
    pub us_per_launch: f64,
    pub ms_per_step: f64,
    pub share: f64,
}

/// Device time of the prefill step and of the decode steps that follow it.
#[derive(Debug, Clone, Serialize)]
pub struct StreamProfile {
    pub prompt_tokens: usize,
    pub prefill: StepProfile,
    pub decode: StepProfile,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepProfile {
    /// Submits profiled (engine steps).
    pub steps: u64,
    pub dispatches_per_step: f64,
    /// Summed device time of a step's launches.
    pub device_ms_per_step: f64,
    /// Wall time of a profiled step (includes the waits profiling adds).
    pub profiled_wall_ms_per_step: f64,
    /// Host time of a step: recording its launches, then encoding and submitting them
    /// (bind groups included), excluding every wait for the device.
    pub host_record_ms_per_step: f64,
    pub host_encode_ms_per_step: f64,
    /// Bind groups made and reused per step.
    pub bind_groups_made_per_step: f64,
    pub bind_groups_reused_per_step: f64,
    pub kernels: Vec<KernelRow>,
}

impl StepProfile {
    fn from(p: &kiln_tensor::Profile, host: &kiln_tensor::HostStats, wall_ms: f64) -> Self {
        let steps = p.submits.max(1) as f64;
        let hsteps = host.submits.max(1) as f64;
        let total = p.total_ns();
        let kernels = p
            .kernels
            .iter()
            .map(|k| KernelRow {
                name: k.name.clone(),
                launches_per_step: k.launches as f64 / steps,
                us_per_launch: k.total_ns / 1e3 / k.launches.max(1) as f64,
                ms_per_step: k.total_ns / 1e6 / steps,
                share: if total > 0.0 { k.total_ns / total } else { 0.0 },
            })
            .collect();
        Self {
            steps: p.submits,
            dispatches_per_step: p.dispatches as f64 / steps,
            device_ms_per_step: total / 1e6 / steps,
            profiled_wall_ms_per_step: wall_ms / steps,
            host_record_ms_per_step: host.record_ns as f64 / 1e6 / hsteps,
            host_encode_ms_per_step: host.encode_ns as f64 / 1e6 / hsteps,
            bind_groups_made_per_step: host.bind_groups_made as f64 / hsteps,
            bind_groups_reused_per_step: host.bind_groups_reused as f64 / hsteps,
            kernels,
        }
    }
}

/// Profiles the prefill of a `prompt`-token prompt and the `steps` decode steps after it.
/// `Err` with a reason when the device has nothing to profile.
pub async fn run(
    model: &std::path::Path,
    backend: BackendChoice,
    prompts: &mut Prompts,
    prompt: usize,
    steps: usize,
) -> anyhow::Result<Result<StreamProfile, String>> {
    let dev = Device::new(&DeviceOptions {
        backend,
        profile: true,
        ..DeviceOptions::default()
    })
    .context("opening a profiling device")?;
    if dev.is_cpu() {
        return Ok(Err("the CPU backend runs no kernels".into()));
    }
    if dev.profile().is_none() {
        return Ok(Err(format!("{} has no timestamp queries", dev.info().name)));
    }
    let checkpoint = target::open(model)?;
    let sizing = EngineSizing {
        kv_blocks: u32::try_from((prompt + steps + 2).div_ceil(16) * 2 + 8).unwrap_or(u32::MAX),
        max_num_seqs: 4,
        // The whole prompt in one step, so the prefill profile is one step.
        max_num_batched_tokens: prompt.max(64),
        max_waiting: 8,
        prefix_caching: false,
        speculative: None,
    };
    let engine = target::start_engine(checkpoint, &dev, &sizing, None)?.engine;
    let result = async {
        // Warm-up: pipelines compile outside the measured steps.
        for n in [prompt, 1] {
            let mut r = Request::tokens(prompts.fresh(n)).max_new_tokens(3);
            r.stopping.ignore_eos = true;
            engine.submit(r)?.collect().await?;
        }
        let mut r = Request::tokens(prompts.fresh(prompt)).max_new_tokens(steps + 1);
        r.stopping.ignore_eos = true;
        dev.reset_profile();
        dev.reset_host_stats();
        let submitted = Instant::now();
        let mut s = engine.submit(r)?;
        let mut prefill = None;
        let mut first = None;
        let mut tokens = 0usize;
        while let Some(ev) = s.recv().await {
            match ev {
                Event::Delta(d) => {
                    tokens += d.token_ids.len();
                    if first.is_none() {
                        // The prefill step is done: what follows are decode steps.
                        prefill = dev.profile().zip(dev.host_stats());
                        dev.reset_profile();
                        dev.reset_host_stats();
                        first = Some(Instant::now());
                    }
                }
                Event::Finished(_) => break,
                Event::Error(e) => return Err(anyhow::Error::new(e).context("profiled request")),
            }
        }
        let (Some((prefill, prefill_host)), Some(first), Some(decode), Some(decode_host)) =
            (prefill, first, dev.profile(), dev.host_stats())
        else {
            bail!("the profiled request produced no tokens");
        };
        if decode.submits == 0 || tokens < 2 {
            bail!("no decode steps were profiled");
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        Ok(StreamProfile {
            prompt_tokens: prompt,
            prefill: StepProfile::from(&prefill, &prefill_host, ms(first - submitted)),
            decode: StepProfile::from(&decode, &decode_host, ms(first.elapsed())),
        })
    }
    .await;
    engine.shutdown(kiln_engine::ShutdownMode::Drain).await;
    result.map(Ok)
}

pub fn print_stream(p: &StreamProfile) {
    println!(
        "profile (timestamp queries, one pass a launch): {}-token prefill, then decode",
        p.prompt_tokens
    );
    print_step("prefill", &p.prefill);
    print_step("decode", &p.decode);
    println!();
}

fn print_step(what: &str, p: &StepProfile) {
    println!(
        "  {what}: {} step(s), {:.1} launches/step, device time {:.2} ms/step (profiled wall {:.2} ms/step)",
        p.steps, p.dispatches_per_step, p.device_ms_per_step, p.profiled_wall_ms_per_step
    );
    println!(
        "  host {:.3} ms/step recording + {:.3} ms/step encoding and submitting; bind groups {:.1} made, {:.1} reused a step",
        p.host_record_ms_per_step,
        p.host_encode_ms_per_step,
        p.bind_groups_made_per_step,
        p.bind_groups_reused_per_step
    );
    println!(
        "  {:<22} {:>9} {:>11} {:>10} {:>7}",
        "kernel", "per step", "us/launch", "ms/step", "share"
    );
    for k in &p.kernels {
        println!(
            "  {:<22} {:>9.1} {:>11.1} {:>10.3} {:>6.1}%",
            k.name,
            k.launches_per_step,
            k.us_per_launch,
            k.ms_per_step,
            k.share * 100.0
        );
    }
}
