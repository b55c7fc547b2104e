//! One value per key (a device, a device and stream: library handles, cuDNN state), made on
//! first use. The map's lock only finds the key's cell; the value is made outside it under
//! the cell's own lock, so threads making values for different keys (the ranks of a
//! multi-GPU plan, each its device's handles) do not wait on each other, and two threads
//! asking for one key make it once. A failed make leaves the cell empty: the next call
//! tries again.
//!
//! **Per-thread streams.** A device's per-thread stream (`CU_STREAM_PER_THREAD`, candle's
//! default) is one handle value that names a different stream on every thread, so a value
//! keyed by (device, stream) would be shared by streams that run at once — a library
//! handle's workspace written by two threads' products together (seen as wrong outputs of
//! a decode whose bands ran on threads of one GPU). [`Cells::for_stream`] keeps such values
//! per thread instead, dropped when the thread ends.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

type Cell<T> = Arc<Mutex<Option<Arc<Mutex<T>>>>>;

pub(crate) struct Cells<K, T>(OnceLock<Mutex<HashMap<K, Cell<T>>>>);

/// The handle value of a device's per-thread stream (`CU_STREAM_PER_THREAD`).
pub(crate) const PER_THREAD_STREAM: usize = 0x2;

thread_local! {
    /// This thread's values for per-thread streams, by (the [`Cells`]' address, device).
    static MINE: RefCell<HashMap<(usize, usize), Box<dyn Any>>> = RefCell::new(HashMap::new());
}

impl<T: 'static> Cells<(usize, usize), T> {
    /// The value for device `device`'s stream `stream` (its raw handle), made by `make` if
    /// there is none yet: one for every thread that asks where `stream` is the per-thread
    /// stream, else one for all.
    pub(crate) fn for_stream<E>(
        &'static self,
        device: usize,
        stream: usize,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<Mutex<T>>, E> {
        if stream != PER_THREAD_STREAM {
            return self.get_or_make((device, stream), make);
        }
        let key = (self as *const Self as usize, device);
        if let Some(v) = MINE.with(|m| {
            m.borrow()
                .get(&key)
                .and_then(|b| b.downcast_ref::<Arc<Mutex<T>>>().cloned())
        }) {
            return Ok(v);
        }
        let v = Arc::new(Mutex::new(make()?));
        MINE.with(|m| m.borrow_mut().insert(key, Box::new(v.clone())));
        Ok(v)
    }
}

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

    /// On a per-thread stream every thread has its own value; on any other stream all
    /// threads share one.
    #[test]
    fn per_thread_streams_get_a_value_per_thread() {
        static C: Cells<(usize, usize), usize> = Cells::new();
        let made = AtomicUsize::new(0);
        let make = || -> Result<usize, ()> { Ok(made.fetch_add(1, Ordering::SeqCst)) };
        let mine = C.for_stream(0, PER_THREAD_STREAM, make).unwrap();
        let again = C.for_stream(0, PER_THREAD_STREAM, make).unwrap();
        assert!(Arc::ptr_eq(&mine, &again));
        let shared = C.for_stream(0, 0x1234, make).unwrap();
        let other_device = C.for_stream(1, PER_THREAD_STREAM, make).unwrap();
        assert!(!Arc::ptr_eq(&mine, &other_device));
        std::thread::scope(|s| {
            s.spawn(|| {
                let theirs = C.for_stream(0, PER_THREAD_STREAM, make).unwrap();
                assert!(!Arc::ptr_eq(&mine, &theirs), "a thread of its own");
                let same = C.for_stream(0, 0x1234, make).unwrap();
                assert!(Arc::ptr_eq(&shared, &same), "one for a stream of its own");
            });
        });
        assert_eq!(made.load(Ordering::SeqCst), 4);
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
