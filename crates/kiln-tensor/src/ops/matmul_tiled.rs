//! The tiled matmul (`matmul_tiled.wgsl`: prefill and batched decode) and, on GPUs, its
//! split-K form: a product with too few tiles to fill the device splits k between several
//! workgroups a tile, whose partial products `matmul_split_sum.wgsl` adds up with the bias.
//! With [`Kernels::Experimental`](crate::Kernels::Experimental), on an adapter with 16 × 16
//! f16 cooperative matrices, the same product runs on them instead (`matmul_coop.wgsl`).

use bytemuck::{Pod, Zeroable};

use super::{flag, number, weight_defines};
use crate::gpu::{Access, KernelDef};
use crate::tensor::Storage;
use crate::{DType, Recorder, Result, Tensor, TensorError};

const R: Access = Access::Read;
const W: Access = Access::ReadWrite;

const TILED_SRC: &str = concat!(
    include_str!("../../wgsl/weights.wgsl"),
    include_str!("../../wgsl/matmul_tiled.wgsl")
);
const SPLIT_SUM_SRC: &str = include_str!("../../wgsl/matmul_split_sum.wgsl");
/// The cooperative-matrix form; its extension comes first, before any declaration.
pub(crate) const COOP_SRC: &str = concat!(
    "enable wgpu_cooperative_matrix;\n",
    include_str!("../../wgsl/weights.wgsl"),
    include_str!("../../wgsl/matmul_coop.wgsl")
);

static MATMUL_TILED: KernelDef = KernelDef {
    name: "matmul_tiled",
    source: TILED_SRC,
    bindings: &[R, R, W],
};
static MATMUL_TILED_BIAS: KernelDef = KernelDef {
    name: "matmul_tiled",
    source: TILED_SRC,
    bindings: &[R, R, W, R],
};
static MATMUL_COOP: KernelDef = KernelDef {
    name: "matmul_coop",
    source: COOP_SRC,
    bindings: &[R, R, W],
};
static MATMUL_COOP_BIAS: KernelDef = KernelDef {
    name: "matmul_coop",
    source: COOP_SRC,
    bindings: &[R, R, W, R],
};
static MATMUL_SPLIT_SUM: KernelDef = KernelDef {
    name: "matmul_split_sum",
    source: SPLIT_SUM_SRC,
    bindings: &[R, W],
};
static MATMUL_SPLIT_SUM_BIAS: KernelDef = KernelDef {
    name: "matmul_split_sum",
    source: SPLIT_SUM_SRC,
    bindings: &[R, W, R],
};

/// Rows and columns of Y a workgroup of `matmul_coop.wgsl` computes.
const COOP_TILE: usize = 32;

/// Columns of Y (rows of W) a workgroup of `matmul_tiled.wgsl` computes.
const TILED_COLS: usize = 64;

/// Rows of X a workgroup of `matmul_tiled.wgsl` computes (its `BM`): the least of 16, 32
/// and 64 that covers `m`, so a batch of a few rows does not pay for 64.
fn tiled_rows(m: usize) -> usize {
    match m {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    }
}

/// The least length of k one split-K workgroup sums: 16 slices of the tiled kernel's 16.
const SPLIT_K_MIN: usize = 256;

/// How the tiled kernel splits k for `tiles` tiles of a product of length `k` on a device
/// that splits below `target` workgroups (split-K: a 7B model's 4096-wide projections at
/// batch 64 make 64 tiles of 64 × 64 for an H200's 132 SMs): `(splits, length each)`, `(1,
/// k)` when the tiles reach the target or k is short. The length is a multiple of the
/// kernel's 16-wide slices, and every split gets some of k.
fn split_k(tiles: usize, k: usize, target: usize) -> (usize, usize) {
    if tiles >= target || k < 2 * SPLIT_K_MIN {
        return (1, k);
    }
    let want = target.div_ceil(tiles).min(k / SPLIT_K_MIN);
    let kc = k.div_ceil(want).next_multiple_of(16);
    (k.div_ceil(kc), kc)
}

/// Parameters of `matmul_tiled.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct TiledParams {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    splits: u32,
    kc: u32,
}

/// Parameters of `matmul_split_sum.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct SplitSumParams {
    m: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    splits: u32,
    _pad: [u32; 3],
}

