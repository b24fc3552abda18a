//! The experimental kernel set (`--kernels experimental`) against the CPU reference: the
//! integer dot product matrix-vector kernel runs on every adapter (lavapipe included, in
//! both kernel shapes); the cooperative matmul only where the adapter has 16 × 16 f16
//! cooperative matrices, and elsewhere the tested kernels run in its place.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_close, gpu, randn, rng};
use kiln_tensor::{
    Activation, COOP_F16_16, DType, Device, DeviceOptions, Kernels, LinearOps, Recorder, RmsNorm,
    Tensor,
};

/// The experimental set on the default adapter, in its own kernel shapes and in the other
/// family's (so both the 8- and the 32-thread row layouts run).
fn experimental_devices() -> Vec<(&'static str, Device)> {
    let Some(natural) = gpu().map(|d| d.cpu_shaped_kernels()) else {
        return Vec::new();
    };
    [
        ("experimental", natural),
        ("experimental-other-shapes", !natural),
    ]
    .into_iter()
    .filter_map(|(name, cpu_shaped)| {
        kiln_testkit::wgpu_device(DeviceOptions {
            kernels: Kernels::Experimental,
            cpu_shaped_kernels: Some(cpu_shaped),
            ..DeviceOptions::default()
        })
        .map(|d| (name, d))
    })
    .collect()
}

#[test]
fn kernel_sets_parse_and_default_to_tested() {
    assert_eq!(
        "Experimental".parse::<Kernels>().unwrap(),
        Kernels::Experimental
    );
    assert_eq!("".parse::<Kernels>().unwrap(), Kernels::Tested);
    let e = "fast".parse::<Kernels>().unwrap_err().to_string();
    assert!(e.contains("fast") && e.contains("experimental"), "{e}");
    if let Some(d) = gpu() {
        let i = d.info();
        assert!(
            !i.coop_matmul && !i.dp4a_matvec,
            "tested kernels only: {i:?}"
        );
    }
}

#[test]
fn the_integer_dot_product_matvec_matches_the_reference_within_int8_rounding() {
    let mut r = rng(11);
    for (name, dev) in experimental_devices() {
        assert!(dev.info().dp4a_matvec, "{name}: {:?}", dev.info());
        let max_m = if dev.cpu_shaped_kernels() { 8 } else { 4 };
        for dtype in [DType::Q8_0, DType::Q4_0] {
            for (m, n, k, bias) in [
                (1, 72, 256, false),
                (3, 40, 96, true),
                (max_m, 130, 512, false),
            ] {
                let x = randn(&mut r, m * k, 2.0);
                let wv = randn(&mut r, n * k, 0.5);
                let bv = randn(&mut r, n, 1.0);
                let run = |d: &Device| -> (Vec<f32>, Vec<f32>) {
                    let xt = Tensor::from_f32(d, &[m, k], &x).unwrap();
                    let wt = Tensor::quantize_f32(d, dtype, &[n, k], &wv).unwrap();
                    let bt = Tensor::from_f32(d, &[n], &bv).unwrap();
                    let mut rec = Recorder::new(d);
                    let y = rec.matmul(&xt, &wt, bias.then_some(&bt)).unwrap();
                    rec.submit().unwrap();
                    (y.to_f32_vec().unwrap(), wt.to_f32_vec().unwrap())
                };
                let (want, wq) = run(&Device::reference());
                let (got, _) = run(&dev);
                // 8-bit X's rounding, then the f32 sums' share.
                let bound: Vec<f32> = kiln_tensor::int8_activation_bounds(&x, &wq, k)
                    .iter()
                    .map(|b| b * 1.01 + 1e-4)
                    .collect();
                for (j, ((g, w), b)) in got.iter().zip(&want).zip(&bound).enumerate() {
                    assert!(
                        (g - w).abs() <= *b,
                        "{name} {dtype:?} m={m} n={n} k={k} bias={bias}: y[{j}] = {g}, \
                         reference {w}, bound {b}"
                    );
                }
                // A real product: the int8 rounding is small against the values.
                let worst = bound.iter().fold(0f32, |a, b| a.max(*b));
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                assert!(
                    worst < 0.1 * scale,
                    "{name}: bound {worst} vs values {scale}"
                );
            }
        }
    }
}

