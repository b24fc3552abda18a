//! The native backend's matmul: X quantized once, weight rows split between the pool's
//! threads, each task one kernel call over its rows.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Mutex;

use rayon::prelude::*;

use super::dot::Rows;
use super::{CpuContext, QuantX, activation, dispatch};
use crate::ops::{Activation, RoutedX, dot, host_row, rms_norm_row};
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

/// What [`linear_native`] does around the products, as `Recorder::linear`'s ops say.
pub(crate) struct Fused<'a> {
    /// RMSNorm of X's rows first: the weight and epsilon.
    pub norm: Option<(&'a [f32], f32)>,
    pub bias: Option<&'a [f32]>,
    /// W is `[gate; up]`: Y is act(gate) · up, half as wide.
    pub glu: Option<Activation>,
    /// Added to Y, Y's shape.
    pub residual: Option<&'a [f32]>,
}

/// A matmul's buffers between X and Y, kept between calls ([`CpuContext`]'s).
#[derive(Default)]
pub(crate) struct LinearScratch {
    /// X quantized.
    quant_x: QuantX,
    /// X's rows normed.
    normed: Vec<f32>,
    /// The products by weight row, `[n][m]` (unused when `m` is 1 and no GLU follows: the
    /// products are then written into Y's row).
    by_row: Vec<f32>,
}

/// The most floats a kept buffer of [`LinearScratch`] holds past a call (16 MiB): a long
/// prompt's are given back.
const KEEP_FLOATS: usize = 4 << 20;

impl LinearScratch {
    fn trim(&mut self) {
        for v in [&mut self.normed, &mut self.by_row] {
            if v.capacity() > KEEP_FLOATS {
                *v = Vec::new();
            }
        }
    }
}

/// Y = epilogue(norm(X) · Wᵀ) for `m` rows of X (f32, `k` = W's columns wide) into `y`,
/// `[m][n]` (`n/2` wide with a GLU), each step on the pool and each element as the reference
/// computes it.
pub(crate) fn linear_native(
    ctx: &CpuContext,
    x: &[f32],
    m: usize,
    w: &Tensor,
    fused: &Fused<'_>,
    y: &mut [f32],
) -> Result<()> {
    linear_rows(ctx, x, m, w, 0..w.rows(), fused, y)
}

/// The routed matmul (`Recorder::linear_routed`): for each expert that has slots, their
/// input rows gathered (row `slot / x.step` of `x`), multiplied by the expert's rows of `w`
/// (`[experts, n, k]`) as [`linear_native`] does, with the expert's row of `bias`, each
/// expert's weight read once, and the products scattered to the slots' rows of `y`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_routed_native(
    ctx: &CpuContext,
    x: RoutedX<'_>,
    w: &Tensor,
    bias: Option<&[f32]>,
    groups: &[u32],
    experts: usize,
    glu: Option<Activation>,
    y: &mut [f32],
) -> Result<()> {
    let (n, k) = (w.shape()[1], w.cols());
    let width = if glu.is_some() { n / 2 } else { n };
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    let mut read = 0;
    for e in 0..experts {
        let slots = crate::ops::expert_slots(groups, experts, e);
        if slots.is_empty() {
            continue;
        }
        read += 1;
        let fused = Fused {
            norm: None,
            bias: bias.map(|b| &b[e * n..(e + 1) * n]),
            glu,
            residual: None,
        };
        xs.clear();
        for &s in slots {
            let r = s as usize / x.step;
            xs.extend_from_slice(&x.x[r * k..(r + 1) * k]);
        }
        ys.resize(slots.len() * width, 0.0);
        linear_rows(
            ctx,
            &xs,
            slots.len(),
            w,
            e * n..(e + 1) * n,
            &fused,
            &mut ys,
        )?;
        for (&s, out) in slots.iter().zip(ys.chunks_exact(width)) {
            let s = s as usize;
            y[s * width..(s + 1) * width].copy_from_slice(out);
        }
    }
    let expert_bytes = w.dtype().stored().bytes_for(n * k).unwrap_or(0) as u64;
    ctx.routed.add(read, experts as u64, expert_bytes);
    Ok(())
}

/// [`linear_native`] over rows `rows` of `w`.
fn linear_rows(
    ctx: &CpuContext,
    x: &[f32],
    m: usize,
    w: &Tensor,
    rows: Range<usize>,
    fused: &Fused<'_>,
    y: &mut [f32],
) -> Result<()> {
    let (n, k) = (rows.len(), w.cols());
    ctx.linear.with(|scratch| {
        let LinearScratch {
            quant_x,
            normed,
            by_row,
        } = &mut *scratch;
        let x = match fused.norm {
            Some((g, eps)) => {
                normed.resize(x.len(), 0.0);
                ctx.pool().install(|| {
                    normed
                        .par_chunks_mut(k)
                        .zip(x.par_chunks(k))
                        .for_each(|(o, row)| rms_norm_row(row, g, eps, o));
                });
                &normed[..]
            }
            None => x,
        };
        let r = if m == 1 && fused.glu.is_none() {
            // Y's one row is the products.
            products(ctx, x, m, w, rows.start, quant_x, y).map(|()| one_row(y, fused))
        } else {
            by_row.resize(n * m, 0.0);
            products(ctx, x, m, w, rows.start, quant_x, by_row)
                .map(|()| epilogue(ctx, by_row, m, n, fused, y))
        };
        scratch.trim();
        r
    })
}

