//! Weights stored as float codes under block scales, as DeepSeek ships V4: FP8 E4M3 linears
//! with one scale a `weight_block_size` tile (128 × 128; `<stem>.scale` as ue8m0 exponents,
//! DeepSeek's, or `<stem>.weight_scale_inv` as floats, transformers' and DeepSeek-V3's), which
//! load as kiln's `FP8` blocks (each 32 codes of a row under their tile's scale); and FP4 E2M1
//! routed experts, two codes a byte (element 2j in the low nibble of byte j) with a ue8m0
//! scale a 32 inputs (`<stem>.scale`), which load as `MXFP4` blocks. Both stay packed: the
//! codes are copied, never decoded.

use kiln_tensor::{DType, Device, Tensor};

use crate::hf_experts::{MX_BLOCK, MX_PACKED, mxfp4_block};
use crate::hf_source::HfSource;
use crate::safetensors::StDtype;
use crate::{ModelError, Result};

/// The value of a ue8m0 scale byte, 2^(e − 127) (`None` for 255, its NaN).
fn e8m0(e: u8) -> Option<f32> {
    match e {
        255 => None,
        // 2^-127 is an f32 subnormal.
        0 => Some(f32::from_bits(1 << 22)),
        e => Some(f32::from_bits(u32::from(e) << 23)),
    }
}

impl HfSource {
    /// Tensor `name`, `shape` `[rows, cols]`, as kiln's FP8 or MXFP4 blocks on `device` when
    /// the folder stores it as codes under block scales; `None` when it is stored otherwise
    /// (or missing: the float path then names it).
    pub(crate) fn block_scaled(
        &self,
        device: &Device,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Tensor>> {
        let (Some((_, e)), &[rows, cols]) = (self.raw(name), shape) else {
            return Ok(None);
        };
        let packed_fp4 = matches!(e.dtype, StDtype::I8 | StDtype::U8)
            && cols.is_multiple_of(2)
            && e.shape == [rows, cols / 2];
        if e.dtype == StDtype::F8E4M3 {
            self.fp8(device, name, rows, cols).map(Some)
        } else if packed_fp4 {
            self.fp4(device, name, rows, cols).map(Some)
        } else {
            Ok(None)
        }
    }

    fn scaled_err(&self, name: &str, problem: String) -> ModelError {
        let file = self
            .raw(name)
            .map_or(self.describe.as_str(), |(f, _)| f.name());
        ModelError::Tensor {
            file: file.into(),
            tensor: name.into(),
            problem,
        }
    }

    /// The scales beside weight `name`, `[grid rows, grid cols]` row-major: DeepSeek's
    /// `.scale` (ue8m0 bytes, or floats) or transformers' `.weight_scale_inv` (floats).
    fn block_scales(&self, name: &str, grid: [usize; 2]) -> Result<(String, Vec<f32>)> {
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let candidates = [format!("{stem}.scale"), format!("{stem}.weight_scale_inv")];
        let Some((scale, file, e)) = candidates
            .iter()
            .find_map(|n| self.raw(n).map(|(f, e)| (n.clone(), f, e)))
        else {
            return Err(self.scaled_err(
                name,
                format!(
                    "stored as codes without their block scales ({} or {})",
                    candidates[0], candidates[1]
                ),
            ));
        };
        if e.shape != grid {
            return Err(self.scaled_err(
                &scale,
                format!(
                    "shape {:?}, expected {grid:?}: one scale a block of the weight {name}",
                    e.shape
                ),
            ));
        }
        let values = match e.dtype {
            StDtype::U8 | StDtype::F8E8M0 => {
                let bytes = file.bytes(&scale, e)?;
                let decoded: Option<Vec<f32>> = bytes.iter().map(|&b| e8m0(b)).collect();
                decoded.ok_or_else(|| {
                    self.scaled_err(&scale, "holds the ue8m0 NaN (255) as a scale".into())
                })?
            }
            _ => file.entry_f32(&scale, e)?,
        };
        Ok((scale, values))
    }

    /// An FP8 E4M3 weight and its tile scales as `FP8` blocks.
    fn fp8(&self, device: &Device, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        let [br, bc] = self.fp8_block;
        let (file, e) = self
            .raw(name)
            .ok_or_else(|| self.scaled_err(name, "missing".into()))?;
        if e.shape != [rows, cols] {
            return Err(self.scaled_err(
                name,
                format!("shape {:?}, expected [{rows}, {cols}]", e.shape),
            ));
        }
        if cols == 0 || !cols.is_multiple_of(32) {
            return Err(self.scaled_err(
                name,
                format!("{cols} columns are not whole blocks of 32 (kiln's FP8 blocks)"),
            ));
        }
        let grid = [rows.div_ceil(br), cols.div_ceil(bc)];
        let (_, scales) = self.block_scales(name, grid)?;
        let codes = file.bytes(name, e)?;
        let mut out = Vec::with_capacity(rows * cols / 32 * 36);
        for (r, row) in codes.chunks_exact(cols).enumerate() {
            for (g, block) in row.chunks_exact(32).enumerate() {
                let d = scales[(r / br) * grid[1] + g * 32 / bc];
                out.extend_from_slice(&d.to_le_bytes());
                out.extend_from_slice(block);
            }
        }
        self.upload_blocks(device, DType::FP8, name, &[rows, cols], &out)
    }

    /// DeepSeek's FP4 E2M1 codes, two a byte, and their ue8m0 scale a 32 inputs, as `MXFP4`
    /// blocks (the same codes and exponents, ggml's nibble order).
    fn fp4(&self, device: &Device, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        if !cols.is_multiple_of(MX_BLOCK) {
            return Err(self.scaled_err(
                name,
                format!("{cols} columns are not whole MXFP4 blocks of {MX_BLOCK}"),
            ));
        }
        let groups = cols / MX_BLOCK;
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let scale = format!("{stem}.scale");
        let (_, scales, _) =
            self.checked_bytes(&scale, &[rows, groups], &[StDtype::U8, StDtype::F8E8M0])?;
        let (_, codes, _) =
            self.checked_bytes(name, &[rows, cols / 2], &[StDtype::I8, StDtype::U8])?;
        let mut out = Vec::with_capacity(rows * groups * (MX_PACKED + 1));
        for (block, &s) in codes.chunks_exact(MX_PACKED).zip(scales.iter()) {
            mxfp4_block(s, block, &mut out);
        }
        self.upload_blocks(device, DType::MXFP4, name, &[rows, cols], &out)
    }

    fn upload_blocks(
        &self,
        device: &Device,
        dtype: DType,
        name: &str,
        shape: &[usize],
        blocks: &[u8],
    ) -> Result<Tensor> {
        Tensor::from_bytes(device, dtype, shape, blocks).map_err(|source| ModelError::Upload {
            file: self.describe.clone(),
            tensor: name.into(),
            source: Box::new(source),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::e8m0;

    #[test]
    fn ue8m0_bytes_are_powers_of_two() {
        assert_eq!(e8m0(127), Some(1.0));
        assert_eq!(e8m0(120), Some(2f32.powi(-7)));
        assert_eq!(e8m0(254), Some(2f32.powi(127)));
        assert_eq!(e8m0(0), Some(2f32.powi(-127)));
        assert_eq!(e8m0(255), None);
    }
}
