//! Pooled device buffers: op outputs go back to the pool when their last user drops them.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::thread::{self, ThreadId};

use super::lock;
use crate::{Result, TensorError};

/// Idle buffers kept per size class: a decode step keeps a few of a class alive at once (its
/// intermediates come back as soon as the model drops them), a large prefill fewer of its
/// large classes, whose idle bytes are capped.
const KEEP_PER_CLASS: usize = 32;
const KEEP_BYTES_PER_CLASS: u64 = 256 << 20;

/// Idle buffers, per (size class, usage). A take returns the lowest-numbered one, so the same
/// sequence of takes and drops (one decode step after another) gets the same buffers every
/// time, whatever order they came back in: what lets submits reuse their bind groups.
///
/// A buffer dropped while its thread has a recording open (kernels recorded, not submitted)
/// may still be bound by that recording, which writes it when it runs. It is held for that
/// thread until the recording is submitted: the thread may reuse it in the same recording
/// (later in the same command stream), but another thread taking it could submit, read its
/// result back and then have it overwritten by this recording's late submit. After the
/// submit, any later user's work is queued behind it. The rule is per thread: a buffer whose
/// last handle is dropped on another thread than the one recording with it is not covered
/// (kiln's step tensors live on the thread that records them).
// `wgpu::Buffer` orders and hashes by its id, which never changes.
#[allow(clippy::mutable_key_type)]
#[derive(Debug, Default)]
pub(crate) struct BufferPool {
    lists: Mutex<Lists>,
}

type Idle = HashMap<(u64, u32), BTreeSet<wgpu::Buffer>>;

#[allow(clippy::mutable_key_type)]
#[derive(Debug, Default)]
struct Lists {
    free: Idle,
    open: HashMap<ThreadId, Open>,
}

/// A thread's open recordings and the buffers it dropped meanwhile.
#[allow(clippy::mutable_key_type)]
#[derive(Debug, Default)]
struct Open {
    recordings: usize,
    held: Idle,
}

fn size_class(bytes: u64) -> u64 {
    bytes.max(256).next_power_of_two()
}

/// Keep `buffer` idle in `idle` unless its class already holds its share.
#[allow(clippy::mutable_key_type)]
fn keep(idle: &mut Idle, buffer: wgpu::Buffer) {
    let cap = (KEEP_BYTES_PER_CLASS / buffer.size()).clamp(2, KEEP_PER_CLASS as u64) as usize;
    let list = idle
        .entry((buffer.size(), buffer.usage().bits()))
        .or_default();
    if list.len() < cap {
        list.insert(buffer);
    }
}

impl BufferPool {
    /// An output buffer: a free one, one this thread holds (its open recording reads it
    /// earlier in the same command stream), or a new one.
    pub(crate) fn take(
        self: &Arc<Self>,
        device: &wgpu::Device,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> GpuBuffer {
        self.take_from(device, bytes, usage, true)
    }

    /// A buffer to write through the queue: never one this thread holds, since a queue write
    /// lands before the kernels of the open recording that may still read it.
    pub(crate) fn take_free(
        self: &Arc<Self>,
        device: &wgpu::Device,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> GpuBuffer {
        self.take_from(device, bytes, usage, false)
    }

    #[allow(clippy::mutable_key_type)]
    fn take_from(
        self: &Arc<Self>,
        device: &wgpu::Device,
        bytes: u64,
        usage: wgpu::BufferUsages,
        held_too: bool,
    ) -> GpuBuffer {
        let key = (size_class(bytes), usage.bits());
        let reused = {
            let mut lists = lock(&self.lists);
            let Lists { free, open } = &mut *lists;
            let held = open
                .get_mut(&thread::current().id())
                .filter(|_| held_too)
                .and_then(|o| o.held.get_mut(&key));
            let free = free.get_mut(&key);
            // The lowest-numbered of the free ones and this thread's held ones.
            let held_first = match (
                free.as_deref().and_then(BTreeSet::first),
                held.as_deref().and_then(BTreeSet::first),
            ) {
                (Some(f), Some(h)) => h < f,
                (f, h) => f.is_none() && h.is_some(),
            };
            if held_first {
                held.and_then(BTreeSet::pop_first)
            } else {
                free.and_then(BTreeSet::pop_first)
            }
        };
        let buffer = reused.unwrap_or_else(|| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln pooled"),
                size: key.0,
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
        let mut lists = lock(&self.lists);
        let Lists { free, open } = &mut *lists;
        match open.get_mut(&thread::current().id()) {
            Some(o) => keep(&mut o.held, buffer),
            None => keep(free, buffer),
        }
    }

    /// `thread` has begun a recording: buffers it drops are held until it is submitted.
    pub(crate) fn open_recording(&self, thread: ThreadId) {
        lock(&self.lists).open.entry(thread).or_default().recordings += 1;
    }

    /// A recording `thread` opened was submitted (or dropped): when it was the thread's last
    /// open one, what the thread held becomes free for every thread.
    #[allow(clippy::mutable_key_type)]
    pub(crate) fn close_recording(&self, thread: ThreadId) {
        let mut lists = lock(&self.lists);
        let Some(o) = lists.open.get_mut(&thread) else {
            return;
        };
        o.recordings = o.recordings.saturating_sub(1);
        if o.recordings > 0 {
            return;
        }
        let Some(o) = lists.open.remove(&thread) else {
            return;
        };
        for buffer in o.held.into_values().flatten() {
            keep(&mut lists.free, buffer);
        }
    }

    /// Buffers currently idle in the pool (free or held for a thread's open recording).
    #[allow(clippy::mutable_key_type)]
    pub(crate) fn idle(&self) -> usize {
        let lists = lock(&self.lists);
        let count = |idle: &Idle| idle.values().map(BTreeSet::len).sum::<usize>();
        count(&lists.free) + lists.open.values().map(|o| count(&o.held)).sum::<usize>()
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
