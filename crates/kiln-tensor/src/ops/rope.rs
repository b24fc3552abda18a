//! `rope`: rotary position embeddings in both layouts, on the leading or trailing channels of
//! each head, with linear, llama3 and YaRN scaling; `unrope` turns them back.

use bytemuck::{Pod, Zeroable};

use super::{R3W, require_dtype};
use crate::gpu::KernelDef;
use crate::{DType, Device, Recorder, Result, Tensor, TensorError};

static ROPE: KernelDef = KernelDef {
    name: "rope",
    source: include_str!("../../wgsl/rope.wgsl"),
    bindings: R3W,
};

/// Which dimensions are rotated together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(j, j + rot/2)`: Hugging Face checkpoints ("neox").
    HalfSplit,
    /// Pairs `(2j, 2j + 1)`: the layout llama GGUF files' permuted Q/K rows expect.
    Interleaved,
}

impl RopeLayout {
    /// The channels of pair `j` among the rotated ones, of `half` pairs.
    fn pair(self, j: usize, half: usize) -> (usize, usize) {
        match self {
            RopeLayout::HalfSplit => (j, j + half),
            RopeLayout::Interleaved => (2 * j, 2 * j + 1),
        }
    }
}

/// Which of a head's channels a partial rotary embedding turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RotaryChannels {
    /// The first `rotary_dim` (Llama, Qwen, GPT-NeoX with `partial_rotary_factor`).
    #[default]
    Leading,
    /// The last `rotary_dim`, each head laid out `[nope | rope]` (DeepSeek-V4).
    Trailing,
}

/// Frequency scaling for context extension.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// All frequencies divided by `factor` (positions interpolated).
    Linear {
        factor: f32,
    },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: u32,
    },
    /// YaRN ("NTK-by-parts"): frequencies that turn more than `beta_fast` times over the
    /// original context kept, those turning fewer than `beta_slow` times divided by `factor`,
    /// a linear ramp between (its ends rounded outwards when `truncate`); cos and sin then
    /// scaled by `attention_factor`.
    Yarn {
        factor: f32,
        original_max_position: u32,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
}

impl RopeScaling {
    /// YaRN's default attention factor for `factor`, with DeepSeek's `mscale` and
    /// `mscale_all_dim` where a config gives both: `0.1·m·ln(factor) + 1` (1 below factor 1).
    pub fn yarn_attention_factor(
        factor: f32,
        mscale: Option<f32>,
        mscale_all_dim: Option<f32>,
    ) -> f32 {
        let get = |m: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * m * f64::from(factor).ln() + 1.0
            }
        };
        match (mscale, mscale_all_dim) {
            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                (get(f64::from(m)) / get(f64::from(a))) as f32
            }
            _ => get(1.0) as f32,
        }
    }

    /// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    pub fn attention_factor(self) -> f32 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }
}

/// Everything that defines a rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    pub head_dim: usize,
    /// Rotated dimensions (`head_dim` unless partial rotary); even.
    pub rotary_dim: usize,
    pub theta: f32,
    pub scaling: RopeScaling,
    pub layout: RopeLayout,
    pub rotated: RotaryChannels,
}

impl RopeConfig {
    /// The inverse frequencies, computed in f32 the way Hugging Face `transformers` does.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.rotary_dim;
        let base: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f32 / dim as f32))
            .collect();
        match self.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let old = original_max_position as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // transformers' `_compute_yarn_parameters`: the correction range in f64, the
                // ramp and the blend in f32.
                let (d, theta) = (dim as f64, f64::from(self.theta));
                let correction = |turns: f32| {
                    d * (f64::from(original_max_position)
                        / (f64::from(turns) * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0) as f32, high.min(d - 1.0) as f32);
                if low == high {
                    high += 0.001;
                }
                (0..dim / 2)
                    .map(|i| {
                        let pos_freq = self.theta.powf((2 * i) as f32 / dim as f32);
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolated = 1.0 - ramp;
                        let interpolated = 1.0 / (factor * pos_freq);
                        interpolated * (1.0 - extrapolated) + (1.0 / pos_freq) * extrapolated
                    })
                    .collect()
            }
        }
    }

    /// The first rotated channel of a head.
    pub fn first_rotated(&self) -> usize {
        match self.rotated {
            RotaryChannels::Leading => 0,
            RotaryChannels::Trailing => self.head_dim - self.rotary_dim,
        }
    }

    /// The channels of a head that pair `j` turns together.
    pub fn pair(&self, j: usize) -> (usize, usize) {
        let (a, b) = self.layout.pair(j, self.rotary_dim / 2);
        let first = self.first_rotated();
        (first + a, first + b)
    }

    /// The channels of a head left as they are.
    pub fn unrotated(&self) -> std::ops::Range<usize> {
        match self.rotated {
            RotaryChannels::Leading => self.rotary_dim..self.head_dim,
            RotaryChannels::Trailing => 0..self.head_dim - self.rotary_dim,
        }
    }

    fn validate(&self) -> Result<()> {
        let ok = self.rotary_dim.is_multiple_of(2)
            && self.rotary_dim > 0
            && self.rotary_dim <= self.head_dim
            && self.theta.is_finite()
            && self.theta > 0.0;
        if !ok {
            return Err(TensorError::Invalid {
                op: "rope",
                detail: format!(
                    "rotary_dim {} (even, 1..=head_dim {}) and theta {} (> 0)",
                    self.rotary_dim, self.head_dim, self.theta
                ),
            });
        }
        Ok(())
    }

    /// (cos, sin) of position `pos`, frequency `j`: the angle is rounded to f32 as in the
    /// reference, then evaluated in f64 (the table's entries; also how the INT4 KV cache
    /// turns its key centres).
    pub fn cos_sin(inv_freq: &[f32], pos: u32, j: usize) -> (f32, f32) {
        let angle = f64::from(pos as f32 * inv_freq[j]);
        (angle.cos() as f32, angle.sin() as f32)
    }
}

