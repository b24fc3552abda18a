//! Hyper-connections (DeepSeek-V4's mHC): the residual is `n` streams a token. Around each
//! sublayer, [`Recorder::hc_weights`] turns a token's mix logits (a projection of its
//! normed, flattened streams) into the weights that collapse the streams into the
//! sublayer's input (`pre`), spread its output back (`post`) and mix the streams (`comb`, a
//! doubly stochastic matrix by Sinkhorn-Knopp); [`Recorder::hc_collapse`] and
//! [`Recorder::hc_expand`] apply them.

use bytemuck::{Pod, Zeroable};

use super::{one_binding, require_dtype};
use crate::gpu::{Access, KernelDef};
use crate::{DType, Recorder, Result, Tensor, TensorError};

const SRC: &str = include_str!("../../wgsl/hyper.wgsl");
const R3W3: &[Access] = &[
    Access::Read,
    Access::Read,
    Access::Read,
    Access::ReadWrite,
    Access::ReadWrite,
    Access::ReadWrite,
];
static WEIGHTS: KernelDef = KernelDef {
    name: "hc_weights",
    source: SRC,
    bindings: R3W3,
};
static COLLAPSE: KernelDef = KernelDef {
    name: "hc_collapse",
    source: SRC,
    bindings: super::R2W,
};
static EXPAND: KernelDef = KernelDef {
    name: "hc_expand",
    source: SRC,
    bindings: &[
        Access::Read,
        Access::Read,
        Access::Read,
        Access::Read,
        Access::ReadWrite,
    ],
};

/// The most streams a token may have (the kernels keep a token's `n × n` mix in registers).
pub const MAX_STREAMS: usize = 8;

/// How [`Recorder::hc_weights`] makes its weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcConfig {
    pub streams: usize,
    /// Sinkhorn-Knopp normalisations of `comb` (its first, over the sources, included).
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// One step's hyper-connection weights, a row a token.
#[derive(Debug, Clone)]
pub struct HcWeights {
    /// F32 `[tokens, n]`.
    pub pre: Tensor,
    /// F32 `[tokens, n]` (all zero from a head's mix, which makes `pre` only).
    pub post: Tensor,
    /// F32 `[tokens, n, n]`, `[source, destination]` (zero from a head's mix).
    pub comb: Tensor,
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    tokens: u32,
    n: u32,
    /// Mix columns a token: `(2 + n)·n`, or `n` for a head.
    mix: u32,
    iters: u32,
    eps: f32,
    width: u32,
    _pad: [u32; 2],
}

