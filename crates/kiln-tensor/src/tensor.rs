//! `Tensor`: shape and dtype over reference-counted storage on one device.

use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};
use smallvec::SmallVec;

use crate::gpu::{GpuBuffer, GpuContext};
use crate::host::{self, HostData};
use crate::quant;
use crate::{DType, Device, Result, TensorError};

/// One binding's worth of a tensor on the device: whole rows `[row0, row0 + rows)`.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub buf: GpuBuffer,
    pub row0: usize,
    pub rows: usize,
    /// Word offset of the quants (quantized dtypes only).
    pub qs_offset: u32,
}

#[derive(Debug)]
pub(crate) enum Storage {
    Cpu(HostData),
    Gpu {
        ctx: Arc<GpuContext>,
        chunks: Vec<Chunk>,
    },
}

/// An n-dimensional array on a [`Device`]. Cloning is cheap (shared storage).
///
/// Rows are everything but the last dimension; a tensor larger than the device's largest
/// binding is stored as several chunks of whole rows, which the ops that need big tensors
/// (matmul weights, embedding tables) consume chunk by chunk.
#[derive(Clone)]
pub struct Tensor {
    shape: Shape,
    dtype: DType,
    storage: Arc<Storage>,
}

/// A tensor's dimensions, inline up to four (no allocation a tensor).
pub(crate) type Shape = SmallVec<[usize; 4]>;

/// A CPU tensor's storage, when this was its last owner, goes to the process's spares
/// ([`host`]) for the next CPU tensor to reuse.
impl Drop for Tensor {
    fn drop(&mut self) {
        if matches!(*self.storage, Storage::Cpu(_)) && Arc::strong_count(&self.storage) == 1 {
            host::give_back(std::mem::replace(&mut self.storage, host::vacant()));
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = match &*self.storage {
            Storage::Cpu(_) => "cpu".to_string(),
            Storage::Gpu { chunks, .. } => format!("wgpu, {} chunk(s)", chunks.len()),
        };
        write!(f, "Tensor({:?}, {:?}, {place})", self.shape, self.dtype)
    }
}

fn check_shape(shape: &[usize], dtype: DType, what: &str) -> Result<usize> {
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| TensorError::Invalid {
            op: "tensor",
            detail: format!("{what}: shape {shape:?} overflows"),
        })?;
    let cols = shape.last().copied().unwrap_or(1);
    if dtype.is_quantized() && cols % dtype.block_elems() != 0 {
        return Err(TensorError::Shape {
            op: "tensor",
            detail: format!(
                "{what}: last dimension {cols} of a {dtype:?} tensor must be a multiple of {}",
                dtype.block_elems()
            ),
        });
    }
    Ok(n)
}

impl Tensor {
    fn wrap(shape: &[usize], dtype: DType, storage: Storage) -> Self {
        Self::over(shape, dtype, Arc::new(storage))
    }

    fn over(shape: &[usize], dtype: DType, storage: Arc<Storage>) -> Self {
        Self {
            shape: shape.into(),
            dtype,
            storage,
        }
    }

    /// A host tensor whose `bytes` bytes `fill` writes, in spare storage when a spare fits.
    fn host_with(
        shape: &[usize],
        dtype: DType,
        bytes: usize,
        fill: impl FnOnce(&mut [u32]),
    ) -> Self {
        Self::over(shape, dtype, host::storage(bytes, fill))
    }

