//! `kiln-bench gpu-check`'s kernel checks: the GPU kernel family against the CPU reference
//! compiled into the same binary (every weight dtype through `linear`, a mixture of experts'
//! step, a layer's K/V write and paged attention for every KV dtype, the device sampler), and
//! the experimental kernels (`--kernels experimental`) where the adapter runs them.

use std::time::Instant;

use kiln_attention::{AttnConfig, KvCache, KvCacheConfig, QkPrep, QkvRows, SeqBatch};
use kiln_kv::{BlockId, KvDtype};
use kiln_tensor::sample::{self, LogitEdit, RowSampling};
use kiln_tensor::{
    Activation, BackendChoice, COOP_F16_16, DType, Device, DeviceOptions, Kernels, LinearOps,
    Recorder, RmsNorm, RopeConfig, RopeLayout, RopeScaling, RopeTable, RotaryChannels, Router,
    Tensor,
};
use serde::Serialize;

use crate::gpu_check::table;

/// One kernel check.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Check {
    pub what: String,
    pub max_error: f32,
    pub bound: f32,
    pub ok: bool,
}

/// SplitMix64 values in [-1, 1).
pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

pub(crate) fn max_error(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
        )
}

/// Sampling settings of the check: row `i`'s.
fn row_sampling(i: usize, seed: u64, vocab: usize) -> RowSampling {
    let knobs = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 40, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.0, 0, 1.0, 0.05),
        (0.8, 50, 0.95, 0.02),
    ];
    let (temperature, top_k, top_p, min_p) = knobs[i % knobs.len()];
    let mut how = RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: seed ^ (i as u64) << 32,
        draw: i as u64 * 7,
        ..RowSampling::greedy()
    };
    if i % 3 == 1 {
        how.edits = (0..8u32)
            .map(|e| LogitEdit {
                id: (e * 6007 + i as u32) % vocab as u32,
                add: if e == 0 { f32::NEG_INFINITY } else { 1.5 },
                rep: 1.3,
                sub: 0.4,
            })
            .collect();
    }
    if i % 4 == 2 {
        let bits = values(seed + i as u64, vocab.div_ceil(32));
        how.allowed = Some(bits.iter().map(|v| v.to_bits() | 1).collect());
    }
    how
}

/// The device sampler's picks against the reference's: the count of rows that differ.
pub(crate) fn sampling_check(dev: &Device, seed: u64) -> anyhow::Result<Check> {
    let (rows, vocab) = (48usize, 49152usize);
    let logits: Vec<f32> = values(seed + 77, rows * vocab)
        .iter()
        .map(|v| v * 12.0)
        .collect();
    let how: Vec<RowSampling> = (0..rows).map(|i| row_sampling(i, seed, vocab)).collect();
    let pairs: Vec<(usize, &RowSampling)> = how.iter().enumerate().collect();
    let want: Vec<u32> = pairs
        .iter()
        .map(|&(r, h)| {
            let row = &logits[r * vocab..(r + 1) * vocab];
            sample::pick(sample::process(row, h), h).unwrap_or(sample::NO_TOKEN)
        })
        .collect();
    let t = Tensor::from_f32(dev, &[rows, vocab], &logits)?;
    let mut rec = Recorder::new(dev);
    let got = rec.sample(&t, &pairs)?;
    rec.submit()?;
    let got = got.to_u32_vec()?;
    let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    Ok(Check {
        what: format!("sample: rows of {rows} whose pick differs from the reference's"),
        max_error: differ as f32,
        bound: 0.0,
        ok: differ == 0,
    })
}

/// Milliseconds to pick a token from each of 16 rows on the device and by reading them back
/// and sampling on the host (median of 9 each, after one warm-up).
pub(crate) fn sampling_times(dev: &Device, seed: u64) -> anyhow::Result<(f64, f64)> {
    let (rows, vocab) = (16usize, 49152usize);
    let logits: Vec<f32> = values(seed + 78, rows * vocab)
        .iter()
        .map(|v| v * 12.0)
        .collect();
    let t = Tensor::from_f32(dev, &[rows, vocab], &logits)?;
    let how: Vec<RowSampling> = (0..rows as u64)
        .map(|s| RowSampling {
            temperature: 0.8,
            top_k: 50,
            top_p: 0.95,
            seed: s,
            ..RowSampling::greedy()
        })
        .collect();
    let pairs: Vec<(usize, &RowSampling)> = how.iter().enumerate().collect();
    let median = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        f()?;
        let mut ms = Vec::new();
        for _ in 0..9 {
            let t0 = Instant::now();
            f()?;
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[4])
    };
    let device = median(&mut || {
        let mut rec = Recorder::new(dev);
        let ids = rec.sample(&t, &pairs)?;
        rec.submit()?;
        ids.to_u32_vec()?;
        Ok(())
    })?;
    let host = median(&mut || {
        let x = t.to_f32_vec()?;
        for (row, h) in x.chunks_exact(vocab).zip(&how) {
            sample::pick(sample::process(row, h), h);
        }
        Ok(())
    })?;
    Ok((device, host))
}

