//! Paged attention by hand: two sequences' K/V written into scattered blocks of a paged pool,
//! one launch of attention for a mixed batch (a prefill chunk and a decode token), checked
//! against plain contiguous attention on the host. Grouped-query heads (8 query heads over 2
//! K/V heads), a causal mask, and each K/V storage type.
//!
//! `cargo run --release -p kiln-attention --example paged`. The device is the best GPU, else
//! the CPU backend; the CPU backend runs too.

use std::process::ExitCode;

use kiln_attention::{AttnConfig, KvCache, KvCacheConfig, SeqBatch, contiguous_attention};
use kiln_kv::{BlockId, KvDtype};
use kiln_tensor::{Device, DeviceOptions, Recorder, Tensor};

const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const D: usize = 64;
const BLOCK: usize = 16;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("paged example: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let best = Device::new(&DeviceOptions::default())?;
    let mut devices = vec![best.clone()];
    if !matches!(best, Device::Reference) {
        devices.push(Device::Reference);
    }
    // Sequence A: 37 tokens over blocks 5, 1, 7 (a prompt computed in one chunk);
    // sequence B: 20 tokens over blocks 2, 6, of which the last is this step's decode token.
    let (a_len, b_len) = (37, 20);
    let a_table = [5, 1, 7].map(BlockId);
    let b_table = [2, 6].map(BlockId);
    let row = KV_HEADS * D;
    let (a_k, a_v) = (values(a_len * row, 1), values(a_len * row, 2));
    let (b_k, b_v) = (values(b_len * row, 3), values(b_len * row, 4));
    let a_q = values(a_len * HEADS * D, 5);
    let b_q = values(HEADS * D, 6);
    let scale = 1.0 / (D as f32).sqrt();

    // The host reference, contiguous: A's queries at positions 0..37, B's one at 19.
    let mut want = contiguous_attention(
        &a_q,
        &(0..a_len).collect::<Vec<_>>(),
        &a_k,
        &a_v,
        HEADS,
        KV_HEADS,
        D,
        scale,
        None,
        None,
    );
    want.extend(contiguous_attention(
        &b_q,
        &[b_len - 1],
        &b_k,
        &b_v,
        HEADS,
        KV_HEADS,
        D,
        scale,
        None,
        None,
    ));

    println!(
        "devices: {}",
        devices
            .iter()
            .map(|d| d.info().to_string())
            .collect::<Vec<_>>()
            .join("; ")
    );
    for dev in &devices {
        for (dtype, tol) in [
            (KvDtype::F32, 1e-4),
            (KvDtype::F16, 1e-3),
            (KvDtype::Int8, 1e-2),
        ] {
            let mut cache = KvCache::new(
                dev,
                KvCacheConfig {
                    layers: 1,
                    kv_heads: KV_HEADS,
                    head_dim: D,
                    block_size: BLOCK,
                    num_blocks: 8,
                    dtype,
                },
            )?;
            // B's first 19 tokens were written by earlier steps: write them now, alone.
            let mut rec = Recorder::new(dev);
            let earlier = cache.batch(&[SeqBatch {
                block_table: &b_table,
                query_len: b_len - 1,
                context_len: b_len - 1,
            }])?;
            let k = Tensor::from_f32(dev, &[b_len - 1, KV_HEADS, D], &b_k[..(b_len - 1) * row])?;
            let v = Tensor::from_f32(dev, &[b_len - 1, KV_HEADS, D], &b_v[..(b_len - 1) * row])?;
            cache.write(&mut rec, 0, &k, &v, &earlier)?;

            // This step: A's whole prompt and B's next token, in one batch and one launch.
            let batch = cache.batch(&[
                SeqBatch {
                    block_table: &a_table,
                    query_len: a_len,
                    context_len: a_len,
                },
                SeqBatch {
                    block_table: &b_table,
                    query_len: 1,
                    context_len: b_len,
                },
            ])?;
            let step_k: Vec<f32> = a_k
                .iter()
                .chain(&b_k[(b_len - 1) * row..])
                .copied()
                .collect();
            let step_v: Vec<f32> = a_v
                .iter()
                .chain(&b_v[(b_len - 1) * row..])
                .copied()
                .collect();
            let step_q: Vec<f32> = a_q.iter().chain(&b_q).copied().collect();
            let tokens = a_len + 1;
            let k = Tensor::from_f32(dev, &[tokens, KV_HEADS, D], &step_k)?;
            let v = Tensor::from_f32(dev, &[tokens, KV_HEADS, D], &step_v)?;
            let q = Tensor::from_f32(dev, &[tokens, HEADS, D], &step_q)?;
            cache.write(&mut rec, 0, &k, &v, &batch)?;
            let attn = AttnConfig {
                heads: HEADS,
                scale,
                window: None,
                sinks: None,
            };
            let out = cache.attention(&mut rec, 0, &q, &batch, &attn)?;
            rec.submit()?;
            let got = out.to_f32_vec()?;
            let err = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            let backend = if matches!(dev, Device::Reference) {
                "cpu"
            } else {
                "wgpu"
            };
            println!(
                "{backend:4} {:<5} slots {:?}..: max |paged - contiguous| = {err:.2e}",
                dtype.name(),
                &batch.slots()[..3],
            );
            if err > tol || got.iter().any(|x| !x.is_finite()) {
                return Err(format!("{dtype:?} on {}: error {err} over {tol}", dev.info()).into());
            }
        }
    }
    Ok(())
}