impl Recorder {
    /// The weights from each token's mix logits `mix` (F32 `[tokens, (2 + n)·n]`: pre, post,
    /// then comb row-major `[source, destination]`; or `[tokens, n]`, a head's, pre only),
    /// `scale` (F32 `[3]`, or `[1]` for a head) and `base` (F32, the mix's width):
    /// `pre = sigmoid(m·s0 + b) + eps`, `post = 2·sigmoid(m·s1 + b)`, `comb` = Sinkhorn of
    /// `softmax_dst(m·s2 + b) + eps`: the columns (over sources) normalised, then
    /// `sinkhorn_iters - 1` times the rows and the columns, each sum plus `eps`.
    pub fn hc_weights(
        &mut self,
        mix: &Tensor,
        scale: &Tensor,
        base: &Tensor,
        cfg: HcConfig,
    ) -> Result<HcWeights> {
        const OP: &str = "hc_weights";
        for (what, t) in [("the mix", mix), ("the scale", scale), ("the base", base)] {
            require_dtype(OP, what, t, &[DType::F32])?;
        }
        self.check_device(OP, &[mix, scale, base])?;
        one_binding(OP, &[mix, scale, base])?;
        let n = cfg.streams;
        let (tokens, width) = (mix.rows(), mix.cols());
        let head = width == n;
        let scales = if head { 1 } else { 3 };
        if n == 0 || n > MAX_STREAMS || cfg.sinkhorn_iters == 0 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!(
                    "{n} streams (1..={MAX_STREAMS}), {} Sinkhorn iterations (at least 1)",
                    cfg.sinkhorn_iters
                ),
            });
        }
        if !(head || width == (2 + n) * n)
            || scale.elem_count() != scales
            || base.elem_count() != width
            || tokens == 0
        {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "mix {:?}, scale {:?}, base {:?} for {n} streams",
                    mix.shape(),
                    scale.shape(),
                    base.shape()
                ),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let (m, s, b) = (mix.host_f32()?, scale.host_f32()?, base.host_f32()?);
            let mut post = vec![0f32; tokens * n];
            let mut comb = vec![0f32; tokens * n * n];
            let pre = Tensor::host_f32_with(&[tokens, n], |pre| {
                for t in 0..tokens {
                    let out = HcRow {
                        pre: &mut pre[t * n..][..n],
                        post: &mut post[t * n..][..n],
                        comb: &mut comb[t * n * n..][..n * n],
                    };
                    hc_weights_row(&m[t * width..][..width], s, b, cfg, out);
                }
                Ok::<_, TensorError>(())
            })?;
            let post = Tensor::host_f32_with(&[tokens, n], |o| {
                o.copy_from_slice(&post);
                Ok::<_, TensorError>(())
            })?;
            let comb = Tensor::host_f32_with(&[tokens, n, n], |o| {
                o.copy_from_slice(&comb);
                Ok::<_, TensorError>(())
            })?;
            return Ok(HcWeights { pre, post, comb });
        };
        let pre = Tensor::gpu_output(&ctx, DType::F32, &[tokens, n], OP)?;
        let post = Tensor::gpu_output(&ctx, DType::F32, &[tokens, n], OP)?;
        let comb = Tensor::gpu_output(&ctx, DType::F32, &[tokens, n, n], OP)?;
        let params = Params {
            tokens: tokens as u32,
            n: n as u32,
            mix: width as u32,
            iters: cfg.sinkhorn_iters as u32,
            eps: cfg.eps,
            width: 0,
            _pad: [0; 2],
        };
        self.dispatch(
            &WEIGHTS,
            &[("WEIGHTS", "1"), ("COLLAPSE", "0"), ("EXPAND", "0")],
            &params,
            vec![
                (mix.clone(), 0),
                (scale.clone(), 0),
                (base.clone(), 0),
                (pre.clone(), 0),
                (post.clone(), 0),
                (comb.clone(), 0),
            ],
            tokens.div_ceil(64) as u32,
        )?;
        Ok(HcWeights { pre, post, comb })
    }

    /// `Σ_i pre[t, i] · streams[t, i]`: F32 `[tokens, width]` from streams F32 `[tokens, n,
    /// width]` and `pre` F32 `[tokens, n]`.
    pub fn hc_collapse(&mut self, streams: &Tensor, pre: &Tensor) -> Result<Tensor> {
        const OP: &str = "hc_collapse";
        let [tokens, n, width] = self.hc_streams(OP, streams)?;
        require_dtype(OP, "pre", pre, &[DType::F32])?;
        self.check_device(OP, &[pre])?;
        one_binding(OP, &[streams, pre])?;
        if pre.shape() != [tokens, n] {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!("pre {:?} for streams {:?}", pre.shape(), streams.shape()),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let (s, p) = (streams.host_f32()?, pre.host_f32()?);
            return Tensor::host_f32_with(&[tokens, width], |out| {
                for (t, row) in out.chunks_exact_mut(width).enumerate() {
                    for (c, o) in row.iter_mut().enumerate() {
                        *o =
                            (0..n).fold(0f32, |a, i| a + p[t * n + i] * s[(t * n + i) * width + c]);
                    }
                }
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, &[tokens, width], OP)?;
        let params = self.stream_params(tokens, n, width);
        self.dispatch(
            &COLLAPSE,
            &[("WEIGHTS", "0"), ("COLLAPSE", "1"), ("EXPAND", "0")],
            &params,
            vec![(streams.clone(), 0), (pre.clone(), 0), (out.clone(), 0)],
            (tokens * width).div_ceil(64) as u32,
        )?;
        Ok(out)
    }

    /// The streams after a sublayer: `out[t, k] = post[t, k] · y[t] + Σ_j comb[t, j, k] ·
    /// streams[t, j]`, F32 `[tokens, n, width]`, from its output `y` F32 `[tokens, width]`.
    pub fn hc_expand(
        &mut self,
        streams: &Tensor,
        y: &Tensor,
        post: &Tensor,
        comb: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "hc_expand";
        let [tokens, n, width] = self.hc_streams(OP, streams)?;
        for (what, t) in [("the output", y), ("post", post), ("comb", comb)] {
            require_dtype(OP, what, t, &[DType::F32])?;
        }
        self.check_device(OP, &[y, post, comb])?;
        one_binding(OP, &[streams, y, post, comb])?;
        if y.shape() != [tokens, width]
            || post.shape() != [tokens, n]
            || comb.shape() != [tokens, n, n]
        {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "output {:?}, post {:?}, comb {:?} for streams {:?}",
                    y.shape(),
                    post.shape(),
                    comb.shape(),
                    streams.shape()
                ),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let (s, yv) = (streams.host_f32()?, y.host_f32()?);
            let (p, c) = (post.host_f32()?, comb.host_f32()?);
            return Tensor::host_f32_with(streams.shape(), |out| {
                for t in 0..tokens {
                    for k in 0..n {
                        for ch in 0..width {
                            let mixed = (0..n).fold(0f32, |a, j| {
                                a + c[(t * n + j) * n + k] * s[(t * n + j) * width + ch]
                            });
                            out[(t * n + k) * width + ch] =
                                p[t * n + k] * yv[t * width + ch] + mixed;
                        }
                    }
                }
                Ok(())
            });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, streams.shape(), OP)?;
        let params = self.stream_params(tokens, n, width);
        self.dispatch(
            &EXPAND,
            &[("WEIGHTS", "0"), ("COLLAPSE", "0"), ("EXPAND", "1")],
            &params,
            vec![
                (streams.clone(), 0),
                (y.clone(), 0),
                (post.clone(), 0),
                (comb.clone(), 0),
                (out.clone(), 0),
            ],
            (tokens * n * width).div_ceil(64) as u32,
        )?;
        Ok(out)
    }

    fn hc_streams(&self, op: &'static str, streams: &Tensor) -> Result<[usize; 3]> {
        require_dtype(op, "the streams", streams, &[DType::F32])?;
        self.check_device(op, &[streams])?;
        match *streams.shape() {
            [t, n, w] if t > 0 && (1..=MAX_STREAMS).contains(&n) && w > 0 => Ok([t, n, w]),
            _ => Err(TensorError::Shape {
                op,
                detail: format!(
                    "streams must be [tokens, n (1..={MAX_STREAMS}), width], got {:?}",
                    streams.shape()
                ),
            }),
        }
    }

    fn stream_params(&self, tokens: usize, n: usize, width: usize) -> Params {
        Params {
            tokens: tokens as u32,
            n: n as u32,
            mix: 0,
            iters: 0,
            eps: 0.0,
            width: width as u32,
            _pad: [0; 2],
        }
    }
}

