//! Device selection: the wgpu product path, the native CPU backend, or the plain CPU
//! reference every kernel is tested against.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::cpu::{CpuContext, Isa};
use crate::gpu::GpuContext;
use crate::{Result, TensorError};

/// Which backend to use (`--backend auto|wgpu|cpu|reference`, env `KILN_BACKEND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// The best GPU adapter (discrete > integrated > virtual), else the native CPU backend:
    /// CPU-type adapters (lavapipe, SwiftShader) only by [`BackendChoice::Wgpu`].
    #[default]
    Auto,
    /// A wgpu adapter (CPU-type ones included) or an error.
    Wgpu,
    /// The native CPU backend: SIMD integer dot products over 8-bit activations, threads.
    Cpu,
    /// The plain CPU reference, the oracle of every kernel (tests, debugging).
    Reference,
}

/// `auto`, `wgpu` (or `gpu`), `cpu` or `reference`, any case; empty (as in `KILN_BACKEND=`)
/// is `auto`.
impl FromStr for BackendChoice {
    type Err = TensorError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Self::Auto),
            "wgpu" | "gpu" => Ok(Self::Wgpu),
            "cpu" => Ok(Self::Cpu),
            "reference" => Ok(Self::Reference),
            other => Err(TensorError::UnknownBackend(other.to_string())),
        }
    }
}

impl BackendChoice {
    /// The choice named by env `KILN_BACKEND`, or `Auto` when unset.
    pub fn from_env() -> Result<Self> {
        match std::env::var("KILN_BACKEND") {
            Ok(v) => v.parse(),
            Err(_) => Ok(Self::Auto),
        }
    }
}

/// Which GPU kernels a device may run (`--kernels tested|experimental`, env `KILN_KERNELS`).
///
/// A kernel is `Tested` once `kiln-bench gpu-check` has checked it against the CPU reference on
/// a real GPU; until then it runs only where a user opts in, so a user's GPU is never the first
/// place a kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    #[default]
    Tested,
    /// Also the kernels not yet checked on a real GPU: today the cooperative-matrix (tensor
    /// core) matmul, where the adapter multiplies 16 × 16 f16 tiles into f32. Opening the
    /// device then enables wgpu's experimental features.
    Experimental,
}

/// `tested` or `experimental`, any case; empty is `tested`.
impl FromStr for Kernels {
    type Err = TensorError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tested" | "" => Ok(Self::Tested),
            "experimental" => Ok(Self::Experimental),
            other => Err(TensorError::UnknownKernels(other.to_string())),
        }
    }
}

impl Kernels {
    /// The set named by env `KILN_KERNELS`, or `Tested` when unset.
    pub fn from_env() -> Result<Self> {
        match std::env::var("KILN_KERNELS") {
            Ok(v) => v.parse(),
            Err(_) => Ok(Self::Tested),
        }
    }
}

/// How to open a device.
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    pub backend: BackendChoice,
    /// Request `SHADER_F16` when the adapter has it (kernels fall back without it).
    pub allow_shader_f16: bool,
    /// Request `SUBGROUP` when the adapter has it (kernels fall back without it).
    pub allow_subgroups: bool,
    /// Split tensors into bindings of at most this many bytes even if the device allows more
    /// (tests use it to exercise the split path on small tensors).
    pub max_binding_bytes: Option<u64>,
    /// Time every kernel launch with timestamp queries (wgpu, when the adapter has
    /// `TIMESTAMP_QUERY`); read with [`Device::profile`]. Each submit then waits for the
    /// device, so use it to find where the time goes, not to measure throughput.
    pub profile: bool,
    /// Kernel shapes: `None` picks by adapter type (CPU-type adapters such as lavapipe get
    /// kernels shaped for SIMD-across-invocations compilers, GPUs the subgroup and tiled
    /// ones); `Some(_)` forces one family (tests use it to run both on one adapter).
    pub cpu_shaped_kernels: Option<bool>,
    /// The matrix-vector kernel's layout for every weight; `None` picks one per weight
    /// ([`MatvecShape::choose`]). `kiln-bench gpu-check` times the alternatives with it.
    pub matvec_shape: Option<MatvecShape>,
    /// Tiles of the tiled matmul below which a GPU splits k between several workgroups a
    /// tile; `None` takes the default ([`DEFAULT_SPLIT_K_WORKGROUPS`]), `Some(0)` never
    /// splits. CPU-type adapters never split.
    pub split_k_workgroups: Option<u32>,
    /// Threads of the native CPU backend's pool (`--threads`); `None` is one a core.
    pub threads: Option<usize>,
    /// The highest instruction set the native CPU backend may use; `None` reads env
    /// `KILN_CPU_ISA` (`scalar|avx2|avx512`), else takes the best the CPU has.
    pub cpu_isa: Option<Isa>,
    /// Which GPU kernels may run ([`Kernels`]).
    pub kernels: Kernels,
}

