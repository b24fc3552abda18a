//! The kernels not yet checked on a real GPU ([`Kernels::Experimental`]) and what they need
//! from the adapter: today the cooperative-matrix matmul (`matmul_coop.wgsl`), 16 × 16 f16
//! tiles multiplied into f32 by one subgroup.
//!
//! wgpu exposes cooperative matrices as an experimental feature, which a device requests only
//! with [`wgpu::ExperimentalFeatures::enabled`]: its contract is that experimental features
//! may have bugs wgpu has not found. That is the contract `--kernels experimental` states to
//! the user, so this is the one place the GPU side opens it.

#![allow(unsafe_code)]

use crate::device::Kernels;

/// One cooperative-matrix configuration the adapter reports: `m × k` A times `k × n` B
/// into `m × n` C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoopConfig {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Element type of A and B, and of C and the result (`f16`, `f32`, `i8`, ...).
    pub ab: &'static str,
    pub cr: &'static str,
}

impl std::fmt::Display for CoopConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}x{}x{} {}->{}",
            self.m, self.n, self.k, self.ab, self.cr
        )
    }
}

/// The configuration `matmul_coop.wgsl` is written for.
pub const COOP_F16_16: CoopConfig = CoopConfig {
    m: 16,
    n: 16,
    k: 16,
    ab: "f16",
    cr: "f32",
};

fn scalar_name(t: wgpu::wgt::CooperativeScalarType) -> &'static str {
    use wgpu::wgt::CooperativeScalarType as S;
    match t {
        S::F32 => "f32",
        S::F16 => "f16",
        S::I32 => "i32",
        S::U32 => "u32",
    }
}

/// The configurations `adapter` reports (empty without the feature).
pub(crate) fn coop_configs(adapter: &wgpu::Adapter) -> Vec<CoopConfig> {
    if !adapter
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        return Vec::new();
    }
    adapter
        .cooperative_matrix_properties()
        .iter()
        .map(|p| CoopConfig {
            m: p.m_size,
            n: p.n_size,
            k: p.k_size,
            ab: scalar_name(p.ab_type),
            cr: scalar_name(p.cr_type),
        })
        .collect()
}

/// What the device opens with for the experimental kernels: the feature to request, the
/// token that allows it, and the subgroup size `matmul_coop.wgsl` is specialised for.
pub(crate) struct Opened {
    pub features: wgpu::Features,
    pub token: wgpu::ExperimentalFeatures,
    /// `Some(subgroup size)` when the cooperative matmul can run.
    pub coop_subgroup: Option<u32>,
}

/// The experimental kernels this device can run: none unless `kernels` opts in; the
/// cooperative matmul where the adapter has the feature, 16 × 16 f16 into f32, f16 shaders
/// (`f16`) and one subgroup size (the kernel's workgroup is one subgroup).
pub(crate) fn open(
    kernels: Kernels,
    adapter: &wgpu::Adapter,
    f16: bool,
    subgroups: (u32, u32),
) -> Opened {
    let none = Opened {
        features: wgpu::Features::empty(),
        token: wgpu::ExperimentalFeatures::disabled(),
        coop_subgroup: None,
    };
    if kernels != Kernels::Experimental {
        return none;
    }
    let configs = coop_configs(adapter);
    let fixed = subgroups.0 == subgroups.1 && subgroups.0 > 0;
    if !(f16 && fixed && configs.contains(&COOP_F16_16)) {
        tracing::warn!(
            "--kernels experimental: no cooperative matmul on this adapter (f16 shaders {f16}, \
             subgroup sizes {:?}, configurations [{}]; it needs f16, one subgroup size and {COOP_F16_16})",
            subgroups,
            configs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        return none;
    }
    Opened {
        features: wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        // wgpu's contract for experimental features: they may have bugs wgpu has not found,
        // reachable from safe calls. The user accepted that by choosing the experimental set.
        // SAFETY: the user opted in (`--kernels experimental`); only the coop matmul uses it.
        token: unsafe { wgpu::ExperimentalFeatures::enabled() },
        coop_subgroup: Some(subgroups.0),
    }
}
