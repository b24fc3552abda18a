//! Every op on every wgpu configuration against the CPU reference, over random shapes that
//! include sizes which are not multiples of tiles or blocks.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::too_many_arguments,
    clippy::type_complexity
)]

mod common;

use common::{assert_close, gpus, randn, random_blocks, rng};
use kiln_tensor::{
    Activation, ClampLimit, ColumnIndex, DType, Device, DeviceOptions, LinearOps, MatvecShape,
    Recorder, RmsNorm, RopeConfig, RopeLayout, RopeScaling, RopeTable, RotaryChannels, Tensor,
    TensorError,
};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

const WEIGHT_DTYPES: &[DType] = DType::WEIGHTS;

/// A weight of `dtype` built the same way on both devices from the same f32 values: converted
/// or quantized where kiln can, else random blocks seeded from the values (the formats kiln
/// only reads).
fn weight(dev: &Device, dtype: DType, n: usize, k: usize, v: &[f32]) -> Tensor {
    match dtype {
        DType::F32 => Tensor::from_f32(dev, &[n, k], v).unwrap(),
        DType::F16 => {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            Tensor::from_f16(dev, &[n, k], &h).unwrap()
        }
        DType::BF16 => {
            let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Tensor::from_bf16(dev, &[n, k], &h).unwrap()
        }
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => {
            Tensor::quantize_f32(dev, dtype, &[n, k], v).unwrap()
        }
        q => {
            let seed = u64::from(v[0].to_bits()) ^ (v.len() as u64) << 32;
            let raw = random_blocks(&mut rng(seed), q, n * k / q.block_elems());
            Tensor::from_bytes(dev, q, &[n, k], &raw).unwrap()
        }
    }
}

fn run_matmul(
    dev: &Device,
    dtype: DType,
    x: &[f32],
    m: usize,
    k: usize,
    wv: &[f32],
    n: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let xt = Tensor::from_f32(dev, &[m, k], x).unwrap();
    let wt = weight(dev, dtype, n, k, wv);
    let bt = bias.map(|b| Tensor::from_f32(dev, &[n], b).unwrap());
    let mut rec = Recorder::new(dev);
    let y = rec.matmul(&xt, &wt, bt.as_ref()).unwrap();
    rec.submit().unwrap();
    assert_eq!(y.shape(), &[m, n]);
    y.to_f32_vec().unwrap()
}

/// f32 accumulation over k terms of magnitude <= 1: a wrong index or dequantization is off by
/// O(1), rounding by O(k·ε).
fn matmul_tol(k: usize) -> f32 {
    1e-5 * k as f32 + 1e-5
}

#[test]
fn matmul_matches_cpu_for_every_weight_dtype() {
    let mut r = rng(1);
    for &dtype in WEIGHT_DTYPES {
        let ks: &[usize] = if dtype.is_k_quant() {
            &[256, 768]
        } else if dtype.is_quantized() {
            &[32, 96, 576]
        } else {
            &[1, 7, 33, 100]
        };
        for &k in ks {
            for &m in &[1usize, 2, 5, 8, 9, 20, 40, 67] {
                let n = r.random_range(1..80);
                let x = randn(&mut r, m * k, 1.0);
                let w = randn(&mut r, n * k, 1.0);
                let bias = if r.random_bool(0.5) {
                    Some(randn(&mut r, n, 1.0))
                } else {
                    None
                };
                let want = run_matmul(
                    &Device::reference(),
                    dtype,
                    &x,
                    m,
                    k,
                    &w,
                    n,
                    bias.as_deref(),
                );
                for (name, dev) in gpus() {
                    let got = run_matmul(&dev, dtype, &x, m, k, &w, n, bias.as_deref());
                    assert_close(
                        &format!(
                            "{name} matmul {dtype:?} m={m} k={k} n={n} bias={}",
                            bias.is_some()
                        ),
                        &got,
                        &want,
                        matmul_tol(k),
                        0.0,
                    );
                }
            }
        }
    }
}

/// GELU-tanh as `gelu_pytorch_tanh` computes it, in f64.
fn gelu_tanh64(g: f32) -> f32 {
    let g = f64::from(g);
    (0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh()))
        as f32
}

/// What `linear` may add around a matmul, as a test case.
#[derive(Debug, Clone, Copy)]
struct Case {
    norm: bool,
    bias: bool,
    residual: bool,
    glu: Option<Activation>,
}

const CASES: &[Case] = &[
    Case {
        norm: false,
        bias: false,
        residual: true,
        glu: None,
    },
    Case {
        norm: false,
        bias: false,
        residual: false,
        glu: Some(Activation::Silu),
    },
    Case {
        norm: false,
        bias: false,
        residual: false,
        glu: Some(Activation::GeluTanh),
    },
    Case {
        norm: true,
        bias: false,
        residual: false,
        glu: None,
    },
    Case {
        norm: true,
        bias: true,
        residual: false,
        glu: None,
    },
    Case {
        norm: true,
        bias: false,
        residual: false,
        glu: Some(Activation::Silu),
    },
    Case {
        norm: true,
        bias: false,
        residual: false,
        glu: Some(Activation::GeluTanh),
    },
    Case {
        norm: false,
        bias: false,
        residual: false,
        glu: Some(Activation::SwigluOai),
    },
    Case {
        norm: true,
        bias: false,
        residual: false,
        glu: Some(Activation::SwigluOai),
    },
    Case {
        norm: true,
        bias: false,
        residual: false,
        glu: Some(CLAMPED),
    },
    // Two epilogues: composed on every device.
    Case {
        norm: true,
        bias: true,
        residual: true,
        glu: None,
    },
    Case {
        norm: false,
        bias: false,
        residual: true,
        glu: Some(Activation::Silu),
    },
];