/// Threads [`MatvecShape::choose`] puts to work on a GPU.
pub const MATVEC_GPU_THREADS: usize = 65536;

/// [`DeviceOptions::split_k_workgroups`]'s default.
pub const DEFAULT_SPLIT_K_WORKGROUPS: u32 = 256;

/// How `matmul_vec.wgsl` (decode's matmul, a few rows of X) spreads a weight over a
/// workgroup of 64 invocations: `threads_per_row` of them split each row's length, and each
/// computes `rows_per_thread` rows with the X it loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatvecShape {
    pub threads_per_row: u32,
    pub rows_per_thread: u32,
}

impl MatvecShape {
    /// The layout for a weight of `rows` output rows (a gated weight's gate rows): 8
    /// threads a row and one row a thread where invocations are a CPU's SIMD lanes. On GPUs,
    /// a warp of 32 threads a row, and 4 rows a thread (each X load serves them all) where
    /// that still puts [`MATVEC_GPU_THREADS`] threads to work, else one: on an H200, 4 rows a
    /// thread took a 7B model's 12288- and 11008-row weights from 121 and 107 to 59 and 75 µs
    /// a launch, and its 4096-row weights (whose threads also walk the longest rows) from 44
    /// to 75 µs.
    pub fn choose(cpu_shaped: bool, rows: usize) -> Self {
        if cpu_shaped {
            return Self {
                threads_per_row: 8,
                rows_per_thread: 1,
            };
        }
        let t = 32;
        let r = if rows.div_ceil(4) * t >= MATVEC_GPU_THREADS {
            4
        } else {
            1
        };
        Self {
            threads_per_row: t as u32,
            rows_per_thread: r as u32,
        }
    }

    /// Output rows one workgroup computes.
    pub fn rows_per_workgroup(self) -> u32 {
        64 / self.threads_per_row * self.rows_per_thread
    }

    /// Checks the shape fits the kernel: threads a row a power of two from 1 to 64, rows a
    /// thread 1 to 8.
    pub fn validate(self) -> Result<()> {
        let t = self.threads_per_row;
        let detail = if !(t.is_power_of_two() && t <= 64) {
            format!("threads per row {t}: expected a power of two up to 64")
        } else if !(1..=8).contains(&self.rows_per_thread) {
            format!("rows per thread {}: expected 1 to 8", self.rows_per_thread)
        } else {
            return Ok(());
        };
        Err(TensorError::Invalid {
            op: "DeviceOptions::matvec_shape",
            detail,
        })
    }
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            allow_shader_f16: true,
            allow_subgroups: true,
            max_binding_bytes: None,
            profile: false,
            cpu_shaped_kernels: None,
            matvec_shape: None,
            split_k_workgroups: None,
            threads: None,
            cpu_isa: None,
            kernels: Kernels::Tested,
        }
    }
}

/// Device time per kernel, gathered with timestamp queries since the device opened or the
/// last [`Device::reset_profile`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// Submits (one per recorded step).
    pub submits: u64,
    /// Kernel launches over all submits.
    pub dispatches: u64,
    /// Per kernel name, sorted by total time, longest first.
    pub kernels: Vec<KernelTime>,
}

/// One kernel's launches and their summed device time.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub launches: u64,
    pub total_ns: f64,
}

impl Profile {
    /// Summed device time of every launch.
    pub fn total_ns(&self) -> f64 {
        self.kernels.iter().map(|k| k.total_ns).sum()
    }
}

/// Host time spent on submits since the device opened or the last
/// [`Device::reset_host_stats`]: what a step costs the CPU before the device runs it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Submits that launched at least one kernel.
    pub submits: u64,
    /// Kernel launches over those submits.
    pub dispatches: u64,
    /// From each submit's first recorded launch to the `submit` call: the ops' host work
    /// (validation, uploads of per-step inputs, recording).
    pub record_ns: u64,
    /// Inside `submit`: parameters, bind groups, encoding and the queue submit (never the
    /// device's own work, which `submit` does not wait for).
    pub encode_ns: u64,
    /// Bind groups made, and those found in the cache, over those submits.
    pub bind_groups_made: u64,
    pub bind_groups_reused: u64,
}

