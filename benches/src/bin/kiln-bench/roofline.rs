//! Roofline: the device's measured copy bandwidth and matmul FLOP/s, and the share of each
//! ceiling that decode (memory-bound) and prefill (compute-bound) reach.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_model::ModelConfig;
use kiln_tensor::{Access, DType, Device, KernelDef, Recorder, Tensor};
use serde::Serialize;

use crate::scenarios::Single;

/// A device copy, `dst[i] = src[i]` over 16-byte words, `PER` words per invocation: either
/// consecutive words (`CONTIGUOUS`, what CPU drivers like) or words a grid apart (coalesced, what
/// GPUs like). The roofline takes the best variant.
static COPY: KernelDef = KernelDef {
    name: "kiln_bench_copy",
    source: "
struct Params {
    n: u32,
    stride: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let inv = (wid.x + wid.y * nwg.x) * {{WG}}u + lid;
    if (inv >= p.stride) {
        return;
    }
    for (var j = 0u; j < {{PER}}u; j++) {
#if CONTIGUOUS
        let i = inv * {{PER}}u + j;
#else
        let i = inv + j * p.stride;
#endif
        if (i < p.n) {
            dst[i] = src[i];
        }
    }
}
",
    bindings: &[Access::Read, Access::ReadWrite],
};

/// The smallest launch: one workgroup writing one word. Many of them in one submit give the
/// cost of a launch itself.
static NOOP: KernelDef = KernelDef {
    name: "kiln_bench_noop",
    source: "
struct Params {
    v: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        dst[0] = p.v;
    }
}
",
    bindings: &[Access::ReadWrite],
};

/// Launches per submit when measuring the launch cost.
const DISPATCHES: usize = 256;

/// Copy kernel variants: (workgroup size, words per invocation, contiguous).
const COPY_VARIANTS: [(u32, u32, bool); 4] = [
    (64, 1, false),
    (256, 1, false),
    (256, 8, false),
    (64, 16, true),
];

/// Bytes each copy moves at most (each way); less where the device's bindings are smaller.
const COPY_BYTES_MAX: u64 = 256 << 20;
/// Matmul microbenchmark shapes: rows of X (a prefill chunk, and a small batch that kernels
/// for few rows may serve faster), and a 1024×1024 weight.
const MM_M: [usize; 2] = [16, 256];
const MM_NK: usize = 1024;
/// Each timed batch of repetitions runs about this long.
const BATCH_TARGET: Duration = Duration::from_millis(300);