/// The operands of one `linear` case: X `[m, k]`, W `[n, k]` (a stacked `[gate; up]` under
/// a GLU), the norm's weights, a bias and a residual of the output's shape.
struct Operands {
    x: Vec<f32>,
    w: Vec<f32>,
    g: Vec<f32>,
    bias: Vec<f32>,
    res: Vec<f32>,
}

impl Operands {
    /// Random operands of `c` for `m` rows of length `k`, and the product's width `f` (1..40;
    /// W has twice as many rows under a GLU).
    fn random(r: &mut StdRng, c: Case, m: usize, k: usize) -> (Self, usize) {
        let f = r.random_range(1..40);
        let n = if c.glu.is_some() { 2 * f } else { f };
        let o = Self {
            x: randn(r, m * k, 1.0),
            w: randn(r, n * k, 1.0),
            g: randn(r, k, 1.0),
            bias: randn(r, n, 1.0),
            res: randn(r, m * f, 1.0),
        };
        (o, f)
    }
}

/// The operands on `dev`: X, W, the norm's weights, the bias and the residual.
fn operand_tensors(dev: &Device, dtype: DType, o: &Operands, m: usize, k: usize) -> [Tensor; 5] {
    let n = o.w.len() / k;
    [
        Tensor::from_f32(dev, &[m, k], &o.x).unwrap(),
        weight(dev, dtype, n, k, &o.w),
        Tensor::from_f32(dev, &[k], &o.g).unwrap(),
        Tensor::from_f32(dev, &[n], &o.bias).unwrap(),
        Tensor::from_f32(dev, &[m, o.res.len() / m], &o.res).unwrap(),
    ]
}

fn run_linear(dev: &Device, dtype: DType, c: Case, o: &Operands, m: usize, k: usize) -> Vec<f32> {
    let [xt, wt, gt, bt, rt] = operand_tensors(dev, dtype, o, m, k);
    let ops = LinearOps {
        norm: c.norm.then_some(RmsNorm {
            weight: &gt,
            eps: 1e-5,
        }),
        bias: c.bias.then_some(&bt),
        glu: c.glu,
        residual: c.residual.then_some(&rt),
    };
    let mut rec = Recorder::new(dev);
    let y = rec.linear(&xt, &wt, ops).unwrap();
    rec.submit().unwrap();
    assert_eq!(y.shape(), &[m, o.res.len() / m]);
    y.to_f32_vec().unwrap()
}

/// The same case composed of the plain ops (`rms_norm`, `matmul`, `glu`, `add`).
fn run_composed(dev: &Device, dtype: DType, c: Case, o: &Operands, m: usize, k: usize) -> Vec<f32> {
    let [xt, wt, gt, bt, rt] = operand_tensors(dev, dtype, o, m, k);
    let mut rec = Recorder::new(dev);
    let h = if c.norm {
        rec.rms_norm(&xt, &gt, 1e-5).unwrap()
    } else {
        xt
    };
    let mut y = rec.matmul(&h, &wt, c.bias.then_some(&bt)).unwrap();
    if let Some(act) = c.glu {
        y = rec.glu(&y, act).unwrap();
    }
    if c.residual {
        y = rec.add(&rt, &y).unwrap();
    }
    rec.submit().unwrap();
    y.to_f32_vec().unwrap()
}

/// `linear` (norm, bias, residual and gated epilogues fused on both kernel families where
/// they apply, composed elsewhere) against the CPU reference, for every weight dtype and for
/// batches that span several launches of the CPU-adapter kernel; on the CPU backend it is
/// exactly the plain ops composed.
#[test]
fn linear_ops_match_cpu() {
    let mut r = rng(7);
    for (di, &dtype) in WEIGHT_DTYPES.iter().enumerate() {
        let k = if dtype.is_quantized() {
            dtype.block_elems().max(96)
        } else {
            40
        };
        // Every case and dtype with one row (decode: the matrix-vector kernel), and every
        // case with 37 rows (several launches of the CPU-adapter kernel, the last one
        // partial; the tiled kernel elsewhere) on a third of the dtypes, in rotation: each
        // of those large unrolled kernels takes lavapipe seconds to compile.
        for (ci, &c) in CASES.iter().enumerate() {
            for m in [1usize, 37] {
                if m > 1 && (di + ci) % 3 != 0 {
                    continue;
                }
                let (o, f) = Operands::random(&mut r, c, m, k);
                let (want, plain) = reference(dtype, c, &o, m, k);
                let composed = run_composed(&Device::reference(), dtype, c, &o, m, k);
                assert_eq!(
                    want, composed,
                    "cpu {dtype:?} {c:?} m={m}: linear != composed ops"
                );
                for (name, dev) in gpus() {
                    let got = run_linear(&dev, dtype, c, &o, m, k);
                    let what = format!("{name} {dtype:?} {c:?} m={m} k={k} f={f}");
                    check_linear(&what, c, &got, &want, &plain, m, k);
                }
            }
        }
    }
}

