//! The mixture-of-experts ops (`moe_route`, `linear_routed`, `moe_combine`) on every backend
//! against the CPU reference: routing ids exactly, weights and products within f32 rounding;
//! the native backend's routed products bit for bit equal to its plain matmul on each
//! expert's matrix alone.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_close, gpu_split, gpus, randn, random_blocks, rng};
use kiln_tensor::{Activation, Choice, DType, Device, LinearOps, Recorder, Router, Tensor};
use rand::Rng;
use rand::rngs::StdRng;

const ROUTERS: [Router; 3] = [
    Router::SoftmaxTopK { renorm: false },
    Router::SoftmaxTopK { renorm: true },
    Router::TopKSoftmax,
];

/// Every wgpu configuration.
fn devices() -> Vec<(&'static str, Device)> {
    gpus()
}

fn route(
    dev: &Device,
    logits: &[f32],
    t: usize,
    e: usize,
    k: usize,
    r: Router,
) -> (Vec<u32>, Vec<f32>) {
    let l = Tensor::from_f32(dev, &[t, e], logits).unwrap();
    let mut rec = Recorder::new(dev);
    let routes = rec.moe_route(&l, k, r).unwrap();
    rec.submit().unwrap();
    (
        routes.ids().to_u32_vec().unwrap(),
        routes.weights().to_f32_vec().unwrap(),
    )
}

#[test]
fn routers_hold_their_definitions() {
    // Logits 1, 3, 3, 0: the top two are experts 1 and 2 (a tie, lower index first).
    let l = [1.0f32, 3.0, 3.0, 0.0];
    let total: f32 = l.iter().map(|v| (v - 3.0f32).exp()).sum();
    let (ids, w) = route(&Device::Reference, &l, 1, 4, 2, ROUTERS[0]);
    assert_eq!(ids, [1, 2]);
    assert_close("softmax top-k", &w, &[1.0 / total, 1.0 / total], 1e-7, 1e-6);
    let (_, w) = route(&Device::Reference, &l, 1, 4, 2, ROUTERS[1]);
    assert_close("renormalised", &w, &[0.5, 0.5], 1e-7, 1e-6);
    let (ids, w) = route(&Device::Reference, &l, 1, 4, 3, ROUTERS[2]);
    assert_eq!(ids, [1, 2, 0]);
    let s = 2.0 + (-2.0f32).exp();
    assert_close(
        "top-k softmax",
        &w,
        &[1.0 / s, 1.0 / s, (-2.0f32).exp() / s],
        1e-7,
        1e-6,
    );
}

/// Logits drawn from few values, so that ties are common, or from many.
fn logits(r: &mut StdRng, n: usize, ties: bool) -> Vec<f32> {
    if ties {
        (0..n).map(|_| r.random_range(0..4) as f32 * 0.5).collect()
    } else {
        randn(r, n, 3.0)
    }
}

#[test]
fn routing_matches_the_reference_on_every_backend() {
    let mut r = rng(45);
    let mut devs = devices();
    devs.push(("native cpu", kiln_testkit::native_cpu()));
    for (t, e, k) in [(1, 4, 1), (5, 8, 2), (37, 60, 8), (130, 128, 8), (3, 3, 3)] {
        for ties in [false, true] {
            let l = logits(&mut r, t * e, ties);
            for router in ROUTERS {
                let (want_ids, want_w) = route(&Device::Reference, &l, t, e, k, router);
                for (name, dev) in &devs {
                    let (ids, w) = route(dev, &l, t, e, k, router);
                    let what = format!("{name} t={t} e={e} k={k} ties={ties} {router:?}");
                    assert_eq!(ids, want_ids, "{what}");
                    assert_close(&what, &w, &want_w, 1e-6, 1e-5);
                }
            }
        }
    }
}

