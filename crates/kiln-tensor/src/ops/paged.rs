//! Rows of one sequence inside a tensor, consecutive or through a block table (a paged pool,
//! as kiln-kv's block tables lay it out): what the ops that read a sequence's cached rows
//! take.

use crate::Tensor;

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