/// X · Wᵀ by weight row into `by_row` (`[n][m]`), for the `n` rows of W from `row0`, split
/// between the pool's threads.
fn products(
    ctx: &CpuContext,
    x: &[f32],
    m: usize,
    w: &Tensor,
    row0: usize,
    qx: &mut QuantX,
    by_row: &mut [f32],
) -> Result<()> {
    let Storage::Cpu(h) = w.storage() else {
        return Err(TensorError::DeviceMismatch { op: "matmul" });
    };
    let (n, k) = (by_row.len() / m, w.cols());
    let dtype = w.dtype();
    let chunk = rows_per_task(n, ctx.threads());
    match &dtype.format().ints {
        Some(ints) if k.is_multiple_of(32) => {
            ctx.pool().install(|| qx.fill(x, m, k));
            let f = dtype.format();
            let row_bytes = k / f.block_elems * f.block_bytes;
            let isa = ctx.isa();
            let qx = &*qx;
            ctx.pool().install(|| {
                by_row
                    .par_chunks_mut(chunk * m)
                    .enumerate()
                    .for_each(|(c, out)| {
                        let r0 = row0 + c * chunk;
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
                                if let Err(e) = host_row(w, row0 + c * chunk + r, &mut row) {
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
    Ok(())
}

/// Rows of Y a task of the epilogue: the products of a weight row for them are read as one
/// run, and each of the rows is written in order.
const Y_ROWS: usize = 16;

thread_local! {
    /// [`Y_ROWS`] rows of `X · Wᵀ + bias`, before the GLU and the residual.
    static Y: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The bias and the residual on Y's one row, the products themselves (no GLU).
fn one_row(y: &mut [f32], fused: &Fused<'_>) {
    if let Some(b) = fused.bias {
        y.iter_mut().zip(b).for_each(|(v, b)| *v += b);
    }
    if let Some(r) = fused.residual {
        y.iter_mut().zip(r).for_each(|(v, r)| *v += r);
    }
}

/// Y `[m][n]` (`n/2` wide with a GLU) from the products by weight row `[n][m]`: the bias,
/// then the GLU, then the residual, a task a few rows of Y (without a GLU the products are
/// transposed straight into Y's rows).
fn epilogue(
    ctx: &CpuContext,
    by_row: &[f32],
    m: usize,
    n: usize,
    fused: &Fused<'_>,
    y: &mut [f32],
) {
    let width = if fused.glu.is_some() { n / 2 } else { n };
    let residual = |i: usize, out: &mut [f32]| {
        if let Some(r) = fused.residual {
            out.iter_mut()
                .zip(&r[i * width..])
                .for_each(|(v, r)| *v += r);
        }
    };
    // Y's row `i` from its `[gate; up]` row.
    let gated = |act, i: usize, row: &[f32], out: &mut [f32]| {
        activation::glu(row, act, out);
        residual(i, out);
    };
    if m == 1
        && fused.bias.is_none()
        && let Some(act) = fused.glu
    {
        // The products are Y's one `[gate; up]` row.
        gated(act, 0, by_row, y);
        return;
    }
    ctx.pool().install(|| {
        y.par_chunks_mut(Y_ROWS * width)
            .enumerate()
            .for_each(|(c, ys)| {
                let (i0, rows) = (c * Y_ROWS, ys.len() / width);
                let Some(act) = fused.glu else {
                    // Y's rows are the products' rows: transposed straight into them.
                    transpose(by_row, m, n, i0, ys, fused.bias);
                    for (r, out) in ys.chunks_exact_mut(width).enumerate() {
                        residual(i0 + r, out);
                    }
                    return;
                };
                Y.with(|t| {
                    let mut t = t.borrow_mut();
                    t.resize(rows * n, 0.0);
                    transpose(by_row, m, n, i0, &mut t, fused.bias);
                    for (r, (row, out)) in t
                        .chunks_exact(n)
                        .zip(ys.chunks_exact_mut(width))
                        .enumerate()
                    {
                        gated(act, i0 + r, row, out);
                    }
                })
            });
    });
}

/// Columns of the products a step of [`transpose`]: their rows for a task's rows of Y (a few
/// KiB) stay in L1 while each of those rows is written.
const COLS: usize = 64;

/// Rows `i0..` of `X · Wᵀ + bias` (as many as `out` holds, `n` wide) from the products by
/// weight row (`[n][m]`), a block of columns at a time.
fn transpose(by_row: &[f32], m: usize, n: usize, i0: usize, out: &mut [f32], bias: Option<&[f32]>) {
    for j0 in (0..n).step_by(COLS) {
        let block = &by_row[j0 * m..(j0 + COLS).min(n) * m];
        for (r, row) in out.chunks_exact_mut(n).enumerate() {
            let dst = &mut row[j0..j0 + block.len() / m];
            for (d, col) in dst.iter_mut().zip(block.chunks_exact(m)) {
                *d = col[i0 + r];
            }
            if let Some(b) = bias {
                dst.iter_mut().zip(&b[j0..]).for_each(|(d, b)| *d += b);
            }
        }
    }
}
