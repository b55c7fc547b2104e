//! The NCCL watchdog: what each rank is doing ([`Tracker`]), the monitor thread of a
//! group (pending all-reduces past the limit, NCCL's asynchronous errors, the run's
//! failure signal), and the last resort of ending a process that would hang.

use super::group::{describe_ranks, Group};
use super::{async_error, CommError};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Why a watchdog timeout fired, for [`CommError::Timeout`].
pub(super) fn why(limit: Duration) -> String {
    format!(
        "watchdog MOLD_NCCL_TIMEOUT_S={}: a rank did not join or the GPUs are stuck; the \
         group was aborted",
        limit.as_secs_f64()
    )
}

/// What each rank is doing, for the monitor: which NCCL host call it is inside (a call
/// that never returns cannot be timed out by the rank itself) and how many collectives
/// it has issued.
pub(super) struct Tracker {
    epoch: Instant,
    /// Per rank: ms since `epoch` + 1 when it entered an NCCL host call, 0 when outside.
    busy_since: Vec<AtomicU64>,
    /// Per rank: index into [`CALLS`] of that call.
    busy_call: Vec<AtomicUsize>,
    /// Per rank: collectives enqueued so far.
    pub(super) issued: Vec<AtomicU64>,
    /// ms since `epoch` + 1 when the group failed, 0 while healthy.
    pub(super) failed_at: AtomicU64,
}

const CALLS: [&str; 5] = [
    "ncclAllReduce",
    "ncclCommAbort",
    "ncclSend/ncclRecv (all-to-all)",
    "ncclAllGather",
    "ncclReduceScatter",
];
pub(super) const CALL_ALL_REDUCE: usize = 0;
pub(super) const CALL_ABORT: usize = 1;
pub(super) const CALL_ALL_TO_ALL: usize = 2;
pub(super) const CALL_ALL_GATHER: usize = 3;
pub(super) const CALL_REDUCE_SCATTER: usize = 4;