/// The CPU backend's `linear` of one case, and its product before any gate (for the GLU's
/// error bound in [`check_linear`]).
fn reference(dtype: DType, c: Case, o: &Operands, m: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let cpu = Device::reference();
    let plain_case = Case {
        glu: None,
        residual: false,
        ..c
    };
    (
        run_linear(&cpu, dtype, c, o, m, k),
        run_composed(&cpu, dtype, plain_case, o, m, k),
    )
}

/// `got` against the CPU reference `want` of one `linear` case, given the reference's
/// product before any gate (`plain`, for the GLU's error bound).
fn check_linear(what: &str, c: Case, got: &[f32], want: &[f32], plain: &[f32], m: usize, k: usize) {
    // The norm's weights scale the terms by |g| ~ 1.
    check_linear_within(what, c, got, want, plain, m, 2.0 * matmul_tol(k));
}

/// [`check_linear`] for a product known within `e`.
fn check_linear_within(
    what: &str,
    c: Case,
    got: &[f32],
    want: &[f32],
    plain: &[f32],
    m: usize,
    e: f32,
) {
    if c.glu.is_none() {
        assert_close(what, got, want, e, 0.0);
        return;
    }
    // An error e in g and in u moves silu(g)·u (and gelu_tanh(g)·u: its slope is at most
    // 1.13) by at most e·(1.13·|u| + |g|) + e².
    let f = want.len() / m;
    let n = 2 * f;
    for i in 0..m {
        for j in 0..f {
            let (gv, uv) = (plain[i * n + j], plain[i * n + f + j]);
            let bound = e * (1.13 * uv.abs() + gv.abs() + 1.0);
            let at = i * f + j;
            assert!(
                (got[at] - want[at]).abs() <= bound,
                "{what} element ({i}, {j}): got {}, want {} (bound {bound})",
                got[at],
                want[at]
            );
        }
    }
}

/// How far a product may move when X is quantized to 8 bits a 32-element block (the native
/// CPU backend): each element by at most half a step (its block's amax / 254), so an output
/// by Σ |w|·step/2 over its row, at the worst output.
fn int8_x_bound(dtype: DType, c: Case, o: &Operands, m: usize, k: usize) -> f32 {
    let dev = Device::reference();
    let [xt, wt, gt, _, _] = operand_tensors(&dev, dtype, o, m, k);
    let mut rec = Recorder::new(&dev);
    let x = if c.norm {
        rec.rms_norm(&xt, &gt, 1e-5).unwrap()
    } else {
        xt
    };
    rec.submit().unwrap();
    let (x, w) = (x.to_f32_vec().unwrap(), wt.to_f32_vec().unwrap());
    kiln_tensor::int8_activation_bounds(&x, &w, k)
        .into_iter()
        .fold(0f32, f32::max)
}

/// `linear` on the native CPU backend against the reference, for every weight dtype, every
/// case and batches of 1 and 5 rows (its matrix-vector and batched paths): float weights as
/// tightly as any backend, block formats within the error of 8-bit X ([`int8_x_bound`]).
#[test]
fn linear_ops_on_the_native_cpu_backend_match_the_reference() {
    let mut r = rng(17);
    let native = kiln_testkit::native_cpu();
    for &dtype in WEIGHT_DTYPES {
        let k = if dtype.is_quantized() {
            dtype.block_elems().max(96)
        } else {
            40
        };
        for &c in CASES {
            for m in [1usize, 5] {
                let (o, f) = Operands::random(&mut r, c, m, k);
                let (want, plain) = reference(dtype, c, &o, m, k);
                let got = run_linear(&native, dtype, c, &o, m, k);
                let what = format!("native cpu {dtype:?} {c:?} m={m} k={k} f={f}");
                let e = if dtype.is_quantized() {
                    int8_x_bound(dtype, c, &o, m, k) * 1.01 + 2.0 * matmul_tol(k)
                } else {
                    2.0 * matmul_tol(k)
                };
                check_linear_within(&what, c, &got, &want, &plain, m, e);
            }
        }
    }
}

/// The matrix-vector kernel in every layout a device can be given (`MatvecShape`: threads a
/// row, rows a thread), with row counts that leave a workgroup's last rows empty, rows long
/// enough for 64 threads a row, and a length that is not a multiple of 8 (X read by element).
#[test]
fn matvec_layouts_match_cpu() {
    let mut r = rng(11);
    let layouts = [(8, 1), (16, 4), (32, 1), (32, 3), (32, 8), (64, 2), (1, 1)];
    let cases = [CASES[0], CASES[2], CASES[4], CASES[5]];
    for (t, rpt) in layouts {
        let shape = MatvecShape {
            threads_per_row: t,
            rows_per_thread: rpt,
        };
        let Some(dev) = kiln_testkit::wgpu_device(DeviceOptions {
            cpu_shaped_kernels: Some(false),
            matvec_shape: Some(shape),
            ..DeviceOptions::default()
        }) else {
            return;
        };
        for (dtype, k) in [
            (DType::F32, 44),
            (DType::F16, 520),
            (DType::Q4_1, 576),
            (DType::Q8_0, 96),
            (DType::Q4_K, 512),
        ] {
            for &c in &cases {
                let m = r.random_range(1..=4);
                let (o, f) = Operands::random(&mut r, c, m, k);
                let (want, plain) = reference(dtype, c, &o, m, k);
                let got = run_linear(&dev, dtype, c, &o, m, k);
                let what = format!("{t}x{rpt} {dtype:?} {c:?} m={m} k={k} f={f}");
                check_linear(&what, c, &got, &want, &plain, m, k);
            }
        }
    }
    let bad = MatvecShape {
        threads_per_row: 48,
        rows_per_thread: 1,
    };
    let err = Device::new(&DeviceOptions {
        backend: kiln_tensor::BackendChoice::Wgpu,
        matvec_shape: Some(bad),
        ..DeviceOptions::default()
    })
    .err()
    .map(|e| e.to_string());
    if let Some(e) = err {
        assert!(e.contains("threads per row 48"), "{e}");
    } else {
        panic!("a 48-thread layout was accepted");
    }
}

