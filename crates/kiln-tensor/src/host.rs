//! Host storage: a CPU tensor's bytes, and the spare storage that new CPU tensors reuse.
//!
//! A decode step makes and drops the same tensors every step (a layer's projections, its
//! attention output, the next hidden state). Each CPU tensor dropped as the only owner of its
//! storage gives that storage (the `Arc` and its words) to the spares; the next CPU tensor
//! made takes the smallest spare that holds it (in at most a quarter more room). Once the spares
//! have seen one step, a step of the same shapes allocates nothing for its tensors. The
//! spares are the process's, not a thread's: a step runs on whichever of the pool's threads
//! takes it, and a tensor may be dropped on another thread than the one that made it.

use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use crate::tensor::Storage;

/// Host bytes kept in `u32` words so that every typed view is aligned.
#[derive(Debug, Default)]
pub(crate) struct HostData {
    words: Vec<u32>,
    bytes: usize,
}

impl HostData {
    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u32, u8>(&self.words)[..self.bytes]
    }
    pub(crate) fn f32s(&self) -> &[f32] {
        bytemuck::cast_slice(&self.words)
    }
    pub(crate) fn u32s(&self) -> &[u32] {
        &self.words
    }
    pub(crate) fn f32s_mut(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(&mut self.words)
    }
    /// Words allocated (what the spares count).
    fn capacity_bytes(&self) -> usize {
        self.words.capacity() * 4
    }
}

/// The most spares kept.
const SPARES: usize = 32;
/// The most bytes the spares hold together (64 MiB)...
const SPARE_BYTES: usize = 64 << 20;
/// ...and the largest storage kept as a spare (16 MiB): a long prompt's activations are
/// freed, not held.
const SPARE_MAX: usize = 16 << 20;

/// Host storage that dropped tensors left, for new tensors to reuse, oldest first.
#[derive(Default)]
struct Spares {
    list: Mutex<Vec<Arc<Storage>>>,
}

/// The process's spares.
static SPARE: Spares = Spares {
    list: Mutex::new(Vec::new()),
};

/// Words allocated in `s` (what the caps count); none for device storage.
fn spare_bytes(s: &Storage) -> usize {
    match s {
        Storage::Cpu(h) => h.capacity_bytes(),
        Storage::Gpu { .. } => 0,
    }
}

impl Spares {
    fn list(&self) -> MutexGuard<'_, Vec<Arc<Storage>>> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Host storage of `bytes` bytes that `fill` writes (the words past `bytes` are zero):
    /// the smallest spare that holds them in at most a quarter more room, else new.
    fn storage(&self, bytes: usize, fill: impl FnOnce(&mut [u32])) -> Arc<Storage> {
        let words = bytes.div_ceil(4);
        let mut s = self.take(words).unwrap_or_else(|| {
            Arc::new(Storage::Cpu(HostData {
                words: Vec::with_capacity(words),
                bytes: 0,
            }))
        });
        let Some(Storage::Cpu(h)) = Arc::get_mut(&mut s) else {
            unreachable!("a spare is host storage with one owner")
        };
        h.words.clear();
        h.words.resize(words, 0);
        h.bytes = bytes;
        fill(&mut h.words);
        s
    }

    /// The smallest spare of `words` to `words` and a quarter words, taken out. No larger
    /// one: a tensor that lives long (a weight, made at load) would hold the rest of a larger
    /// spare's room, outside the caps, for good.
    fn take(&self, words: usize) -> Option<Arc<Storage>> {
        let mut list = self.list();
        let (_, at) = list
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &**s {
                Storage::Cpu(h) if (words..=words + words / 4).contains(&h.words.capacity()) => {
                    Some((h.words.capacity(), i))
                }
                _ => None,
            })
            .min()?;
        Some(list.remove(at))
    }

    /// Keeps `s` when it is host storage that nothing else owns and the caps allow; else it
    /// is dropped. The oldest spares make room.
    fn give_back(&self, s: Arc<Storage>) {
        let fits = matches!(&*s, Storage::Cpu(_)) && (1..=SPARE_MAX).contains(&spare_bytes(&s));
        if !fits || Arc::strong_count(&s) != 1 || Arc::weak_count(&s) != 0 {
            return;
        }
        let mut list = self.list();
        list.push(s);
        let mut held: usize = list.iter().map(|s| spare_bytes(s)).sum();
        // Freed once the lock is let go.
        let mut evicted = Vec::new();
        while list.len() > SPARES || held > SPARE_BYTES {
            let old = list.remove(0);
            held -= spare_bytes(&old);
            evicted.push(old);
        }
        drop(list);
    }
}

