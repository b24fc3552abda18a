//! The hyper-connections around each sublayer (`DeepseekV4HyperConnection`) and the head's
//! collapse of the streams (`DeepseekV4HyperHead`).

use kiln_tensor::{DType, HcConfig, HcWeights, Recorder, Tensor};

use crate::{ModelError, Result};

/// The part both modules share: the unweighted RMSNorm of a token's flattened streams,
/// projected to its mix logits by `fn`, with `scale` and `base`.
#[derive(Debug, Clone)]
struct Mixer {
    fn_: Tensor,
    base: Tensor,
    scale: Tensor,
    /// Ones `[streams · hidden]`: the norm is unweighted.
    ones: Tensor,
    cfg: HcConfig,
    norm_eps: f32,
}

impl Mixer {
    fn new(
        file: &str,
        names: [&str; 3],
        [fn_, base, scale]: [Tensor; 3],
        cfg: HcConfig,
        norm_eps: f32,
        mix: usize,
    ) -> Result<Self> {
        let flat = fn_.cols();
        let scales = if mix == cfg.streams { 1 } else { 3 };
        let want = [
            (&fn_, vec![mix, flat]),
            (&base, vec![mix]),
            (&scale, vec![scales]),
        ];
        for ((t, shape), name) in want.into_iter().zip(names) {
            if t.shape() != shape.as_slice() || t.dtype() != DType::F32 {
                return Err(ModelError::Tensor {
                    file: file.into(),
                    tensor: name.into(),
                    problem: format!(
                        "{:?} {:?}, expected F32 {shape:?} for {} streams",
                        t.dtype(),
                        t.shape(),
                        cfg.streams
                    ),
                });
            }
        }
        if flat % cfg.streams != 0 {
            return Err(ModelError::Tensor {
                file: file.into(),
                tensor: names[0].into(),
                problem: format!("{flat} columns are not {} streams' worth", cfg.streams),
            });
        }
        let ones = Tensor::from_f32(&fn_.device(), &[flat], &vec![1.0; flat])?;
        Ok(Self {
            fn_,
            base,
            scale,
            ones,
            cfg,
            norm_eps,
        })
    }

    /// The weights for streams `[tokens, streams, hidden]`.
    fn weights(&self, rec: &mut Recorder, streams: &Tensor) -> Result<HcWeights> {
        let flat = streams.reshape(&[streams.rows() / self.cfg.streams, self.fn_.cols()])?;
        let normed = rec.rms_norm(&flat, &self.ones, self.norm_eps)?;
        let mix = rec.matmul(&normed, &self.fn_, None)?;
        Ok(rec.hc_weights(&mix, &self.scale, &self.base, self.cfg)?)
    }
}

/// The hyper-connection around one sublayer: its input is the streams collapsed by `pre`;
/// its output spreads back by `post`, added to the streams mixed by `comb`.
#[derive(Debug, Clone)]
pub struct HyperConnection {
    mixer: Mixer,
}

impl HyperConnection {
    /// `fn` `[(2 + n)·n, n·hidden]`, `base` `[(2 + n)·n]`, `scale` `[3]`, all F32; `names`
    /// name them in errors.
    pub fn new(
        file: &str,
        names: [&str; 3],
        weights: [Tensor; 3],
        cfg: HcConfig,
        norm_eps: f32,
    ) -> Result<Self> {
        let mix = (2 + cfg.streams) * cfg.streams;
        Ok(Self {
            mixer: Mixer::new(file, names, weights, cfg, norm_eps, mix)?,
        })
    }

    /// The sublayer's input `[tokens, hidden]` from the streams `[tokens, n, hidden]`, and
    /// the weights [`HyperConnection::expand`] takes.
    pub fn collapse(&self, rec: &mut Recorder, streams: &Tensor) -> Result<(Tensor, HcWeights)> {
        let w = self.mixer.weights(rec, streams)?;
        let x = rec.hc_collapse(streams, &w.pre)?;
        Ok((x, w))
    }

    /// The streams after the sublayer's output `y` `[tokens, hidden]`.
    pub fn expand(
        &self,
        rec: &mut Recorder,
        streams: &Tensor,
        y: &Tensor,
        w: &HcWeights,
    ) -> Result<Tensor> {
        Ok(rec.hc_expand(streams, y, &w.post, &w.comb)?)
    }
}

/// The streams' last collapse, before the final norm: `pre` only.
#[derive(Debug, Clone)]
pub struct HyperHead {
    mixer: Mixer,
}

impl HyperHead {
    /// `hc_fn` `[n, n·hidden]`, `hc_base` `[n]`, `hc_scale` `[1]`, all F32.
    pub fn new(
        file: &str,
        names: [&str; 3],
        weights: [Tensor; 3],
        cfg: HcConfig,
        norm_eps: f32,
    ) -> Result<Self> {
        Ok(Self {
            mixer: Mixer::new(file, names, weights, cfg, norm_eps, cfg.streams)?,
        })
    }

    /// `[tokens, hidden]` from the streams `[tokens, n, hidden]`.
    pub fn collapse(&self, rec: &mut Recorder, streams: &Tensor) -> Result<Tensor> {
        let w = self.mixer.weights(rec, streams)?;
        Ok(rec.hc_collapse(streams, &w.pre)?)
    }
}