/// An expert weight `[e, n, k]` of `dtype` from random values or random blocks.
fn experts_weight(dev: &Device, dtype: DType, shape: [usize; 3], seed: u64) -> Tensor {
    let [e, n, k] = shape;
    let mut r = rng(seed);
    match dtype {
        DType::F32 => Tensor::from_f32(dev, &shape, &randn(&mut r, e * n * k, 1.0)).unwrap(),
        DType::F16 => {
            let v: Vec<half::f16> = randn(&mut r, e * n * k, 1.0)
                .into_iter()
                .map(half::f16::from_f32)
                .collect();
            Tensor::from_f16(dev, &shape, &v).unwrap()
        }
        d => {
            let raw = random_blocks(&mut r, d, e * n * k / d.block_elems());
            Tensor::from_bytes(dev, d, &shape, &raw).unwrap()
        }
    }
}

/// Routed products on `dev` for logits `l` (`[t, e]`, top `topk`), input rows `x` (a row a
/// token, or a row a slot), with the experts' `bias` (`[e, n]`) if given.
#[allow(clippy::too_many_arguments)]
fn run_routed(
    dev: &Device,
    w: &Tensor,
    bias: Option<&[f32]>,
    l: &[f32],
    x: &[f32],
    t: usize,
    topk: usize,
    glu: Option<Activation>,
) -> Vec<f32> {
    let [e, n, k] = [w.shape()[0], w.shape()[1], w.shape()[2]];
    let lt = Tensor::from_f32(dev, &[t, e], l).unwrap();
    let xt = Tensor::from_f32(dev, &[x.len() / k, k], x).unwrap();
    let bt = bias.map(|b| Tensor::from_f32(dev, &[e, n], b).unwrap());
    let mut rec = Recorder::new(dev);
    let routes = rec
        .moe_route(&lt, topk, Router::SoftmaxTopK { renorm: true })
        .unwrap();
    let y = rec
        .linear_routed(&xt, w, bt.as_ref(), &routes, glu)
        .unwrap();
    rec.submit().unwrap();
    y.to_f32_vec().unwrap()
}

#[test]
fn routed_matmul_matches_the_reference_for_every_weight_dtype() {
    let mut r = rng(46);
    let mut split_weights = 0;
    for &dtype in DType::WEIGHTS {
        let k = if dtype.is_quantized() {
            dtype.block_elems().max(64)
        } else {
            40
        };
        for (t, e, topk, n) in [(1, 4, 2, 48), (3, 5, 2, 24), (16, 8, 3, 40), (9, 6, 6, 10)] {
            // With the experts' biases (GPT-OSS's, before its clamped SwiGLU) and without.
            for (glu, biased) in [
                (None, false),
                (None, true),
                (Some(Activation::Silu), false),
                (Some(Activation::GeluTanh), false),
                (Some(Activation::SwigluOai), true),
            ] {
                for per_slot in [false, true] {
                    let l = randn(&mut r, t * e, 2.0);
                    let rows = if per_slot { t * topk } else { t };
                    let x = randn(&mut r, rows * k, 1.0);
                    let bias = biased.then(|| randn(&mut r, e * n, 1.0));
                    let bias = bias.as_deref();
                    let seed = r.random();
                    let host = experts_weight(&Device::Reference, dtype, [e, n, k], seed);
                    let want = run_routed(&Device::Reference, &host, bias, &l, &x, t, topk, glu);
                    let width = if glu.is_some() { n / 2 } else { n };
                    assert_eq!(want.len(), t * topk * width);
                    // Bindings of 16 KiB split the experts' weight (each expert whole in one)
                    // where the activations still fit one.
                    let split = gpu_split().filter(|_| (rows.max(t * topk) * k.max(n)) * 4 < 16000);
                    for (name, dev) in devices()
                        .into_iter()
                        .chain(split.map(|d| ("wgpu-split-bindings", d)))
                    {
                        let w = experts_weight(&dev, dtype, [e, n, k], seed);
                        split_weights += usize::from(w.chunk_count() > 1);
                        let got = run_routed(&dev, &w, bias, &l, &x, t, topk, glu);
                        let what = format!(
                            "{name} {dtype:?} t={t} e={e} top{topk} n={n} k={k} {glu:?} per_slot={per_slot} biased={biased}"
                        );
                        let tol = 1e-5 * k as f32 + 1e-5;
                        assert_close(&what, &got, &want, 4.0 * tol, 1e-4);
                    }
                    // The dense op takes no bias with a GLU.
                    if !(biased && glu.is_some()) {
                        let w = (dtype, [e, n, k], seed);
                        native_equals_its_plain_matmul(w, bias, &l, &x, t, topk, glu);
                    }
                }
            }
        }
    }
    assert!(
        gpu_split().is_none() || split_weights > 0,
        "no expert weight was split between bindings"
    );
}