/// The GPU kernel family against the CPU reference.
pub(crate) fn kernel_checks(dev: &Device, seed: u64) -> anyhow::Result<Vec<Check>> {
    let mut out = Vec::new();
    let cpu = Device::Reference;
    for (di, &dtype) in DType::WEIGHTS.iter().enumerate() {
        let k = if dtype.is_k_quant() { 512 } else { 256 };
        for m in [1usize, 5, 9, 20, 40] {
            for case in ["plain", "norm+gated", "residual"] {
                let n = 48;
                let s = seed ^ ((di as u64) << 16 | (m as u64) << 4);
                let x = values(s, m * k);
                let w = values(s + 1, n * k);
                let g = values(s + 2, k);
                let res = values(s + 3, m * n / 2);
                let wh = values(s + 4, n / 2 * k);
                let run = |d: &Device| -> anyhow::Result<Vec<f32>> {
                    let xt = Tensor::from_f32(d, &[m, k], &x)?;
                    let wt = weight(d, dtype, n, k, &w, s)?;
                    let wht = weight(d, dtype, n / 2, k, &wh, s + 5)?;
                    let gt = Tensor::from_f32(d, &[k], &g)?;
                    let rt = Tensor::from_f32(d, &[m, n / 2], &res)?;
                    let norm = RmsNorm {
                        weight: &gt,
                        eps: 1e-5,
                    };
                    let mut rec = Recorder::new(d);
                    let y = match case {
                        "plain" => rec.matmul(&xt, &wt, None)?,
                        "norm+gated" => rec.linear(
                            &xt,
                            &wt,
                            LinearOps {
                                norm: Some(norm),
                                glu: Some(Activation::Silu),
                                ..LinearOps::default()
                            },
                        )?,
                        _ => rec.matmul_add(&xt, &wht, &rt)?,
                    };
                    rec.submit()?;
                    Ok(y.to_f32_vec()?)
                };
                let want = run(&cpu)?;
                let got = run(dev)?;
                // f32 accumulation over k terms, the gated product's error bound included.
                let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                let bound = 4e-5 * k as f32 * scale;
                let e = max_error(&got, &want);
                out.push(Check {
                    what: format!("linear {case} {dtype:?} m={m} k={k}"),
                    max_error: e,
                    bound,
                    ok: e <= bound,
                });
            }
        }
    }
    out.extend(routed_checks(dev, seed)?);
    for dtype in KvDtype::ALL {
        let e = attention_check(dev, dtype, seed)?;
        let bound = match dtype {
            KvDtype::F32 => 1e-4,
            KvDtype::F16 => 1e-3,
            KvDtype::Int8 | KvDtype::Int4 => 1e-2,
        };
        out.push(Check {
            what: format!("write_qkv + paged attention, {dtype} KV"),
            max_error: e,
            bound,
            ok: e <= bound,
        });
    }
    Ok(out)
}

