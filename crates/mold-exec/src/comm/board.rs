//! Where the ranks of a one-process group meet for each exchange of the copy-engine
//! all-to-all (`copy_engine.rs`): round `k` holds each rank's post (its receive buffers and
//! the event after which they may be written) and each rank's `sent` (the event after which
//! its copies are done). A rank waits on the host until the others have put theirs, at most
//! the limit, and stops as soon as any rank fails the board (taking what is already there). Rounds are forgotten once
//! every rank has finished them. Nothing here touches a GPU.

use super::CommError;
use candle_core::Result;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Round `k` as the ranks have filled it: `P` a rank's post, `S` its `sent`.
pub(crate) struct Round<P, S> {
    pub(crate) posts: Vec<Option<Arc<P>>>,
    pub(crate) sent: Vec<Option<Arc<S>>>,
    finished: usize,
}

impl<P, S> Round<P, S> {
    fn new(world: usize) -> Self {
        Round {
            posts: (0..world).map(|_| None).collect(),
            sent: (0..world).map(|_| None).collect(),
            finished: 0,
        }
    }
}

/// The longest a rank spins for the others before it sleeps ([`Board::wait_for`]).
const SPIN: Duration = Duration::from_millis(2);

/// What a group's ranks share.
pub(crate) struct Board<P, S> {
    world: usize,
    rounds: Mutex<HashMap<u64, Round<P, S>>>,
    changed: Condvar,
    /// Counts the board's changes, so a waiting rank can spin on it without the lock.
    version: AtomicU64,
    failed: AtomicBool,
    /// The longest a rank waits for the others (the NCCL watchdog's limit; `None`: no limit).
    limit: Option<Duration>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<P, S> Board<P, S> {
    pub(crate) fn new(world: usize, limit: Option<Duration>) -> Self {
        Board {
            world,
            rounds: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            version: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            limit,
        }
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// Changes round `k` with `f` and wakes the ranks waiting on the board.
    pub(crate) fn put(&self, k: u64, f: impl FnOnce(&mut Round<P, S>)) {
        let mut rounds = lock(&self.rounds);
        f(rounds.entry(k).or_insert_with(|| Round::new(self.world)));
        self.version.fetch_add(1, Ordering::SeqCst);
        drop(rounds);
        self.changed.notify_all();
    }

    /// Waits until `done` holds for round `k`, then runs `take` on it (under the lock).
    /// A rank first spins on the board's changes for up to [`SPIN`] (the ranks of a step
    /// meet at every exchange, and a thread put to sleep wakes tens of microseconds after
    /// it is notified), then sleeps until notified.
    /// `what` names what rank `rank` waits for, in the timeout's message. Fails at once
    /// where the board has failed, and fails the board where the limit runs out.
    pub(crate) fn wait_for<T>(
        &self,
        rank: usize,
        k: u64,
        what: &str,
        done: impl Fn(&Round<P, S>) -> bool,
        take: impl FnOnce(&mut Round<P, S>) -> T,
    ) -> Result<T> {
        let start = Instant::now();
        let mut rounds = lock(&self.rounds);
        let mut spun = Duration::ZERO;
        loop {
            // What is there is taken even after a failure: a rank whose peers' copies are
            // all queued must still wait for them before it frees their destinations.
            let round = rounds.entry(k).or_insert_with(|| Round::new(self.world));
            if done(round) {
                return Ok(take(round));
            }
            if self.failed.load(Ordering::SeqCst) {
                return Err(CommError::PeerAborted {
                    rank: format!("rank {rank}"),
                    cause: "a rank of the sequence-parallel group failed".into(),
                }
                .into());
            }
            let waited = start.elapsed();
            let mut step = Duration::from_millis(100);
            if let Some(limit) = self.limit {
                if waited > limit {
                    drop(rounds);
                    self.fail();
                    return Err(CommError::Timeout {
                        rank: format!("rank {rank}"),
                        what: format!("waiting for the other ranks' {what}"),
                        waited,
                        why: "MOLD_NCCL_TIMEOUT_S; another rank stopped or is stuck".into(),
                    }
                    .into());
                }
                step = step.min(limit - waited + Duration::from_millis(1));
            }
            if spun < SPIN {
                let seen = self.version.load(Ordering::SeqCst);
                drop(rounds);
                let t = Instant::now();
                while self.version.load(Ordering::SeqCst) == seen
                    && !self.failed.load(Ordering::SeqCst)
                    && t.elapsed() < SPIN - spun
                {
                    std::hint::spin_loop();
                }
                spun += t.elapsed();
                rounds = lock(&self.rounds);
                continue;
            }
            rounds = self
                .changed
                .wait_timeout(rounds, step)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// A rank is done with round `k`; the last rank to finish forgets it.
    pub(crate) fn finished(&self, k: u64) {
        let mut rounds = lock(&self.rounds);
        if let Some(r) = rounds.get_mut(&k) {
            r.finished += 1;
            if r.finished == self.world {
                rounds.remove(&k);
            }
        }
    }

    /// Every waiting rank stops (with [`CommError::PeerAborted`]), and every later wait.
    pub(crate) fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.changed.notify_all();
    }

    /// Rounds not yet finished by every rank.
    #[cfg(test)]
    fn open_rounds(&self) -> usize {
        lock(&self.rounds).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = Board<usize, usize>;

    /// Three ranks post in any order; each sees every post of its round and its round only;
    /// the round is forgotten once all three finished it.
    #[test]
    fn every_rank_sees_every_post_of_its_round() {
        let board = B::new(3, Some(Duration::from_secs(10)));
        let got: Vec<Vec<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let board = &board;
                    s.spawn(move || {
                        let mut seen = Vec::new();
                        for k in 0..4u64 {
                            std::thread::sleep(Duration::from_millis((rank as u64 * 7 + k) % 5));
                            board.put(k, |r| {
                                r.posts[rank] = Some(Arc::new(100 * k as usize + rank))
                            });
                            let posts: Vec<usize> = board
                                .wait_for(
                                    rank,
                                    k,
                                    "posts",
                                    |r| r.posts.iter().all(Option::is_some),
                                    |r| r.posts.iter().flatten().map(|p| **p).collect(),
                                )
                                .unwrap();
                            seen.extend(posts);
                            board.finished(k);
                        }
                        seen
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for seen in got {
            let want: Vec<usize> = (0..4)
                .flat_map(|k| (0..3).map(move |r| 100 * k + r))
                .collect();
            assert_eq!(seen, want);
        }
        assert_eq!(board.open_rounds(), 0);
    }

    /// A rank whose partner never posts stops at the limit, naming what it waited for, and
    /// fails the board: the next wait stops at once as another rank's failure.
    #[test]
    fn a_missing_rank_times_out_and_fails_the_board() {
        let board = B::new(2, Some(Duration::from_millis(150)));
        board.put(0, |r| r.posts[0] = Some(Arc::new(1)));
        let start = Instant::now();
        let e = board
            .wait_for(
                0,
                0,
                "messages",
                |r| r.posts.iter().all(Option::is_some),
                |_| (),
            )
            .unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(150));
        assert!(start.elapsed() < Duration::from_secs(5));
        let m = e.to_string();
        assert!(m.contains("timed out") && m.contains("messages"), "{m}");
        let e = board
            .wait_for(1, 0, "copies", |_| false, |_| ())
            .unwrap_err();
        assert!(CommError::is_peer_aborted(&e), "{e}");
    }

    /// A round every rank completed is still taken after the board failed (a rank must wait
    /// for copies already queued into its buffers); an incomplete one is not.
    #[test]
    fn a_complete_round_is_taken_after_a_failure() {
        let board = B::new(2, None);
        board.put(3, |r| r.sent = vec![Some(Arc::new(1)), Some(Arc::new(2))]);
        board.fail();
        let all = |r: &Round<usize, usize>| r.sent.iter().all(Option::is_some);
        let got = board.wait_for(0, 3, "copies", all, |r| r.sent.iter().flatten().count());
        assert_eq!(got.unwrap(), 2);
        assert!(board.wait_for(0, 4, "copies", all, |_| ()).is_err());
    }

    /// A rank that fails the board releases the ranks waiting on it at once.
    #[test]
    fn failing_the_board_releases_the_waiting_ranks() {
        let board = B::new(2, None);
        std::thread::scope(|s| {
            let h = s.spawn(|| {
                let start = Instant::now();
                let r = board.wait_for(1, 5, "copies", |r| r.sent[0].is_some(), |_| ());
                (r, start.elapsed())
            });
            std::thread::sleep(Duration::from_millis(50));
            board.fail();
            let (r, waited) = h.join().unwrap();
            assert!(CommError::is_peer_aborted(&r.unwrap_err()));
            assert!(waited < Duration::from_secs(5), "{waited:?}");
        });
    }
}