/// The plain gated ops against their definitions, on the CPU reference: `glu` over the
/// halves of one tensor and `matmul_gated` over two weights.
#[test]
fn gated_activations_hold_their_definitions() {
    let mut r = rng(8);
    let (m, k, f) = (3usize, 32usize, 5usize);
    let x = randn(&mut r, m * k, 1.0);
    let gw = randn(&mut r, f * k, 1.0);
    let uw = randn(&mut r, f * k, 1.0);
    let dev = Device::reference();
    let g = run_matmul(&dev, DType::F32, &x, m, k, &gw, f, None);
    let u = run_matmul(&dev, DType::F32, &x, m, k, &uw, f, None);
    let xt = Tensor::from_f32(&dev, &[m, k], &x).unwrap();
    let gt = Tensor::from_f32(&dev, &[f, k], &gw).unwrap();
    let ut = Tensor::from_f32(&dev, &[f, k], &uw).unwrap();
    let mut stacked_y = Vec::new();
    for i in 0..m {
        stacked_y.extend_from_slice(&g[i * f..(i + 1) * f]);
        stacked_y.extend_from_slice(&u[i * f..(i + 1) * f]);
    }
    let yt = Tensor::from_f32(&dev, &[m, 2 * f], &stacked_y).unwrap();
    for act in [
        Activation::Silu,
        Activation::GeluTanh,
        Activation::SwigluOai,
        clamped(0.5),
    ] {
        let mut rec = Recorder::new(&dev);
        let glu = rec.glu(&yt, act).unwrap().to_f32_vec().unwrap();
        let gated = rec
            .matmul_gated(&xt, &gt, &ut, act)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        for i in 0..m * f {
            let want = match act {
                Activation::Silu => g[i] / (1.0 + (-g[i]).exp()) * u[i],
                Activation::GeluTanh => gelu_tanh64(g[i]) * u[i],
                Activation::SwigluOai => swiglu_oai64(g[i], u[i]),
                Activation::SiluClamped { limit } => silu_clamped64(g[i], u[i], limit.get()),
            };
            assert!(
                (glu[i] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{act:?} glu {i}"
            );
            assert!(
                (gated[i] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{act:?} gated {i}"
            );
        }
    }
    let mut rec = Recorder::new(&dev);
    let odd = Tensor::from_f32(&dev, &[1, 3], &[1.0, 2.0, 3.0]).unwrap();
    assert!(matches!(
        rec.glu(&odd, Activation::Silu),
        Err(TensorError::Shape { .. })
    ));
}

/// GPT-OSS's clamped SwiGLU as its definition states it, in f64.
fn swiglu_oai64(gate: f32, up: f32) -> f32 {
    let g = f64::from(gate).min(7.0);
    let u = f64::from(up).clamp(-7.0, 7.0);
    ((u + 1.0) * g / (1.0 + (-1.702 * g).exp())) as f32
}

/// DeepSeek-V4's clamped SwiGLU at a bound that random products cross.
const CLAMPED: Activation = Activation::SiluClamped {
    limit: match ClampLimit::new(1.5) {
        Some(l) => l,
        None => panic!("a positive bound"),
    },
};

fn clamped(limit: f32) -> Activation {
    Activation::SiluClamped {
        limit: ClampLimit::new(limit).unwrap(),
    }
}

/// DeepSeek-V4's clamped SwiGLU as its definition states it, in f64.
fn silu_clamped64(gate: f32, up: f32, limit: f32) -> f32 {
    let l = f64::from(limit);
    let g = f64::from(gate).min(l);
    let u = f64::from(up).clamp(-l, l);
    (g / (1.0 + (-g).exp()) * u) as f32
}

/// The clamped SwiGLUs' bounds hold on every device, stacked (`glu`) and apart
/// (`gated_mul`): GPT-OSS's (gates above 7 and ups beyond ±7 clamped, large negative gates
/// giving almost 0) and DeepSeek-V4's at a bound of 1.5; `linear_ops_match_cpu` covers them
/// fused into a matmul.
#[test]
fn clamped_swiglus_hold_their_bounds_on_every_device() {
    let oai_gate = [10.0f32, 7.5, 3.0, 0.0, -3.0, -40.0, 1.0, -0.5];
    let oai_up = [9.0f32, -8.0, 0.5, 2.0, -10.0, 3.0, -1.0, 7.0];
    let v4_gate = [10.0f32, 1.5, 3.0, 0.0, -3.0, -40.0, 1.0, -0.5];
    let v4_up = [9.0f32, -8.0, 0.5, 2.0, -10.0, 3.0, -1.0, 1.2];
    let cases: [(Activation, [f32; 8], [f32; 8], fn(f32, f32) -> f32); 2] = [
        (Activation::SwigluOai, oai_gate, oai_up, swiglu_oai64),
        (clamped(1.5), v4_gate, v4_up, |g, u| {
            silu_clamped64(g, u, 1.5)
        }),
    ];
    assert!((swiglu_oai64(10.0, 9.0) - 8.0 * 7.0 / (1.0 + (-11.914f32).exp())).abs() < 1e-5);
    let mut devs = gpus();
    devs.push(("reference", Device::reference()));
    devs.push(("native cpu", kiln_testkit::native_cpu()));
    for (act, gate, up, def) in cases {
        let want: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| def(g, u)).collect();
        let stacked: Vec<f32> = gate.iter().chain(&up).copied().collect();
        for (name, dev) in &devs {
            let y = Tensor::from_f32(dev, &[1, 16], &stacked).unwrap();
            let (g, u) = (
                Tensor::from_f32(dev, &[1, 8], &gate).unwrap(),
                Tensor::from_f32(dev, &[1, 8], &up).unwrap(),
            );
            let mut rec = Recorder::new(dev);
            let a = rec.glu(&y, act).unwrap();
            let b = rec.gated_mul(&g, &u, act).unwrap();
            rec.submit().unwrap();
            for got in [a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap()] {
                assert_close(&format!("{name} {act:?}"), &got, &want, 1e-5, 1e-5);
            }
        }
    }
}

#[test]
fn matmul_on_smollm_shapes() {
    // The projections of SmolLM2-135M: hidden 576, FFN 1536; decode and a prefill chunk.
    let mut r = rng(2);
    for (n, k) in [(1536usize, 576usize), (576, 1536)] {
        for m in [1usize, 48] {
            for dtype in [DType::Q4_1, DType::Q8_0] {
                let x = randn(&mut r, m * k, 1.0);
                let w = randn(&mut r, n * k, 0.5);
                let want = run_matmul(&Device::reference(), dtype, &x, m, k, &w, n, None);
                for (name, dev) in gpus() {
                    let got = run_matmul(&dev, dtype, &x, m, k, &w, n, None);
                    assert_close(
                        &format!("{name} {dtype:?} {m}x{k} · {n}x{k}"),
                        &got,
                        &want,
                        matmul_tol(k),
                        0.0,
                    );
                }
            }
        }
    }
}

/// The projections of Gemma 3 270M with the formats its Q4_K_M file gives them: Q/K/V and
/// gate/up Q5_0 over hidden 640, attention output and down Q4_K/Q6_K over 1024 and 2048.
#[test]
fn matmul_on_gemma_shapes() {
    let mut r = rng(9);
    for (dtype, n, k) in [
        (DType::Q5_0, 2048usize, 640usize),
        (DType::Q5_0, 256, 640),
        (DType::Q4_K, 640, 1024),
        (DType::Q4_K, 640, 2048),
        (DType::Q6_K, 640, 2048),
    ] {
        let w = randn(&mut r, n * k, 1.0);
        for m in [1usize, 9] {
            let x = randn(&mut r, m * k, 1.0);
            let want = run_matmul(&Device::reference(), dtype, &x, m, k, &w, n, None);
            for (name, dev) in gpus() {
                let got = run_matmul(&dev, dtype, &x, m, k, &w, n, None);
                assert_close(
                    &format!("{name} {dtype:?} {m}x{k} · {n}x{k}"),
                    &got,
                    &want,
                    matmul_tol(k),
                    0.0,
                );
            }
        }
    }
}

fn run_embedding(
    dev: &Device,
    dtype: DType,
    rows: usize,
    k: usize,
    v: &[f32],
    ids: &[u32],
) -> Vec<f32> {
    let t = weight(dev, dtype, rows, k, v);
    let mut rec = Recorder::new(dev);
    let e = rec.embedding(&t, ids).unwrap();
    rec.submit().unwrap();
    assert_eq!(e.shape(), &[ids.len(), k]);
    e.to_f32_vec().unwrap()
}

#[test]
fn embedding_matches_cpu_for_every_table_dtype() {
    let mut r = rng(3);
    for &dtype in WEIGHT_DTYPES {
        let k = if dtype.is_quantized() {
            dtype.block_elems().max(64)
        } else {
            37
        };
        let rows = 101;
        let v = randn(&mut r, rows * k, 2.0);
        let mut ids: Vec<u32> = (0..13).map(|_| r.random_range(0..rows as u32)).collect();
        ids.extend([0, rows as u32 - 1, 5, 5]);
        let want = run_embedding(&Device::reference(), dtype, rows, k, &v, &ids);
        for (name, dev) in gpus() {
            let got = run_embedding(&dev, dtype, rows, k, &v, &ids);
            // A gather moves values: exact.
            assert_close(
                &format!("{name} embedding {dtype:?}"),
                &got,
                &want,
                0.0,
                0.0,
            );
        }
    }
}

/// `gather_cols` on every backend against an independent gather: permutations (the
/// activation-order GPTQ case) and indices with repeats into another width, odd sizes and a
/// 3-D input included. A gather moves values: exact.
#[test]
fn gather_cols_matches_cpu_exactly() {
    let mut r = rng(12);
    for shape in [
        vec![1usize, 1],
        vec![3, 7],
        vec![5, 64],
        vec![9, 333],
        vec![40, 576],
        vec![2, 4099],
        vec![2, 3, 65],
    ] {
        let k = shape[shape.len() - 1];
        let m = shape.iter().product::<usize>() / k;
        let x = randn(&mut r, m * k, 3.0);
        let mut perm: Vec<u32> = (0..k as u32).collect();
        perm.shuffle(&mut r);
        let picks: Vec<u32> = (0..k / 3 + 2)
            .map(|_| r.random_range(0..k as u32))
            .collect();
        for idx in [&perm, &picks] {
            let want: Vec<f32> = x
                .chunks(k)
                .flat_map(|row| idx.iter().map(|&i| row[i as usize]))
                .collect();
            let mut out_shape = shape.clone();
            *out_shape.last_mut().unwrap() = idx.len();
            for (name, dev) in gpus().into_iter().chain([("cpu", Device::reference())]) {
                let xt = Tensor::from_f32(&dev, &shape, &x).unwrap();
                let ci = ColumnIndex::new(&dev, idx, k).unwrap();
                let mut rec = Recorder::new(&dev);
                let y = rec.gather_cols(&xt, &ci).unwrap();
                rec.submit().unwrap();
                assert_eq!(y.shape(), out_shape.as_slice(), "{name}");
                let got = y.to_f32_vec().unwrap();
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name} gather_cols {shape:?} by {} indices",
                    idx.len()
                );
            }
        }
    }
}