/// The storage a dropped tensor leaves behind while its own goes to the spares.
pub(crate) fn vacant() -> Arc<Storage> {
    static VACANT: LazyLock<Arc<Storage>> =
        LazyLock::new(|| Arc::new(Storage::Cpu(HostData::default())));
    VACANT.clone()
}

/// [`Spares::storage`] of the process's spares.
pub(crate) fn storage(bytes: usize, fill: impl FnOnce(&mut [u32])) -> Arc<Storage> {
    SPARE.storage(bytes, fill)
}

/// [`Spares::give_back`] to the process's spares.
pub(crate) fn give_back(s: Arc<Storage>) {
    SPARE.give_back(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words_ptr(s: &Arc<Storage>) -> *const u32 {
        match &**s {
            Storage::Cpu(h) => h.words.as_ptr(),
            Storage::Gpu { .. } => unreachable!(),
        }
    }

    #[test]
    fn a_given_back_storage_is_taken_again_smallest_first() {
        let sp = Spares::default();
        let big = sp.storage(4096, |w| w.fill(1));
        let small = sp.storage(64, |w| w.fill(2));
        let (pb, ps) = (words_ptr(&big), words_ptr(&small));
        sp.give_back(big);
        sp.give_back(small);
        // 56 bytes fit both: the smaller is taken, refilled and zero past what `fill` wrote.
        let s = sp.storage(56, |w| w[0] = 7);
        assert_eq!(words_ptr(&s), ps);
        let Storage::Cpu(h) = &*s else { unreachable!() };
        assert_eq!(h.bytes().len(), 56);
        assert_eq!(h.u32s()[0], 7);
        assert!(h.u32s()[1..].iter().all(|&w| w == 0));
        assert_eq!(h.u32s().len(), 14);
        let b = sp.storage(4000, |_| {});
        assert_eq!(words_ptr(&b), pb);
        assert!(sp.list().is_empty());
        // A spare much larger than asked stays for a request its size.
        sp.give_back(b);
        let tiny = sp.storage(16, |_| {});
        assert_ne!(words_ptr(&tiny), pb);
        assert_eq!(sp.list().len(), 1);
    }

    #[test]
    fn shared_or_oversized_storage_is_not_kept() {
        let sp = Spares::default();
        let s = sp.storage(64, |_| {});
        let other = s.clone();
        sp.give_back(s);
        assert!(sp.list().is_empty(), "still owned by `other`");
        drop(other);
        sp.give_back(sp.storage(SPARE_MAX + 4, |_| {}));
        assert!(sp.list().is_empty(), "larger than a spare may be");
        sp.give_back(sp.storage(64, |_| {}));
        assert_eq!(sp.list().len(), 1);
    }

    #[test]
    fn spares_stay_under_their_caps_oldest_out_first() {
        let sp = Spares::default();
        let all: Vec<_> = (0..2 * SPARES).map(|_| sp.storage(1024, |_| {})).collect();
        let newest = words_ptr(&all[2 * SPARES - 1]);
        all.into_iter().for_each(|s| sp.give_back(s));
        assert_eq!(sp.list().len(), SPARES);
        assert_eq!(words_ptr(&sp.list()[SPARES - 1]), newest);
        let big: Vec<_> = (0..8).map(|_| sp.storage(SPARE_MAX, |_| {})).collect();
        big.into_iter().for_each(|s| sp.give_back(s));
        let held: usize = sp.list().iter().map(|s| spare_bytes(s)).sum();
        assert!(held <= SPARE_BYTES, "{held}");
        assert_eq!(sp.list().len(), SPARE_BYTES / SPARE_MAX);
    }
}
