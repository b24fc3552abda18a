//! `embedding`: gather rows of a table of any float or GGUF block dtype by token id.

use bytemuck::{Pod, Zeroable};

use super::{R2W, WEIGHT_DTYPES, host_row, require_dtype, weight_defines};
use crate::gpu::KernelDef;
use crate::tensor::Storage;
use crate::{DType, Recorder, Result, Tensor, TensorError};

const SRC: &str = concat!(
    include_str!("../../wgsl/weights.wgsl"),
    include_str!("../../wgsl/embedding.wgsl")
);
static EMBEDDING: KernelDef = KernelDef {
    name: "embedding",
    source: SRC,
    bindings: R2W,
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    n_ids: u32,
    k: u32,
    row0: u32,
    rows: u32,
    total_rows: u32,
    qs: u32,
    first: u32,
    _pad: u32,
}

impl Recorder {
    /// Rows `table[ids[t]]` as an F32 `[ids.len(), dim]` tensor. Every id must be below the
    /// table's row count.
    pub fn embedding(&mut self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        const OP: &str = "embedding";
        require_dtype(OP, "the table", table, WEIGHT_DTYPES)?;
        self.check_device(OP, &[table])?;
        if table.shape().len() != 2 {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!("table must be [rows, dim], got {:?}", table.shape()),
            });
        }
        let (rows, k) = (table.rows(), table.cols());
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= rows) {
            return Err(TensorError::OutOfRange {
                op: OP,
                what: "token id",
                index: bad as usize,
                limit: rows,
            });
        }
        if ids.is_empty() || k == 0 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: "no ids or an empty table".into(),
            });
        }
        let shape = vec![ids.len(), k];
        let Some(ctx) = self.gpu().cloned() else {
            return Ok(Tensor::cpu_f32(shape, embedding_ref(table, ids)?));
        };
        let ids_t = Tensor::from_u32(&self.device().clone(), &[ids.len()], ids)?;
        let out = Tensor::gpu_output(&ctx, DType::F32, shape, OP)?;
        let Storage::Gpu { chunks, .. } = table.storage() else {
            return Err(TensorError::DeviceMismatch { op: OP });
        };
        let defines = weight_defines(table.dtype(), 2);
        for (ci, c) in chunks.iter().enumerate() {
            // Skip chunks that no id falls in.
            if !ids
                .iter()
                .any(|&i| (c.row0..c.row0 + c.rows).contains(&(i as usize)))
            {
                continue;
            }
            let params = Params {
                n_ids: ids.len() as u32,
                k: k as u32,
                row0: c.row0 as u32,
                rows: c.rows as u32,
                total_rows: rows as u32,
                qs: c.qs_offset,
                first: u32::from(ci == 0),
                _pad: 0,
            };
            let groups = (ids.len() * k).div_ceil(64) as u32;
            self.dispatch(
                &EMBEDDING,
                &defines,
                &params,
                vec![(ids_t.clone(), 0), (table.clone(), ci), (out.clone(), 0)],
                groups,
            )?;
        }
        Ok(out)
    }
}

/// CPU reference.
pub(crate) fn embedding_ref(table: &Tensor, ids: &[u32]) -> Result<Vec<f32>> {
    let k = table.cols();
    let mut out = vec![0f32; ids.len() * k];
    for (t, &id) in ids.iter().enumerate() {
        host_row(table, id as usize, &mut out[t * k..(t + 1) * k])?;
    }
    Ok(out)
}