/// What the microbenchmarks measured.
#[derive(Debug, Clone, Serialize)]
pub struct Ceilings {
    pub copy_bytes: u64,
    /// Bytes read plus bytes written per second.
    pub copy_bandwidth_gb_s: f64,
    /// How it was measured (the fastest variant on wgpu).
    pub copy_method: String,
    /// The weight's shape `[n, k]`.
    pub matmul_n_k: [usize; 2],
    /// GFLOP/s per weight dtype (F32, and block-quantized dtypes GGUF models use) and rows.
    pub matmul_rates: Vec<MatmulRate>,
    /// The best of them: the compute ceiling prefill is compared with.
    pub matmul_gflop_s: f64,
    /// What one kernel launch costs on its own (a submit of many one-workgroup launches,
    /// less a submit of one, per launch; 0 on the CPU backend).
    pub dispatch_us: f64,
    /// Which one that was.
    pub matmul_best: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct MatmulRate {
    pub dtype: String,
    /// Rows of X.
    pub m: usize,
    pub gflop_s: f64,
}

/// Seconds per `Recorder::matmul(x, w)`, launched back to back in one submit (the best of
/// [`best_per_rep`]).
pub fn matmul_seconds(dev: &Device, x: &Tensor, w: &Tensor) -> anyhow::Result<f64> {
    matmul_seconds_over(dev, x, std::slice::from_ref(w))
}

/// [`matmul_seconds`] with each launch taking the next of `ws` in turn: copies of one weight
/// that together outgrow the GPU's cache time it read from memory, as a model's step reads it.
pub fn matmul_seconds_over(dev: &Device, x: &Tensor, ws: &[Tensor]) -> anyhow::Result<f64> {
    best_per_rep(|reps| {
        let mut rec = Recorder::new(dev);
        let mut outs = Vec::with_capacity(reps);
        for w in ws.iter().cycle().take(reps) {
            outs.push(rec.matmul(x, w, None)?);
        }
        rec.submit()?;
        dev.synchronize()?;
        Ok(())
    })
}

/// Runs `batch(reps)` with growing `reps` until one batch lasts about [`BATCH_TARGET`], then
/// returns the best seconds per repetition over three batches.
fn best_per_rep(mut batch: impl FnMut(usize) -> anyhow::Result<()>) -> anyhow::Result<f64> {
    batch(1)?; // warm-up: pipelines, pools, page faults
    let t = Instant::now();
    batch(1)?;
    let one = t.elapsed().as_secs_f64().max(1e-6);
    let reps = ((BATCH_TARGET.as_secs_f64() / one).ceil() as usize).clamp(1, 256);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        batch(reps)?;
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    Ok(best)
}

pub fn measure(dev: &Device) -> anyhow::Result<Ceilings> {
    let (copy_bytes, copy_s, copy_method) = match dev {
        Device::Reference | Device::Cpu(_) => {
            // One thread's memcpy: the reference's ceiling, and near the native backend's
            // (two cores share one memory bus).
            let n = COPY_BYTES_MAX as usize;
            let src = vec![1u8; n];
            let mut dst = vec![0u8; n];
            let s = best_per_rep(|reps| {
                for _ in 0..reps {
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                }
                Ok(())
            })?;
            (COPY_BYTES_MAX, s, "memcpy, one thread".to_owned())
        }
        Device::Wgpu(_) => {
            let info = dev.info();
            let cap = info
                .max_storage_binding_bytes
                .min(info.max_buffer_bytes)
                .saturating_sub(64);
            // The largest power of two that fits one binding, at most COPY_BYTES_MAX.
            let bytes = COPY_BYTES_MAX.min(1 << cap.max(16).ilog2());
            let words = (bytes / 4) as usize;
            let src = Tensor::zeros(dev, DType::U32, &[words]).context("copy source")?;
            let dst = Tensor::zeros(dev, DType::U32, &[words]).context("copy destination")?;
            let vec4s = u32::try_from(bytes / 16).context("copy size")?;
            let mut best: Option<(f64, String)> = None;
            for (wg, per, contiguous) in COPY_VARIANTS {
                let invocations = vec4s.div_ceil(per).next_multiple_of(wg);
                let defines = [
                    ("WG", wg.to_string()),
                    ("PER", per.to_string()),
                    ("CONTIGUOUS", u32::from(contiguous).to_string()),
                ];
                let s = best_per_rep(|reps| {
                    let mut rec = Recorder::new(dev);
                    for _ in 0..reps {
                        rec.launch(
                            &COPY,
                            &defines,
                            &[vec4s, invocations, 0, 0],
                            &[&src, &dst],
                            invocations / wg,
                        )?;
                    }
                    rec.submit()?;
                    dev.synchronize()?;
                    Ok(())
                })
                .context("device copy")?;
                let name = format!(
                    "copy kernel, workgroup {wg}, {per} {} 16-byte word(s) per invocation",
                    if contiguous { "consecutive" } else { "strided" }
                );
                if best.as_ref().is_none_or(|(b, _)| s < *b) {
                    best = Some((s, name));
                }
            }
            let (s, name) = best.context("no copy variant ran")?;
            (bytes, s, name)
        }
    };
    let dispatch_us = match dev {
        Device::Reference | Device::Cpu(_) => 0.0,
        Device::Wgpu(_) => {
            let dst = Tensor::zeros(dev, DType::U32, &[4]).context("launch-cost target")?;
            let submit = |n: usize| -> anyhow::Result<f64> {
                best_per_rep(|reps| {
                    for _ in 0..reps {
                        let mut rec = Recorder::new(dev);
                        for i in 0..n {
                            rec.launch(&NOOP, &[], &[i as u32, 0, 0, 0], &[&dst], 1)?;
                        }
                        rec.submit()?;
                        dev.synchronize()?;
                    }
                    Ok(())
                })
            };
            let one = submit(1).context("one launch")?;
            let many = submit(DISPATCHES).context("many launches")?;
            ((many - one) / (DISPATCHES - 1) as f64 * 1e6).max(0.0)
        }
    };
    let (n, k) = (MM_NK, MM_NK);
    let w: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
    let mut rates = Vec::new();
    for dtype in [DType::F32, DType::Q8_0, DType::Q4_1] {
        let w = match dtype {
            DType::F32 => Tensor::from_f32(dev, &[n, k], &w),
            q => Tensor::quantize_f32(dev, q, &[n, k], &w),
        }
        .with_context(|| format!("matmul weight {dtype:?}"))?;
        for m in MM_M {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
            let x = Tensor::from_f32(dev, &[m, k], &x).context("matmul input")?;
            let s =
                matmul_seconds(dev, &x, &w).with_context(|| format!("matmul {dtype:?} m={m}"))?;
            rates.push(MatmulRate {
                dtype: format!("{dtype:?}"),
                m,
                gflop_s: 2.0 * (m * n * k) as f64 / s / 1e9,
            });
        }
    }
    if copy_s <= 0.0 {
        bail!("the copy took no measurable time");
    }
    let best = rates
        .iter()
        .max_by(|a, b| a.gflop_s.total_cmp(&b.gflop_s))
        .cloned()
        .context("no matmul rate")?;
    Ok(Ceilings {
        copy_bytes,
        copy_bandwidth_gb_s: 2.0 * copy_bytes as f64 / copy_s / 1e9,
        copy_method,
        matmul_n_k: [n, k],
        matmul_gflop_s: best.gflop_s,
        dispatch_us,
        matmul_best: format!("{} m={}", best.dtype, best.m),
        matmul_rates: rates,
    })
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Params {
    pub embedding: u64,
    /// Every decoder layer's projections, biases and norms.
    pub layers: u64,
    /// The output projection (shares the embedding's storage when tied).
    pub lm_head: u64,
    pub total: u64,
}

pub fn params(c: &ModelConfig) -> Params {
    let (h, q, kv, f) = (
        c.hidden as u64,
        (c.heads * c.head_dim) as u64,
        (c.kv_heads * c.head_dim) as u64,
        c.ffn as u64,
    );
    let bias = if c.qkv_bias { q + 2 * kv } else { 0 };
    let layer = h * q + 2 * h * kv + q * h + bias + 3 * h * f + 2 * h;
    let embedding = c.vocab as u64 * h;
    let layers = c.layers as u64 * layer + h; // + the final norm
    let lm_head = c.vocab as u64 * h;
    Params {
        embedding,
        layers,
        lm_head,
        total: embedding + layers + if c.tie_embeddings { 0 } else { lm_head },
    }
}

/// Matmul FLOPs of prefilling a `t`-token prompt: every projection for each token, causal
/// attention (QKᵀ and AV over the positions before each token), and the LM head once (only
/// the last position's logits are computed).
pub fn prefill_flops(c: &ModelConfig, t: usize) -> f64 {
    let p = params(c);
    let t = t as f64;
    let attn = 2.0 * (c.layers * c.heads * c.head_dim) as f64 * t * (t + 1.0);
    2.0 * p.layers as f64 * t + attn + 2.0 * p.lm_head as f64
}

#[derive(Debug, Clone, Serialize)]
pub struct Roofline {
    #[serde(flatten)]
    pub ceilings: Ceilings,
    pub params: Params,
    /// Device bytes of the weights (quantized sizes as stored): each decode step reads them all.
    pub weight_bytes: u64,
    pub kv_bytes_per_token: u64,
    /// Mean context length over the single stream's decode steps.
    pub decode_context_tokens: usize,
    /// Weights plus the K/V read at that context.
    pub decode_bytes_per_step: u64,
    /// The decode rate the copy bandwidth allows at batch 1.
    pub decode_ceiling_tokens_per_s: f64,
    pub decode_tokens_per_s: Option<f64>,
    pub decode_achieved_gb_s: Option<f64>,
    pub decode_share_of_bandwidth: Option<f64>,
    pub prefill_tokens: usize,
    pub prefill_flops_per_token: f64,
    pub prefill_tokens_per_s: Option<f64>,
    pub prefill_achieved_gflop_s: Option<f64>,
    pub prefill_share_of_matmul: Option<f64>,
    pub note: Option<String>,
}

/// Relates the single stream's rates to the measured ceilings.
pub fn relate(
    ceilings: Ceilings,
    cfg: &ModelConfig,
    weight_bytes: u64,
    kv_bytes_per_token: u64,
    single: Option<&Single>,
    prompt_tokens: usize,
    new_tokens: usize,
) -> Roofline {
    let ctx = prompt_tokens + new_tokens / 2;
    let bytes_step = weight_bytes + kv_bytes_per_token * ctx as u64;
    let bw = ceilings.copy_bandwidth_gb_s * 1e9;
    let flops_token = prefill_flops(cfg, prompt_tokens) / prompt_tokens.max(1) as f64;
    let decode = single.and_then(|s| s.decode_tokens_per_s);
    let prefill = single.and_then(|s| s.prefill_tokens_per_s);
    let decode_bw = decode.map(|d| d * bytes_step as f64);
    let prefill_flops = prefill.map(|p| p * flops_token);
    Roofline {
        params: params(cfg),
        weight_bytes,
        kv_bytes_per_token,
        decode_context_tokens: ctx,
        decode_bytes_per_step: bytes_step,
        decode_ceiling_tokens_per_s: bw / bytes_step.max(1) as f64,
        decode_tokens_per_s: decode,
        decode_achieved_gb_s: decode_bw.map(|b| b / 1e9),
        decode_share_of_bandwidth: decode_bw.map(|b| b / bw),
        prefill_tokens: prompt_tokens,
        prefill_flops_per_token: flops_token,
        prefill_tokens_per_s: prefill,
        prefill_achieved_gflop_s: prefill_flops.map(|f| f / 1e9),
        prefill_share_of_matmul: prefill_flops.map(|f| f / (ceilings.matmul_gflop_s * 1e9)),
        note: single
            .is_none()
            .then(|| "the single scenario did not run: no achieved figures".to_owned()),
        ceilings,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// SmolLM2-135M's shape, as its `config.json` states it.
    fn smollm() -> ModelConfig {
        let json = r#"{"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
            "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": true}"#;
        ModelConfig::from_hf_json("config.json", json).unwrap()
    }

    #[test]
    fn smollm2_has_135m_parameters() {
        let p = params(&smollm());
        // 134,515,008 in the model card's count (embeddings tied, norms included).
        assert_eq!(p.total, 134_515_008);
        // A 1-token prefill is two FLOPs per layer parameter, one attention position and the head.
        let f = prefill_flops(&smollm(), 1);
        let want = 2.0 * p.layers as f64 + 2.0 * (30 * 9 * 64 * 2) as f64 + 2.0 * p.lm_head as f64;
        assert_eq!(f, want);
    }
}
