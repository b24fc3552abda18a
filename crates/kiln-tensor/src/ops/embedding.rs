//! Gathers: `embedding` (rows of a table of any float or block dtype by token id) and
//! `gather_cols` (columns of an F32 activation by a [`ColumnIndex`] built at load time:
//! activation-order GPTQ checkpoints permute a layer's input features).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use super::{R2W, WEIGHT_DTYPES, check_indices, host_row, require_dtype, weight_defines};
use crate::gpu::KernelDef;
use crate::tensor::{Shape, Storage};
use crate::{DType, Device, Recorder, Result, Tensor, TensorError};

const SRC: &str = concat!(
    include_str!("../../wgsl/weights.wgsl"),
    include_str!("../../wgsl/embedding.wgsl")
);
static EMBEDDING: KernelDef = KernelDef {
    name: "embedding",
    source: SRC,
    bindings: R2W,
};
static GATHER_COLS: KernelDef = KernelDef {
    name: "gather_cols",
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
        check_indices(OP, "token id", ids, rows)?;
        if k == 0 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: "an empty table".into(),
            });
        }
        let shape = [ids.len(), k];
        let Some(ctx) = self.gpu().cloned() else {
            return Tensor::host_f32_with(&shape, |out| embedding_ref(table, ids, out));
        };
        let ids_t = Tensor::from_u32(&self.device().clone(), &[ids.len()], ids)?;
        let out = Tensor::gpu_output(&ctx, DType::F32, &shape, OP)?;
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

/// CPU reference: the rows `ids` of `table`, into `out`.
pub(crate) fn embedding_ref(table: &Tensor, ids: &[u32], out: &mut [f32]) -> Result<()> {
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(table.cols())) {
        host_row(table, id as usize, o)?;
    }
    Ok(())
}

/// Column indices checked against the width of the tensors they will gather from, and
/// uploaded once (they are built at load time and used every step). Checking here, not in
/// [`Recorder::gather_cols`], needs no read-back of the device copy, and a bad index fails
/// before anything is recorded.
#[derive(Debug, Clone)]
pub struct ColumnIndex {
    source_cols: usize,
    host: Arc<[u32]>,
    uploaded: Option<Tensor>,
}

impl ColumnIndex {
    /// `idx[i]` is the source column of output column `i`; every index must be below
    /// `source_cols`. Repeats and omissions are allowed (a permutation is the usual case).
    pub fn new(device: &Device, idx: &[u32], source_cols: usize) -> Result<Self> {
        check_indices("gather_cols", "column index", idx, source_cols)?;
        let uploaded = if device.is_cpu() {
            None
        } else {
            Some(Tensor::from_u32(device, &[idx.len()], idx)?)
        };
        Ok(Self {
            source_cols,
            host: idx.into(),
            uploaded,
        })
    }

    /// Output columns.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Always false: an index holds at least one column.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The width of the tensors this index gathers from.
    pub fn source_cols(&self) -> usize {
        self.source_cols
    }

    pub fn indices(&self) -> &[u32] {
        &self.host
    }
}

impl Recorder {
    /// Y[r, i] = X[r, idx[i]]: X is F32 `[.., k]` with k = `idx.source_cols()`, Y is F32
    /// `[.., idx.len()]`.
    pub fn gather_cols(&mut self, x: &Tensor, idx: &ColumnIndex) -> Result<Tensor> {
        const OP: &str = "gather_cols";
        require_dtype(OP, "the input", x, &[DType::F32])?;
        self.check_device(OP, &[x])?;
        match &idx.uploaded {
            Some(t) => self.check_device(OP, &[t])?,
            None if !self.device().is_cpu() => return Err(TensorError::DeviceMismatch { op: OP }),
            None => {}
        }
        let (m, k, n) = (x.rows(), x.cols(), idx.len());
        if k != idx.source_cols || m == 0 {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "input {:?} for an index over {} columns",
                    x.shape(),
                    idx.source_cols
                ),
            });
        }
        let mut shape = Shape::from(x.shape());
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        let (Some(ctx), Some(t)) = (self.gpu().cloned(), &idx.uploaded) else {
            let xs = x.host_f32()?;
            return Tensor::host_f32_with(&shape, |out| {
                gather_cols_ref(xs, k, &idx.host, out);
                Ok(())
            });
        };
        // Activations are op outputs, one binding each; a chunked input would be read wrong.
        if x.chunk_count() != 1 {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("input {:?} spans {} bindings", x.shape(), x.chunk_count()),
            });
        }
        let y = Tensor::gpu_output(&ctx, DType::F32, &shape, OP)?;
        let params = Params {
            n_ids: n as u32,
            k: k as u32,
            row0: 0,
            rows: m as u32,
            total_rows: m as u32,
            qs: 0,
            first: 0,
            _pad: 0,
        };
        let mut defines = weight_defines(DType::F32, 2);
        defines.push(("COLS", "1".into()));
        self.dispatch(
            &GATHER_COLS,
            &defines,
            &params,
            vec![(t.clone(), 0), (x.clone(), 0), (y.clone(), 0)],
            (m * n).div_ceil(64) as u32,
        )?;
        Ok(y)
    }
}

/// CPU reference of `gather_cols`: rows of `x` (`k` wide) gathered by `idx`.
pub(crate) fn gather_cols_ref(x: &[f32], k: usize, idx: &[u32], out: &mut [f32]) {
    for (row, o) in x.chunks_exact(k).zip(out.chunks_exact_mut(idx.len())) {
        for (o, &i) in o.iter_mut().zip(idx) {
            *o = row[i as usize];
        }
    }
}
