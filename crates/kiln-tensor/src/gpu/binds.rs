//! What a submit reuses from the last ones: the op-parameter uniform buffer (rewritten, not
//! recreated) and bind groups, cached by layout and the exact buffer ranges they bind. A
//! decode step records the same launches over the same pooled buffers as the step before,
//! so after the first step its bind groups all come from here: on a real GPU making ~300 bind
//! groups a step costs more host time than the step's kernels take on the device.

use rustc_hash::FxHashMap;

use crate::device::HostStats;

/// Every this many submits, bind groups unused since the last sweep are dropped: they hold
/// their buffers alive, so the cache keeps only what recent steps bound.
const SWEEP_EVERY: u64 = 16;
/// Smallest op-parameter buffer (grows to the next power of two a step needs).
const MIN_PARAMS: u64 = 64 << 10;

/// One bind group's identity: its layout and each entry's (buffer, offset, size).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct BindKey {
    pub layout: wgpu::BindGroupLayout,
    pub entries: Vec<(wgpu::Buffer, u64, u64)>,
}

/// The cache, locked for a whole submit (parameter write, bind groups, queue submit), so two
/// threads submitting on one device never see each other's parameters.
#[derive(Debug, Default)]
pub(crate) struct BindCache {
    params: Option<wgpu::Buffer>,
    /// By buffer ids: FxHash, not SipHash (a decode step looks up ~200 of them).
    groups: FxHashMap<BindKey, (wgpu::BindGroup, u64)>,
    submits: u64,
    pub stats: HostStats,
}

impl BindCache {
    /// The parameter buffer holding at least `bytes`, written with `data` through the queue
    /// (ordered after every earlier submit that reads it, before the next).
    pub fn params(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        data: &[u8],
    ) -> wgpu::Buffer {
        let need = data.len() as u64;
        let buf = match &self.params {
            Some(b) if b.size() >= need => b.clone(),
            _ => {
                let b = device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("kiln op params"),
                    size: need.max(MIN_PARAMS).next_power_of_two(),
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                self.params = Some(b.clone());
                b
            }
        };
        queue.write_buffer(&buf, 0, data);
        buf
    }

    /// The bind group for `key` (entry `i` at binding `i`), made when not cached.
    pub fn group(&mut self, device: &wgpu::Device, key: BindKey) -> wgpu::BindGroup {
        let now = self.submits;
        if let Some((g, used)) = self.groups.get_mut(&key) {
            *used = now;
            self.stats.bind_groups_reused += 1;
            return g.clone();
        }
        let entries: Vec<wgpu::BindGroupEntry<'_>> = key
            .entries
            .iter()
            .enumerate()
            .map(|(i, (buffer, offset, size))| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: *offset,
                    size: wgpu::BufferSize::new(*size),
                }),
            })
            .collect();
        let g = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &key.layout,
            entries: &entries,
        });
        drop(entries);
        self.stats.bind_groups_made += 1;
        self.groups.insert(key, (g.clone(), now));
        g
    }

    /// Ends a submit; every [`SWEEP_EVERY`] submits drops the bind groups none of them used.
    pub fn end_submit(&mut self) {
        self.submits += 1;
        if self.submits.is_multiple_of(SWEEP_EVERY) {
            let since = self.submits - SWEEP_EVERY;
            self.groups.retain(|_, (_, used)| *used >= since);
        }
    }

    /// Bind groups currently cached.
    pub fn len(&self) -> usize {
        self.groups.len()
    }
}