/// The products above are the integer dot product kernel's: its two launches are what a
/// profiled experimental device records for a Q8_0 matmul at decode.
#[test]
fn decode_matmuls_of_q8_0_and_q4_0_take_the_integer_dot_product_kernel() {
    let Some(dev) = gpu().and_then(|_| {
        kiln_testkit::wgpu_device(DeviceOptions {
            kernels: Kernels::Experimental,
            profile: true,
            ..DeviceOptions::default()
        })
    }) else {
        return;
    };
    let Some(_) = dev.profile() else {
        panic!("{}: no timestamp queries", dev.info().name);
    };
    let mut r = rng(13);
    for (dtype, kernels) in [
        (DType::Q8_0, vec!["matmul_vec_dp4a", "quantize_q8"]),
        (DType::Q4_0, vec!["matmul_vec_dp4a", "quantize_q8"]),
    ] {
        dev.reset_profile();
        let x = Tensor::from_f32(&dev, &[1, 64], &randn(&mut r, 64, 1.0)).unwrap();
        let w = Tensor::quantize_f32(&dev, dtype, &[32, 64], &randn(&mut r, 32 * 64, 1.0)).unwrap();
        let mut rec = Recorder::new(&dev);
        rec.matmul(&x, &w, None).unwrap();
        rec.submit().unwrap();
        let mut names: Vec<String> = dev
            .profile()
            .unwrap()
            .kernels
            .iter()
            .map(|k| k.name.clone())
            .collect();
        names.sort();
        assert_eq!(names, kernels, "{dtype:?}");
    }
    // Other weight formats keep the tested kernels.
    dev.reset_profile();
    let x = Tensor::from_f32(&dev, &[1, 64], &randn(&mut r, 64, 1.0)).unwrap();
    let w =
        Tensor::quantize_f32(&dev, DType::Q4_1, &[32, 64], &randn(&mut r, 32 * 64, 1.0)).unwrap();
    let mut rec = Recorder::new(&dev);
    rec.matmul(&x, &w, None).unwrap();
    rec.submit().unwrap();
    let p = dev.profile().unwrap();
    assert!(p.kernels.iter().all(|k| !k.name.contains("dp4a")), "{p:?}");
}

/// A decode layer's fused forms (norm + gated, residual) around the integer dot product
/// kernel run as separate ops and still match.
#[test]
fn linear_ops_around_the_integer_dot_product_matvec_match() {
    let mut r = rng(12);
    let (m, k, f) = (2, 128, 48);
    let x = randn(&mut r, m * k, 1.0);
    let g = randn(&mut r, k, 1.0);
    let wv = randn(&mut r, 2 * f * k, 0.5);
    let res = randn(&mut r, m * 2 * f, 1.0);
    for (name, dev) in experimental_devices() {
        for dtype in [DType::Q8_0, DType::Q4_0] {
            let run = |d: &Device| -> Vec<f32> {
                let xt = Tensor::from_f32(d, &[m, k], &x).unwrap();
                let gt = Tensor::from_f32(d, &[k], &g).unwrap();
                let wt = Tensor::quantize_f32(d, dtype, &[2 * f, k], &wv).unwrap();
                let rt = Tensor::from_f32(d, &[m, 2 * f], &res).unwrap();
                let mut rec = Recorder::new(d);
                let gated = rec
                    .linear(
                        &xt,
                        &wt,
                        LinearOps {
                            norm: Some(RmsNorm {
                                weight: &gt,
                                eps: 1e-5,
                            }),
                            glu: Some(Activation::Silu),
                            ..LinearOps::default()
                        },
                    )
                    .unwrap();
                let added = rec.matmul_add(&xt, &wt, &rt).unwrap();
                rec.submit().unwrap();
                let mut out = gated.to_f32_vec().unwrap();
                out.extend(added.to_f32_vec().unwrap());
                out
            };
            // int8 activations: a few parts in a thousand of these magnitudes.
            assert_close(
                &format!("{name} {dtype:?}"),
                &run(&dev),
                &run(&Device::reference()),
                0.05,
                0.02,
            );
        }
    }
}

/// Where the adapter lacks what the cooperative matmul needs (lavapipe has no cooperative
/// matrices), the tiled product runs in its place and gives the reference's values.
#[test]
fn the_cooperative_matmul_runs_only_where_the_adapter_has_it() {
    let mut r = rng(7);
    let (m, k, n) = (40, 96, 72);
    let x = randn(&mut r, m * k, 1.0);
    let w = randn(&mut r, n * k, 1.0);
    for (name, dev) in experimental_devices() {
        let info = dev.info();
        let coop = info.cooperative_matrix.contains(&COOP_F16_16);
        assert_eq!(
            info.coop_matmul,
            coop && info.shader_f16 && info.subgroup_size.0 == info.subgroup_size.1,
            "{name}: {info:?}"
        );
        let run = |d: &Device| {
            let xt = Tensor::from_f32(d, &[m, k], &x).unwrap();
            let wt = Tensor::from_f32(d, &[n, k], &w).unwrap();
            let mut rec = Recorder::new(d);
            let y = rec.matmul(&xt, &wt, None).unwrap();
            rec.submit().unwrap();
            y.to_f32_vec().unwrap()
        };
        // f16 tiles where the cooperative matmul runs; the f32 kernels' bound elsewhere.
        let bound = if info.coop_matmul { 2e-2 } else { 1e-4 };
        assert_close(name, &run(&dev), &run(&Device::reference()), bound, bound);
    }
}
