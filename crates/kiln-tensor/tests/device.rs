//! Device selection, storage, limits and errors.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::too_many_arguments,
    clippy::type_complexity
)]

mod common;

use common::{
    assert_close, fresh_gpu, gpu, gpu_plain, gpu_profiled, gpu_split, gpus, randn, random_blocks,
    rng,
};
use kiln_tensor::{DType, Device, Recorder, Tensor, TensorError};

#[test]
fn reports_the_adapter_and_its_features() {
    for (name, dev) in gpus() {
        let info = dev.info();
        eprintln!("{name}: {info}");
        assert!(
            !info.name.is_empty() && info.backend != "cpu",
            "{name}: {info:?}"
        );
        assert!(info.max_storage_binding_bytes >= 1 << 20);
    }
    if let Some(plain) = gpu_plain() {
        let i = plain.info();
        assert!(
            !i.shader_f16 && !i.subgroups,
            "features were turned off: {i:?}"
        );
    }
    assert_eq!(Device::reference().info().backend, "reference");
    let native = kiln_testkit::native_cpu().info();
    assert_eq!(
        (native.backend.as_str(), native.device_type.as_str()),
        ("cpu", "cpu")
    );
    assert!(
        native.threads >= 1 && !native.cpu_isa.is_empty(),
        "{native:?}"
    );
}

fn bytemuck_bytes(v: &[half::bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn upload_download_roundtrips_every_dtype() {
    let mut r = rng(10);
    let v = randn(&mut r, 3 * 64, 3.0);
    let mut devs = gpus();
    devs.push(("cpu", Device::reference()));
    for (name, dev) in devs {
        let t = Tensor::from_f32(&dev, &[3, 64], &v).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), v, "{name} f32");
        let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
        let t = Tensor::from_f16(&dev, &[3, 64], &h).unwrap();
        let back: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
        assert_eq!(t.to_f32_vec().unwrap(), back, "{name} f16");
        let b: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let t = Tensor::from_bf16(&dev, &[3, 64], &b).unwrap();
        assert_eq!(t.dtype(), DType::BF16, "bf16 stays bf16 on the device");
        assert_eq!(
            t.to_bytes().unwrap(),
            bytemuck_bytes(&b),
            "{name} bf16 keeps its bytes"
        );
        assert_eq!(
            t.to_f32_vec().unwrap(),
            b.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
            "{name} bf16"
        );
        for q in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let raw = kiln_tensor::quantize(q, &v).unwrap();
            let t = Tensor::from_bytes(&dev, q, &[3, 64], &raw).unwrap();
            assert_eq!(
                t.to_bytes().unwrap(),
                raw,
                "{name} {q:?} keeps its GGUF bytes"
            );
        }
        // Odd block counts (the formats whose heads pair up) and every bit pattern.
        for q in [
            DType::Q5_0,
            DType::Q5_1,
            DType::Q2_K,
            DType::Q3_K,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q4_Z,
            DType::Q8_Z,
        ] {
            let rows = 3;
            let cols = 3 * q.block_elems();
            let raw = random_blocks(&mut r, q, rows * 3);
            let t = Tensor::from_bytes(&dev, q, &[rows, cols], &raw).unwrap();
            assert_eq!(
                t.to_bytes().unwrap(),
                raw,
                "{name} {q:?} keeps its GGUF bytes"
            );
        }
        let u: Vec<u32> = (0..7).map(|i| i * 1_000_003).collect();
        assert_eq!(
            Tensor::from_u32(&dev, &[7], &u)
                .unwrap()
                .to_u32_vec()
                .unwrap(),
            u,
            "{name} u32"
        );
        let odd: Vec<half::f16> = h[..5].to_vec();
        let t = Tensor::from_f16(&dev, &[5], &odd).unwrap();
        assert_eq!(t.to_f32_vec().unwrap().len(), 5, "{name} odd f16 count");
    }
}

