//! One value per key (a device, a device and stream: library handles, cuDNN state), made on
//! first use. The map's lock only finds the key's cell; the value is made outside it under
//! the cell's own lock, so threads making values for different keys (the ranks of a
//! multi-GPU plan, each its device's handles) do not wait on each other, and two threads
//! asking for one key make it once. A failed make leaves the cell empty: the next call
//! tries again.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

type Cell<T> = Arc<Mutex<Option<Arc<Mutex<T>>>>>;

pub(crate) struct Cells<K, T>(OnceLock<Mutex<HashMap<K, Cell<T>>>>);

impl<K: Eq + Hash, T> Cells<K, T> {
    pub(crate) const fn new() -> Self {
        Cells(OnceLock::new())
    }

    /// The value for `key`, made by `make` if there is none yet.
    pub(crate) fn get_or_make<E>(
        &self,
        key: K,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<Mutex<T>>, E> {
        let cell = self
            .0
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default()
            .clone();
        let mut slot = cell.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = slot.as_ref() {
            return Ok(v.clone());
        }
        let v = Arc::new(Mutex::new(make()?));
        *slot = Some(v.clone());
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;
    use std::time::Duration;

    #[test]
    fn one_key_is_made_once_and_a_failure_is_tried_again() {
        static C: Cells<u32, usize> = Cells::new();
        let made = AtomicUsize::new(0);
        let e: Result<_, &str> = C.get_or_make(1, || Err("no memory"));
        assert!(e.is_err());
        let gate = Barrier::new(8);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    gate.wait();
                    let v = C
                        .get_or_make(1, || -> Result<_, ()> {
                            std::thread::sleep(Duration::from_millis(20));
                            Ok(made.fetch_add(1, Ordering::SeqCst) + 100)
                        })
                        .unwrap();
                    assert_eq!(*v.lock().unwrap(), 100);
                });
            }
        });
        assert_eq!(made.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn keys_are_made_at_once_not_one_after_another() {
        static C: Cells<u32, u32> = Cells::new();
        let gate = Barrier::new(2);
        // Each make waits for the other key's make to start: made one after another (the
        // map's lock held while making) this would never finish.
        std::thread::scope(|s| {
            for k in 0..2u32 {
                let gate = &gate;
                s.spawn(move || {
                    C.get_or_make(k, || -> Result<_, ()> {
                        gate.wait();
                        Ok(k)
                    })
                    .unwrap()
                });
            }
        });
    }
}