/// A device table of (cos, sin) for positions `0..max_positions`, built once per model.
#[derive(Debug, Clone)]
pub struct RopeTable {
    config: RopeConfig,
    max_positions: usize,
    table: Tensor,
}

impl RopeTable {
    pub fn new(device: &Device, config: RopeConfig, max_positions: usize) -> Result<Self> {
        config.validate()?;
        let inv = config.inv_freq();
        let half = config.rotary_dim / 2;
        let a = config.scaling.attention_factor();
        let mut cs = Vec::with_capacity(max_positions * half * 2);
        for pos in 0..max_positions {
            for j in 0..half {
                let (c, s) = RopeConfig::cos_sin(&inv, pos as u32, j);
                cs.push(c * a);
                cs.push(s * a);
            }
        }
        let table = Tensor::from_f32(device, &[max_positions, half, 2], &cs)?;
        Ok(Self {
            config,
            max_positions,
            table,
        })
    }

    pub fn config(&self) -> &RopeConfig {
        &self.config
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The table itself, F32 `[max_positions, rotary_dim / 2, 2]` of (cos, sin): for kernels
    /// outside this crate that rotate as they go (the KV write).
    pub fn tensor(&self) -> &Tensor {
        &self.table
    }

    /// Validate the positions of a step's tokens and upload them once, for every `rope` of the
    /// step (Q and K of every layer).
    pub fn positions(&self, positions: &[u32]) -> Result<RopePositions> {
        let mut p = RopePositions {
            table: self.clone(),
            host: Vec::new(),
            uploaded: None,
        };
        p.set(positions)?;
        Ok(p)
    }
}

/// Token positions checked against a [`RopeTable`] and uploaded once.
#[derive(Debug, Clone)]
pub struct RopePositions {
    table: RopeTable,
    host: Vec<u32>,
    uploaded: Option<Tensor>,
}

impl RopePositions {
    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The positions, checked against the table.
    pub fn positions(&self) -> &[u32] {
        &self.host
    }

    /// Another step's positions for the same table, in place of these (the host list's
    /// room reused: a step after the first allocates nothing for them on a CPU backend).
    /// After an error there are none.
    pub fn set(&mut self, positions: &[u32]) -> Result<()> {
        self.host.clear();
        self.uploaded = None;
        super::check_indices("rope", "position", positions, self.table.max_positions)?;
        let device = self.table.table.device();
        if !device.is_cpu() {
            self.uploaded = Some(Tensor::from_u32(&device, &[positions.len()], positions)?);
        }
        self.host.extend_from_slice(positions);
        Ok(())
    }

    /// The table they index.
    pub fn table(&self) -> &RopeTable {
        &self.table
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    tokens: u32,
    heads: u32,
    head_dim: u32,
    rot: u32,
    max_pos: u32,
    interleaved: u32,
    /// The first rotated channel.
    first: u32,
    /// 1 to turn by minus the angle.
    back: u32,
}

/// Which way [`Recorder::rope`] turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// By each position's angle.
    Forward,
    /// By minus it: RoPE undone.
    Back,
}

impl Recorder {
    /// Rotate x `[tokens, heads, head_dim]` by each token's position.
    pub fn rope(&mut self, x: &Tensor, positions: &RopePositions) -> Result<Tensor> {
        self.turn("rope", x, positions, Turn::Forward)
    }

    /// Rotate x `[tokens, heads, head_dim]` by minus each token's angle, with the same cos and
    /// sin (transformers' `apply_rotary_pos_emb(x, cos, -sin)`): RoPE's inverse where its
    /// attention factor is 1. DeepSeek-V4 turns its attention output back at the query's
    /// position, its values having been rotated as keys.
    pub fn unrope(&mut self, x: &Tensor, positions: &RopePositions) -> Result<Tensor> {
        self.turn("unrope", x, positions, Turn::Back)
    }