impl HostStats {
    /// Host milliseconds per submit, recording and encoding together.
    pub fn ms_per_submit(&self) -> f64 {
        (self.record_ns + self.encode_ns) as f64 / 1e6 / self.submits.max(1) as f64
    }
}

/// What the device is and can do, for logs and `kiln info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `cpu` (native), `reference`, or the wgpu backend name (`vulkan`, `metal`, `dx12`).
    pub backend: String,
    /// Adapter name (`llvmpipe (LLVM 15.0.6, 256 bits)` for lavapipe).
    pub name: String,
    /// `discrete`, `integrated`, `virtual`, `cpu`, `other`.
    pub device_type: String,
    pub driver: String,
    pub shader_f16: bool,
    pub subgroups: bool,
    /// Smallest and largest subgroup size the adapter reports (0 when subgroups are off).
    pub subgroup_size: (u32, u32),
    /// The cooperative-matrix (tensor core) configurations the adapter reports, whether or
    /// not the device uses them.
    pub cooperative_matrix: Vec<crate::gpu::CoopConfig>,
    /// The tiled matmul runs on cooperative matrices (`matmul_coop.wgsl`; only with
    /// [`Kernels::Experimental`]).
    pub coop_matmul: bool,
    /// Decode's Q8_0 and Q4_0 matmuls take the integer dot product kernel
    /// (`matmul_vec_dp4a.wgsl`; only with [`Kernels::Experimental`]).
    pub dp4a_matvec: bool,
    pub max_storage_binding_bytes: u64,
    pub max_buffer_bytes: u64,
    pub max_workgroups_per_dim: u32,
    /// The native CPU backend's instruction set (`avx512`, `avx2`, `scalar`); empty elsewhere.
    pub cpu_isa: String,
    /// The native CPU backend's threads; 0 elsewhere.
    pub threads: usize,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.threads > 0 {
            let plural = if self.threads == 1 { "" } else { "s" };
            return write!(
                f,
                "{} ({}), {} SIMD, {} thread{plural}",
                self.name, self.backend, self.cpu_isa, self.threads
            );
        }
        write!(
            f,
            "{} ({}, {}), f16={}, subgroups={} {:?}, max binding {} MiB, max buffer {} MiB",
            self.name,
            self.backend,
            self.device_type,
            self.shader_f16,
            self.subgroups,
            self.subgroup_size,
            self.max_storage_binding_bytes >> 20,
            self.max_buffer_bytes >> 20
        )?;
        if self.coop_matmul {
            write!(f, ", cooperative matmul (experimental)")?;
        }
        if self.dp4a_matvec {
            write!(f, ", integer dot product matvec (experimental)")?;
        }
        Ok(())
    }
}

/// A compute device: wgpu, the native CPU backend, or the CPU reference. Cheap to clone.
///
/// The two CPU devices share host storage: a tensor made on one is valid on the other, so a
/// test can run the same weights through both.
#[derive(Clone)]
pub enum Device {
    /// The plain CPU reference: every op written as simply as it can be, single-threaded.
    Reference,
    /// The native CPU backend (see [`BackendChoice::Cpu`]).
    Cpu(Arc<CpuContext>),
    Wgpu(Arc<GpuContext>),
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Reference => f.write_str("Device::Reference"),
            Device::Cpu(c) => write!(f, "Device::Cpu({}, {} threads)", c.isa(), c.threads()),
            Device::Wgpu(g) => write!(f, "Device::Wgpu({})", g.info().name),
        }
    }
}

impl Device {
    /// Open a device as `opts` asks.
    pub fn new(opts: &DeviceOptions) -> Result<Self> {
        match opts.backend {
            BackendChoice::Reference => Ok(Device::Reference),
            BackendChoice::Cpu => Self::native_cpu(opts),
            BackendChoice::Wgpu => Ok(Device::Wgpu(Arc::new(GpuContext::new(opts)?))),
            BackendChoice::Auto => match GpuContext::new(opts) {
                Ok(g) => Ok(Device::Wgpu(Arc::new(g))),
                Err(e) => {
                    tracing::info!("{e}; serving on the native CPU backend");
                    Self::native_cpu(opts)
                }
            },
        }
    }

    fn native_cpu(opts: &DeviceOptions) -> Result<Self> {
        Ok(Device::Cpu(Arc::new(CpuContext::new(opts)?)))
    }

    /// The CPU reference backend.
    pub fn reference() -> Self {
        Device::Reference
    }

    /// The native CPU backend with its defaults (a thread a core, the best ISA env
    /// `KILN_CPU_ISA` allows).
    pub fn cpu() -> Result<Self> {
        Self::native_cpu(&DeviceOptions::default())
    }

