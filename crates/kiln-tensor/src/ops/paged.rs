//! Rows of one sequence inside a tensor, consecutive or through a block table (a paged pool,
//! as kiln-kv's block tables lay it out): what the ops that read a sequence's cached rows
//! take; and [`Recorder::write_rows`], which puts a step's rows into such a pool in place.

use bytemuck::{Pod, Zeroable};

use super::{R2W, one_binding, require_dtype};
use crate::gpu::KernelDef;
use crate::{DType, Recorder, Result, Tensor, TensorError};

static WRITE_ROWS: KernelDef = KernelDef {
    name: "write_rows",
    source: include_str!("../../wgsl/write_rows.wgsl"),
    bindings: R2W,
};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct WriteParams {
    /// Values written: rows × cols.
    n: u32,
    cols: u32,
    _pad: [u32; 2],
}

impl Recorder {
    /// Writes the rows of `src` (F32 `[n, cols]`) over rows `rows` of `dst` (F32
    /// `[_, cols]`, one binding), in place: how a step puts what it computed into a pool (a
    /// paged cache's rows). On wgpu in the step's command stream, so that what reads `dst`
    /// later in it reads them; on the CPU backends at once, where `dst` must be its storage's
    /// only handle (a clone would otherwise see, or not see, the write).
    pub fn write_rows(&mut self, dst: &mut Tensor, rows: &[u32], src: &Tensor) -> Result<()> {
        const OP: &str = "write_rows";
        require_dtype(OP, "the pool", dst, &[DType::F32])?;
        require_dtype(OP, "the rows", src, &[DType::F32])?;
        self.check_device(OP, &[dst, src])?;
        one_binding(OP, &[dst, src])?;
        if dst.shares_storage(src) {
            return Err(TensorError::Invalid {
                op: OP,
                detail: "the rows are a view of the pool itself".into(),
            });
        }
        let cols = dst.cols();
        if src.cols() != cols || src.rows() != rows.len() || src.shape().len() != 2 {
            return Err(TensorError::Shape {
                op: OP,
                detail: format!(
                    "{} rows {:?} into a pool {:?}",
                    rows.len(),
                    src.shape(),
                    dst.shape()
                ),
            });
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= dst.rows()) {
            return Err(TensorError::OutOfRange {
                op: OP,
                what: "pool row",
                index: r as usize,
                limit: dst.rows(),
            });
        }
        let mut sorted = rows.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(TensorError::Invalid {
                op: OP,
                detail: format!("row {} written twice in one call", w[0]),
            });
        }
        if rows.is_empty() {
            return Ok(());
        }
        if self.gpu().is_none() {
            let values = src.host_f32()?.to_vec();
            let pool = dst.host_f32_mut().ok_or_else(|| TensorError::Invalid {
                op: OP,
                detail: "the pool is shared with another tensor: a pool keeps one handle".into(),
            })?;
            for (&r, row) in rows.iter().zip(values.chunks_exact(cols)) {
                let at = r as usize * cols;
                pool[at..at + cols].copy_from_slice(row);
            }
            return Ok(());
        }
        let device = self.device().clone();
        let ids = Tensor::from_u32(&device, &[rows.len()], rows)?;
        let n = rows.len() * cols;
        let params = WriteParams {
            n: n as u32,
            cols: cols as u32,
            _pad: [0; 2],
        };
        self.dispatch(
            &WRITE_ROWS,
            &[] as &[(&str, &str)],
            &params,
            vec![(src.clone(), 0), (ids, 0), (dst.clone(), 0)],
            n.div_ceil(64) as u32,
        )
    }
}

/// Which row of its tensor holds a sequence's item `i` (a position's row, or an entry).
#[derive(Debug, Clone, Copy)]
pub enum RowMap<'a> {
    /// Row `i - first`: the items from `first` lie consecutively.
    Consecutive,
    /// Row `table[i / block] * block + i % block`: a pool of blocks of `block` rows and the
    /// sequence's block table (`u32::MAX` for a block it gave back).
    Paged { table: &'a [u32], block: u32 },
}

impl RowMap<'_> {
    /// The row of item `i` of items laid out from `first`; `None` where the table has no
    /// block for it.
    pub fn row(self, first: u32, i: u32) -> Option<usize> {
        match self {
            RowMap::Consecutive => i.checked_sub(first).map(|r| r as usize),
            RowMap::Paged { block: 0, .. } => None,
            RowMap::Paged { table, block } => {
                let b = *table.get((i / block) as usize)?;
                (b != u32::MAX).then(|| b as usize * block as usize + (i % block) as usize)
            }
        }
    }

    /// The first of `items` (laid out from `first`) without a row below `rows`.
    pub fn missing(
        self,
        first: u32,
        rows: usize,
        mut items: impl Iterator<Item = u32>,
    ) -> Option<u32> {
        items.find(|&i| self.row(first, i).is_none_or(|r| r >= rows))
    }

    /// Appends the table to a kernel's index buffer: `(block, where the table starts)`;
    /// `(0, 0)` for consecutive rows, which need none.
    pub fn append_table(self, index: &mut Vec<u32>) -> (u32, u32) {
        match self {
            RowMap::Consecutive => (0, 0),
            RowMap::Paged { table, block } => {
                let at = index.len() as u32;
                index.extend_from_slice(table);
                (block, at)
            }
        }
    }

    /// In words, for errors.
    pub fn describe(self) -> String {
        match self {
            RowMap::Consecutive => "consecutive rows".into(),
            RowMap::Paged { table, block } => {
                format!("a table of {} blocks of {block} rows", table.len())
            }
        }
    }
}

/// `count` items of a sequence in `rows` (`[rows, width]`), as `map` lays them out from 0.
#[derive(Debug, Clone, Copy)]
pub struct MappedRows<'a> {
    pub rows: &'a Tensor,
    pub count: u32,
    pub map: RowMap<'a>,
}

impl<'a> MappedRows<'a> {
    /// Every row of `rows`, in order.
    pub fn consecutive(rows: &'a Tensor) -> Self {
        Self {
            rows,
            count: rows.rows() as u32,
            map: RowMap::Consecutive,
        }
    }

    /// The first item without a row of the tensor, if any.
    pub fn missing(&self) -> Option<u32> {
        self.map.missing(0, self.rows.rows(), 0..self.count)
    }
}