/// Bad indices fail when the index is built; a bad input fails recording nothing.
#[test]
fn gather_cols_rejects_bad_indices_and_inputs() {
    let devs: Vec<(&str, Device)> = gpus()
        .into_iter()
        .chain([("cpu", Device::reference())])
        .collect();
    for (name, dev) in &devs {
        let e = ColumnIndex::new(dev, &[0, 5, 2], 5)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gather_cols: column index 5 is out of range (limit 5)"),
            "{name}: {e}"
        );
        let e = ColumnIndex::new(dev, &[], 5).unwrap_err().to_string();
        assert!(
            e.contains("gather_cols") && e.contains("no column index given"),
            "{name}: {e}"
        );
        let ci = ColumnIndex::new(dev, &[1, 0, 3], 4).unwrap();
        assert_eq!(
            (ci.len(), ci.source_cols(), ci.indices()),
            (3, 4, &[1u32, 0, 3][..])
        );
        let mut rec = Recorder::new(dev);
        let wide = Tensor::from_f32(dev, &[2, 5], &[0.0; 10]).unwrap();
        let ids = Tensor::from_u32(dev, &[2, 4], &[0; 8]).unwrap();
        for (x, want) in [
            (&wide, "gather_cols: shape mismatch"),
            (&ids, "gather_cols: dtype U32"),
        ] {
            let e = rec.gather_cols(x, &ci).unwrap_err().to_string();
            assert!(e.starts_with(want), "{name}: {e}");
        }
        // An index built for another device.
        let other = if dev.is_cpu() {
            &devs[0].1
        } else {
            &devs[devs.len() - 1].1
        };
        if !std::ptr::eq(other, dev) {
            let ci = ColumnIndex::new(other, &[0], 4).unwrap();
            let x = Tensor::from_f32(dev, &[1, 4], &[1.0; 4]).unwrap();
            let e = rec.gather_cols(&x, &ci).unwrap_err();
            assert!(
                matches!(e, TensorError::DeviceMismatch { .. }),
                "{name}: {e}"
            );
        }
        assert_eq!(rec.pending_dispatches(), 0, "{name}");
    }
}

