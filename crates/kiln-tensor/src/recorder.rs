//! `Recorder`: a sequence of ops encoded into one command encoder and submitted once.

use std::sync::Arc;
use std::time::Instant;

use crate::gpu::{Access, GpuContext, KernelDef, PARAM_SLOT, Pipeline};
use crate::tensor::Storage;
use crate::{Device, Result, Tensor, TensorError};

/// Launches timed by one query set when profiling (two queries each; a query set holds at
/// most 4096); longer submits use several.
const TIMED_PER_SET: usize = 2048;

/// Workgroups per dimension every adapter supports; bigger launches spill into `y`.
const MAX_GROUPS_X: u32 = 65535;

/// One storage or uniform binding of a launch, as an op gives it.
pub(crate) struct Bind {
    pub tensor: Tensor,
    pub chunk: usize,
    /// `(offset, size)` in bytes within the chunk; the whole chunk when `None`.
    pub range: Option<(u64, u64)>,
}

impl From<(Tensor, usize)> for Bind {
    fn from((tensor, chunk): (Tensor, usize)) -> Self {
        Self {
            tensor,
            chunk,
            range: None,
        }
    }
}

/// A binding resolved to its buffer range. It holds the wgpu buffer, not the tensor: a tensor
/// the caller drops before the submit returns its buffer to the pool, where a later op of the
/// same recording may take it as its output (the launches run in recorded order, with the
/// barriers wgpu puts between them), so a step's intermediates reuse a few buffers instead of
/// all staying alive until the submit.
struct Bound {
    buffer: wgpu::Buffer,
    offset: u64,
    size: u64,
}

struct Dispatch {
    pipeline: Arc<Pipeline>,
    bindings: Vec<Bound>,
    param_offset: u32,
    groups: [u32; 3],
}

/// Records ops for one device. On the wgpu backend nothing runs until [`Recorder::submit`],
/// which encodes every recorded kernel into one compute pass, uploads all op parameters in one
/// uniform buffer and submits once. On the CPU backend each op runs when it is recorded.
///
/// Output tensors returned by ops may be used by later ops of the same recording; read them
/// back only after `submit`.
pub struct Recorder {
    device: Device,
    dispatches: Vec<Dispatch>,
    params: Vec<u8>,
    /// When the first launch of the pending submit was recorded (host time statistics).
    first_at: Option<Instant>,
    /// The thread whose buffer pool entry this recording holds open while it has kernels
    /// recorded and not submitted (see `BufferPool`).
    open_on: Option<std::thread::ThreadId>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Recorder({:?}, {} dispatches)",
            self.device,
            self.dispatches.len()
        )
    }
}

impl Drop for Recorder {
    /// Kernels recorded and never submitted never run: release what their thread held.
    fn drop(&mut self) {
        self.close();
    }
}

/// Wait for a profiled submit and turn its timestamps into (kernel, device ns) pairs.
fn read_timestamps(
    ctx: &GpuContext,
    staging: &wgpu::Buffer,
    kernels: &[&'static str],
) -> Result<Vec<(&'static str, f64)>> {
    let view = ctx.map_read(staging, "profile read-back")?;
    let period = f64::from(ctx.queue.get_timestamp_period());
    let ticks: &[u64] = bytemuck::cast_slice(&view);
    let out = kernels
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let dt = ticks[2 * i + 1].saturating_sub(ticks[2 * i]);
            (*k, dt as f64 * period)
        })
        .collect();
    drop(view);
    staging.unmap();
    Ok(out)
}

/// Grid for `n` workgroups: `[x, y, 1]` with `x * y >= n`. Kernels rebuild the linear id as
/// `wid.x + wid.y * nwg.x` and ignore ids past their work.
pub(crate) fn grid(n: u32) -> [u32; 3] {
    if n <= MAX_GROUPS_X {
        [n.max(1), 1, 1]
    } else {
        [MAX_GROUPS_X, n.div_ceil(MAX_GROUPS_X), 1]
    }
}

