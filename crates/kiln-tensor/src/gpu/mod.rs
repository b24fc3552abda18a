//! The wgpu side: adapter selection, device, buffer pool, pipeline cache.

mod binds;
mod experimental;
mod pool;
#[cfg(test)]
pub(crate) mod spirv_check;
mod template;

pub use experimental::{COOP_F16_16, CoopConfig};

pub use template::TemplateError;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) use binds::{BindCache, BindKey};
use pool::BufferPool;
pub(crate) use pool::GpuBuffer;

use crate::device::{BackendChoice, DeviceInfo, DeviceOptions, HostStats, KernelTime, Profile};
use crate::{Result, TensorError};

/// Bytes of one op's parameter slot in the step's uniform buffer (the largest params struct
/// fits; offsets are multiples of this, which is a multiple of every adapter's uniform offset
/// alignment).
pub(crate) const PARAM_SLOT: u64 = 256;

/// Usage of every tensor buffer: storage for kernels, uniform for [`Access::Uniform`]
/// bindings, copies for read-back and KV moves.
/// A launch's keyed defines (as [`template::keyed`] gives them) and its pipeline.
type KnownLaunch = (Vec<(String, String)>, Arc<Pipeline>);

/// Uploads up to this size come from the buffer pool (see [`GpuContext::upload`]).
const POOLED_UPLOAD: u64 = 64 << 10;

const TENSOR_USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::UNIFORM)
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// How a kernel binding is accessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    ReadWrite,
    /// Read through a uniform buffer binding (a fixed-size array in the kernel, at most
    /// [`GpuContext::max_uniform_binding`] bytes). Compilers for CPU-type adapters turn
    /// workgroup-uniform reads of it into one broadcast load instead of a per-lane gather.
    Uniform,
}

/// A kernel: WGSL source with entry point `main`, its params uniform at `@binding(0)` and its
/// storage bindings at 1, 2, ... in the order of `bindings`. Crates built on `kiln-tensor`
/// define their own kernels this way and launch them with [`Recorder::launch`].
///
/// The source may use the template step: `#if NAME` / `#else` / `#endif` and `{{NAME}}`, filled
/// from the defines given at launch; `F16` is true when the device has `SHADER_F16` (and
/// `enable f16;` is then prepended). Launches are linear: rebuild the workgroup index as
/// `wid.x + wid.y * nwg.x` (large launches spill into `y`) and ignore indices past the work.
///
/// [`Recorder::launch`]: crate::Recorder::launch
#[derive(Debug)]
pub struct KernelDef {
    pub name: &'static str,
    pub source: &'static str,
    pub bindings: &'static [Access],
}

/// Launch counts and device nanoseconds per kernel name.
#[derive(Debug, Default)]
pub(crate) struct Profiler {
    submits: u64,
    kernels: HashMap<&'static str, (u64, f64)>,
}