#[test]
fn rows_ops_match_cpu() {
    let mut r = rng(4);
    for &(rows, cols) in &[
        (1usize, 1usize),
        (3, 63),
        (5, 64),
        (2, 65),
        (7, 576),
        (2, 4099),
        (1, 49152),
    ] {
        let x = randn(&mut r, rows * cols, 4.0);
        let g = randn(&mut r, cols, 1.0);
        let run = |dev: &Device| {
            let xt = Tensor::from_f32(dev, &[rows, cols], &x).unwrap();
            let gt = Tensor::from_f32(dev, &[cols], &g).unwrap();
            let mut rec = Recorder::new(dev);
            let n = rec.rms_norm(&xt, &gt, 1e-5).unwrap();
            let s = rec.softmax(&xt).unwrap();
            let a = rec.argmax(&xt).unwrap();
            rec.submit().unwrap();
            (
                n.to_f32_vec().unwrap(),
                s.to_f32_vec().unwrap(),
                a.to_u32_vec().unwrap(),
            )
        };
        let (wn, ws, wa) = run(&Device::reference());
        for (name, dev) in gpus() {
            let (gn, gs, ga) = run(&dev);
            assert_close(
                &format!("{name} rms_norm {rows}x{cols}"),
                &gn,
                &wn,
                1e-5,
                1e-5,
            );
            assert_close(
                &format!("{name} softmax {rows}x{cols}"),
                &gs,
                &ws,
                1e-7,
                1e-5,
            );
            assert_eq!(ga, wa, "{name} argmax {rows}x{cols}");
        }
    }
}

#[test]
fn argmax_takes_the_first_of_equal_maxima() {
    let cols = 300;
    let mut x = vec![0f32; 2 * cols];
    for &i in &[17usize, 200, 299] {
        x[i] = 3.0;
    }
    x[cols + 299] = -1.0;
    for i in 0..cols - 1 {
        x[cols + i] = -2.0;
    }
    x[cols + 64] = -1.0;
    for (name, dev) in gpus().into_iter().chain([("cpu", Device::reference())]) {
        let t = Tensor::from_f32(&dev, &[2, cols], &x).unwrap();
        let mut rec = Recorder::new(&dev);
        let a = rec.argmax(&t).unwrap();
        rec.submit().unwrap();
        assert_eq!(a.to_u32_vec().unwrap(), vec![17, 64], "{name}");
    }
}