impl Recorder {
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            dispatches: Vec::new(),
            params: Vec::new(),
            first_at: None,
            open_on: None,
        }
    }

    /// Buffers the recording thread drops from now on are held for it until the submit.
    fn open(&mut self) {
        if let (None, Device::Wgpu(ctx)) = (self.open_on, &self.device) {
            let me = std::thread::current().id();
            ctx.pool.open_recording(me);
            self.open_on = Some(me);
        }
    }

    /// The recording is submitted or given up: what its thread held is free for every thread.
    fn close(&mut self) {
        if let (Some(thread), Device::Wgpu(ctx)) = (self.open_on.take(), &self.device) {
            ctx.pool.close_recording(thread);
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Kernels recorded and not yet submitted.
    pub fn pending_dispatches(&self) -> usize {
        self.dispatches.len()
    }

    /// The wgpu context when this recorder targets wgpu.
    pub(crate) fn gpu(&self) -> Option<&Arc<GpuContext>> {
        match &self.device {
            Device::Wgpu(g) => Some(g),
            Device::Reference | Device::Cpu(_) => None,
        }
    }

    /// Check that every tensor lives on this recorder's device.
    pub(crate) fn check_device(&self, op: &'static str, ts: &[&Tensor]) -> Result<()> {
        for t in ts {
            let ok = match (t.storage(), &self.device) {
                (Storage::Cpu(_), Device::Reference | Device::Cpu(_)) => true,
                (Storage::Gpu { ctx, .. }, Device::Wgpu(g)) => Arc::ptr_eq(ctx, g),
                _ => false,
            };
            if !ok {
                return Err(TensorError::DeviceMismatch { op });
            }
        }
        Ok(())
    }

    /// Record one kernel launch of `groups` workgroups.
    pub(crate) fn dispatch<P: bytemuck::Pod, V: AsRef<str>>(
        &mut self,
        kernel: &KernelDef,
        defines: &[(&str, V)],
        params: &P,
        bindings: Vec<(Tensor, usize)>,
        groups: u32,
    ) -> Result<()> {
        let bindings = bindings.into_iter().map(Bind::from).collect();
        self.dispatch_binds(kernel, defines, params, bindings, groups)
    }

    /// [`Recorder::dispatch`] with byte ranges for some bindings.
    pub(crate) fn dispatch_binds<P: bytemuck::Pod, V: AsRef<str>>(
        &mut self,
        kernel: &KernelDef,
        defines: &[(&str, V)],
        params: &P,
        bindings: Vec<Bind>,
        groups: u32,
    ) -> Result<()> {
        let Device::Wgpu(ctx) = &self.device else {
            return Err(TensorError::Invalid {
                op: kernel.name,
                detail: "kernel launch on the CPU backend".into(),
            });
        };
        debug_assert_eq!(bindings.len(), kernel.bindings.len(), "{}", kernel.name);
        let bindings = bindings
            .iter()
            .map(|b| {
                let Storage::Gpu { chunks, .. } = b.tensor.storage() else {
                    return Err(TensorError::DeviceMismatch { op: kernel.name });
                };
                let c = chunks.get(b.chunk).ok_or_else(|| TensorError::Invalid {
                    op: kernel.name,
                    detail: format!("binding chunk {} of {}", b.chunk, chunks.len()),
                })?;
                let (offset, size) = b.range.unwrap_or((0, c.buf.binding_size()));
                Ok(Bound {
                    buffer: c.buf.buffer.clone(),
                    offset,
                    size,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let pipeline = ctx.pipeline(kernel, defines)?;
        self.open();
        self.first_at.get_or_insert_with(Instant::now);
        let bytes = bytemuck::bytes_of(params);
        debug_assert!(bytes.len() as u64 <= PARAM_SLOT);
        let param_offset = self.params.len() as u32;
        self.params.extend_from_slice(bytes);
        self.params
            .resize(self.params.len().next_multiple_of(PARAM_SLOT as usize), 0);
        self.dispatches.push(Dispatch {
            pipeline,
            bindings,
            param_offset,
            groups: grid(groups),
        });
        Ok(())
    }

    /// Record a launch of a kernel defined outside this crate. `bindings` are single-chunk
    /// tensors on this recorder's device, in the kernel's binding order; `ReadWrite` bindings
    /// are written in place. wgpu only: on the CPU backend the caller runs its own reference.
    pub fn launch<P: bytemuck::Pod>(
        &mut self,
        kernel: &KernelDef,
        defines: &[(&str, String)],
        params: &P,
        bindings: &[&Tensor],
        groups: u32,
    ) -> Result<()> {
        if bindings.len() != kernel.bindings.len() {
            return Err(TensorError::Invalid {
                op: kernel.name,
                detail: format!(
                    "{} bindings given, the kernel declares {}",
                    bindings.len(),
                    kernel.bindings.len()
                ),
            });
        }
        if bytemuck::bytes_of(params).len() as u64 > PARAM_SLOT {
            return Err(TensorError::Invalid {
                op: kernel.name,
                detail: format!("params exceed {PARAM_SLOT} bytes"),
            });
        }
        self.check_device(kernel.name, bindings)?;
        if let Some(t) = bindings.iter().find(|t| t.chunk_count() != 1) {
            return Err(TensorError::Invalid {
                op: kernel.name,
                detail: format!(
                    "tensor {:?} is split into {} bindings; this kernel takes whole tensors",
                    t.shape(),
                    t.chunk_count()
                ),
            });
        }
        if let Some(ctx) = self.gpu() {
            for (t, a) in bindings.iter().zip(kernel.bindings) {
                let bytes = t.dtype().stored().bytes_for(t.elem_count()).unwrap_or(0) as u64;
                if *a == Access::Uniform && bytes > ctx.max_uniform_binding() {
                    return Err(TensorError::TooLarge {
                        what: format!("uniform binding {:?} of {}", t.shape(), kernel.name),
                        bytes,
                        limit: ctx.max_uniform_binding(),
                        limit_name: "max_uniform_buffer_binding_size",
                    });
                }
            }
        }
        let bind = bindings.iter().map(|t| ((*t).clone(), 0)).collect();
        self.dispatch(kernel, defines, params, bind, groups)
    }

    /// An uninitialised F32/U32 device tensor from the buffer pool, for a kernel to fill
    /// (a zeroed host tensor on the CPU backend).
    pub fn output(
        &self,
        dtype: crate::DType,
        shape: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        match &self.device {
            Device::Wgpu(ctx) => Tensor::gpu_output(ctx, dtype, shape, what),
            Device::Reference | Device::Cpu(_) => Tensor::zeros(&self.device, dtype, shape),
        }
    }

    /// Profiling: every launch in its own compute pass with timestamps at its start and end,
    /// resolved into a mappable buffer. Returns that buffer and the kernel of each timed launch.
    fn encode_timed(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        groups: &[wgpu::BindGroup],
    ) -> Result<(wgpu::Buffer, Vec<&'static str>)> {
        let n = self.dispatches.len();
        let device = &ctx.device;
        let sets: Vec<wgpu::QuerySet> = (0..n.div_ceil(TIMED_PER_SET))
            .map(|s| {
                let count = (n - s * TIMED_PER_SET).min(TIMED_PER_SET);
                device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("kiln profile"),
                    ty: wgpu::QueryType::Timestamp,
                    count: (2 * count) as u32,
                })
            })
            .collect();
        let mut kernels = Vec::with_capacity(n);
        for (i, (d, bg)) in self.dispatches.iter().zip(groups).enumerate() {
            let at = (2 * (i % TIMED_PER_SET)) as u32;
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(d.pipeline.kernel),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &sets[i / TIMED_PER_SET],
                    beginning_of_pass_write_index: Some(at),
                    end_of_pass_write_index: Some(at + 1),
                }),
            });
            pass.set_pipeline(&d.pipeline.pipeline);
            pass.set_bind_group(0, bg, &[d.param_offset]);
            pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
            kernels.push(d.pipeline.kernel);
        }
        let bytes = (2 * n * 8) as u64;
        let resolve = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln profile resolve"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let staging = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln profile read"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        for (s, set) in sets.iter().enumerate() {
            let count = (n - s * TIMED_PER_SET).min(TIMED_PER_SET);
            let offset = (2 * s * TIMED_PER_SET * 8) as u64;
            enc.resolve_query_set(set, 0..(2 * count) as u32, &resolve, offset);
        }
        enc.copy_buffer_to_buffer(&resolve, 0, &staging, 0, bytes);
        Ok((staging, kernels))
    }

    /// Encode everything recorded into one command encoder and submit it once. Does not wait
    /// for the device; reading a tensor back waits.
    pub fn submit(&mut self) -> Result<()> {
        let Device::Wgpu(ctx) = self.device.clone() else {
            return Ok(());
        };
        if self.dispatches.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let recorded = self.first_at.take().map_or(started, |t| t);
        let device = &ctx.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        // Held until the queue submit: the parameters written are this submit's.
        let mut cache = crate::gpu::lock(&ctx.binds);
        let uniform = cache.params(device, &ctx.queue, &self.params);
        let mut groups = Vec::with_capacity(self.dispatches.len());
        for d in &self.dispatches {
            let mut key = crate::gpu::BindKey {
                layout: d.pipeline.layout.clone(),
                entries: Vec::with_capacity(d.bindings.len() + 1),
            };
            key.entries.push((uniform.clone(), 0, PARAM_SLOT));
            key.entries.extend(
                d.bindings
                    .iter()
                    .map(|b| (b.buffer.clone(), b.offset, b.size)),
            );
            let group = cache.group(device, key);
            groups.push(group);
        }
        let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("kiln step"),
        });
        let timed = if ctx.profiling() {
            Some(self.encode_timed(&ctx, &mut enc, &groups)?)
        } else {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("kiln step"),
                timestamp_writes: None,
            });
            for (d, bg) in self.dispatches.iter().zip(&groups) {
                pass.set_pipeline(&d.pipeline.pipeline);
                pass.set_bind_group(0, bg, &[d.param_offset]);
                pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
            }
            None
        };
        ctx.queue.submit([enc.finish()]);
        cache.end_submit();
        // Anything queued from now on runs after this submit.
        self.close();
        let done = Instant::now();
        cache.stats.submits += 1;
        cache.stats.dispatches += self.dispatches.len() as u64;
        cache.stats.record_ns += (started - recorded).as_nanos() as u64;
        cache.stats.encode_ns += (done - started).as_nanos() as u64;
        drop(cache);
        if let Some((staging, kernels)) = timed {
            let launches = read_timestamps(&ctx, &staging, &kernels)?;
            ctx.record_profile(&launches);
        }
        let oom_err = pollster::block_on(oom.pop());
        let val_err = pollster::block_on(scope.pop());
        let failed = oom_err.or(val_err).map(|source| TensorError::Submit {
            kernels: self
                .dispatches
                .iter()
                .map(|d| d.pipeline.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            source,
        });
        self.dispatches.clear();
        self.params.clear();
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(())
    }
}