/// On the native backend each slot's routed row equals the plain matmul of its input row by
/// its expert's matrix alone (plus its bias row), bit for bit. `weight`: the experts' dtype,
/// shape and seed.
fn native_equals_its_plain_matmul(
    (dtype, shape, seed): (DType, [usize; 3], u64),
    bias: Option<&[f32]>,
    l: &[f32],
    x: &[f32],
    t: usize,
    topk: usize,
    glu: Option<Activation>,
) {
    let native = kiln_testkit::native_cpu();
    let [e, n, k] = shape;
    let w = experts_weight(&native, dtype, shape, seed);
    let got = run_routed(&native, &w, bias, l, x, t, topk, glu);
    let (ids, _) = route(&native, l, t, e, topk, Router::SoftmaxTopK { renorm: true });
    let bytes = w.to_bytes().unwrap();
    let per_expert = bytes.len() / e;
    let width = if glu.is_some() { n / 2 } else { n };
    let x_step = if x.len() / k == t * topk { 1 } else { topk };
    for (s, &ex) in ids.iter().enumerate() {
        let ex = ex as usize;
        let we = Tensor::from_bytes(
            &native,
            dtype,
            &[n, k],
            &bytes[ex * per_expert..(ex + 1) * per_expert],
        )
        .unwrap();
        let row = s / x_step;
        let xr = Tensor::from_f32(&native, &[1, k], &x[row * k..(row + 1) * k]).unwrap();
        let be = bias.map(|b| Tensor::from_f32(&native, &[n], &b[ex * n..(ex + 1) * n]).unwrap());
        let mut rec = Recorder::new(&native);
        let y = rec
            .linear(
                &xr,
                &we,
                LinearOps {
                    glu,
                    bias: be.as_ref(),
                    ..LinearOps::default()
                },
            )
            .unwrap();
        let want = y.to_f32_vec().unwrap();
        assert_eq!(
            &got[s * width..(s + 1) * width],
            &want[..],
            "native {dtype:?} slot {s} (expert {ex}) {glu:?}"
        );
    }
}

#[test]
fn combine_matches_the_reference() {
    let mut r = rng(47);
    let mut devs = devices();
    devs.push(("native cpu", kiln_testkit::native_cpu()));
    for (t, e, topk, n) in [(1, 4, 2, 64), (7, 8, 3, 33), (40, 16, 4, 96)] {
        let l = randn(&mut r, t * e, 2.0);
        let y = randn(&mut r, t * topk * n, 1.0);
        let res = randn(&mut r, t * n, 1.0);
        let run = |dev: &Device| {
            let lt = Tensor::from_f32(dev, &[t, e], &l).unwrap();
            let yt = Tensor::from_f32(dev, &[t * topk, n], &y).unwrap();
            let rt = Tensor::from_f32(dev, &[t, n], &res).unwrap();
            let mut rec = Recorder::new(dev);
            let routes = rec.moe_route(&lt, topk, Router::TopKSoftmax).unwrap();
            let out = rec.moe_combine(&yt, &routes, &rt).unwrap();
            rec.submit().unwrap();
            (
                routes.weights().to_f32_vec().unwrap(),
                out.to_f32_vec().unwrap(),
            )
        };
        let (w, want) = run(&Device::Reference);
        // The definition, by hand.
        for i in 0..t * n {
            let (ti, c) = (i / n, i % n);
            let s: f32 = (0..topk)
                .map(|j| w[ti * topk + j] * y[(ti * topk + j) * n + c])
                .sum();
            assert!(
                (want[i] - (res[i] + s)).abs() <= 1e-6,
                "reference element {i}"
            );
        }
        for (name, dev) in &devs {
            let (_, got) = run(dev);
            assert_close(
                &format!("{name} t={t} top{topk} n={n}"),
                &got,
                &want,
                1e-6,
                1e-5,
            );
        }
    }
}

