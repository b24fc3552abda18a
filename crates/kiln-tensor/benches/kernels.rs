//! Kernel benchmarks on the default wgpu adapter (lavapipe in CI):
//! - `matvec/*`: decode-shaped Y[1, n] = X[1, k] · Wᵀ per weight dtype; throughput in bytes is
//!   the weight bytes read, so criterion's rate is the achieved weight bandwidth;
//! - `matmul/*`: prefill-shaped, m = 128; throughput in "elements" is FLOPs (2·m·n·k);
//! - `dispatch/*`: the cost of one kernel launch (100 tiny launches in one submit) and of one
//!   submit-and-wait round trip;
//! - `sampling/*`: picking one token from each of 1 or 16 rows of 49152 logits with
//!   temperature 0.8, top-k 50 and top-p 0.95, on the device (`Recorder::sample`, reading back
//!   the ids) against reading the rows back and sampling them on the host (the same
//!   definition's CPU reference).
//!
//! Shapes: SmolLM2-135M's projections (576×1536, 1536×576), its LM head (49152×576), Gemma 3
//! 270M's down projection (640×2048), and a 7B MLP projection (11008×4096); a format runs on
//! the shapes whose rows are whole blocks of it (K-quants: multiples of 256). The matmul benches
//! time launches back to back, as a model step runs them (submitted every [`SUBMIT_EVERY`]),
//! and wait for the queue once before the clock stops: the figure is the kernel's, not a queue
//! round trip's (`dispatch/one_launch_submit_wait`, 81 µs on an NVIDIA H200).
//!
//! Weights: F32/F16/BF16 and Q8_0/Q4_0/Q4_1 from the same values; the formats kiln only reads
//! (Q5_0, Q5_1, K-quants) from random blocks with small finite scales (speed does not depend
//! on the values).
//!
//! Run: `cargo bench -p kiln-tensor --bench kernels` (filter with e.g. `-- matvec/Q4_1`).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kiln_tensor::{BackendChoice, DType, Device, DeviceOptions, Recorder, Tensor};
use std::time::{Duration, Instant};

fn device() -> Device {
    let opts = DeviceOptions {
        backend: BackendChoice::from_env().unwrap_or(BackendChoice::Wgpu),
        ..DeviceOptions::default()
    };
    match Device::new(&opts) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kernels bench: cannot open a device: {e}");
            std::process::exit(2);
        }
    }
}

const SHAPES: [(&str, usize, usize); 5] = [
    ("smollm_up_576x1536", 1536, 576),
    ("smollm_down_1536x576", 576, 1536),
    ("smollm_lm_head_49152x576", 49152, 576),
    ("gemma_down_2048x640", 640, 2048),
    ("7b_mlp_4096x11008", 11008, 4096),
];
const DTYPES: &[DType] = DType::WEIGHTS;

/// `n_blocks` GGUF blocks of `dtype` from a fixed hash, with every f16 scale field (FP8's
/// f32) set to a small finite value.
fn blocks(dtype: DType, n_blocks: usize) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let scales: &[usize] = match dtype {
        DType::Q5_0 => &[0],
        DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[],
    };
    let small = half::f16::from_f32(1e-3).to_le_bytes();
    let mut out: Vec<u8> = (0..n_blocks * bb)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    for blk in out.chunks_exact_mut(bb) {
        for &at in scales {
            blk[at..at + 2].copy_from_slice(&small);
        }
        // FP8: an f32 scale, and no E4M3 NaN code.
        if dtype == DType::FP8 {
            blk[..4].copy_from_slice(&1e-3f32.to_le_bytes());
            for q in &mut blk[4..] {
                if *q & 0x7f == 0x7f {
                    *q ^= 1;
                }
            }
        }
    }
    out
}