/// The block formats decoded on the device from raw GGUF bytes equal the values worked out by
/// hand in `quant.rs`'s unit tests (same blocks).
#[test]
fn device_dequantization_matches_hand_worked_blocks() {
    let mut q8 = vec![0x00, 0x38];
    let mut qs = [0i8; 32];
    qs[..6].copy_from_slice(&[0, 1, -1, 2, -128, 127]);
    q8.extend(qs.iter().map(|&q| q as u8));
    let mut q40 = vec![0x00, 0x40];
    let mut n = [0x88u8; 16];
    n[0] = 0xF0;
    n[15] = 0x98;
    q40.extend_from_slice(&n);
    let mut q41 = vec![0x00, 0x34, 0x00, 0xBC];
    let mut n = [0u8; 16];
    n[0] = 0x3C;
    q41.extend_from_slice(&n);
    // Q4_Z with a zero point that is not an integer, d = 0.25, z = 0.5 (exact either way
    // the kernels compute it); Q8_Z with d = 0.5, z = 128 and unsigned quants 0, 128, 255, 1.
    let mut q4z = vec![0x00, 0x34, 0x00, 0x38];
    let mut n = [0u8; 16];
    n[0] = 0x3C;
    q4z.extend_from_slice(&n);
    let mut q8z = vec![0x00, 0x38, 0x00, 0x58];
    let mut qs = [128u8; 32];
    qs[..4].copy_from_slice(&[0, 128, 255, 1]);
    q8z.extend_from_slice(&qs);
    let checks: [(DType, &[u8], &[(usize, f32)]); 5] = [
        (
            DType::Q8_0,
            &q8,
            &[
                (0, 0.0),
                (1, 0.5),
                (2, -0.5),
                (3, 1.0),
                (4, -64.0),
                (5, 63.5),
                (6, 0.0),
            ],
        ),
        (
            DType::Q4_0,
            &q40,
            &[(0, -16.0), (16, 14.0), (15, 0.0), (31, 2.0), (1, 0.0)],
        ),
        (
            DType::Q4_1,
            &q41,
            &[(0, 2.0), (16, -0.25), (1, -1.0), (31, -1.0)],
        ),
        (
            DType::Q4_Z,
            &q4z,
            &[(0, 2.875), (16, 0.625), (1, -0.125), (31, -0.125)],
        ),
        (
            DType::Q8_Z,
            &q8z,
            &[(0, -64.0), (1, 0.0), (2, 63.5), (3, -63.5), (31, 0.0)],
        ),
    ];
    for (name, dev) in gpus() {
        for (dt, raw, want) in &checks {
            let t = Tensor::from_bytes(&dev, *dt, &[1, 32], raw).unwrap();
            let mut rec = Recorder::new(&dev);
            let e = rec.embedding(&t, &[0]).unwrap();
            // And through matmul with a one-hot x: column j of the row.
            let mut xs = vec![0f32; 32 * 32];
            for j in 0..32 {
                xs[j * 32 + j] = 1.0;
            }
            let x = Tensor::from_f32(&dev, &[32, 32], &xs).unwrap();
            let x1 = Tensor::from_f32(&dev, &[1, 32], &xs[..32]).unwrap();
            let tiled = rec.matmul(&x, &t, None).unwrap();
            let vec = rec.matmul(&x1, &t, None).unwrap();
            rec.submit().unwrap();
            let e = e.to_f32_vec().unwrap();
            let tiled = tiled.to_f32_vec().unwrap();
            for &(i, v) in *want {
                assert_eq!(e[i], v, "{name} {dt:?} embedding element {i}");
                assert_eq!(tiled[i], v, "{name} {dt:?} tiled matmul element {i}");
            }
            assert_eq!(
                vec.to_f32_vec().unwrap()[0],
                want[0].1,
                "{name} {dt:?} matvec"
            );
        }
    }
}