/// One token's weights, written by [`hc_weights_row`].
struct HcRow<'a> {
    pre: &'a mut [f32],
    post: &'a mut [f32],
    comb: &'a mut [f32],
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The reference of one token's [`Recorder::hc_weights`], in f32 as transformers computes it.
fn hc_weights_row(m: &[f32], scale: &[f32], base: &[f32], cfg: HcConfig, out: HcRow<'_>) {
    let n = cfg.streams;
    for i in 0..n {
        out.pre[i] = sigmoid(m[i] * scale[0] + base[i]) + cfg.eps;
    }
    if m.len() == n {
        return;
    }
    for i in 0..n {
        out.post[i] = 2.0 * sigmoid(m[n + i] * scale[1] + base[n + i]);
    }
    let c = &mut *out.comb;
    for j in 0..n {
        let row = &mut c[j * n..(j + 1) * n];
        for (k, v) in row.iter_mut().enumerate() {
            *v = m[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k];
        }
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = row.iter().map(|v| (v - mx).exp()).sum();
        for v in row.iter_mut() {
            *v = (*v - mx).exp() / sum + cfg.eps;
        }
    }
    let columns = |c: &mut [f32]| {
        for k in 0..n {
            let s = (0..n).map(|j| c[j * n + k]).sum::<f32>() + cfg.eps;
            for j in 0..n {
                c[j * n + k] /= s;
            }
        }
    };
    let rows = |c: &mut [f32]| {
        for row in c.chunks_exact_mut(n) {
            let s = row.iter().sum::<f32>() + cfg.eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
    };
    columns(c);
    for _ in 1..cfg.sinkhorn_iters {
        rows(c);
        columns(c);
    }
}