    fn turn(
        &mut self,
        op: &'static str,
        x: &Tensor,
        positions: &RopePositions,
        turn: Turn,
    ) -> Result<Tensor> {
        let table = &positions.table;
        let positions_host = &positions.host;
        require_dtype(op, "the input", x, &[DType::F32])?;
        self.check_device(op, &[x, &table.table])?;
        let cfg = table.config;
        let [tokens, heads, head_dim] = x.shape() else {
            return Err(TensorError::Shape {
                op,
                detail: format!(
                    "input must be [tokens, heads, head_dim], got {:?}",
                    x.shape()
                ),
            });
        };
        let (tokens, heads, head_dim) = (*tokens, *heads, *head_dim);
        if head_dim != cfg.head_dim || positions_host.len() != tokens || heads == 0 {
            return Err(TensorError::Shape {
                op,
                detail: format!(
                    "input {:?} with {} positions for head_dim {}",
                    x.shape(),
                    positions_host.len(),
                    cfg.head_dim
                ),
            });
        }
        let Some(ctx) = self.gpu().cloned() else {
            let (shape, x) = (x.shape(), x.host_f32()?);
            // The native backend reads the table's (cos, sin); the reference evaluates them.
            let table = match self.device().native() {
                Some(_) => Some(table.table.host_f32()?),
                None => None,
            };
            return Tensor::host_f32_with(shape, |out| {
                match table {
                    Some(table) => rope_table(x, positions_host, heads, &cfg, table, turn, out),
                    None => rope_ref(x, positions_host, heads, &cfg, turn, out),
                }
                Ok(())
            });
        };
        let Some(pos) = positions.uploaded.clone() else {
            return Err(TensorError::DeviceMismatch { op });
        };
        let out = Tensor::gpu_output(&ctx, DType::F32, x.shape(), op)?;
        let params = Params {
            tokens: tokens as u32,
            heads: heads as u32,
            head_dim: head_dim as u32,
            rot: cfg.rotary_dim as u32,
            max_pos: table.max_positions as u32,
            interleaved: u32::from(cfg.layout == RopeLayout::Interleaved),
            first: cfg.first_rotated() as u32,
            back: u32::from(turn == Turn::Back),
        };
        let bind = vec![
            (x.clone(), 0),
            (pos, 0),
            (table.table.clone(), 0),
            (out.clone(), 0),
        ];
        self.dispatch(
            &ROPE,
            &[] as &[(&str, String)],
            &params,
            bind,
            x.elem_count().div_ceil(64) as u32,
        )?;
        Ok(out)
    }
}

/// [`rope_ref`] with each (cos, sin) read from the table (`[positions, rotary_dim / 2, 2]`,
/// the same values): the native backend's.
fn rope_table(
    x: &[f32],
    positions: &[u32],
    heads: usize,
    cfg: &RopeConfig,
    table: &[f32],
    turn: Turn,
    out: &mut [f32],
) {
    let half = cfg.rotary_dim / 2;
    rotate_pairs(x, positions, heads, cfg, out, |pos, j| {
        let at = (pos as usize * half + j) * 2;
        (table[at], turn.sign() * table[at + 1])
    })
}

/// CPU reference, straight from the config (no table), into `out`.
fn rope_ref(
    x: &[f32],
    positions: &[u32],
    heads: usize,
    cfg: &RopeConfig,
    turn: Turn,
    out: &mut [f32],
) {
    let inv = cfg.inv_freq();
    let a = cfg.scaling.attention_factor();
    rotate_pairs(x, positions, heads, cfg, out, |pos, j| {
        let (c, s) = RopeConfig::cos_sin(&inv, pos, j);
        (c * a, turn.sign() * s * a)
    })
}

impl Turn {
    /// What sin is multiplied by.
    fn sign(self) -> f32 {
        match self {
            Turn::Forward => 1.0,
            Turn::Back => -1.0,
        }
    }
}

/// Each token's heads of `x` into `out`, every rotated pair `j` turned by
/// `turn(position, j)`'s (cos, sin); channels past the rotary ones as they are.
fn rotate_pairs(
    x: &[f32],
    positions: &[u32],
    heads: usize,
    cfg: &RopeConfig,
    out: &mut [f32],
    turn: impl Fn(u32, usize) -> (f32, f32),
) {
    let (hd, half) = (cfg.head_dim, cfg.rotary_dim / 2);
    out.copy_from_slice(x);
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * hd;
            for j in 0..half {
                let (c, s) = turn(pos, j);
                let (a, b) = cfg.pair(j);
                let (a, b) = (base + a, base + b);
                out[a] = x[a] * c - x[b] * s;
                out[b] = x[b] * c + x[a] * s;
            }
        }
    }
}
