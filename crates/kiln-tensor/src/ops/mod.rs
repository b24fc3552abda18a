//! Ops recorded on a [`Recorder`](crate::Recorder): validation, then either the CPU reference
//! (CPU backend) or a WGSL kernel launch (wgpu backend). One file per op family, each holding
//! its kernel definitions, typed launch function and CPU reference.

mod compress;
mod elementwise;
mod embedding;
mod hyper;
mod matmul;
mod matmul_code;
mod matmul_dp4a;
mod matmul_rows;
mod matmul_tiled;
mod moe;
mod moe_route;
mod paged;
mod rope;
mod rows;
pub mod sample;

pub use compress::{NO_ENTRY, PoolWindows};
#[cfg(test)]
pub(crate) use elementwise::glu_row;
pub use embedding::ColumnIndex;
pub use hyper::{HcConfig, HcWeights, MAX_STREAMS};
pub use matmul::{Activation, ClampLimit, LinearOps, RmsNorm};
pub use moe::{MAX_EXPERTS, MAX_EXPERTS_USED};
pub(crate) use moe::{RoutedX, expert_slots};
pub use moe_route::{Choice, Router, Routes};
pub use paged::{MappedRows, RowMap};
pub use rope::{RopeConfig, RopeLayout, RopePositions, RopeScaling, RopeTable, RotaryChannels};
pub(crate) use rows::rms_norm_row;

use std::borrow::Cow;

use crate::gpu::Access;
use crate::quant::BlockSums;
use crate::tensor::Storage;
use crate::{DType, Result, Tensor, TensorError};

/// Bindings of kernels that read `n` tensors and write one.
pub(crate) const R1W: &[Access] = &[Access::Read, Access::ReadWrite];
pub(crate) const R2W: &[Access] = &[Access::Read, Access::Read, Access::ReadWrite];
pub(crate) const R3W: &[Access] = &[Access::Read, Access::Read, Access::Read, Access::ReadWrite];

/// A kernel define: its name and value, the value borrowed where it is fixed, so recording a
/// launch allocates no string for it.
pub(crate) type Define = (&'static str, Cow<'static, str>);

/// A `0`/`1` switch's value.
pub(crate) fn flag(on: bool) -> Cow<'static, str> {
    Cow::Borrowed(if on { "1" } else { "0" })
}

/// A number's value (borrowed for the small ones launches give most).
pub(crate) fn number(n: usize) -> Cow<'static, str> {
    const SMALL: [&str; 17] = [
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
    ];
    SMALL
        .get(n)
        .map_or_else(|| Cow::Owned(n.to_string()), |s| Cow::Borrowed(*s))
}

/// Defines naming the subgroup specialisation of kernels that use `reduce.wgsl`, for
/// workgroups of `wg` invocations (a power of two, at most 256).
pub(crate) fn subgroup_defines(subgroups: bool, wg: u32) -> Vec<Define> {
    debug_assert!(wg.is_power_of_two() && wg <= 256);
    let mut d = subgroup_switch("SUBGROUPS", subgroups);
    d.push(("RED_WG", number(wg as usize)));
    d
}

/// The flag `name` set when `subgroups`, with the entry-point argument and lane expression
/// that go with it (`SG_ARG`, `SG_LANE`; no argument and lane 0 without).
pub(super) fn subgroup_switch(name: &'static str, subgroups: bool) -> Vec<Define> {
    if subgroups {
        vec![
            (name, flag(true)),
            (
                "SG_ARG",
                "@builtin(subgroup_invocation_id) sg_lane: u32,".into(),
            ),
            ("SG_LANE", "sg_lane".into()),
        ]
    } else {
        vec![
            (name, flag(false)),
            ("SG_ARG", "".into()),
            ("SG_LANE", "0u".into()),
        ]
    }
}

/// The dtypes matmul weights and embedding tables may have.
pub(crate) const WEIGHT_DTYPES: &[DType] = DType::WEIGHTS;