#[test]
fn elementwise_ops_match_cpu() {
    let mut r = rng(5);
    for n in [1usize, 63, 64, 65, 1000, 70_001] {
        let mut a = randn(&mut r, n, 6.0);
        // Arguments whose tanh or exp overflows a naive formula.
        for (i, v) in [200.0f32, -200.0, 1e4, -1e4, 30.0, -30.0]
            .iter()
            .enumerate()
        {
            if i < n {
                a[i] = *v;
            }
        }
        let b = randn(&mut r, n, 2.0);
        let run = |dev: &Device| {
            let at = Tensor::from_f32(dev, &[n], &a).unwrap();
            let bt = Tensor::from_f32(dev, &[n], &b).unwrap();
            let mut rec = Recorder::new(dev);
            let outs = [
                rec.add(&at, &bt).unwrap(),
                rec.silu_mul(&at, &bt).unwrap(),
                rec.gelu_tanh_mul(&at, &bt).unwrap(),
                rec.scale(&at, 25.298_221).unwrap(),
                rec.softcap(&at, 30.0).unwrap(),
                rec.softcap(&at, 0.5).unwrap(),
            ];
            rec.submit().unwrap();
            outs.map(|t| t.to_f32_vec().unwrap())
        };
        let want = run(&Device::reference());
        // The CPU reference against f64 formulas.
        for i in 0..n {
            let g = gelu_tanh64(a[i]) * b[i];
            assert!(
                (want[2][i] - g).abs() <= 1e-6 + 1e-5 * g.abs(),
                "gelu {}",
                a[i]
            );
            assert_eq!(want[3][i], a[i] * 25.298_221);
            for (j, cap) in [(4, 30.0f64), (5, 0.5)] {
                let c = (cap * (f64::from(a[i]) / cap).tanh()) as f32;
                assert!(
                    (want[j][i] - c).abs() <= 1e-6 + 1e-6 * c.abs(),
                    "softcap {}",
                    a[i]
                );
            }
        }
        for (name, dev) in gpus() {
            let got = run(&dev);
            assert_close(&format!("{name} add n={n}"), &got[0], &want[0], 0.0, 0.0);
            assert_close(
                &format!("{name} silu_mul n={n}"),
                &got[1],
                &want[1],
                1e-6,
                1e-5,
            );
            assert_close(
                &format!("{name} gelu_tanh_mul n={n}"),
                &got[2],
                &want[2],
                1e-6,
                1e-5,
            );
            assert_close(&format!("{name} scale n={n}"), &got[3], &want[3], 0.0, 0.0);
            assert_close(
                &format!("{name} softcap 30 n={n}"),
                &got[4],
                &want[4],
                1e-5,
                1e-5,
            );
            assert_close(
                &format!("{name} softcap 0.5 n={n}"),
                &got[5],
                &want[5],
                1e-6,
                1e-5,
            );
        }
    }
}

#[test]
fn gelu_and_softcap_hold_known_values_and_reject_bad_caps() {
    let dev = Device::reference();
    let x = Tensor::from_f32(&dev, &[4], &[1.0, -3.0, 0.0, 2.0]).unwrap();
    let one = Tensor::from_f32(&dev, &[4], &[1.0; 4]).unwrap();
    let mut rec = Recorder::new(&dev);
    let g = rec.gelu_tanh_mul(&x, &one).unwrap().to_f32_vec().unwrap();
    // gelu_pytorch_tanh(1) = 0.8411920, (-3) = -0.0036373, (2) = 1.9545977.
    assert_close(
        "gelu_tanh",
        &g,
        &[0.841_192, -0.003_637_3, 0.0, 1.954_597_7],
        1e-6,
        0.0,
    );
    let c = rec.softcap(&x, 2.0).unwrap().to_f32_vec().unwrap();
    // 2·tanh(0.5) = 0.9242343.
    assert_close("softcap", &c[..1], &[0.924_234_3], 1e-6, 0.0);
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = rec.softcap(&x, bad).unwrap_err();
        assert!(e.to_string().contains("softcap"), "{e}");
    }
    assert_eq!(rec.pending_dispatches(), 0);
}