    /// What this device is.
    pub fn info(&self) -> DeviceInfo {
        match self {
            Device::Wgpu(g) => g.info().clone(),
            Device::Cpu(c) => DeviceInfo {
                backend: "cpu".into(),
                name: "kiln native CPU".into(),
                cpu_isa: c.isa().name().into(),
                threads: c.threads(),
                ..Self::host_info()
            },
            Device::Reference => Self::host_info(),
        }
    }

    fn host_info() -> DeviceInfo {
        DeviceInfo {
            backend: "reference".into(),
            name: "kiln CPU reference".into(),
            device_type: "cpu".into(),
            driver: String::new(),
            shader_f16: false,
            subgroups: false,
            subgroup_size: (0, 0),
            cooperative_matrix: Vec::new(),
            coop_matmul: false,
            dp4a_matvec: false,
            max_storage_binding_bytes: u64::MAX,
            max_buffer_bytes: u64::MAX,
            max_workgroups_per_dim: u32::MAX,
            cpu_isa: String::new(),
            threads: 0,
        }
    }

    /// The kernel profile when the device was opened with [`DeviceOptions::profile`] and the
    /// adapter supports timestamp queries; `None` otherwise.
    pub fn profile(&self) -> Option<Profile> {
        match self {
            Device::Wgpu(g) => g.profile(),
            Device::Reference | Device::Cpu(_) => None,
        }
    }

    /// Clear the kernel profile (after a warm-up, say).
    pub fn reset_profile(&self) {
        if let Device::Wgpu(g) = self {
            g.reset_profile();
        }
    }

    /// Host time of the submits so far (`None` on the CPU backend, where ops run as they are
    /// recorded).
    pub fn host_stats(&self) -> Option<HostStats> {
        match self {
            Device::Wgpu(g) => Some(g.host_stats()),
            Device::Reference | Device::Cpu(_) => None,
        }
    }

    /// What the routed products read of their experts since the last call (then cleared),
    /// on the native CPU backend (`None` elsewhere: a GPU groups the slots on the device).
    pub fn take_routed_stats(&self) -> Option<crate::cpu::RoutedStats> {
        match self {
            Device::Cpu(c) => Some(c.routed.take()),
            Device::Reference | Device::Wgpu(_) => None,
        }
    }

    /// Clear [`Device::host_stats`].
    pub fn reset_host_stats(&self) {
        if let Device::Wgpu(g) = self {
            g.reset_host_stats();
        }
    }

    /// Whether kernels take the shapes meant for CPU-type adapters (see
    /// [`DeviceOptions::cpu_shaped_kernels`]); false on the CPU backend, which runs no kernels.
    pub fn cpu_shaped_kernels(&self) -> bool {
        match self {
            Device::Wgpu(g) => g.cpu_shaped_kernels(),
            Device::Reference | Device::Cpu(_) => false,
        }
    }

    /// True for the two CPU backends (native and reference), whose tensors live in host
    /// memory.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Reference | Device::Cpu(_))
    }

    /// The native CPU backend's context, when this is it.
    pub(crate) fn native(&self) -> Option<&Arc<CpuContext>> {
        match self {
            Device::Cpu(c) => Some(c),
            _ => None,
        }
    }

    /// Runs `f` where this device's ops start fastest: on the native CPU backend, on one of
    /// its pool's threads, so that every op's parallel loop inside `f` is split among threads
    /// that are already awake instead of handed over to the pool and waited for (on two cores
    /// that handover, two thread switches an op, cost a tenth of a decode step). Elsewhere `f`
    /// runs here. A model step is the unit to wrap.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            Device::Cpu(c) => c.step(f),
            Device::Reference | Device::Wgpu(_) => f(),
        }
    }

    /// Block until all submitted device work is done (no-op on the CPU).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Reference | Device::Cpu(_) => Ok(()),
            Device::Wgpu(g) => g.wait(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_parse() {
        assert_eq!(
            "auto".parse::<BackendChoice>().unwrap(),
            BackendChoice::Auto
        );
        assert_eq!(
            "WGPU".parse::<BackendChoice>().unwrap(),
            BackendChoice::Wgpu
        );
        assert_eq!("cpu".parse::<BackendChoice>().unwrap(), BackendChoice::Cpu);
        assert_eq!(
            "Reference".parse::<BackendChoice>().unwrap(),
            BackendChoice::Reference
        );
        let e = "cuda".parse::<BackendChoice>().unwrap_err().to_string();
        assert!(
            e.contains("cuda") && e.contains("auto, wgpu, cpu, reference"),
            "{e}"
        );
    }
}
