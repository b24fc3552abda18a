//! The native backend's matmul: X quantized once, weight rows split between the pool's
//! threads, each task one kernel call over its rows.

use std::cell::RefCell;
use std::sync::Mutex;

use rayon::prelude::*;

use super::dot::Rows;
use super::{CpuContext, dispatch};
use crate::ops::{dot, host_row};
use crate::tensor::Storage;
use crate::{Result, Tensor, TensorError};

thread_local! {
    /// A float weight's row, dequantized.
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows of W a task takes: about four tasks a thread, so that threads finishing early take
/// more.
fn rows_per_task(n: usize, threads: usize) -> usize {
    n.div_ceil(threads * 4).max(1)
}

/// Y = X · Wᵀ (+ bias) for `m` rows of X (f32, `k` = W's columns wide): `[m][n]`.
pub(crate) fn linear_native(
    ctx: &CpuContext,
    x: &[f32],
    m: usize,
    w: &Tensor,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let Storage::Cpu(h) = w.storage() else {
        return Err(TensorError::DeviceMismatch { op: "matmul" });
    };
    let (n, k) = (w.rows(), w.cols());
    let dtype = w.dtype();
    let chunk = rows_per_task(n, ctx.threads());
    // Products by weight row: `[n][m]`.
    let mut by_row = vec![0f32; n * m];
    match &dtype.format().ints {
        Some(ints) if k.is_multiple_of(32) => {
            let mut qx = ctx.quant_x.lock().unwrap_or_else(|p| p.into_inner());
            qx.fill(x, m, k);
            let f = dtype.format();
            let row_bytes = k / f.block_elems * f.block_bytes;
            let isa = ctx.isa();
            let qx = &*qx;
            ctx.pool().install(|| {
                by_row
                    .par_chunks_mut(chunk * m)
                    .enumerate()
                    .for_each(|(c, out)| {
                        let r0 = c * chunk;
                        let rows = Rows {
                            dtype,
                            ints,
                            block_bytes: f.block_bytes,
                            groups_per_block: f.block_elems / 32,
                            row_bytes,
                            w: &h.bytes()[r0 * row_bytes..(r0 + out.len() / m) * row_bytes],
                        };
                        dispatch::rows(isa, &rows, qx, out);
                    });
            });
        }
        _ => {
            // Float weights: each row widened to f32 once, dotted with every row of X.
            let err = Mutex::new(None);
            ctx.pool().install(|| {
                by_row
                    .par_chunks_mut(chunk * m)
                    .enumerate()
                    .for_each(|(c, out)| {
                        ROW.with(|row| {
                            let mut row = row.borrow_mut();
                            row.resize(k, 0.0);
                            for (r, o) in out.chunks_exact_mut(m).enumerate() {
                                if let Err(e) = host_row(w, c * chunk + r, &mut row) {
                                    *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                                    return;
                                }
                                for (i, v) in o.iter_mut().enumerate() {
                                    *v = dot(&x[i * k..(i + 1) * k], &row);
                                }
                            }
                        })
                    });
            });
            if let Some(e) = err.into_inner().unwrap_or_else(|p| p.into_inner()) {
                return Err(e);
            }
        }
    }
    Ok(transpose(ctx, by_row, m, n, bias))
}

/// Rows of Y at a time in the transpose: the products of a weight row for them are read as
/// one run, and each of the rows is written in order.
const Y_ROWS: usize = 16;

/// Y `[m][n]` from the products by weight row `[n][m]`, plus the bias, on the pool.
fn transpose(
    ctx: &CpuContext,
    mut by_row: Vec<f32>,
    m: usize,
    n: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    if m == 1 {
        if let Some(b) = bias {
            by_row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
        return by_row;
    }
    let mut y = vec![0f32; m * n];
    ctx.pool().install(|| {
        y.par_chunks_mut(Y_ROWS * n)
            .enumerate()
            .for_each(|(c, ys)| {
                let i0 = c * Y_ROWS;
                for (j, col) in by_row.chunks_exact(m).enumerate() {
                    let b = bias.map_or(0.0, |b| b[j]);
                    for (r, &v) in ys.chunks_exact_mut(n).zip(&col[i0..]) {
                        r[j] = v + b;
                    }
                }
            });
    });
    y
}
