//! Shared test devices. Every wgpu test runs on a real adapter (lavapipe in CI); when none
//! exists the test fails, unless `KILN_TEST_ALLOW_NO_GPU=1` explicitly opts out, in which case
//! only the CPU reference runs and a warning says so.
#![allow(dead_code)]

use std::sync::OnceLock;

use kiln_tensor::{BackendChoice, DType, Device, DeviceOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn open(opts: DeviceOptions) -> Option<Device> {
    kiln_testkit::wgpu_device(opts)
}

fn wgpu_opts() -> DeviceOptions {
    DeviceOptions {
        backend: BackendChoice::Wgpu,
        ..DeviceOptions::default()
    }
}

/// The adapter with every optional feature it has.
pub fn gpu() -> Option<Device> {
    kiln_testkit::wgpu()
}

/// A device of its own, for tests that count what is cached on it (the shared ones are used by
/// tests running in parallel).
pub fn fresh_gpu() -> Option<Device> {
    open(wgpu_opts())
}

/// The same adapter with SHADER_F16 and SUBGROUP turned off (the fallback kernels).
pub fn gpu_plain() -> Option<Device> {
    static D: OnceLock<Option<Device>> = OnceLock::new();
    D.get_or_init(|| {
        open(DeviceOptions {
            allow_shader_f16: false,
            allow_subgroups: false,
            ..wgpu_opts()
        })
    })
    .clone()
}

/// Features off and the kernel family the adapter would not pick itself.
pub fn gpu_plain_other_kernels() -> Option<Device> {
    static D: OnceLock<Option<Device>> = OnceLock::new();
    D.get_or_init(|| {
        let natural = gpu()?.cpu_shaped_kernels();
        open(DeviceOptions {
            allow_shader_f16: false,
            allow_subgroups: false,
            cpu_shaped_kernels: Some(!natural),
            ..wgpu_opts()
        })
    })
    .clone()
}

/// A device of its own that times every launch with timestamp queries.
pub fn gpu_profiled() -> Option<Device> {
    open(DeviceOptions {
        profile: true,
        ..wgpu_opts()
    })
}

/// The adapter with every feature and the kernel family it would not pick itself.
pub fn gpu_other_kernels() -> Option<Device> {
    kiln_testkit::wgpu_other_kernels()
}

/// Bindings capped at 16 KiB, so that modest tensors exercise the split-binding path.
pub fn gpu_split() -> Option<Device> {
    static D: OnceLock<Option<Device>> = OnceLock::new();
    D.get_or_init(|| {
        open(DeviceOptions {
            max_binding_bytes: Some(16384),
            ..wgpu_opts()
        })
    })
    .clone()
}

/// Every wgpu configuration under test, named.
pub fn gpus() -> Vec<(&'static str, Device)> {
    let mut v = Vec::new();
    v.extend(gpu().map(|d| ("wgpu", d)));
    v.extend(gpu_plain().map(|d| ("wgpu-no-f16-no-subgroups", d)));
    v.extend(gpu_other_kernels().map(|d| ("wgpu-other-kernel-shapes", d)));
    v.extend(gpu_plain_other_kernels().map(|d| ("wgpu-no-features-other-kernel-shapes", d)));
    v
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn randn(r: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) * scale)
        .collect()
}

/// Assert |got - want| <= atol + rtol·|want| everywhere, naming the first failure.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0usize, 0f32);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}: element {i}: got {g}, want {w} (|err| {err} > atol {atol} + rtol {rtol}·|want|)"
        );
        if err > worst.1 {
            worst = (i, err);
        }
    }
}

/// `n_blocks` blocks of the block format `dtype` made of random bytes, with random finite f16
/// scales small enough that every value lies within about ±1 (BF16: random values in ±1).
/// Covers every quant bit pattern, which a quantizer's output would not.
pub fn random_blocks(r: &mut StdRng, dtype: DType, n_blocks: usize) -> Vec<u8> {
    if dtype == DType::BF16 {
        return (0..n_blocks)
            .flat_map(|_| half::bf16::from_f32(r.random_range(-1.0f32..1.0)).to_le_bytes())
            .collect();
    }
    if dtype == DType::MXFP4 {
        // Exponents 119..=124 (scales 2^-9 .. 2^-4): values within ±0.75, every nibble.
        let mut out = vec![0u8; n_blocks * 17];
        r.fill(&mut out[..]);
        for blk in out.chunks_exact_mut(17) {
            blk[0] = r.random_range(119..=124);
        }
        return out;
    }
    if dtype == DType::FP8 {
        // Scales within ±1/448 (the largest code's 448 then within ±1); every code but NaN's.
        let mut out = vec![0u8; n_blocks * 36];
        r.fill(&mut out[..]);
        for blk in out.chunks_exact_mut(36) {
            let d: f32 = r.random_range(-1.0f32..1.0) / 448.0;
            blk[..4].copy_from_slice(&d.to_le_bytes());
            for q in &mut blk[4..] {
                if *q & 0x7f == 0x7f {
                    *q ^= 1;
                }
            }
        }
        return out;
    }
    // (byte offset, bound) of each f16 field: bound·(largest quant·scale product) ≈ 1.
    let fields: &[(usize, f32)] = match dtype {
        DType::Q8_0 | DType::Q4_0 => &[(0, 1.0 / 128.0)],
        DType::Q4_1 => &[(0, 1.0 / 30.0), (2, 0.5)],
        DType::Q5_0 => &[(0, 1.0 / 16.0)],
        DType::Q5_1 => &[(0, 1.0 / 62.0), (2, 0.5)],
        DType::Q2_K => &[(80, 1.0 / 45.0), (82, 1.0 / 30.0)],
        DType::Q3_K => &[(108, 1.0 / 128.0)],
        DType::Q4_K => &[(0, 1.0 / 945.0), (2, 1.0 / 126.0)],
        DType::Q5_K => &[(0, 1.0 / 1953.0), (2, 1.0 / 126.0)],
        DType::Q6_K => &[(208, 1.0 / 4096.0)],
        // Zero points anywhere in ±16 (±256), integer or not: |q − z| < 31 (511).
        DType::Q4_Z => &[(0, 1.0 / 32.0), (2, 16.0)],
        DType::Q8_Z => &[(0, 1.0 / 512.0), (2, 256.0)],
        d => panic!("{d:?} is not a block format"),
    };
    let bb = dtype.block_bytes();
    let mut out = vec![0u8; n_blocks * bb];
    r.fill(&mut out[..]);
    for blk in out.chunks_exact_mut(bb) {
        for &(at, bound) in fields {
            let v = half::f16::from_f32(r.random_range(-1.0f32..1.0) * bound);
            blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    out
}
