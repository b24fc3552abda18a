//! The hyper-connection ops on the native CPU backend and every wgpu configuration against
//! the CPU reference, for every stream count they take (kiln-model's DeepSeek-V4 tests check
//! the reference against transformers' modules); and the Sinkhorn result doubly stochastic.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_close, gpus, randn, rng};
use kiln_tensor::{Device, HcConfig, MAX_STREAMS, Recorder, Tensor};

fn devices() -> Vec<(&'static str, Device)> {
    let mut v = vec![("cpu", Device::cpu().expect("native CPU backend"))];
    v.extend(gpus());
    v
}

/// pre, post, comb, the collapse and the expansion, read back.
fn run(dev: &Device, n: usize, head: bool, seed: u64) -> Vec<Vec<f32>> {
    let mut r = rng(seed);
    let (tokens, width) = (5, 37);
    let mix_w = if head { n } else { (2 + n) * n };
    let scales = if head { 1 } else { 3 };
    let t = |shape: &[usize], v: Vec<f32>| Tensor::from_f32(dev, shape, &v).unwrap();
    let mix = t(&[tokens, mix_w], randn(&mut r, tokens * mix_w, 3.0));
    let scale = t(&[scales], randn(&mut r, scales, 1.0));
    let base = t(&[mix_w], randn(&mut r, mix_w, 1.0));
    let streams = t(&[tokens, n, width], randn(&mut r, tokens * n * width, 1.0));
    let y = t(&[tokens, width], randn(&mut r, tokens * width, 1.0));
    let cfg = HcConfig {
        streams: n,
        sinkhorn_iters: 20,
        eps: 1e-6,
    };
    let mut rec = Recorder::new(dev);
    let w = rec.hc_weights(&mix, &scale, &base, cfg).unwrap();
    let collapsed = rec.hc_collapse(&streams, &w.pre).unwrap();
    let after = rec.hc_expand(&streams, &y, &w.post, &w.comb).unwrap();
    rec.submit().unwrap();
    [&w.pre, &w.post, &w.comb, &collapsed, &after]
        .iter()
        .map(|t| t.to_f32_vec().unwrap())
        .collect()
}

#[test]
fn hyper_connection_ops_match_the_reference_on_every_device() {
    for n in 1..=MAX_STREAMS {
        for head in [false, true] {
            let want = run(&Device::reference(), n, head, n as u64);
            if !head {
                // Sinkhorn's result: rows and columns each sum to about 1.
                let comb = &want[2];
                for c in comb.chunks_exact(n * n) {
                    for i in 0..n {
                        let row: f32 = c[i * n..(i + 1) * n].iter().sum();
                        let col: f32 = (0..n).map(|j| c[j * n + i]).sum();
                        assert!(
                            (row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-4,
                            "{row} {col}"
                        );
                    }
                }
            }
            for (name, dev) in devices() {
                let got = run(&dev, n, head, n as u64);
                for (part, (g, w)) in ["pre", "post", "comb", "collapse", "expand"]
                    .iter()
                    .zip(got.iter().zip(&want))
                {
                    assert_close(
                        &format!("{name} {n} streams head {head} {part}"),
                        g,
                        w,
                        1e-5,
                        1e-5,
                    );
                }
            }
        }
    }
}
