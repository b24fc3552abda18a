//! The CPU-adapter matmul (`matmul_rows.wgsl`, for block dtypes on lavapipe-like adapters):
//! whole weight rows per invocation, X through a uniform binding in groups of rows, with
//! every part of `linear` fused; `matmul_code.rs` writes the code it is specialised with.

use bytemuck::{Pod, Zeroable};

use super::matmul::{Epilogue, RmsNorm, U, epilogue_defines, family};
use super::matmul_code::{ROWS_R, rows_accumulators, rows_x_broadcast};
use super::{number, weight_defines};
use crate::gpu::{GpuContext, KernelDef};
use crate::recorder::Bind;
use crate::tensor::Storage;
use crate::{Recorder, Result, Tensor, TensorError};

const ROWS_SRC: &str = concat!(
    include_str!("../../wgsl/glu.wgsl"),
    include_str!("../../wgsl/matmul_rows.wgsl")
);
static MATMUL_ROWS: [[KernelDef; 2]; 4] = family(
    [
        ["matmul_rows", "matmul_rows_norm"],
        ["matmul_rows", "matmul_rows_norm"],
        ["matmul_rows_add", "matmul_rows_add_norm"],
        ["matmul_rows_gated", "matmul_rows_gated_norm"],
    ],
    ROWS_SRC,
    U,
    U,
);
/// Parameters of `matmul_rows.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RowsParams {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    x_row0: u32,
    n1: u32,
    eps: f32,
    _pad: [u32; 3],
}
/// Rows of X one launch of the CPU-adapter kernel takes at most.
const ROWS_MAX_M: usize = 16;
/// Invocations per workgroup of the CPU-adapter kernel: one 8-lane SIMD batch, so that small
/// matrices split evenly over the worker threads (576 rows: 9 workgroups of 64 rows instead
/// of 5 of 128, of which one of two threads ran 3; lavapipe matvec 1536x576 Q4_1 about 20%
/// faster, measured both ways round).
const ROWS_WG: usize = 8;

impl Recorder {
    /// Launch `matmul_rows.wgsl` over `x`'s rows in groups of `group`, writing `y`.
    pub(super) fn matmul_rows(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        epi: Epilogue<'_>,
        norm: Option<RmsNorm<'_>>,
        group: usize,
    ) -> Result<()> {
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: "matmul" });
        };
        let (m, k) = (x.rows(), x.cols());
        let row_bytes = (k * 4) as u64;
        let gated = matches!(epi, Epilogue::Gated(_));
        let n_total = y.cols();
        let kernel = &MATMUL_ROWS[epi.index()][usize::from(norm.is_some())];
        let sg_x = rows_x_broadcast(self.gpu().map(|c| c.info()));
        for (ci, c) in chunks.iter().enumerate() {
            let rows = if gated { c.rows / 2 } else { c.rows };
            let mut i0 = 0;
            while i0 < m {
                let mg = group.min(m - i0);
                let mut defines = weight_defines(w.dtype(), 2);
                epilogue_defines(&mut defines, epi, norm.is_some());
                defines.push(("MV_M", number(mg)));
                defines.push(("R", number(ROWS_R)));
                defines.push(("WG", number(ROWS_WG)));
                defines.push(("XV", number(mg * k / 4)));
                defines.push(("GV", number(k / 4)));
                let qsum = w.dtype().format().wgsl.sums.summed();
                defines.extend(rows_accumulators(mg, ROWS_R, gated, norm.is_some(), qsum));
                defines.extend(sg_x.iter().cloned());
                let params = RowsParams {
                    m: mg as u32,
                    k: k as u32,
                    rows: rows as u32,
                    n_total: n_total as u32,
                    n_offset: c.row0 as u32,
                    qs: c.qs_offset,
                    x_row0: i0 as u32,
                    n1: rows as u32,
                    eps: norm.map_or(0.0, |n| n.eps),
                    _pad: [0; 3],
                };
                let mut bind = vec![
                    Bind {
                        tensor: x.clone(),
                        chunk: 0,
                        range: Some((i0 as u64 * row_bytes, mg as u64 * row_bytes)),
                    },
                    (w.clone(), ci).into(),
                    (y.clone(), 0).into(),
                ];
                match epi {
                    Epilogue::Bias(t) | Epilogue::Residual(t) => bind.push((t.clone(), 0).into()),
                    Epilogue::None | Epilogue::Gated(_) => {}
                }
                if let Some(n) = norm {
                    bind.push((n.weight.clone(), 0).into());
                }
                let groups = rows.div_ceil(ROWS_WG * ROWS_R) as u32;
                self.dispatch_binds(kernel, &defines, &params, bind, groups)?;
                i0 += mg;
            }
        }
        Ok(())
    }
}

/// Rows of X per launch of the CPU-adapter kernel (`matmul_rows.wgsl`), or `None` when that
/// kernel does not apply: a GPU adapter, a float weight or a format it does not read, or X
/// rows that do not fit a uniform binding at an aligned offset.
pub(super) fn rows_group(ctx: &GpuContext, w: &Tensor, m: usize, k: usize) -> Option<usize> {
    let reads = w.dtype().format().wgsl.reads;
    if !ctx.cpu_shaped_kernels() || !w.dtype().is_quantized() || reads == 0 {
        return None;
    }
    if !k.is_multiple_of(32) {
        return None;
    }
    let row_bytes = (k * 4) as u64;
    let fit = (ctx.max_uniform_binding() / row_bytes) as usize;
    let group = fit.min(ROWS_MAX_M);
    if group == 0 {
        return None;
    }
    // Later launches bind X at an offset of whole groups, which must be aligned.
    if m > group && !(group as u64 * row_bytes).is_multiple_of(ctx.uniform_align()) {
        return None;
    }
    Some(group)
}