/// `(define, value)` switches selecting a weight dtype in `weights.wgsl` and
/// `matmul_rows.wgsl`: the dtype's own switch, the family switches (`W_FLOAT`, `W_QUANT`,
/// `W_SUB` for the formats decoded four elements at a time, `W_Q45_K`, `W_ZP` for the
/// zero-point formats, `W_Q4_DM` for the nibble formats with a `d|m` or `d|z` head word a
/// block), and for `matmul_rows.wgsl`: `HEAD1` for the formats with one head word a block,
/// `QSUM`/`NIB` ([`BlockSums`]), and `RD3`/`RD4`, how many 16-byte reads it makes a block.
/// Each is a fact of the dtype's row of the format table ([`Format`](crate::quant::Format)).
pub(crate) fn weight_defines(dtype: DType, binding: u32) -> Vec<Define> {
    let w = &dtype.format().wgsl;
    let mut d = Vec::with_capacity(32);
    d.push((w.define, flag(true)));
    d.push(("W_BINDING", number(binding as usize)));
    let family = if dtype.is_quantized() {
        "W_QUANT"
    } else {
        "W_FLOAT"
    };
    d.push((family, "1".into()));
    let switches = [
        ("W_SUB", w.sub),
        ("W_Q45_K", w.scale_mins),
        ("W_ZP", w.zero_point),
        ("W_Q4_DM", w.dm_word),
    ];
    d.extend(
        switches
            .into_iter()
            .filter(|s| s.1)
            .map(|(n, _)| (n, "1".into())),
    );
    d.push(("HEAD1", flag(w.head1)));
    d.push(("QSUM", flag(w.sums.summed())));
    d.push(("NIB", flag(w.sums == BlockSums::Nibbles)));
    d.push(("RD3", flag(w.reads >= 3)));
    d.push(("RD4", flag(w.reads >= 4)));
    d
}

pub(crate) fn require_dtype(
    op: &'static str,
    what: &'static str,
    t: &Tensor,
    ok: &[DType],
) -> Result<()> {
    if ok.contains(&t.dtype()) {
        Ok(())
    } else {
        Err(TensorError::DType {
            op,
            what,
            dtype: t.dtype(),
        })
    }
}

/// Host indices checked before anything is recorded: at least one, each below `limit`.
pub(crate) fn check_indices(
    op: &'static str,
    what: &'static str,
    ids: &[u32],
    limit: usize,
) -> Result<()> {
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= limit) {
        return Err(TensorError::OutOfRange {
            op,
            what,
            index: bad as usize,
            limit,
        });
    }
    if ids.is_empty() {
        return Err(TensorError::Invalid {
            op,
            detail: format!("no {what} given"),
        });
    }
    Ok(())
}

/// Activations the kernels bind whole: refused when split between bindings.
pub(crate) fn one_binding(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    match ts.iter().find(|t| t.chunk_count() > 1) {
        Some(t) => Err(TensorError::Invalid {
            op,
            detail: format!(
                "{:?} is split into {} bindings; this op binds its activations whole",
                t.shape(),
                t.chunk_count()
            ),
        }),
        None => Ok(()),
    }
}

pub(crate) fn require_same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.shape() == b.shape() {
        Ok(())
    } else {
        Err(TensorError::Shape {
            op,
            detail: format!("{:?} vs {:?}", a.shape(), b.shape()),
        })
    }
}

/// Row `row` of a CPU weight `[rows, k]` of any float or block dtype, as f32.
pub(crate) fn host_row(w: &Tensor, row: usize, out: &mut [f32]) -> Result<()> {
    let Storage::Cpu(h) = w.storage() else {
        return Err(TensorError::DeviceMismatch { op: "cpu" });
    };
    let k = w.cols();
    match w.dtype() {
        DType::F32 => out.copy_from_slice(&h.f32s()[row * k..(row + 1) * k]),
        DType::F16 => {
            let b = &h.bytes()[row * k * 2..(row + 1) * k * 2];
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            let b = &h.bytes()[row * k * 2..(row + 1) * k * 2];
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        d if d.is_quantized() => {
            let rb = k / d.block_elems() * d.block_bytes();
            crate::quant::dequantize(d, &h.bytes()[row * rb..(row + 1) * rb], out)?;
        }
        d => {
            return Err(TensorError::DType {
                op: "cpu",
                what: "weight rows",
                dtype: d,
            });
        }
    }
    Ok(())
}

/// Dot product with eight independent accumulators (vectorises, and is more accurate than one
/// running sum).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, ra) = a.split_at(a.len() / 8 * 8);
    let (cb, rb) = b.split_at(ca.len());
    for (x, y) in ca.chunks_exact(8).zip(cb.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}