/// A mixture of experts' step on `dev` against the CPU reference: routing (top-2 of 8), the
/// routed gate/up product with each expert's bias and GPT-OSS's clamped SwiGLU (or SiLU
/// without biases), the routed down product and the weighted sum into the residual, for a
/// decode step (1 token) and a batch (16), in a float, a block and a K-quant format and MXFP4.
fn routed_checks(dev: &Device, seed: u64) -> anyhow::Result<Vec<Check>> {
    let mut out = Vec::new();
    let (e, topk, f, h) = (8usize, 2usize, 256usize, 512usize);
    for (di, dtype) in [DType::F16, DType::Q8_0, DType::Q4_K, DType::MXFP4]
        .into_iter()
        .enumerate()
    {
        for (t, biased) in [(1usize, true), (16, true), (16, false)] {
            let s = seed ^ 0x5eed ^ ((di as u64) << 8 | t as u64);
            let logits = values(s, t * e);
            let x = values(s + 1, t * h);
            let gu = values(s + 2, e * 2 * f * h);
            let down = values(s + 3, e * h * f);
            let bias = (values(s + 4, e * 2 * f), values(s + 5, e * h));
            let run = |d: &Device| -> anyhow::Result<Vec<f32>> {
                let lt = Tensor::from_f32(d, &[t, e], &logits)?;
                let xt = Tensor::from_f32(d, &[t, h], &x)?;
                let gut = weight(d, dtype, e * 2 * f, h, &gu, s + 6)?.reshape(&[e, 2 * f, h])?;
                let dt = weight(d, dtype, e * h, f, &down, s + 7)?.reshape(&[e, h, f])?;
                let (gb, db) = match biased {
                    true => (
                        Some(Tensor::from_f32(d, &[e, 2 * f], &bias.0)?),
                        Some(Tensor::from_f32(d, &[e, h], &bias.1)?),
                    ),
                    false => (None, None),
                };
                let act = if biased {
                    Activation::SwigluOai
                } else {
                    Activation::Silu
                };
                let mut rec = Recorder::new(d);
                let routes = rec.moe_route(&lt, topk, Router::SoftmaxTopK { renorm: true })?;
                let m = rec.linear_routed(&xt, &gut, gb.as_ref(), &routes, Some(act))?;
                let y = rec.linear_routed(&m, &dt, db.as_ref(), &routes, None)?;
                let out = rec.moe_combine(&y, &routes, &xt)?;
                rec.submit()?;
                Ok(out.to_f32_vec()?)
            };
            let want = run(&Device::Reference)?;
            let err = max_error(&run(dev)?, &want);
            let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            // f32 sums over h, then over f terms of the gated products.
            let bound = 4e-5 * (h + f) as f32 * scale;
            out.push(Check {
                what: format!(
                    "moe route + routed gate/up/down + combine {dtype:?} t={t} biased={biased}"
                ),
                max_error: err,
                bound,
                ok: err <= bound,
            });
        }
    }
    Ok(out)
}

/// A weight `[n, k]` of `dtype` from `v`: converted or quantized where kiln can, else random
/// blocks from `seed` (the formats kiln only reads).
fn weight(
    d: &Device,
    dtype: DType,
    n: usize,
    k: usize,
    v: &[f32],
    seed: u64,
) -> anyhow::Result<Tensor> {
    Ok(match dtype {
        DType::F32 => Tensor::from_f32(d, &[n, k], v)?,
        DType::F16 => {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            Tensor::from_f16(d, &[n, k], &h)?
        }
        DType::BF16 => {
            let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Tensor::from_bf16(d, &[n, k], &h)?
        }
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => Tensor::quantize_f32(d, dtype, &[n, k], v)?,
        q => Tensor::from_bytes(
            d,
            q,
            &[n, k],
            &random_blocks(q, n * k / q.block_elems(), seed),
        )?,
    })
}

/// Random blocks of a format with small finite scales: every f16 of the block's head set to
/// 2⁻⁸ (FP8's f32 to 2⁻¹⁰), the rest random bytes (FP8's NaN codes changed).
pub(crate) fn random_blocks(dtype: DType, blocks: usize, seed: u64) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let bytes: Vec<u8> = values(seed, blocks * bb)
        .iter()
        .map(|v| ((v + 1.0) * 127.5) as u8)
        .collect();
    let mut out = bytes;
    let small = half::f16::from_f32(1.0 / 256.0).to_le_bytes();
    // The f16 scales sit at a format's start (d, and dmin for the K-quants) or its end (Q6_K).
    for b in out.chunks_exact_mut(bb) {
        match dtype {
            DType::Q6_K => b[bb - 2..].copy_from_slice(&small),
            DType::Q3_K => b[bb - 2..].copy_from_slice(&small),
            DType::Q2_K => {
                b[bb - 4..bb - 2].copy_from_slice(&small);
                b[bb - 2..].copy_from_slice(&small);
            }
            DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K | DType::Q4_Z | DType::Q8_Z => {
                b[..2].copy_from_slice(&small);
                b[2..4].copy_from_slice(&small);
            }
            // An f32 scale of 2⁻¹⁰ (codes reach ±448), and no E4M3 NaN code.
            DType::FP8 => {
                b[..4].copy_from_slice(&(1.0f32 / 1024.0).to_le_bytes());
                for q in &mut b[4..] {
                    if *q & 0x7f == 0x7f {
                        *q ^= 1;
                    }
                }
            }
            _ => b[..2].copy_from_slice(&small),
        }
    }
    out
}