/// Every device's RoPE against the reference's, which evaluates each (cos, sin) from the
/// config: the native backend's bit for bit, the adapters' within rounding.
#[test]
fn rope_matches_cpu_in_both_layouts_and_scalings() {
    let mut r = rng(6);
    let scalings = [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: RopeScaling::yarn_attention_factor(4.0, None, None),
            truncate: true,
        },
    ];
    let shapes = [(64usize, 64usize), (128, 128), (80, 32), (6, 2)];
    let channels = [RotaryChannels::Leading, RotaryChannels::Trailing];
    for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
        for scaling in scalings {
            for ((head_dim, rotary_dim), rotated) in
                shapes.into_iter().zip(channels.into_iter().cycle())
            {
                let cfg = RopeConfig {
                    head_dim,
                    rotary_dim,
                    theta: 10000.0,
                    scaling,
                    layout,
                    rotated,
                };
                let (tokens, heads) = (r.random_range(1..9), r.random_range(1..5));
                let x = randn(&mut r, tokens * heads * head_dim, 1.0);
                let pos: Vec<u32> = (0..tokens).map(|_| r.random_range(0..2000)).collect();
                // The rotation, and the rotation turned back.
                let run = |dev: &Device| {
                    let table = RopeTable::new(dev, cfg, 2048).unwrap();
                    let positions = table.positions(&pos).unwrap();
                    let xt = Tensor::from_f32(dev, &[tokens, heads, head_dim], &x).unwrap();
                    let mut rec = Recorder::new(dev);
                    let y = rec.rope(&xt, &positions).unwrap();
                    let back = rec.unrope(&y, &positions).unwrap();
                    rec.submit().unwrap();
                    [y.to_f32_vec().unwrap(), back.to_f32_vec().unwrap()]
                };
                let [want, want_back] = run(&Device::reference());
                // Turned there and back, a rotated channel comes back scaled by the square
                // of YaRN's attention factor (both turns scale cos and sin by it).
                let a2 = scaling.attention_factor().powi(2);
                let kept = cfg.unrotated();
                let expect_back: Vec<f32> = x
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        if kept.contains(&(i % head_dim)) {
                            *v
                        } else {
                            v * a2
                        }
                    })
                    .collect();
                assert_close(
                    &format!("unrope {layout:?} {scaling:?} {head_dim}/{rotary_dim} {rotated:?}"),
                    &want_back,
                    &expect_back,
                    1e-5,
                    1e-5,
                );
                // The native backend reads the table's (cos, sin), the very values the
                // reference evaluates: the same bits.
                let native = run(&kiln_testkit::native_cpu());
                for (got, want) in native.iter().zip([&want, &want_back]) {
                    assert!(
                        got.iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "native rope {layout:?} {scaling:?} {head_dim}/{rotary_dim} {rotated:?}"
                    );
                }
                // The channels not rotated pass through untouched.
                let (first, kept) = (cfg.first_rotated(), cfg.unrotated());
                assert_eq!(
                    first,
                    if rotated == RotaryChannels::Leading {
                        0
                    } else {
                        head_dim - rotary_dim
                    }
                );
                for t in 0..tokens * heads {
                    let at = t * head_dim;
                    assert_eq!(
                        &want[at + kept.start..at + kept.end],
                        &x[at + kept.start..at + kept.end]
                    );
                }
                for (name, dev) in gpus() {
                    let [got, got_back] = run(&dev);
                    let what = format!(
                        "{name} rope {layout:?} {scaling:?} {head_dim}/{rotary_dim} {rotated:?}"
                    );
                    assert_close(&what, &got, &want, 1e-6, 1e-5);
                    assert_close(&format!("{what} back"), &got_back, &want_back, 1e-6, 1e-5);
                }
            }
        }
    }
}

#[test]
fn rope_rotates_the_documented_pairs() {
    // Position 1, theta such that the first frequency is 1 rad: (1, 0) → (cos 1, sin 1).
    let cfg = |layout| RopeConfig {
        head_dim: 4,
        rotary_dim: 4,
        theta: 10000.0,
        scaling: RopeScaling::None,
        layout,
        rotated: RotaryChannels::Leading,
    };
    let dev = Device::reference();
    let (c, s) = (1f32.cos(), 1f32.sin());
    for (layout, x, want) in [
        (
            RopeLayout::HalfSplit,
            [1.0, 0.0, 0.0, 0.0],
            [c, 0.0, s, 0.0],
        ),
        (
            RopeLayout::Interleaved,
            [1.0, 0.0, 0.0, 0.0],
            [c, s, 0.0, 0.0],
        ),
    ] {
        let table = RopeTable::new(&dev, cfg(layout), 4).unwrap();
        let e = table.positions(&[1, 4]).unwrap_err();
        assert!(
            e.to_string()
                .contains("position 4 is out of range (limit 4)"),
            "{e}"
        );
        let xt = Tensor::from_f32(&dev, &[1, 1, 4], &x).unwrap();
        let mut rec = Recorder::new(&dev);
        let y = rec
            .rope(&xt, &table.positions(&[1]).unwrap())
            .unwrap()
            .to_f32_vec()
            .unwrap();
        assert_close(&format!("{layout:?}"), &y, &want, 1e-6, 0.0);
    }
}

#[test]
fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
    let base = RopeConfig {
        head_dim: 128,
        rotary_dim: 128,
        theta: 500000.0,
        scaling: RopeScaling::None,
        layout: RopeLayout::HalfSplit,
        rotated: RotaryChannels::Leading,
    };
    let l3 = RopeConfig {
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
        ..base
    };
    let (b, s) = (base.inv_freq(), l3.inv_freq());
    let wavelen = |f: f32| 2.0 * std::f32::consts::PI / f;
    let mut seen = [false; 3];
    for (fb, fs) in b.iter().zip(&s) {
        if wavelen(*fb) < 8192.0 / 4.0 {
            assert_eq!(fb, fs);
            seen[0] = true;
        } else if wavelen(*fb) > 8192.0 {
            assert!((fb / 8.0 - fs).abs() <= 1e-12);
            seen[1] = true;
        } else {
            assert!(*fs < *fb && *fs > fb / 8.0);
            seen[2] = true;
        }
    }
    assert_eq!(seen, [true; 3]);
}