fn weight(dev: &Device, dtype: DType, n: usize, k: usize) -> Tensor {
    let v: Vec<f32> = (0..n * k)
        .map(|i| ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let t = match dtype {
        DType::F32 => Tensor::from_f32(dev, &[n, k], &v),
        DType::F16 => Tensor::from_f16(
            dev,
            &[n, k],
            &v.iter()
                .map(|&x| half::f16::from_f32(x))
                .collect::<Vec<_>>(),
        ),
        DType::BF16 => Tensor::from_bf16(
            dev,
            &[n, k],
            &v.iter()
                .map(|&x| half::bf16::from_f32(x))
                .collect::<Vec<_>>(),
        ),
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4_Z | DType::Q8_Z => {
            Tensor::quantize_f32(dev, dtype, &[n, k], &v)
        }
        q => Tensor::from_bytes(dev, q, &[n, k], &blocks(q, n * k / q.block_elems())),
    };
    t.unwrap_or_else(|e| {
        eprintln!("kernels bench: upload failed: {e}");
        std::process::exit(2)
    })
}

fn weight_bytes(dtype: DType, n: usize, k: usize) -> u64 {
    dtype.bytes_for(n * k).unwrap_or(0) as u64
}

/// Launches per submit in the matmul benches.
const SUBMIT_EVERY: u64 = 16;

/// `iters` launches of the matmul, submitted in groups, then one wait: their time.
fn run(dev: &Device, x: &Tensor, w: &Tensor, iters: u64) -> Duration {
    let start = Instant::now();
    let mut left = iters;
    let ok = (|| {
        while left > 0 {
            let mut rec = Recorder::new(dev);
            for _ in 0..left.min(SUBMIT_EVERY) {
                rec.matmul(x, w, None)?;
            }
            rec.submit()?;
            left = left.saturating_sub(SUBMIT_EVERY);
        }
        dev.synchronize()
    })();
    if let Err(e) = ok {
        eprintln!("kernels bench: matmul failed: {e}");
        std::process::exit(2);
    }
    start.elapsed()
}

fn bench_matmul(c: &mut Criterion, name: &str, m: usize) {
    let dev = device();
    eprintln!("device: {}", dev.info());
    let mut g = c.benchmark_group(name);
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for (shape, n, k) in SHAPES {
        let x = Tensor::from_f32(&dev, &[m, k], &vec![0.01; m * k])
            .unwrap_or_else(|e| panic_free_exit(&e));
        for &dtype in DTYPES {
            if !k.is_multiple_of(dtype.block_elems()) {
                continue;
            }
            // The 7B projection in f32 is 180 MB: it exercises split bindings on lavapipe.
            let w = weight(&dev, dtype, n, k);
            g.throughput(if m == 1 {
                Throughput::Bytes(weight_bytes(dtype, n, k))
            } else {
                Throughput::Elements((2 * m * n * k) as u64)
            });
            g.bench_with_input(
                BenchmarkId::new(format!("{dtype:?}"), shape),
                &(),
                |b, _| b.iter_custom(|iters| run(&dev, &x, &w, iters)),
            );
        }
    }
    g.finish();
}

fn panic_free_exit(e: &dyn std::fmt::Display) -> ! {
    eprintln!("kernels bench: {e}");
    std::process::exit(2)
}

fn matvec(c: &mut Criterion) {
    bench_matmul(c, "matvec", 1);
}

fn matmul(c: &mut Criterion) {
    bench_matmul(c, "matmul_m128", 128);
}

fn dispatch(c: &mut Criterion) {
    let dev = device();
    let a = Tensor::from_f32(&dev, &[64], &[1.0; 64]).unwrap_or_else(|e| panic_free_exit(&e));
    let mut g = c.benchmark_group("dispatch");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    // 100 dependent launches of a 64-element add in one submit: time per launch = time / 100.
    g.throughput(Throughput::Elements(100));
    g.bench_function("100_launches_one_submit", |b| {
        b.iter(|| {
            let mut rec = Recorder::new(&dev);
            let mut t = a.clone();
            for _ in 0..100 {
                t = rec.add(&t, &a).unwrap_or_else(|e| panic_free_exit(&e));
            }
            rec.submit()
                .and_then(|_| dev.synchronize())
                .unwrap_or_else(|e| panic_free_exit(&e));
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("one_launch_submit_wait", |b| {
        b.iter(|| {
            let mut rec = Recorder::new(&dev);
            let _t = rec.add(&a, &a).unwrap_or_else(|e| panic_free_exit(&e));
            rec.submit()
                .and_then(|_| dev.synchronize())
                .unwrap_or_else(|e| panic_free_exit(&e));
        })
    });
    g.finish();
}

fn sampling(c: &mut Criterion) {
    use kiln_tensor::sample::{RowSampling, pick, process};
    let dev = device();
    let vocab = 49152;
    let mut g = c.benchmark_group("sampling");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for rows in [1usize, 16] {
        // Logit-like rows: a fixed hash spread over about ±8.
        let x: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / (1 << 24) as f32)
            .map(|u| (u - 0.5) * 16.0)
            .collect();
        let logits =
            Tensor::from_f32(&dev, &[rows, vocab], &x).unwrap_or_else(|e| panic_free_exit(&e));
        let how: Vec<RowSampling> = (0..rows as u64)
            .map(|seed| RowSampling {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.95,
                seed,
                ..RowSampling::greedy()
            })
            .collect();
        let picks: Vec<(usize, &RowSampling)> = how.iter().enumerate().collect();
        g.throughput(Throughput::Elements(rows as u64));
        g.bench_function(BenchmarkId::new("device", rows), |b| {
            b.iter(|| {
                let mut rec = Recorder::new(&dev);
                let ids = rec
                    .sample(&logits, &picks)
                    .unwrap_or_else(|e| panic_free_exit(&e));
                rec.submit().unwrap_or_else(|e| panic_free_exit(&e));
                ids.to_u32_vec().unwrap_or_else(|e| panic_free_exit(&e))
            })
        });
        g.bench_function(BenchmarkId::new("read_back_and_host", rows), |b| {
            b.iter(|| {
                let host = logits.to_f32_vec().unwrap_or_else(|e| panic_free_exit(&e));
                host.chunks_exact(vocab)
                    .zip(&how)
                    .map(|(row, h)| pick(process(row, h), h))
                    .collect::<Vec<_>>()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, dispatch, matvec, matmul, sampling);
criterion_main!(benches);