#[test]
fn split_bindings_give_the_same_results() {
    let Some(split) = gpu_split() else { return };
    let mut r = rng(11);
    // 300 rows of 256 Q8_0 / Q4_1 / … or 40 f32: 82 KB, 48 KB, 48 KB, …: several 16 KiB
    // chunks each.
    for (dtype, n, k) in [
        (DType::Q8_0, 300usize, 256usize),
        (DType::F32, 300, 40),
        (DType::BF16, 300, 80),
        (DType::Q4_1, 300, 256),
        (DType::Q5_0, 300, 256),
        (DType::Q4_K, 300, 256),
        (DType::Q6_K, 300, 256),
        (DType::Q3_K, 300, 256),
        (DType::Q5_K, 300, 256),
        (DType::Q2_K, 400, 256),
        (DType::Q5_1, 300, 256),
        (DType::Q4_Z, 300, 256),
        (DType::Q8_Z, 300, 256),
    ] {
        let w = randn(&mut r, n * k, 1.0);
        let raw = match dtype {
            DType::F32 | DType::Q8_0 | DType::Q4_1 => Vec::new(),
            q => random_blocks(&mut r, q, n * k / q.block_elems()),
        };
        let ids = [0u32, n as u32 - 1, 77, 3];
        for m in [1usize, 9] {
            let x = randn(&mut r, m * k, 1.0);
            let run = |dev: &Device| {
                let wt = match dtype {
                    DType::F32 => Tensor::from_f32(dev, &[n, k], &w).unwrap(),
                    DType::Q8_0 | DType::Q4_1 => {
                        Tensor::quantize_f32(dev, dtype, &[n, k], &w).unwrap()
                    }
                    q => Tensor::from_bytes(dev, q, &[n, k], &raw).unwrap(),
                };
                let xt = Tensor::from_f32(dev, &[m, k], &x).unwrap();
                let mut rec = Recorder::new(dev);
                let y = rec.matmul(&xt, &wt, None).unwrap();
                let e = rec.embedding(&wt, &ids).unwrap();
                rec.submit().unwrap();
                (
                    wt.chunk_count(),
                    y.to_f32_vec().unwrap(),
                    e.to_f32_vec().unwrap(),
                )
            };
            let (_, wy, we) = run(&Device::reference());
            let (chunks, gy, ge) = run(&split);
            assert!(
                chunks > 2,
                "{dtype:?} should be split, got {chunks} chunk(s)"
            );
            assert_close(
                &format!("split matmul {dtype:?} m={m}"),
                &gy,
                &wy,
                1e-5 * k as f32,
                0.0,
            );
            assert_eq!(ge, we, "split embedding {dtype:?}");
        }
    }
    // An output bigger than one binding is a clear error, not a crash.
    let x = Tensor::from_f32(&split, &[64, 32], &vec![0.0; 64 * 32]).unwrap();
    let w = Tensor::from_f32(&split, &[100, 32], &vec![0.0; 100 * 32]).unwrap();
    let e = Recorder::new(&split).matmul(&x, &w, None).unwrap_err();
    assert!(matches!(e, TensorError::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("matmul output"), "{e}");
}

/// A tensor larger than lavapipe's 128 MiB binding limit: an embedding table of
/// 33,000 × 1,024 f32 (135 MB), used by embedding and as a tied LM head.
#[test]
fn tensor_larger_than_the_binding_limit_works() {
    let Some(dev) = gpu() else { return };
    let (rows, k) = (33_000usize, 1024usize);
    let limit = dev.info().max_storage_binding_bytes;
    let bytes = (rows * k * 4) as u64;
    let rows = if bytes <= limit {
        (limit as usize / (k * 4)) + 1000
    } else {
        rows
    };
    let table: Vec<f32> = (0..rows * k)
        .map(|i| ((i % 1013) as f32 - 506.0) / 512.0)
        .collect();
    let t = Tensor::from_f32(&dev, &[rows, k], &table).unwrap();
    assert!(
        t.chunk_count() >= 2,
        "{} bytes over a {limit}-byte limit",
        rows * k * 4
    );
    let ids = [0u32, 1, rows as u32 / 2, rows as u32 - 1];
    let x: Vec<f32> = (0..k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect();
    let xt = Tensor::from_f32(&dev, &[1, k], &x).unwrap();
    let mut rec = Recorder::new(&dev);
    let e = rec.embedding(&t, &ids).unwrap();
    let logits = rec.matmul(&xt, &t, None).unwrap();
    let best = rec.argmax(&logits).unwrap();
    rec.submit().unwrap();
    let e = e.to_f32_vec().unwrap();
    for (j, &id) in ids.iter().enumerate() {
        assert_eq!(
            &e[j * k..(j + 1) * k],
            &table[id as usize * k..(id as usize + 1) * k],
            "row {id}"
        );
    }
    let logits = logits.to_f32_vec().unwrap();
    let cpu_t = Tensor::from_f32(&Device::reference(), &[rows, k], &table).unwrap();
    let cpu_x = Tensor::from_f32(&Device::reference(), &[1, k], &x).unwrap();
    let mut cr = Recorder::new(&Device::reference());
    let want = cr
        .matmul(&cpu_x, &cpu_t, None)
        .unwrap()
        .to_f32_vec()
        .unwrap();
    assert_close(
        "logits over a split table",
        &logits,
        &want,
        1e-5 * k as f32,
        0.0,
    );
    let want_best = cr
        .argmax(&Tensor::from_f32(&Device::reference(), &[1, rows], &want).unwrap())
        .unwrap();
    assert_eq!(best.to_u32_vec().unwrap(), want_best.to_u32_vec().unwrap());
}

#[test]
fn bad_use_is_an_error_not_a_panic() {
    let mut devs = gpus();
    devs.push(("cpu", Device::reference()));
    for (name, dev) in devs {
        let x = Tensor::from_f32(&dev, &[2, 32], &[0.0; 64]).unwrap();
        let w = Tensor::from_f32(&dev, &[3, 31], &[0.0; 93]).unwrap();
        let mut rec = Recorder::new(&dev);
        let e = rec.matmul(&x, &w, None).unwrap_err();
        assert!(
            matches!(e, TensorError::Shape { op: "matmul", .. }),
            "{name}: {e}"
        );
        let ids = Tensor::from_u32(&dev, &[2, 32], &[0; 64]).unwrap();
        let e = rec.matmul(&x, &ids, None).unwrap_err();
        assert!(
            matches!(
                e,
                TensorError::DType {
                    dtype: DType::U32,
                    ..
                }
            ),
            "{name}: {e}"
        );
        let e = rec.add(&x, &w).unwrap_err();
        assert!(e.to_string().contains("[2, 32] vs [3, 31]"), "{name}: {e}");
        let e = rec.embedding(&x, &[2]).unwrap_err();
        assert!(
            matches!(
                e,
                TensorError::OutOfRange {
                    index: 2,
                    limit: 2,
                    ..
                }
            ),
            "{name}: {e}"
        );
        let e = rec.rms_norm(&x, &x, 1e-5).unwrap_err();
        assert!(
            matches!(e, TensorError::Shape { op: "rms_norm", .. }),
            "{name}: {e}"
        );
        let e = Tensor::from_f32(&dev, &[3, 3], &[0.0; 8]).unwrap_err();
        assert!(
            matches!(
                e,
                TensorError::DataLength {
                    expected: 36,
                    got: 32,
                    ..
                }
            ),
            "{name}: {e}"
        );
        let e = Tensor::quantize_f32(&dev, DType::Q4_0, &[2, 48], &[0.0; 96]).unwrap_err();
        assert!(e.to_string().contains("multiple of 32"), "{name}: {e}");
        let e = rec.softmax(&ids).unwrap_err();
        assert!(
            matches!(e, TensorError::DType { op: "softmax", .. }),
            "{name}: {e}"
        );
        assert_eq!(
            rec.pending_dispatches(),
            0,
            "{name}: failed ops record nothing"
        );
    }
    // Mixing devices is an error.
    if let Some(g) = gpu() {
        let a = Tensor::from_f32(&g, &[4], &[0.0; 4]).unwrap();
        let b = Tensor::from_f32(&Device::reference(), &[4], &[0.0; 4]).unwrap();
        let e = Recorder::new(&g).add(&a, &b).unwrap_err();
        assert!(matches!(e, TensorError::DeviceMismatch { .. }), "{e}");
    }
}

#[test]
fn a_step_is_one_submit_and_pipelines_are_cached() {
    let Some(dev) = fresh_gpu() else { return };
    let Device::Wgpu(ctx) = &dev else {
        unreachable!()
    };
    let x = Tensor::from_f32(&dev, &[4, 64], &vec![0.25; 256]).unwrap();
    let g = Tensor::from_f32(&dev, &[64], &vec![1.0; 64]).unwrap();
    let step = |rec: &mut Recorder| {
        let a = rec.rms_norm(&x, &g, 1e-6).unwrap();
        let b = rec.add(&a, &x).unwrap();
        let c = rec.silu_mul(&b, &a).unwrap();
        rec.softmax(&c).unwrap()
    };
    let mut rec = Recorder::new(&dev);
    let out = step(&mut rec);
    assert_eq!(rec.pending_dispatches(), 4, "nothing runs before submit");
    rec.submit().unwrap();
    let first = out.to_f32_vec().unwrap();
    let compiled = ctx.cached_pipelines();
    drop(out);
    let mut rec = Recorder::new(&dev);
    let again = step(&mut rec);
    rec.submit().unwrap();
    assert_eq!(again.to_f32_vec().unwrap(), first);
    assert_eq!(
        ctx.cached_pipelines(),
        compiled,
        "the second step compiles nothing"
    );
    assert!(
        ctx.idle_pooled_buffers() > 0,
        "intermediates went back to the pool"
    );
}

/// Two threads on one device (engines sharing it, or tests running in parallel): a buffer
/// that thread A dropped while its recording was still open must not become thread B's
/// output, or A's late submit overwrites what B already read (a CI run once read float bits
/// back as a token id this way).
#[test]
fn a_buffer_dropped_during_an_open_recording_stays_with_its_thread() {
    let Some(dev) = fresh_gpu() else { return };
    let ramp: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let x = Tensor::from_f32(&dev, &[1, 64], &ramp).unwrap();
    let mut a = Recorder::new(&dev);
    // A 256-byte intermediate, dropped before A submits.
    let mid = a.softmax(&x).unwrap();
    let a_out = a.softmax(&mid).unwrap();
    drop(mid);
    // B: an argmax, whose output is in the same size class, submitted and read back.
    let (ids, first) = std::thread::scope(|s| {
        s.spawn(|| {
            // 512 bytes: another size class than the buffers counted below.
            let rev: Vec<f32> = (0..128).map(|i| -(i as f32)).collect();
            let y = Tensor::from_f32(&dev, &[1, 128], &rev).unwrap();
            let mut b = Recorder::new(&dev);
            let ids = b.argmax(&y).unwrap();
            b.submit().unwrap();
            let first = ids.to_u32_vec().unwrap();
            (ids, first)
        })
        .join()
        .unwrap()
    });
    assert_eq!(first, [0]);
    a.submit().unwrap();
    let want = {
        let cpu = Device::reference();
        let mut rec = Recorder::new(&cpu);
        let x = Tensor::from_f32(&cpu, &[1, 64], &ramp).unwrap();
        let m = rec.softmax(&x).unwrap();
        rec.softmax(&m).unwrap().to_f32_vec().unwrap()
    };
    let got = a_out.to_f32_vec().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-6,
            "A's result: {got:?} against {want:?}"
        );
    }
    assert_eq!(
        ids.to_u32_vec().unwrap(),
        first,
        "B's result changed after A's submit"
    );
    // Submitted, A's held buffer is free for B: B's next output takes it.
    let Device::Wgpu(ctx) = &dev else {
        unreachable!()
    };
    // Idle: A's intermediate and B's 512-byte input.
    assert_eq!(ctx.idle_pooled_buffers(), 2);
    let again = std::thread::scope(|s| {
        s.spawn(|| {
            let mut b = Recorder::new(&dev);
            let ids = b.argmax(&x).unwrap();
            b.submit().unwrap();
            ids.to_u32_vec().unwrap()
        })
        .join()
        .unwrap()
    });
    assert_eq!(again, [63]);
    assert_eq!(
        ctx.idle_pooled_buffers(),
        2,
        "B took the freed buffer (made none) and gave it back"
    );
}