impl Tracker {
    pub(super) fn new(world: usize) -> Tracker {
        Tracker {
            epoch: Instant::now(),
            busy_since: (0..world).map(|_| AtomicU64::new(0)).collect(),
            busy_call: (0..world).map(|_| AtomicUsize::new(0)).collect(),
            issued: (0..world).map(|_| AtomicU64::new(0)).collect(),
            failed_at: AtomicU64::new(0),
        }
    }
    pub(super) fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }
    /// Runs `f` (an NCCL host call of `rank`) marked busy.
    pub(super) fn busy<R>(&self, rank: usize, call: usize, f: impl FnOnce() -> R) -> R {
        self.busy_call[rank].store(call, Ordering::SeqCst);
        self.busy_since[rank].store(self.now(), Ordering::SeqCst);
        let r = f();
        self.busy_since[rank].store(0, Ordering::SeqCst);
        r
    }
    /// One line per rank, for diagnostics.
    fn dump(&self, ordinals: &[usize]) -> String {
        let now = self.now();
        ordinals
            .iter()
            .enumerate()
            .filter(|(_, o)| **o != usize::MAX)
            .map(|(r, o)| {
                let since = self.busy_since[r].load(Ordering::SeqCst);
                let state = if since == 0 {
                    "not inside an NCCL call".to_string()
                } else {
                    format!(
                        "inside {} for {:.1} s",
                        CALLS[self.busy_call[r].load(Ordering::SeqCst)],
                        now.saturating_sub(since) as f64 / 1e3
                    )
                };
                format!(
                    "  rank {r} (cuda:{o}): {} collectives issued, {state}",
                    self.issued[r].load(Ordering::SeqCst)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Group {
    /// The monitor's share of the watchdog, for ranks that are not inside a call on
    /// their communicator (the host does not wait for each all-reduce): fails the group
    /// when another process failed, when an all-reduce has been pending longer than
    /// `limit`, or when NCCL reports an asynchronous error; then aborts the communicators
    /// of a failed group, which ends their kernels, so a rank waiting for its GPU
    /// (synchronize) returns and sees the failure ([`Comm::check`]).
    fn watch_pending(&self, limit: Duration) {
        self.poll_signal();
        if !self.is_failed() {
            for s in &self.slots {
                // A rank inside a call watches itself.
                let Ok(slot) = s.try_lock() else { continue };
                let Some(comm) = slot.comm.as_ref().map(|c| c.0) else {
                    continue;
                };
                // The oldest collective still running. Finished ones are left for the rank
                // to drop ([`Comm::check`]): destroying an event here could wait for the
                // driver's lock behind a rank that waits for this group's kernels, and
                // only this thread can abort them (see `RankSlot::abort`).
                let oldest = slot
                    .pending
                    .iter()
                    .find(|(e, _)| !matches!(e.try_is_complete(), Ok(true)));
                let where_ = self.here(slot.rank);
                if let Some((_, t)) = oldest {
                    if t.elapsed() > limit {
                        let e = CommError::Timeout {
                            rank: where_,
                            what: "a collective enqueued".into(),
                            waited: t.elapsed(),
                            why: why(limit),
                        };
                        self.fail(Some(slot.rank), e);
                        break;
                    }
                }
                if let Some(e) = async_error(comm) {
                    let e = CommError::Local(format!("{where_}: NCCL reported an error: {e}"));
                    self.fail(Some(slot.rank), e);
                    break;
                }
            }
        }
        if self.is_failed() {
            for s in &self.slots {
                if let Ok(mut slot) = s.try_lock() {
                    slot.abort();
                }
            }
        }
    }
}

/// Starts the monitor of a new group (with the watchdog on), and its deadline.
pub(super) fn watch(g: &Arc<Group>) {
    if let Some(limit) = g.limit {
        let weak = Arc::downgrade(g);
        let _ = std::thread::Builder::new()
            .name("nccl-monitor".into())
            .spawn(move || monitor(weak, limit));
        let (weak, tracker, ordinals) = (Arc::downgrade(g), g.tracker.clone(), g.ordinals.clone());
        let _ = std::thread::Builder::new()
            .name("nccl-deadline".into())
            .spawn(move || deadline(weak, tracker, ordinals, limit));
    }
}

/// Watches a group for what the ranks cannot time out themselves ([`Group::watch_pending`]:
/// collectives pending past the limit, NCCL's asynchronous errors, the run's failure
/// signal), and aborts a failed group's communicators. Its CUDA and NCCL calls (an event's
/// query, an abort) can wait for the driver behind a rank that waits for its GPU; what
/// must happen even then is [`deadline`]'s. Stops when the group is dropped.
fn monitor(group: Weak<Group>, limit: Duration) {
    loop {
        std::thread::sleep(Duration::from_millis(100).min(limit));
        let Some(g) = group.upgrade() else { return };
        g.watch_pending(limit);
    }
}

/// Ends the process (with a report naming the ranks) rather than let it hang, from the
/// group's counters alone — no CUDA or NCCL call, so nothing here waits for the driver:
/// - a rank inside an NCCL host call (e.g. `ncclAllReduce` blocked in connection setup,
///   or `ncclCommAbort`) for longer than `limit`;
/// - a failed group whose ranks have not all let go of it `limit` after the failure (a
///   rank stuck outside NCCL keeps the executor waiting for it, or the monitor waits for
///   the driver behind it).
///
/// Stops when the group is dropped.
///
/// It holds the group's counters, not the group: were it to hold the last reference when
/// the ranks let go, the group's teardown (its communicators' abort) would run here.
fn deadline(group: Weak<Group>, tracker: Arc<Tracker>, ordinals: Vec<usize>, limit: Duration) {
    loop {
        std::thread::sleep(Duration::from_millis(100).min(limit));
        if group.strong_count() == 0 {
            return;
        }
        if overdue(&tracker, &ordinals, limit, String::new).is_none() {
            continue;
        }
        // Held until the process ends here, so the group is never dropped on this thread.
        let Some(g) = group.upgrade() else { return };
        if let Some(what) = overdue(&tracker, &ordinals, limit, || g.failure_text()) {
            eprintln!(
                "error: {what}; ending the process instead of hanging.\n{}\n\
                 (NCCL_DEBUG=INFO shows NCCL's side; MOLD_NCCL_TIMEOUT_S sets the limit)",
                tracker.dump(&ordinals)
            );
            std::process::abort();
        }
    }
}

/// Why a group must end its process now, if it must: a rank inside an NCCL call for more
/// than `limit`, or a failure older than `limit` (`failure()`: what failed, for the
/// message).
fn overdue(
    t: &Tracker,
    ordinals: &[usize],
    limit: Duration,
    failure: impl FnOnce() -> String,
) -> Option<String> {
    let limit_ms = limit.as_millis() as u64;
    let now = t.now();
    let stuck_in_call = (0..t.busy_since.len()).find(|&r| {
        let since = t.busy_since[r].load(Ordering::SeqCst);
        since != 0 && now.saturating_sub(since) > limit_ms
    });
    if let Some(r) = stuck_in_call {
        return Some(format!(
            "NCCL rank {r} (cuda:{}) has been inside {} for more than {:.0} s \
             (MOLD_NCCL_TIMEOUT_S)",
            ordinals.get(r).copied().unwrap_or(usize::MAX),
            CALLS[t.busy_call[r].load(Ordering::SeqCst)],
            limit.as_secs_f64()
        ));
    }
    let failed_at = t.failed_at.load(Ordering::SeqCst);
    if failed_at != 0 && now.saturating_sub(failed_at) > limit_ms {
        return Some(format!(
            "the NCCL group ({}) failed ({}) and its ranks have not stopped {:.0} s later",
            describe_ranks(ordinals),
            failure(),
            limit.as_secs_f64()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The deadline's reasons come from the counters alone: nothing while every rank is
    /// outside NCCL and the group is healthy, or within the limit; a rank inside a call
    /// past the limit; a failure older than the limit.
    #[test]
    fn a_group_is_overdue_past_the_limit_only() {
        let t = Tracker::new(2);
        let limit = Duration::from_millis(50);
        let none = || -> String { unreachable!() };
        assert_eq!(overdue(&t, &[0, 1], limit, none), None);
        t.busy_call[1].store(CALL_ALL_REDUCE, Ordering::SeqCst);
        t.busy_since[1].store(t.now(), Ordering::SeqCst);
        assert_eq!(overdue(&t, &[0, 1], limit, none), None);
        std::thread::sleep(Duration::from_millis(80));
        let m = overdue(&t, &[0, 1], limit, none).unwrap();
        assert!(
            m.contains("rank 1 (cuda:1)") && m.contains("ncclAllReduce"),
            "{m}"
        );
        t.busy_since[1].store(0, Ordering::SeqCst);
        t.failed_at.store(t.now(), Ordering::SeqCst);
        assert_eq!(overdue(&t, &[0, 1], limit, none), None);
        std::thread::sleep(Duration::from_millis(80));
        let m = overdue(&t, &[0, 1], limit, || "rank 1 failed".into()).unwrap();
        let ranks = describe_ranks(&[0, 1]);
        assert!(m.contains(&ranks) && m.contains("rank 1 failed"), "{m}");
    }
}
