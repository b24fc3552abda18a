//! Pooled device buffers: op outputs go back to the pool when their last user drops them.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};

use super::lock;
use crate::{Result, TensorError};

/// Idle buffers kept per size class: a decode step keeps a few of a class alive at once (its
/// intermediates come back as soon as the model drops them), a large prefill fewer of its
/// large classes, whose idle bytes are capped.
const KEEP_PER_CLASS: usize = 32;
const KEEP_BYTES_PER_CLASS: u64 = 256 << 20;

/// Idle buffers per (size class, usage). A take returns the lowest-numbered one, so the same
/// sequence of takes and drops (one decode step after another) gets the same buffers every
/// time, whatever order they came back in: what lets submits reuse their bind groups.
// `wgpu::Buffer` orders and hashes by its id, which never changes.
#[allow(clippy::mutable_key_type)]
#[derive(Debug, Default)]
pub(crate) struct BufferPool {
    free: Mutex<HashMap<(u64, u32), BTreeSet<wgpu::Buffer>>>,
}

fn size_class(bytes: u64) -> u64 {
    bytes.max(256).next_power_of_two()
}

impl BufferPool {
    #[allow(clippy::mutable_key_type)]
    pub(crate) fn take(
        self: &Arc<Self>,
        device: &wgpu::Device,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> GpuBuffer {
        let class = size_class(bytes);
        let reused = lock(&self.free)
            .get_mut(&(class, usage.bits()))
            .and_then(BTreeSet::pop_first);
        let buffer = reused.unwrap_or_else(|| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln pooled"),
                size: class,
                usage,
                mapped_at_creation: false,
            })
        });
        GpuBuffer {
            buffer,
            bytes,
            pool: Some(Arc::downgrade(self)),
        }
    }

    #[allow(clippy::mutable_key_type)]
    fn give_back(&self, buffer: wgpu::Buffer) {
        let keep = (KEEP_BYTES_PER_CLASS / buffer.size()).clamp(2, KEEP_PER_CLASS as u64) as usize;
        let mut free = lock(&self.free);
        let list = free
            .entry((buffer.size(), buffer.usage().bits()))
            .or_default();
        if list.len() < keep {
            list.insert(buffer);
        }
    }

    /// Buffers currently idle in the pool.
    #[allow(clippy::mutable_key_type)]
    pub(crate) fn idle(&self) -> usize {
        lock(&self.free).values().map(BTreeSet::len).sum()
    }
}

/// A device buffer with its logical size; returns to its pool on drop when pooled.
#[derive(Debug)]
pub(crate) struct GpuBuffer {
    pub(crate) buffer: wgpu::Buffer,
    /// Logical bytes (the buffer may be larger).
    pub(crate) bytes: u64,
    pool: Option<Weak<BufferPool>>,
}

impl GpuBuffer {
    pub(crate) fn unpooled(
        device: &wgpu::Device,
        bytes: u64,
        usage: wgpu::BufferUsages,
        mapped: bool,
    ) -> Self {
        let buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln tensor"),
            size: bytes.next_multiple_of(4).max(4),
            usage,
            mapped_at_creation: mapped,
        });
        Self {
            buffer,
            bytes,
            pool: None,
        }
    }

    /// Write `data` into a buffer created mapped, then unmap it.
    pub(crate) fn fill_mapped(&self, data: &[u8]) -> Result<()> {
        {
            let mut view = self
                .buffer
                .get_mapped_range_mut(..)
                .map_err(TensorError::gpu("upload"))?;
            view.slice(..data.len()).copy_from_slice(data);
        }
        self.buffer.unmap();
        Ok(())
    }

    /// Bytes to bind: the logical size rounded up to 4, never zero.
    pub(crate) fn binding_size(&self) -> u64 {
        self.bytes.next_multiple_of(4).max(4)
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take().and_then(|w| w.upgrade()) {
            pool.give_back(self.buffer.clone());
        }
    }
}
