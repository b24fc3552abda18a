//! [`Keep`]: a value kept from call to call for the room it holds (a step's lists, a
//! kernel's scratch), so that a warm step allocates nothing.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// A value kept between calls for its room. [`Keep::with`] takes it out while a call uses it
/// and puts it back after: no lock is held while the call runs, so a call beside it, or one
/// that a thread waiting in the pool picks up inside it, finds a fresh default value instead
/// of waiting (a lock held across the pool's work can deadlock: the holder may be the thread
/// that runs the waiter's job).
#[derive(Debug, Default)]
pub struct Keep<T>(Mutex<T>);

impl<T: Default> Keep<T> {
    pub fn new(value: T) -> Self {
        Self(Mutex::new(value))
    }

    /// `f` over the kept value (a default one when another call has it out).
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut value = std::mem::take(&mut *self.lock());
        let r = f(&mut value);
        *self.lock() = value;
        r
    }

    fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_value_comes_back_and_a_use_inside_a_use_gets_a_fresh_one() {
        let k = Keep::new(vec![1, 2, 3]);
        let inner = k.with(|v| {
            v.push(4);
            k.with(|w| w.len())
        });
        assert_eq!(inner, 0, "the outer use has it out");
        assert_eq!(k.with(|v| v.clone()), [1, 2, 3, 4]);
    }
}