#[test]
fn bad_routing_and_shapes_are_refused() {
    let dev = Device::Reference;
    let l = Tensor::from_f32(&dev, &[2, 4], &[0.0; 8]).unwrap();
    let mut rec = Recorder::new(&dev);
    for k in [0, 5] {
        let e = rec.moe_route(&l, k, ROUTERS[0]).unwrap_err().to_string();
        assert!(e.contains("experts a token"), "{e}");
    }
    let routes = rec.moe_route(&l, 2, ROUTERS[0]).unwrap();
    let w = Tensor::from_f32(&dev, &[3, 8, 16], &[0.0; 3 * 8 * 16]).unwrap();
    let x = Tensor::from_f32(&dev, &[2, 16], &[0.0; 32]).unwrap();
    let e = rec
        .linear_routed(&x, &w, None, &routes, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("for 4 experts"), "{e}");
    let w = Tensor::from_f32(&dev, &[4, 8, 16], &[0.0; 4 * 8 * 16]).unwrap();
    let x3 = Tensor::from_f32(&dev, &[3, 16], &[0.0; 48]).unwrap();
    let e = rec
        .linear_routed(&x3, &w, None, &routes, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 input rows for 2 tokens"), "{e}");
    let flat = Tensor::from_f32(&dev, &[32, 16], &[0.0; 512]).unwrap();
    let e = rec
        .linear_routed(&x, &flat, None, &routes, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not [experts, n, k]"), "{e}");
    let bias = Tensor::from_f32(&dev, &[4, 7], &[0.0; 28]).unwrap();
    let e = rec
        .linear_routed(&x, &w, Some(&bias), &routes, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("experts' bias [4, 7]"), "{e}");
    let y = Tensor::from_f32(&dev, &[3, 16], &[0.0; 48]).unwrap();
    let e = rec.moe_combine(&y, &routes, &x).unwrap_err().to_string();
    assert!(e.contains("for 2 tokens of 2 experts"), "{e}");
    // The softmax routers weight by logits alone: no given experts, no selection bias.
    let e = rec
        .moe_route_by(&l, 2, ROUTERS[0], Choice::Fixed(&[0, 1, 2, 3]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("takes its experts by their logits alone"), "{e}");
    let v4 = Router::SqrtSoftplus { scale: 1.0 };
    let e = rec
        .moe_route_by(&l, 2, v4, Choice::Fixed(&[0, 1, 2, 4]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("expert 4 is out of range"), "{e}");
}

/// The native backend counts what the routed products read: each expert any slot routes to,
/// once a call, of the stack it holds.
#[test]
fn routed_products_count_the_experts_they_read() {
    // A device of its own: the counters are the device's, and other tests run beside this.
    let dev = Device::cpu().unwrap();
    let (t, e, topk, n, k) = (3, 8, 2, 16, 64);
    // Tokens 0 and 1 pick experts 1 and 5, token 2 experts 5 and 6: three experts of eight.
    let mut l = vec![0f32; t * e];
    for (tok, picks) in [[1, 5], [1, 5], [5, 6]].iter().enumerate() {
        for &p in picks {
            l[tok * e + p] = 4.0;
        }
    }
    let w = experts_weight(&dev, DType::Q8_0, [e, n, k], 3);
    let x = vec![0.5f32; t * k];
    let _ = dev.take_routed_stats();
    run_routed(&dev, &w, None, &l, &x, t, topk, None);
    let s = dev.take_routed_stats().unwrap();
    let per_expert = (DType::Q8_0.block_bytes() * n * k / DType::Q8_0.block_elems()) as u64;
    assert_eq!(
        (
            s.calls,
            s.experts_read,
            s.experts_held,
            s.bytes_read,
            s.bytes_held
        ),
        (1, 3, 8, 3 * per_expert, 8 * per_expert)
    );
    assert!((s.bytes_share() - 3.0 / 8.0).abs() < 1e-12);
    assert_eq!(
        dev.take_routed_stats().unwrap().calls,
        0,
        "taking them clears them"
    );
    assert!(Device::Reference.take_routed_stats().is_none());
}

/// DeepSeek-V4's router from its definition, in f64: scores sqrt(softplus(logit)), the k best
/// by score + bias (or the given ones), weights the picks' scores over their sum, times the
/// scale.
fn sqrt_softplus_route64(
    logits: &[f32],
    bias: Option<&[f32]>,
    given: Option<&[u32]>,
    k: usize,
    scale: f32,
) -> (Vec<u32>, Vec<f32>) {
    let score = |l: f32| {
        let x = f64::from(l);
        (if x > 20.0 { x } else { x.exp().ln_1p() }).sqrt()
    };
    let ids: Vec<u32> = match given {
        Some(g) => g.to_vec(),
        None => {
            let mut order: Vec<usize> = (0..logits.len()).collect();
            let sel = |e: usize| score(logits[e]) + bias.map_or(0.0, |b| f64::from(b[e]));
            order.sort_by(|&a, &b| sel(b).total_cmp(&sel(a)).then(a.cmp(&b)));
            order[..k].iter().map(|&e| e as u32).collect()
        }
    };
    let s: Vec<f64> = ids.iter().map(|&e| score(logits[e as usize])).collect();
    let total: f64 = s.iter().sum::<f64>() + 1e-20;
    let w = s
        .iter()
        .map(|v| (v / total * f64::from(scale)) as f32)
        .collect();
    (ids, w)
}

/// DeepSeek-V4's routing, the best by score plus a selection bias and hash-fixed, on the
/// reference, the native backend and every wgpu configuration, against its definition:
/// the ids exactly, the weights within f32 rounding; logits spread to both softplus tails.
#[test]
fn sqrt_softplus_routing_holds_its_definition_on_every_device() {
    let mut r = rng(48);
    let (t, e, k, scale) = (9, 16, 6, 1.5);
    let logits: Vec<f32> = randn(&mut r, t * e, 30.0);
    let bias = randn(&mut r, e, 0.5);
    let given: Vec<u32> = (0..t * k).map(|i| ((i * 7 + i / k) % e) as u32).collect();
    let router = Router::SqrtSoftplus { scale };
    let mut devs = devices();
    devs.push(("reference", Device::reference()));
    devs.push(("native cpu", kiln_testkit::native_cpu()));
    for fixed in [false, true] {
        let mut want = (Vec::new(), Vec::new());
        for row in 0..t {
            let l = &logits[row * e..(row + 1) * e];
            let g = fixed.then(|| &given[row * k..(row + 1) * k]);
            let (ids, w) = sqrt_softplus_route64(l, (!fixed).then_some(&bias[..]), g, k, scale);
            want.0.extend(ids);
            want.1.extend(w);
        }
        for (name, dev) in &devs {
            let l = Tensor::from_f32(dev, &[t, e], &logits).unwrap();
            let b = Tensor::from_f32(dev, &[e], &bias).unwrap();
            let choice = if fixed {
                Choice::Fixed(&given)
            } else {
                Choice::Best { bias: Some(&b) }
            };
            let mut rec = Recorder::new(dev);
            let routes = rec.moe_route_by(&l, k, router, choice).unwrap();
            rec.submit().unwrap();
            assert_eq!(
                routes.ids().to_u32_vec().unwrap(),
                want.0,
                "{name} fixed {fixed}"
            );
            let w = routes.weights().to_f32_vec().unwrap();
            assert_close(&format!("{name} fixed {fixed}"), &w, &want.1, 1e-6, 1e-5);
        }
    }
}