impl Recorder {
    /// The tiled kernel over every chunk of `w` (with a bias, the only epilogue it has); on
    /// GPUs, a product of too few tiles to fill the device splits k (`split_k`) and sums the
    /// partial products in a second launch.
    pub(super) fn matmul_tiled(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<()> {
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: "matmul" });
        };
        let (m, k, n) = (x.rows(), x.cols(), w.rows());
        if let Some(sg) = self.gpu().and_then(|c| c.coop_subgroup()) {
            return self.matmul_coop(x, w, y, bias, sg);
        }
        let bm = tiled_rows(m);
        let target = self.gpu().map_or(0, |c| c.split_k_workgroups());
        for (ci, c) in chunks.iter().enumerate() {
            let tiles = m.div_ceil(bm) * c.rows.div_ceil(TILED_COLS);
            let (splits, kc) = split_k(tiles, k, target);
            let split = splits > 1;
            let mut defines = weight_defines(w.dtype(), 2);
            defines.push(("BIAS", flag(bias.is_some() && !split)));
            defines.push(("SPLIT", flag(split)));
            defines.push(("BM", number(bm)));
            let params = TiledParams {
                m: m as u32,
                k: k as u32,
                rows: c.rows as u32,
                n_total: n as u32,
                n_offset: c.row0 as u32,
                qs: c.qs_offset,
                splits: splits as u32,
                kc: kc as u32,
            };
            let groups = (tiles * splits) as u32;
            if !split {
                let mut bind = vec![(x.clone(), 0), (w.clone(), ci), (y.clone(), 0)];
                let kernel = match bias {
                    Some(b) => {
                        bind.push((b.clone(), 0));
                        &MATMUL_TILED_BIAS
                    }
                    None => &MATMUL_TILED,
                };
                self.dispatch(kernel, &defines, &params, bind, groups)?;
                continue;
            }
            let parts = self.output(DType::F32, &[splits, m, c.rows], "matmul_split_parts")?;
            let bind = vec![(x.clone(), 0), (w.clone(), ci), (parts.clone(), 0)];
            self.dispatch(&MATMUL_TILED, &defines, &params, bind, groups)?;
            let sum = SplitSumParams {
                m: m as u32,
                rows: c.rows as u32,
                n_total: n as u32,
                n_offset: c.row0 as u32,
                splits: splits as u32,
                _pad: [0; 3],
            };
            let mut bind = vec![(parts, 0), (y.clone(), 0)];
            let kernel = match bias {
                Some(b) => {
                    bind.push((b.clone(), 0));
                    &MATMUL_SPLIT_SUM_BIAS
                }
                None => &MATMUL_SPLIT_SUM,
            };
            let defines = [("BIAS", flag(bias.is_some()))];
            self.dispatch(
                kernel,
                &defines,
                &sum,
                bind,
                (m * c.rows).div_ceil(256) as u32,
            )?;
        }
        Ok(())
    }

    /// [`Recorder::matmul_tiled`] on cooperative matrices: tiles of 32 × 32, one subgroup of
    /// `sg` invocations a tile, no split of k (each tile's workgroup is small enough that
    /// the tiles fill the device).
    fn matmul_coop(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        bias: Option<&Tensor>,
        sg: u32,
    ) -> Result<()> {
        let Storage::Gpu { chunks, .. } = w.storage() else {
            return Err(TensorError::DeviceMismatch { op: "matmul" });
        };
        let (m, k, n) = (x.rows(), x.cols(), w.rows());
        for (ci, c) in chunks.iter().enumerate() {
            let mut defines = weight_defines(w.dtype(), 2);
            defines.push(("BIAS", flag(bias.is_some())));
            defines.push(("SG", number(sg as usize)));
            let params = TiledParams {
                m: m as u32,
                k: k as u32,
                rows: c.rows as u32,
                n_total: n as u32,
                n_offset: c.row0 as u32,
                qs: c.qs_offset,
                splits: 1,
                kc: k as u32,
            };
            let groups = (m.div_ceil(COOP_TILE) * c.rows.div_ceil(COOP_TILE)) as u32;
            let mut bind = vec![(x.clone(), 0), (w.clone(), ci), (y.clone(), 0)];
            let kernel = match bias {
                Some(b) => {
                    bind.push((b.clone(), 0));
                    &MATMUL_COOP_BIAS
                }
                None => &MATMUL_COOP,
            };
            self.dispatch(kernel, &defines, &params, bind, groups)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::spirv_check::{self, Needs, OP_COOP_MUL_ADD};

    /// Every variant of the cooperative matmul (weight dtype, bias, subgroup size) compiles
    /// to SPIR-V that `spirv-val` accepts, with the cooperative multiply-add in it: no CI
    /// adapter has cooperative matrices, so this is what runs before a GPU does.
    #[test]
    fn the_cooperative_matmul_compiles_to_valid_spirv_for_every_weight() {
        let needs = Needs {
            f16: true,
            subgroups: false,
            coop: true,
            int_dot: false,
        };
        for &dtype in super::super::WEIGHT_DTYPES {
            for bias in [false, true] {
                for sg in [32usize, 64] {
                    let mut defines = weight_defines(dtype, 2);
                    defines.push(("BIAS", flag(bias)));
                    defines.push(("SG", number(sg)));
                    let what = format!("matmul_coop {dtype:?} bias={bias} sg={sg}");
                    let words = spirv_check::to_spirv(COOP_SRC, &defines, needs)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(
                        spirv_check::has_op(&words, OP_COOP_MUL_ADD),
                        "{what}: no OpCooperativeMatrixMulAddKHR"
                    );
                    spirv_check::spirv_val(&words, &what).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }

    #[test]
    fn split_k_fills_the_device_only_where_the_tiles_do_not() {
        // Enough tiles, or too short a k: one workgroup a tile.
        let t = 256;
        assert_eq!(split_k(t, 4096, t), (1, 4096));
        assert_eq!(
            split_k(8, 2 * SPLIT_K_MIN - 16, t),
            (1, 2 * SPLIT_K_MIN - 16)
        );
        assert_eq!(split_k(8, 4096, 0), (1, 4096));
        // A 7B model's 4096-wide projections at batch 64: 64 tiles.
        assert_eq!(split_k(64, 4096, t), (4, 1024));
        assert_eq!(split_k(64, 11008, t), (4, 2752));
        assert_eq!(split_k(64, 11008, 128), (2, 5504));
        // Long enough splits, whole slices, every split some of k.
        for tiles in 1..300 {
            for k in (16..5000).step_by(44) {
                let (splits, kc) = split_k(tiles, k, t);
                if splits == 1 {
                    continue;
                }
                assert!(
                    kc % 16 == 0 && kc >= SPLIT_K_MIN,
                    "tiles {tiles} k {k}: {kc}"
                );
                assert!(
                    (splits - 1) * kc < k && splits * kc >= k,
                    "tiles {tiles} k {k}"
                );
                assert!(tiles * (splits - 1) < t, "tiles {tiles} k {k}");
            }
        }
    }
}