/// One mixed batch through `write_qkv` and attention on `dev` and on the CPU backend.
fn attention_check(dev: &Device, dtype: KvDtype, seed: u64) -> anyhow::Result<f32> {
    let (kvh, heads, d) = (2usize, 8usize, 128usize);
    let run = |device: &Device| -> anyhow::Result<Vec<f32>> {
        let cfg = KvCacheConfig {
            layers: 1,
            kv_heads: kvh,
            head_dim: d,
            block_size: 16,
            num_blocks: 16,
            dtype,
        };
        let mut cache = KvCache::new(device, cfg)?;
        let rope = RopeTable::new(
            device,
            RopeConfig {
                head_dim: d,
                rotary_dim: d,
                theta: 10_000.0,
                scaling: RopeScaling::None,
                layout: RopeLayout::HalfSplit,
                rotated: RotaryChannels::Leading,
            },
            256,
        )?;
        let t1 = table(3, 13);
        let t2 = [BlockId(1)];
        // With attention sinks (GPT-OSS's), so that the check covers them too.
        let attn = AttnConfig {
            heads,
            scale: 1.0 / (d as f32).sqrt(),
            window: None,
            sinks: Some(Tensor::from_f32(
                device,
                &[heads],
                &values(seed ^ 0x51, heads),
            )?),
        };
        let width = (heads + 2 * kvh) * d;
        // A 200-token prompt and a 9-token one in one step (whole queries), then a decode
        // step of both (its keys split into runs on a GPU).
        let steps: [([usize; 2], [usize; 2]); 2] = [([200, 9], [200, 9]), ([1, 1], [201, 10])];
        let mut outs = Vec::new();
        for (i, (query, context)) in steps.into_iter().enumerate() {
            let seqs = [
                SeqBatch {
                    block_table: &t1,
                    query_len: query[0],
                    context_len: context[0],
                },
                SeqBatch {
                    block_table: &t2,
                    query_len: query[1],
                    context_len: context[1],
                },
            ];
            let batch = cache.batch(&seqs)?;
            let positions: Vec<u32> = (context[0] - query[0]..context[0])
                .chain(context[1] - query[1]..context[1])
                .map(|p| p as u32)
                .collect();
            let pos = rope.positions(&positions)?;
            let n = positions.len();
            let qkv = Tensor::from_f32(
                device,
                &[n, width],
                &values(seed ^ 0xa7 ^ i as u64, n * width),
            )?;
            let mut rec = Recorder::new(device);
            let prep = QkPrep {
                heads,
                rope: &pos,
                norm: None,
            };
            let q = cache.write_qkv(&mut rec, 0, QkvRows::Stacked(&qkv), &prep, &batch)?;
            let out = cache.attention(&mut rec, 0, &q, &batch, &attn)?;
            rec.submit()?;
            outs.extend(out.to_f32_vec()?);
        }
        Ok(outs)
    };
    Ok(max_error(&run(dev)?, &run(&Device::Reference)?))
}

/// The experimental kernels (`--kernels experimental`) against the CPU reference: the
/// integer dot product matrix-vector kernel over Q8_0 and Q4_0 weights at 1 and 4 rows of X
/// (within 8-bit X's rounding), and, where the adapter has 16 × 16 f16 cooperative matrices,
/// the cooperative matmul: one 16 × 16 × 16 tile of f16 weights, then every weight dtype at
/// rows of X that fill one tile, part of one and several (with and without a bias, over a
/// weight whose rows end inside a tile).
pub(crate) fn experimental_checks(seed: u64) -> anyhow::Result<Vec<Check>> {
    let dev = match Device::new(&DeviceOptions {
        backend: BackendChoice::Wgpu,
        cpu_shaped_kernels: Some(false),
        kernels: Kernels::Experimental,
        ..DeviceOptions::default()
    }) {
        Ok(d) => d,
        Err(e) => {
            println!("gpu-check: --kernels experimental did not open the device: {e}");
            return Ok(vec![Check {
                what: "experimental kernels: device opened".into(),
                max_error: f32::NAN,
                bound: 0.0,
                ok: false,
            }]);
        }
    };
    let mut out = Vec::new();
    for (di, dtype) in [DType::Q8_0, DType::Q4_0].into_iter().enumerate() {
        for m in [1usize, 4] {
            out.push(dp4a_check(&dev, dtype, m, 4096, seed ^ (di as u64) << 24)?);
        }
    }
    let i = dev.info();
    if !i.coop_matmul {
        println!(
            "gpu-check: no cooperative matmul here (f16 shaders {}, subgroup sizes {:?}, \
             configurations [{}]; it needs f16, one subgroup size and {COOP_F16_16})",
            i.shader_f16,
            i.subgroup_size,
            configs(&i)
        );
        return Ok(out);
    }
    out.push(coop_check(&dev, DType::F16, 16, 16, 16, false, seed)?);
    for (di, &dtype) in DType::WEIGHTS.iter().enumerate() {
        let k = if dtype.is_k_quant() { 512 } else { 256 };
        for (m, bias) in [(16usize, false), (20, true), (64, false), (200, true)] {
            out.push(coop_check(
                &dev,
                dtype,
                m,
                72,
                k,
                bias,
                seed ^ (di as u64) << 20,
            )?);
        }
    }
    Ok(out)
}