    /// Upload host-layout bytes (GGUF blocks for the GGUF block dtypes, kiln's `Q4_Z`/`Q8_Z`
    /// blocks as `DType` describes them, little-endian otherwise).
    pub fn from_bytes(
        device: &Device,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<Self> {
        let n = check_shape(shape, dtype, "upload")?;
        let expected = dtype.bytes_for(n).unwrap_or(usize::MAX);
        if bytes.len() != expected {
            return Err(TensorError::DataLength {
                what: format!("tensor {shape:?} {dtype:?}"),
                expected,
                got: bytes.len(),
            });
        }
        crate::quant::check_blocks(dtype, bytes)?;
        match device {
            Device::Reference | Device::Cpu(_) => {
                Ok(Self::host_with(shape, dtype, bytes.len(), |w| {
                    bytemuck::cast_slice_mut::<u32, u8>(w)[..bytes.len()].copy_from_slice(bytes)
                }))
            }
            Device::Wgpu(ctx) => Self::upload_chunks(ctx, dtype, shape, bytes),
        }
    }

    fn upload_chunks(
        ctx: &Arc<GpuContext>,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<Self> {
        let cols = shape.last().copied().unwrap_or(1);
        let rows = shape
            .iter()
            .product::<usize>()
            .checked_div(cols)
            .unwrap_or(0);
        let row_bytes = dtype.bytes_for(cols).unwrap_or(0);
        // Device bytes a row: the host size for plain dtypes; for block formats at most
        // `device_block_bytes` a block, plus up to 16 bytes of padding a chunk before the
        // quants.
        let dev_row_bytes = if dtype.is_quantized() {
            cols / dtype.block_elems() * quant::device_block_bytes(dtype)
        } else {
            row_bytes
        };
        let rows_per_chunk = (ctx.max_binding() as usize)
            .saturating_sub(16)
            .checked_div(dev_row_bytes)
            .unwrap_or(rows)
            .max(1);
        // A stack of matrices (experts `[E, rows, cols]`) is split between whole matrices
        // where one fits a binding, so that each lies in one chunk.
        let matrix_rows = match shape {
            [.., r, _] if shape.len() >= 3 && *r > 0 => *r,
            _ => 1,
        };
        let rows_per_chunk = match rows_per_chunk / matrix_rows {
            0 => rows_per_chunk,
            whole => whole * matrix_rows,
        };
        let single = (rows * dev_row_bytes + 16) as u64 <= ctx.max_binding();
        let mut chunks = Vec::new();
        let mut row0 = 0;
        loop {
            let nrows = if single {
                rows
            } else {
                rows_per_chunk.min(rows - row0)
            };
            let part = &bytes[row0 * row_bytes..(row0 + nrows) * row_bytes];
            let what = || format!("tensor {shape:?} {dtype:?} rows {row0}..{}", row0 + nrows);
            let (buf, qs_offset) = if dtype.is_quantized() {
                let nb = nrows * cols / dtype.block_elems();
                let words = quant::to_device(dtype, part);
                let layout = quant::device_layout(dtype, nb);
                (
                    ctx.upload(bytemuck::cast_slice(&words), what)?,
                    layout.qs_offset as u32,
                )
            } else {
                (ctx.upload(part, what)?, 0)
            };
            chunks.push(Chunk {
                buf,
                row0,
                rows: nrows,
                qs_offset,
            });
            row0 += nrows;
            if row0 >= rows {
                break;
            }
        }
        Ok(Self::wrap(
            shape,
            dtype,
            Storage::Gpu {
                ctx: ctx.clone(),
                chunks,
            },
        ))
    }

    /// A zero-filled tensor (for storage that kernels update in place, such as KV pools).
    pub fn zeros(device: &Device, dtype: DType, shape: &[usize]) -> Result<Self> {
        let n = check_shape(shape, dtype, "zeros")?;
        let bytes = dtype
            .stored()
            .bytes_for(n)
            .ok_or_else(|| TensorError::Invalid {
                op: "zeros",
                detail: format!("{n} elements is not a whole number of {dtype:?} blocks"),
            })?;
        match device {
            // Host storage comes zeroed.
            Device::Reference | Device::Cpu(_) => {
                Ok(Self::host_with(shape, dtype.stored(), bytes, |_| {}))
            }
            Device::Wgpu(_) => Self::from_bytes(device, dtype.stored(), shape, &vec![0u8; bytes]),
        }
    }

    pub fn from_f32(device: &Device, shape: &[usize], data: &[f32]) -> Result<Self> {
        Self::from_bytes(device, DType::F32, shape, bytemuck::cast_slice(data))
    }
    pub fn from_f16(device: &Device, shape: &[usize], data: &[f16]) -> Result<Self> {
        Self::from_bytes(device, DType::F16, shape, bytemuck::cast_slice(data))
    }
    pub fn from_bf16(device: &Device, shape: &[usize], data: &[bf16]) -> Result<Self> {
        Self::from_bytes(device, DType::BF16, shape, bytemuck::cast_slice(data))
    }
    pub fn from_u32(device: &Device, shape: &[usize], data: &[u32]) -> Result<Self> {
        Self::from_bytes(device, DType::U32, shape, bytemuck::cast_slice(data))
    }
    pub fn from_i32(device: &Device, shape: &[usize], data: &[i32]) -> Result<Self> {
        Self::from_bytes(device, DType::I32, shape, bytemuck::cast_slice(data))
    }

    /// Quantize `data` on the CPU to `dtype` (Q8_0/Q4_0/Q4_1/Q4_Z/Q8_Z; the other block
    /// formats are only read) and upload it (load-time `--quantize`).
    pub fn quantize_f32(
        device: &Device,
        dtype: DType,
        shape: &[usize],
        data: &[f32],
    ) -> Result<Self> {
        check_shape(shape, dtype, "quantize")?;
        let q = quant::quantize(dtype, data)?;
        Self::from_bytes(device, dtype, shape, &q)
    }

    /// An F32 host tensor whose every value `fill` writes (an op's output on the CPU
    /// backends), in spare storage when a spare fits.
    pub(crate) fn host_f32_with<E>(
        shape: &[usize],
        fill: impl FnOnce(&mut [f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        let n: usize = shape.iter().product();
        let mut r = Ok(());
        let t = Self::host_with(shape, DType::F32, n * 4, |w| {
            r = fill(bytemuck::cast_slice_mut(w));
        });
        r.map(|()| t)
    }

    /// [`Tensor::host_f32_with`] for a U32 tensor.
    pub(crate) fn host_u32_with(shape: &[usize], fill: impl FnOnce(&mut [u32])) -> Self {
        let n: usize = shape.iter().product();
        Self::host_with(shape, DType::U32, n * 4, fill)
    }

    /// An F32 tensor on `device` whose every value `fill` writes: on the CPU backends into
    /// the tensor's own storage (a dropped tensor's, reused, once a step has run), on a GPU
    /// into host memory that is then uploaded.
    pub fn from_f32_with<E: From<TensorError>>(
        device: &Device,
        shape: &[usize],
        fill: impl FnOnce(&mut [f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        let n = check_shape(shape, DType::F32, "from_f32_with")?;
        match device {
            Device::Reference | Device::Cpu(_) => Self::host_f32_with(shape, fill),
            Device::Wgpu(_) => {
                let mut v = vec![0f32; n];
                fill(&mut v)?;
                Ok(Self::from_f32(device, shape, &v)?)
            }
        }
    }

    /// An uninitialised (pooled) device tensor that a kernel is about to fill.
    pub(crate) fn gpu_output(
        ctx: &Arc<GpuContext>,
        dtype: DType,
        shape: &[usize],
        op: &'static str,
    ) -> Result<Self> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes_for(n).unwrap_or(0) as u64;
        let buf = ctx.output_buffer(bytes, || format!("{op} output {shape:?} {dtype:?}"))?;
        let rows = if shape.is_empty() {
            1
        } else {
            n / shape.last().copied().unwrap_or(1).max(1)
        };
        let chunks = vec![Chunk {
            buf,
            row0: 0,
            rows,
            qs_offset: 0,
        }];
        Ok(Self::wrap(
            shape,
            dtype,
            Storage::Gpu {
                ctx: ctx.clone(),
                chunks,
            },
        ))
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
    /// Size of the last dimension.
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    /// Product of all but the last dimension.
    pub fn rows(&self) -> usize {
        let c = self.cols();
        self.elem_count().checked_div(c).unwrap_or(0)
    }
    /// Number of device bindings this tensor is split into (1 unless it is huge).
    pub fn chunk_count(&self) -> usize {
        match &*self.storage {
            Storage::Cpu(_) => 1,
            Storage::Gpu { chunks, .. } => chunks.len(),
        }
    }
    /// The device the tensor lives on.
    pub fn device(&self) -> Device {
        match &*self.storage {
            Storage::Cpu(_) => Device::Reference,
            Storage::Gpu { ctx, .. } => Device::Wgpu(ctx.clone()),
        }
    }
    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The same storage under a new shape with the same element count (no copy). A tensor
    /// split into chunks keeps its last dimension.
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        let n = check_shape(shape, self.dtype, "reshape")?;
        if n != self.elem_count() || (self.chunk_count() > 1 && shape.last() != self.shape.last()) {
            return Err(TensorError::Shape {
                op: "reshape",
                detail: format!("{:?} cannot become {shape:?}", self.shape),
            });
        }
        Ok(Self::over(shape, self.dtype, self.storage.clone()))
    }

    /// The values of an F32 tensor of the CPU backends, to change in place: `None` unless
    /// this is its storage's only handle (a change must not show through another tensor).
    pub(crate) fn host_f32_mut(&mut self) -> Option<&mut [f32]> {
        let n = self.elem_count();
        match Arc::get_mut(&mut self.storage)? {
            Storage::Cpu(h) if self.dtype == DType::F32 => Some(&mut h.f32s_mut()[..n]),
            _ => None,
        }
    }

    /// Whether `self` and `other` are views of the same storage.
    pub(crate) fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// The values of an F32 tensor of the CPU backends, borrowed (a GPU tensor's are read
    /// with [`Tensor::to_f32_vec`]).
    pub fn host_f32(&self) -> Result<&[f32]> {
        match &*self.storage {
            Storage::Cpu(h) if self.dtype == DType::F32 => Ok(&h.f32s()[..self.elem_count()]),
            Storage::Cpu(_) => Err(TensorError::DType {
                op: "host_f32",
                what: "borrowing f32 values",
                dtype: self.dtype,
            }),
            Storage::Gpu { .. } => Err(TensorError::DeviceMismatch { op: "host_f32" }),
        }
    }

    /// The values of a U32 tensor of the CPU backends, borrowed.
    pub(crate) fn host_u32(&self) -> Result<&[u32]> {
        match &*self.storage {
            Storage::Cpu(h) if self.dtype == DType::U32 => Ok(&h.u32s()[..self.elem_count()]),
            Storage::Cpu(_) => Err(TensorError::DType {
                op: "host_u32",
                what: "borrowing u32 values",
                dtype: self.dtype,
            }),
            Storage::Gpu { .. } => Err(TensorError::DeviceMismatch { op: "host_u32" }),
        }
    }

    /// Host-layout bytes (GGUF blocks for quantized dtypes). Blocks on device work.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        match &*self.storage {
            Storage::Cpu(h) => Ok(h.bytes().to_vec()),
            Storage::Gpu { ctx, chunks } => {
                let parts: Vec<(&wgpu::Buffer, u64)> = chunks
                    .iter()
                    .map(|c| (&c.buf.buffer, c.buf.bytes))
                    .collect();
                let raw = ctx.read_back(&parts)?;
                if !self.dtype().is_quantized() {
                    return Ok(raw);
                }
                let mut out = Vec::new();
                let mut at = 0usize;
                for c in chunks {
                    let nb = c.rows * self.cols() / self.dtype().block_elems();
                    let n = c.buf.bytes as usize;
                    out.extend(quant::from_device(self.dtype(), &raw[at..at + n], nb));
                    at += n;
                }
                Ok(out)
            }
        }
    }

    /// Values as f32 (F16 widened, quantized dequantized). Blocks on device work.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        if let Ok(v) = self.host_f32() {
            return Ok(v.to_vec());
        }
        let b = self.to_bytes()?;
        match self.dtype() {
            DType::F32 => Ok(b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            DType::F16 => Ok(b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            DType::BF16 => Ok(b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            d if d.is_quantized() => {
                let mut out = vec![0f32; self.elem_count()];
                quant::dequantize(d, &b, &mut out)?;
                Ok(out)
            }
            d => Err(TensorError::DType {
                op: "to_f32_vec",
                what: "reading back as f32",
                dtype: d,
            }),
        }
    }

    /// Values of a U32 tensor. Blocks on device work.
    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        if self.dtype() != DType::U32 {
            return Err(TensorError::DType {
                op: "to_u32_vec",
                what: "reading back as u32",
                dtype: self.dtype(),
            });
        }
        if let Storage::Cpu(h) = &*self.storage {
            return Ok(h.u32s()[..self.elem_count()].to_vec());
        }
        let b = self.to_bytes()?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