/// A compiled pipeline with its bind group layout.
#[derive(Debug)]
pub(crate) struct Pipeline {
    pub name: String,
    /// The kernel's name without its specialisation (for profiles).
    pub kernel: &'static str,
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// The wgpu device, queue and everything cached on them.
#[derive(Debug)]
pub struct GpuContext {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    info: DeviceInfo,
    max_binding: u64,
    max_uniform: u64,
    uniform_align: u64,
    cpu_shaped: bool,
    matvec: Option<crate::device::MatvecShape>,
    split_k: u32,
    /// The subgroup size `matmul_coop.wgsl` runs with, where it runs ([`Kernels::Experimental`]
    /// on an adapter with 16 × 16 f16 cooperative matrices).
    ///
    /// [`Kernels::Experimental`]: crate::Kernels::Experimental
    coop_subgroup: Option<u32>,
    /// Decode's Q8_0 and Q4_0 matmuls take the integer dot product kernel
    /// ([`Kernels::Experimental`]; `dot4I8Packed` runs everywhere, natively where the device
    /// has integer dot products).
    ///
    /// [`Kernels::Experimental`]: crate::Kernels::Experimental
    dp4a: bool,
    pub(crate) pool: Arc<BufferPool>,
    pipelines: Mutex<HashMap<String, Arc<Pipeline>>>,
    /// The same pipelines found without building their key: by a hash of the kernel and its
    /// defines in the order a launch site gives them, checked against those defines (a
    /// launch records ~15 of them; formatting and sorting a key cost more than the rest of
    /// recording it).
    recent: Mutex<rustc_hash::FxHashMap<u64, KnownLaunch>>,
    /// Per-kernel device time when profiling (timestamp queries available and asked for).
    profiler: Option<Mutex<Profiler>>,
    layouts: Mutex<HashMap<Vec<Access>, wgpu::BindGroupLayout>>,
    /// The op-parameter buffer and bind groups submits reuse, and their host time.
    pub(crate) binds: Mutex<BindCache>,
}

fn type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

fn type_name(t: wgpu::DeviceType) -> &'static str {
    match t {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Cpu => "cpu",
        wgpu::DeviceType::Other => "other",
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned cache only means another thread panicked mid-insert; the map is still valid.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl GpuContext {
    /// Pick the best adapter and open a device on it.
    pub(crate) fn new(opts: &DeviceOptions) -> Result<Self> {
        debug_assert!(matches!(
            opts.backend,
            BackendChoice::Auto | BackendChoice::Wgpu
        ));
        // Vulkan, Metal, DX12 (GL lacks what the kernels need); `WGPU_BACKEND` overrides.
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::PRIMARY;
        let desc = desc.with_env();
        let backends = desc.backends;
        let instance = wgpu::Instance::new(desc);
        let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
        adapters.retain(|a| {
            a.get_downlevel_capabilities()
                .flags
                .contains(wgpu::DownlevelFlags::COMPUTE_SHADERS)
        });
        // `auto` wants a GPU: a CPU-type adapter is slower than the native CPU backend.
        if opts.backend == BackendChoice::Auto {
            adapters.retain(|a| a.get_info().device_type != wgpu::DeviceType::Cpu);
        }
        adapters.sort_by_key(|a| type_rank(a.get_info().device_type));
        let adapter = adapters.into_iter().next().ok_or_else(|| {
            TensorError::NoAdapter(if opts.backend == BackendChoice::Auto {
                "no GPU adapter with compute shaders".into()
            } else {
                "no adapter with compute shaders (on Linux, install Mesa's Vulkan drivers for lavapipe)".into()
            })
        })?;
        let ainfo = adapter.get_info();
        let have = adapter.features();
        let mut features = wgpu::Features::empty();
        if opts.allow_shader_f16 && have.contains(wgpu::Features::SHADER_F16) {
            features |= wgpu::Features::SHADER_F16;
        }
        if opts.allow_subgroups && have.contains(wgpu::Features::SUBGROUP) {
            features |= wgpu::Features::SUBGROUP;
        }
        let profile = opts.profile && have.contains(wgpu::Features::TIMESTAMP_QUERY);
        if opts.profile && !profile {
            tracing::warn!("the adapter has no timestamp queries: kernel profiling is off");
        }
        if profile {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        let adapter_subgroups = (ainfo.subgroup_min_size, ainfo.subgroup_max_size);
        let experimental = experimental::open(
            opts.kernels,
            &adapter,
            features.contains(wgpu::Features::SHADER_F16),
            adapter_subgroups,
        );
        features |= experimental.features;
        // Take the adapter's own limits: the defaults cap buffers at 256 MiB.
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kiln"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: experimental.token,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|source| TensorError::DeviceRequest {
            adapter: ainfo.name.clone(),
            source,
        })?;
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| {
            tracing::error!("uncaptured wgpu error: {e}");
        }));
        let subgroups = features.contains(wgpu::Features::SUBGROUP);
        let max_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size)
            .min(opts.max_binding_bytes.unwrap_or(u64::MAX));
        let max_uniform = limits.max_uniform_buffer_binding_size;
        let uniform_align = u64::from(limits.min_uniform_buffer_offset_alignment);
        let info = DeviceInfo {
            backend: ainfo.backend.to_string(),
            name: ainfo.name.clone(),
            device_type: type_name(ainfo.device_type).into(),
            driver: format!("{} {}", ainfo.driver, ainfo.driver_info)
                .trim()
                .to_string(),
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups,
            subgroup_size: if subgroups { adapter_subgroups } else { (0, 0) },
            cooperative_matrix: experimental::coop_configs(&adapter),
            coop_matmul: experimental.coop_subgroup.is_some(),
            dp4a_matvec: opts.kernels == crate::Kernels::Experimental,
            max_storage_binding_bytes: max_binding,
            max_buffer_bytes: limits.max_buffer_size,
            max_workgroups_per_dim: limits.max_compute_workgroups_per_dimension,
            cpu_isa: String::new(),
            threads: 0,
        };
        tracing::info!("wgpu device: {info}");
        let cpu_shaped = opts
            .cpu_shaped_kernels
            .unwrap_or(ainfo.device_type == wgpu::DeviceType::Cpu);
        let matvec = opts.matvec_shape;
        if let Some(m) = matvec {
            m.validate()?;
        }
        let split_k = match opts.split_k_workgroups {
            _ if cpu_shaped => 0,
            Some(w) => w,
            None => crate::device::DEFAULT_SPLIT_K_WORKGROUPS,
        };
        Ok(Self {
            device,
            queue,
            info,
            max_binding,
            max_uniform,
            uniform_align,
            cpu_shaped,
            matvec,
            split_k,
            coop_subgroup: experimental.coop_subgroup,
            dp4a: opts.kernels == crate::Kernels::Experimental,
            pool: Arc::new(BufferPool::default()),
            pipelines: Mutex::default(),
            recent: Mutex::default(),
            profiler: profile.then(Mutex::default),
            layouts: Mutex::default(),
            binds: Mutex::default(),
        })
    }

    pub(crate) fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Largest byte size one binding (and so one tensor chunk) may have.
    pub(crate) fn max_binding(&self) -> u64 {
        self.max_binding
    }

    /// Largest byte size of one uniform binding ([`Access::Uniform`]).
    pub fn max_uniform_binding(&self) -> u64 {
        self.max_uniform
    }

    /// Required alignment of a uniform binding's offset into its buffer.
    pub(crate) fn uniform_align(&self) -> u64 {
        self.uniform_align
    }

    /// Whether kernels take the shapes for CPU implementations (lavapipe, SwiftShader, WARP),
    /// whose compilers run invocations as SIMD lanes: by default when the adapter is one.
    pub(crate) fn cpu_shaped_kernels(&self) -> bool {
        self.cpu_shaped
    }

    /// The matrix-vector kernel's layout for a weight of `rows` rows
    /// ([`crate::DeviceOptions::matvec_shape`], else [`crate::MatvecShape::choose`]).
    pub(crate) fn matvec_shape(&self, rows: usize) -> crate::device::MatvecShape {
        self.matvec
            .unwrap_or_else(|| crate::device::MatvecShape::choose(self.cpu_shaped, rows))
    }

    /// Tiles below which the tiled matmul splits k ([`crate::DeviceOptions::split_k_workgroups`]).
    /// Whether decode's Q8_0 and Q4_0 matmuls take the integer dot product kernel.
    pub(crate) fn dp4a(&self) -> bool {
        self.dp4a
    }

    /// The subgroup size of the cooperative matmul, where this device runs it.
    pub(crate) fn coop_subgroup(&self) -> Option<u32> {
        self.coop_subgroup
    }

    pub(crate) fn split_k_workgroups(&self) -> usize {
        self.split_k as usize
    }

    pub(crate) fn profiling(&self) -> bool {
        self.profiler.is_some()
    }

    /// Add one submit's launches (kernel name, device ns each).
    pub(crate) fn record_profile(&self, launches: &[(&'static str, f64)]) {
        if let Some(p) = &self.profiler {
            let mut p = lock(p);
            p.submits += 1;
            for (name, ns) in launches {
                let e = p.kernels.entry(name).or_default();
                e.0 += 1;
                e.1 += ns;
            }
        }
    }

    pub(crate) fn profile(&self) -> Option<Profile> {
        let p = lock(self.profiler.as_ref()?);
        let mut kernels: Vec<KernelTime> = p
            .kernels
            .iter()
            .map(|(name, (launches, ns))| KernelTime {
                name: (*name).to_string(),
                launches: *launches,
                total_ns: *ns,
            })
            .collect();
        kernels.sort_by(|a, b| b.total_ns.total_cmp(&a.total_ns));
        Some(Profile {
            submits: p.submits,
            dispatches: kernels.iter().map(|k| k.launches).sum(),
            kernels,
        })
    }

    pub(crate) fn host_stats(&self) -> HostStats {
        lock(&self.binds).stats
    }

    pub(crate) fn reset_host_stats(&self) {
        lock(&self.binds).stats = HostStats::default();
    }

    /// Bind groups cached for reuse (for tests and diagnostics).
    pub fn cached_bind_groups(&self) -> usize {
        lock(&self.binds).len()
    }

    pub(crate) fn reset_profile(&self) {
        if let Some(p) = &self.profiler {
            *lock(p) = Profiler::default();
        }
    }

    /// Block until all submitted work has finished.
    pub(crate) fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(TensorError::gpu("wait"))
    }

    fn layout(&self, access: &[Access]) -> wgpu::BindGroupLayout {
        let mut layouts = lock(&self.layouts);
        if let Some(l) = layouts.get(access) {
            return l.clone();
        }
        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: None,
            },
            count: None,
        }];
        for (i, a) in access.iter().enumerate() {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: i as u32 + 1,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match a {
                        Access::Uniform => wgpu::BufferBindingType::Uniform,
                        _ => wgpu::BufferBindingType::Storage {
                            read_only: *a == Access::Read,
                        },
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        let l = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("kiln bind group layout"),
                entries: &entries,
            });
        layouts.insert(access.to_vec(), l.clone());
        l
    }

    /// The pipeline for `kernel` specialised by `defines`, compiled once and cached under a key
    /// naming every specialisation axis.
    pub(crate) fn pipeline<V: AsRef<str>>(
        &self,
        kernel: &KernelDef,
        defines: &[(&str, V)],
    ) -> Result<Arc<Pipeline>> {
        let hash = template::launch_hash(kernel.name, defines);
        if let Some((known, p)) = lock(&self.recent).get(&hash)
            && template::same_defines(known, defines)
        {
            return Ok(p.clone());
        }
        let p = self.compiled(kernel, defines)?;
        let known = template::keyed(defines)
            .map(|(k, v)| (k.to_string(), v.as_ref().to_owned()))
            .collect();
        lock(&self.recent).insert(hash, (known, p.clone()));
        Ok(p)
    }

    /// [`GpuContext::pipeline`] by its full key: compiled on first use.
    fn compiled<V: AsRef<str>>(
        &self,
        kernel: &KernelDef,
        defines: &[(&str, V)],
    ) -> Result<Arc<Pipeline>> {
        let key = template::cache_key(kernel.name, defines);
        if let Some(p) = lock(&self.pipelines).get(&key) {
            return Ok(p.clone());
        }
        let source =
            template::render(kernel.source, defines, self.info.shader_f16).map_err(|source| {
                TensorError::Template {
                    kernel: key.clone(),
                    source,
                }
            })?;
        let layout = self.layout(kernel.bindings);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(kernel.name),
                source: wgpu::ShaderSource::Wgsl(source.as_str().into()),
            });
        let pl = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(kernel.name),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(kernel.name),
                layout: Some(&pl),
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions::default(),
                cache: None,
            });
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(TensorError::Shader {
                kernel: key,
                message: err.to_string(),
                source_text: source,
            });
        }
        let p = Arc::new(Pipeline {
            name: key.clone(),
            kernel: kernel.name,
            pipeline,
            layout,
        });
        lock(&self.pipelines).insert(key, p.clone());
        Ok(p)
    }

    /// Pooled buffers currently idle (for tests and diagnostics).
    pub fn idle_pooled_buffers(&self) -> usize {
        self.pool.idle()
    }

    /// Number of compiled pipelines (for tests and diagnostics).
    pub fn cached_pipelines(&self) -> usize {
        lock(&self.pipelines).len()
    }

    /// A pooled storage buffer of at least `bytes` (rounded up to 4) for an op's output.
    /// A pooled buffer of `bytes` for a kernel's output. `what` names it in the error, and is
    /// only called then (formatting a name per launch costs more than the rest of taking a
    /// pooled buffer).
    pub(crate) fn output_buffer(
        &self,
        bytes: u64,
        what: impl FnOnce() -> String,
    ) -> Result<GpuBuffer> {
        self.check_binding(bytes, what)?;
        Ok(self.pool.take(&self.device, bytes, TENSOR_USAGE))
    }

    pub(crate) fn check_binding(&self, bytes: u64, what: impl FnOnce() -> String) -> Result<()> {
        if bytes > self.max_binding {
            return Err(TensorError::TooLarge {
                what: what(),
                bytes,
                limit: self.max_binding,
                limit_name: "max_storage_buffer_binding_size",
            });
        }
        Ok(())
    }

    /// A buffer holding `data`. Small ones (a step's token ids, positions, block tables) come
    /// from the pool, written through the queue (ordered before the next submit's kernels),
    /// so the same step shape binds the same buffers and reuses its bind groups; large ones
    /// (weights) are new buffers filled through a mapping at creation: no staging copy.
    pub(crate) fn upload(&self, data: &[u8], what: impl FnOnce() -> String) -> Result<GpuBuffer> {
        self.check_binding(data.len() as u64, what)?;
        if data.len() as u64 <= POOLED_UPLOAD {
            // Never one this thread's open recording still reads: the write lands before it.
            let buf = self
                .pool
                .take_free(&self.device, data.len() as u64, TENSOR_USAGE);
            let whole = data.len() - data.len() % 4;
            self.queue.write_buffer(&buf.buffer, 0, &data[..whole]);
            if whole < data.len() {
                let mut tail = [0u8; 4];
                tail[..data.len() - whole].copy_from_slice(&data[whole..]);
                self.queue.write_buffer(&buf.buffer, whole as u64, &tail);
            }
            return Ok(buf);
        }
        let buf = GpuBuffer::unpooled(&self.device, data.len() as u64, TENSOR_USAGE, true);
        buf.fill_mapped(data)?;
        Ok(buf)
    }

    /// Maps `staging` (submitted work writes it) for reading, waiting for the device.
    pub(crate) fn map_read(
        &self,
        staging: &wgpu::Buffer,
        during: &'static str,
    ) -> Result<wgpu::BufferView> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(TensorError::gpu(during))?
            .map_err(TensorError::gpu(during))?;
        staging
            .get_mapped_range(..)
            .map_err(TensorError::gpu(during))
    }

    /// Copy `ranges` of buffers back to the host, in order, with one submit and one wait.
    pub(crate) fn read_back(&self, parts: &[(&wgpu::Buffer, u64)]) -> Result<Vec<u8>> {
        let total: u64 = parts.iter().map(|(_, n)| n.next_multiple_of(4)).sum();
        if total == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln readback"),
            size: total,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("kiln readback"),
            });
        let mut at = 0;
        for (b, n) in parts {
            let n4 = n.next_multiple_of(4);
            enc.copy_buffer_to_buffer(b, 0, &staging, at, n4);
            at += n4;
        }
        self.queue.submit([enc.finish()]);
        let view = self.map_read(&staging, "readback")?;
        let mut out = Vec::with_capacity(total as usize);
        let mut at = 0usize;
        for (_, n) in parts {
            out.extend_from_slice(&view[at..at + *n as usize]);
            at += n.next_multiple_of(4) as usize;
        }
        drop(view);
        staging.unmap();
        Ok(out)
    }
}