/// X `[m, k]` · W `[n, k]`ᵀ with W in `dtype` through the integer dot product kernel on `dev`
/// against the reference, within 8-bit X's rounding (`kiln_tensor::int8_activation_bounds`) and the
/// f32 sums' share.
fn dp4a_check(dev: &Device, dtype: DType, m: usize, k: usize, seed: u64) -> anyhow::Result<Check> {
    let n = 96;
    let x = values(seed, m * k);
    let w = values(seed + 1, n * k);
    let run = |d: &Device| -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
        let xt = Tensor::from_f32(d, &[m, k], &x)?;
        let wt = weight(d, dtype, n, k, &w, seed + 2)?;
        let mut rec = Recorder::new(d);
        let y = rec.matmul(&xt, &wt, None)?;
        rec.submit()?;
        Ok((y.to_f32_vec()?, wt.to_f32_vec()?))
    };
    let (want, wf) = run(&Device::Reference)?;
    let (got, _) = run(dev)?;
    let scale = want.iter().fold(1.0f32, |a, v| a.max(v.abs()));
    let bounds = kiln_tensor::int8_activation_bounds(&x, &wf, k);
    let (mut worst_ratio, mut err, mut bound_at) = (0f32, 0f32, 0f32);
    for ((g, w), b) in got.iter().zip(&want).zip(&bounds) {
        let b = b * 1.01 + 4e-5 * k as f32 * scale / 64.0;
        let e = (g - w).abs();
        let e = if e.is_nan() { f32::INFINITY } else { e };
        if e / b >= worst_ratio {
            (worst_ratio, err, bound_at) = (e / b, e, b);
        }
    }
    Ok(Check {
        what: format!("dp4a matvec {dtype:?} m={m} k={k}"),
        max_error: err,
        bound: bound_at,
        ok: worst_ratio <= 1.0 && got.len() == want.len(),
    })
}

/// The adapter's cooperative-matrix configurations, listed.
pub(crate) fn configs(info: &kiln_tensor::DeviceInfo) -> String {
    info.cooperative_matrix
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// X `[m, k]` · W `[n, k]`ᵀ (+ bias) on `dev` against the reference. X and W enter the
/// tensor cores as f16, so each product may be off by two f16 roundings (2⁻¹⁰ of it): the
/// bound is that share of Σ|x·w| for each output, plus the f32 sum's share.
fn coop_check(
    dev: &Device,
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
    bias: bool,
    seed: u64,
) -> anyhow::Result<Check> {
    let x = values(seed, m * k);
    let w = values(seed + 1, n * k);
    let b = values(seed + 2, n);
    let run = |d: &Device| -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
        let xt = Tensor::from_f32(d, &[m, k], &x)?;
        let wt = weight(d, dtype, n, k, &w, seed + 3)?;
        let bt = Tensor::from_f32(d, &[n], &b)?;
        let mut rec = Recorder::new(d);
        let y = rec.matmul(&xt, &wt, bias.then_some(&bt))?;
        rec.submit()?;
        Ok((y.to_f32_vec()?, wt.to_f32_vec()?))
    };
    let (want, wf) = run(&Device::Reference)?;
    let (got, _) = run(dev)?;
    let mut err = 0f32;
    let mut worst_ratio = 0f32;
    let mut bound_at_worst = 0f32;
    for i in 0..m {
        for r in 0..n {
            let abs: f32 = (0..k).map(|c| (x[i * k + c] * wf[r * k + c]).abs()).sum();
            let bound = abs * (2.0f32.powi(-10) + 4e-5) + 1e-5;
            let e = (got[i * n + r] - want[i * n + r]).abs();
            let e = if e.is_nan() { f32::INFINITY } else { e };
            if e / bound > worst_ratio || bound_at_worst == 0.0 {
                worst_ratio = e / bound;
                bound_at_worst = bound;
                err = e;
            }
        }
    }
    Ok(Check {
        what: format!("coop matmul {dtype:?} m={m} n={n} k={k} bias={bias}"),
        max_error: err,
        bound: bound_at_worst,
        ok: worst_ratio <= 1.0,
    })
}