#[test]
fn profiling_times_every_launch_by_kernel() {
    assert!(
        Device::reference().profile().is_none(),
        "the CPU backend has no kernel profile"
    );
    assert!(
        gpu().is_none_or(|d| d.profile().is_none()),
        "profiling is off unless asked for"
    );
    let Some(dev) = gpu_profiled() else {
        return;
    };
    let Some(p) = dev.profile() else {
        panic!(
            "{}: no timestamp queries, so no kernel profile",
            dev.info().name
        );
    };
    assert_eq!(p, kiln_tensor::Profile::default());
    let mut r = rng(3);
    let a = Tensor::from_f32(&dev, &[4, 64], &randn(&mut r, 256, 1.0)).unwrap();
    let w =
        Tensor::quantize_f32(&dev, DType::Q4_1, &[96, 64], &randn(&mut r, 96 * 64, 1.0)).unwrap();
    let mut rec = Recorder::new(&dev);
    let b = rec.add(&a, &a).unwrap();
    let c = rec.add(&b, &a).unwrap();
    let y = rec.matmul(&c, &w, None).unwrap();
    rec.submit().unwrap();
    // Profiling changes no result.
    let want: Vec<f32> = a.to_f32_vec().unwrap().iter().map(|v| 3.0 * v).collect();
    assert_close(
        "add under profiling",
        &c.to_f32_vec().unwrap(),
        &want,
        1e-6,
        0.0,
    );
    assert_eq!(y.shape(), &[4, 96]);
    let p = dev.profile().unwrap();
    assert_eq!((p.submits, p.dispatches), (1, 3), "{p:?}");
    let add = p.kernels.iter().find(|k| k.name == "add").unwrap();
    assert_eq!(add.launches, 2, "{p:?}");
    assert!(
        p.kernels.iter().any(|k| k.name.starts_with("matmul")),
        "{p:?}"
    );
    assert!(p.kernels.iter().all(|k| k.total_ns > 0.0), "{p:?}");
    assert!(p.total_ns() >= add.total_ns);
    dev.reset_profile();
    assert_eq!(dev.profile().unwrap(), kiln_tensor::Profile::default());
    // A submit longer than one query set holds (2048 launches) is timed in full.
    let mut rec = Recorder::new(&dev);
    let mut t = a.clone();
    for _ in 0..2100 {
        t = rec.add(&t, &a).unwrap();
    }
    rec.submit().unwrap();
    let p = dev.profile().unwrap();
    assert_eq!((p.submits, p.dispatches), (1, 2100), "{p:?}");
}
