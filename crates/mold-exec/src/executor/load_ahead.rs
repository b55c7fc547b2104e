//! Reading a part's blocks from the checkpoint on several threads while the loader
//! uploads them in order. Reading a block is host work (slices of the memory-mapped files
//! copied into tensors: about 0.9 GB/s on one core, measured on Qwen-Image's 41 GB), the
//! upload a device copy (about 8 GB/s from pageable memory); read one after the other,
//! loading took 54 s where the copies alone take 5. Up to 8 blocks are read ahead, one per
//! thread, and no more than [`AHEAD_BYTES`] of them, so the host memory loading takes
//! beyond the plan's own stays bounded whatever a block weighs.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};

/// Host memory that blocks read ahead of their upload may hold at once (beyond what the
/// plan's streamed blocks take, which `check_host_memory` counts).
pub(crate) const AHEAD_BYTES: u64 = 6 << 30;

/// How many blocks are read ahead at once, each on its own thread: the machine's cores,
/// at most 8, and no more than [`AHEAD_BYTES`] of blocks of `largest` bytes (at least
/// one). Qwen-Image's and FLUX's blocks (under 0.7 GB in bf16) get all 8.
pub(crate) fn readers(largest: u64) -> usize {
    readers_shared(largest, 1)
}

/// [`readers`] for one of `share` loaders reading at once (a tensor-parallel group's ranks):
/// each gets its share of the cores (still at most 8 threads, at least one) and of
/// [`AHEAD_BYTES`].
pub(crate) fn readers_shared(largest: u64, share: usize) -> usize {
    let share = share.max(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = (cores / share).clamp(1, 8);
    let fit = (AHEAD_BYTES / share as u64 / largest.max(1)).max(1);
    per.min(usize::try_from(fit).unwrap_or(usize::MAX))
}

struct State<T, E> {
    /// The next index a worker may claim.
    next: usize,
    /// Items the consumer has taken and let go (all below this index).
    taken: usize,
    /// Read and not yet taken.
    ready: BTreeMap<usize, Result<T, E>>,
    /// The consumer stopped (an error): workers claim nothing more.
    stop: bool,
}

/// Reads items `0..n` with `read` on up to `threads` threads, never more than `ahead`
/// beyond the one the caller waits for (so at most `ahead` read items are held at once),
/// and hands each to `take` on this thread, in index order. The first error in index
/// order is returned; no item after it is taken, and the workers stop claiming.
pub(crate) fn in_order<T: Send, E: Send>(
    n: usize,
    threads: usize,
    ahead: usize,
    read: impl Fn(usize) -> Result<T, E> + Sync,
    mut take: impl FnMut(usize, T) -> Result<(), E>,
) -> Result<(), E> {
    let threads = threads.clamp(1, n.max(1));
    let ahead = ahead.max(1);
    if threads == 1 {
        for i in 0..n {
            take(i, read(i)?)?;
        }
        return Ok(());
    }
    let state = Mutex::new(State {
        next: 0,
        taken: 0,
        ready: BTreeMap::new(),
        stop: false,
    });
    let changed = Condvar::new();
    let lock = || state.lock().unwrap_or_else(|p| p.into_inner());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = {
                    let mut st = lock();
                    while !st.stop && st.next < n && st.next >= st.taken + ahead {
                        st = changed.wait(st).unwrap_or_else(|p| p.into_inner());
                    }
                    if st.stop || st.next >= n {
                        return;
                    }
                    st.next += 1;
                    st.next - 1
                };
                let r = read(i);
                lock().ready.insert(i, r);
                changed.notify_all();
            });
        }
        let stop = |e: E| {
            lock().stop = true;
            changed.notify_all();
            Err(e)
        };
        for i in 0..n {
            let r = {
                let mut st = lock();
                loop {
                    if let Some(r) = st.ready.remove(&i) {
                        break r;
                    }
                    st = changed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            match r {
                Ok(t) => {
                    if let Err(e) = take(i, t) {
                        return stop(e);
                    }
                }
                Err(e) => return stop(e),
            }
            lock().taken = i + 1;
            changed.notify_all();
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Items arrive in order whatever order the threads finish in, and no more than
    /// `ahead` are ever read beyond the one being waited for.
    #[test]
    fn items_are_taken_in_order_within_the_look_ahead() {
        for (threads, ahead) in [(1, 1), (2, 1), (4, 3), (8, 8)] {
            let taken = AtomicUsize::new(0);
            let most = AtomicUsize::new(0);
            let mut got = Vec::new();
            in_order::<usize, String>(
                40,
                threads,
                ahead,
                |i| {
                    let beyond = i + 1 - taken.load(Ordering::SeqCst);
                    most.fetch_max(beyond, Ordering::SeqCst);
                    // Later items finish sooner: out of order on several threads.
                    std::thread::sleep(std::time::Duration::from_micros(((40 - i) * 50) as u64));
                    Ok(i * 10)
                },
                |i, v| {
                    taken.store(i + 1, Ordering::SeqCst);
                    got.push((i, v));
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(got, (0..40).map(|i| (i, i * 10)).collect::<Vec<_>>());
            assert!(
                most.load(Ordering::SeqCst) <= ahead,
                "{threads} threads, {ahead} ahead"
            );
        }
    }

    /// Blocks read ahead never hold more than `AHEAD_BYTES` together, and one is always
    /// read.
    #[test]
    fn the_look_ahead_is_bounded_by_bytes() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        assert_eq!(readers(700 << 20), cores);
        assert_eq!(readers(AHEAD_BYTES / 2), cores.min(2));
        assert_eq!(readers(AHEAD_BYTES * 3), 1);
        assert_eq!(readers(0), cores);
        for largest in [1u64, 1 << 20, 700 << 20, 2 << 30, 7 << 30] {
            let n = readers(largest) as u64;
            assert!(n == 1 || n * largest <= AHEAD_BYTES, "{largest}: {n}");
        }
    }

    /// Loaders reading at once share the cores and the look-ahead bytes: together they
    /// never hold more than one loader may, and each keeps at least one thread.
    #[test]
    fn loaders_reading_at_once_share_cores_and_bytes() {
        let all = std::thread::available_parallelism().map_or(1, |n| n.get());
        for share in [1usize, 2, 4, 8, 64] {
            for largest in [1u64, 700 << 20, 2 << 30, 7 << 30] {
                let n = readers_shared(largest, share);
                assert!((1..=8).contains(&n), "{share} {largest}: {n}");
                assert!(
                    n == 1 || n <= all / share,
                    "{share} {largest}: {n} of {all} cores"
                );
                let held = (n * share) as u64 * largest;
                assert!(n == 1 || held <= AHEAD_BYTES, "{share} {largest}: {held}");
            }
        }
        assert_eq!(readers_shared(700 << 20, 1), readers(700 << 20));
    }

    /// The first error in index order comes back, nothing after it is taken, and the
    /// workers stop claiming items.
    #[test]
    fn the_first_error_stops_the_reading() {
        let read_count = AtomicUsize::new(0);
        let mut got = Vec::new();
        let r = in_order(
            100,
            4,
            2,
            |i| {
                read_count.fetch_add(1, Ordering::SeqCst);
                if i == 5 || i == 7 {
                    Err(format!("item {i}"))
                } else {
                    Ok(i)
                }
            },
            |i, _| {
                got.push(i);
                Ok(())
            },
        );
        assert_eq!(r, Err("item 5".to_string()));
        assert_eq!(got, [0, 1, 2, 3, 4]);
        assert!(read_count.load(Ordering::SeqCst) <= 5 + 2 + 4);
        // An error from `take` stops it too.
        let r = in_order(10, 3, 3, Ok::<usize, String>, |i, _| {
            if i == 2 {
                Err("take".to_string())
            } else {
                Ok(())
            }
        });
        assert_eq!(r, Err("take".to_string()));
    }
}
