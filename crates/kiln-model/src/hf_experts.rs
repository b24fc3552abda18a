//! [`HfSource`]'s stacked experts, as GPT-OSS checkpoints hold them: one tensor a projection
//! for all of a layer's experts, with gate and up interleaved in `gate_up_proj` (gate the even
//! output rows, up the odd ones), either as float `[experts, in, out]` (what transformers
//! saves) or as MXFP4 `_blocks [experts, out, in/32, 16]` and `_scales [experts, out, in/32]`
//! (OpenAI's release), which load as kiln's MXFP4 blocks, packed.

use kiln_tensor::{DType, Device, Tensor};

use crate::Arch;
use crate::hf_source::HfSource;
use crate::safetensors::{FLOATS, StDtype};
use crate::weights::ExpertProj;
use crate::{ModelError, Result};

/// Elements of an MXFP4 block, and its packed bytes (two 4-bit values a byte).
pub(crate) const MX_BLOCK: usize = 32;
pub(crate) const MX_PACKED: usize = MX_BLOCK / 2;

/// A projection's stacked tensor: its name, and which of its output rows are this
/// projection's (every `stride`-th from `first`).
struct Stacked {
    name: String,
    stride: usize,
    first: usize,
}

impl Stacked {
    fn of(layer: usize, proj: ExpertProj) -> Self {
        let base = format!("model.layers.{layer}.mlp.experts");
        let (name, stride, first) = match proj {
            ExpertProj::Gate => ("gate_up_proj", 2, 0),
            ExpertProj::Up => ("gate_up_proj", 2, 1),
            ExpertProj::Down => ("down_proj", 1, 0),
        };
        Self {
            name: format!("{base}.{name}"),
            stride,
            first,
        }
    }

    /// Output row `r` of this projection in the stacked tensor.
    fn row(&self, r: usize) -> usize {
        r * self.stride + self.first
    }
}

/// MXFP4 `blocks` (OpenAI's layout: element 2j in the low nibble of byte j, 2j + 1 in its
/// high nibble) and their e8m0 `scale` as one GGUF MXFP4 block (the scale, then elements j
/// and j + 16 in the low and high nibbles of byte j).
pub(crate) fn mxfp4_block(scale: u8, blocks: &[u8], out: &mut Vec<u8>) {
    let nibble = |t: usize| (blocks[t / 2] >> (4 * (t % 2))) & 0xf;
    out.push(scale);
    out.extend((0..MX_PACKED).map(|j| nibble(j) | (nibble(j + MX_PACKED) << 4)));
}

impl HfSource {
    /// Projection `proj` of every expert of layer `layer` from GPT-OSS's stacked tensors,
    /// `[experts, rows, cols]` of `shape`; `None` where the checkpoint has none (experts
    /// stored one by one).
    pub(crate) fn stacked_experts(
        &self,
        device: &Device,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 3],
    ) -> Result<Option<Tensor>> {
        if self.arch != Some(Arch::GptOss) {
            return Ok(None);
        }
        let s = Stacked::of(layer, proj);
        let blocks = format!("{}_blocks", s.name);
        if self.index.contains_key(&blocks) {
            return self.mxfp4_experts(device, &s, shape).map(Some);
        }
        if !self.index.contains_key(&s.name) {
            return Ok(None);
        }
        let [experts, rows, cols] = shape;
        // Stored `[experts, in, out]`: the transpose of kiln's `[experts, out, in]`.
        let stored = [experts, cols, rows * s.stride];
        let (dtype, bytes, file) = self.checked_bytes(&s.name, &stored, FLOATS)?;
        let size = dtype.size().unwrap_or(4);
        let mut out = Vec::with_capacity(experts * rows * cols * size);
        for e in 0..experts {
            let expert = &bytes[e * stored[1] * stored[2] * size..];
            for r in 0..rows {
                let col = s.row(r);
                for c in 0..cols {
                    let at = (c * stored[2] + col) * size;
                    out.extend_from_slice(&expert[at..at + size]);
                }
            }
        }
        self.upload(device, dtype, &shape, &out, (file, &s.name))
            .map(Some)
    }

    /// GPT-OSS's MXFP4 experts as kiln's MXFP4 blocks.
    fn mxfp4_experts(&self, device: &Device, s: &Stacked, shape: [usize; 3]) -> Result<Tensor> {
        let [experts, rows, cols] = shape;
        let (blocks_name, scales_name) =
            (format!("{}_blocks", s.name), format!("{}_scales", s.name));
        if !cols.is_multiple_of(MX_BLOCK) {
            return Err(ModelError::Tensor {
                file: self.describe.clone(),
                tensor: blocks_name,
                problem: format!("{cols} columns are not whole MXFP4 blocks of {MX_BLOCK}"),
            });
        }
        let groups = cols / MX_BLOCK;
        let stored_rows = rows * s.stride;
        let (_, blocks, _) = self.checked_bytes(
            &blocks_name,
            &[experts, stored_rows, groups, MX_PACKED],
            &[StDtype::U8],
        )?;
        let (_, scales, _) = self.checked_bytes(
            &scales_name,
            &[experts, stored_rows, groups],
            &[StDtype::U8],
        )?;
        let mut out = Vec::with_capacity(experts * rows * groups * (MX_PACKED + 1));
        for e in 0..experts {
            for r in 0..rows {
                let row = e * stored_rows + s.row(r);
                for g in 0..groups {
                    let b = (row * groups + g) * MX_PACKED;
                    mxfp4_block(
                        scales[row * groups + g],
                        &blocks[b..b + MX_PACKED],
                        &mut out,
                    );
                }
            }
        }
        Tensor::from_bytes(device, DType::MXFP4, &shape, &out).map_err(|source| {
            ModelError::Upload {
                file: self.describe.clone(),
                tensor: blocks_name,
                source: Box::new(source),
            }
        })
    }

    /// The bias of projection `proj` of every expert of layer `layer` from GPT-OSS's stacked
    /// `gate_up_proj_bias [experts, 2·rows]` (interleaved) or `down_proj_bias`.
    pub(crate) fn stacked_expert_bias(
        &self,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 2],
    ) -> Result<Vec<f32>> {
        let s = Stacked::of(layer, proj);
        let name = format!("{}_bias", s.name);
        let [experts, rows] = shape;
        let stored = [experts, rows * s.stride];
        let (dtype, bytes, file) = self.checked_bytes(&name, &stored, FLOATS)?;
        let all = self
            .upload(&Device::Reference, dtype, &stored, &bytes, (file, &name))?
            .to_f32_vec()?;
        Ok((0..experts)
            .flat_map(|e| (0..rows).map(move |r| (e, r)))
            .map(|(e, r)| all[e * stored[1] + s.row(r)])
            .collect())
    }
}
