//! NCCL groups: creating the communicators (one helper thread per rank), the
//! process-wide pool of healthy groups, and a group's shared failure state.

use super::watchdog::{watch, Tracker, CALL_ABORT};
use super::{describe, lock, nccl, sys, AbortSignal, CommError, NcclComm};
use candle_core::cuda::cudarc;
use cudarc::driver::{CudaContext, CudaEvent};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

/// Sets `NCCL_NVLS_ENABLE=0` unless the user set it: NVLink multicast (NVLS) is off on
/// the shared machines this runs on. Done once, before the first NCCL call.
pub(crate) fn set_nccl_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
}

/// `cuda:0, cuda:1, (another process)` for messages.
pub(super) fn describe_ranks(ordinals: &[usize]) -> String {
    ordinals
        .iter()
        .enumerate()
        .map(|(r, o)| match *o {
            usize::MAX => format!("rank {r} in another process"),
            o => format!("rank {r} on cuda:{o}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A raw communicator handle. NCCL communicators may be used from any thread as long as
/// calls on one communicator do not overlap; [`RankSlot`]'s mutex guarantees that.
pub(super) struct RawComm(pub(super) sys::ncclComm_t);
// SAFETY: see above; the handle is only used under the slot's lock.
unsafe impl Send for RawComm {}

/// One rank's communicator. `comm` is `None` once aborted.
pub(super) struct RankSlot {
    pub(super) rank: usize,
    pub(super) ordinal: usize,
    pub(super) comm: Option<RawComm>,
    /// All-reduces enqueued and not known to be finished: an event recorded after each,
    /// and when it was enqueued (the watchdog's clock).
    pub(super) pending: VecDeque<(CudaEvent, Instant)>,
    /// Keeps the GPU's primary context alive as long as the communicator.
    pub(super) ctx: Option<Arc<CudaContext>>,
    /// The stream chunked sums run on beside the compute ([`super::overlap`]), made on
    /// first use.
    pub(super) side: Option<Arc<cudarc::driver::CudaStream>>,
    tracker: Option<Arc<Tracker>>,
}

impl RankSlot {
    /// Aborts the communicator (once); stops its kernels and frees its resources. The
    /// pending collectives' events are destroyed only after the abort: destroying an event
    /// waits for the CUDA driver's lock, which another thread of the process may hold
    /// while it waits for the GPU — e.g. a rank loading a kernel on first use (lazy module
    /// loading) behind this communicator's kernel, which waits for a peer that failed —
    /// so only the abort, which ends that kernel, can let it go (seen on 4 × H200: a rank
    /// whose peer panicked hung in cuBLAS's first product of a shape, the watchdog in
    /// `cuEventDestroy`).
    pub(super) fn abort(&mut self) {
        if let Some(c) = self.comm.take() {
            if let Some(ctx) = &self.ctx {
                let _ = ctx.bind_to_thread();
            }
            // SAFETY: the handle is live (taken out of the slot, so aborted only once) and
            // no other call on it is in flight (we hold the slot's lock).
            let abort = || {
                let _ = unsafe { nccl::comm_abort(c.0) };
            };
            match &self.tracker {
                Some(t) => t.busy(self.rank, CALL_ABORT, abort),
                None => abort(),
            }
        }
        self.pending.clear();
    }
}

/// The first failure of a group.
#[derive(Clone, Debug)]
pub(super) struct Failure {
    /// The rank at fault; `None` for the whole group (its creation failed, or another
    /// process of the run did).
    rank: Option<usize>,
    error: CommError,
}

/// The shared state of one NCCL group.
pub(super) struct Group {
    /// GPU ordinals of ranks 0..world (with the watchdog limit, the pool key).
    pub(super) ordinals: Vec<usize>,
    pub(super) slots: Vec<Mutex<RankSlot>>,
    /// Set when any rank failed; the others stop and abort.
    failed: AtomicBool,
    /// The first failure, for messages.
    failure: Mutex<Option<Failure>>,
    pub(super) tracker: Arc<Tracker>,
    /// The watchdog's limit (`None`: no watchdog).
    pub(super) limit: Option<Duration>,
    /// The run this group works for, when it is part of a multi-process run: its failure
    /// fails the group. Set anew each time a pooled group is handed out.
    signal: Mutex<Option<AbortSignal>>,
}

impl Group {
    pub(super) fn world(&self) -> usize {
        self.slots.len()
    }

    /// `NCCL rank r (cuda:N)`, for messages.
    pub(super) fn here(&self, rank: usize) -> String {
        match self.ordinals.get(rank) {
            Some(&o) if o != usize::MAX => format!("NCCL rank {rank} (cuda:{o})"),
            _ => format!("NCCL rank {rank}"),
        }
    }

    /// Records the first failure (of `rank`, or of the whole group) and raises the flag.
    pub(super) fn fail(&self, rank: Option<usize>, error: CommError) {
        let mut f = lock(&self.failure);
        if f.is_none() {
            *f = Some(Failure { rank, error });
            let _ = self.tracker.failed_at.compare_exchange(
                0,
                self.tracker.now(),
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
        self.failed.store(true, Ordering::SeqCst);
    }

    pub(super) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// The first failure's message, for reports.
    pub(super) fn failure_text(&self) -> String {
        lock(&self.failure)
            .as_ref()
            .map(|f| f.error.to_string())
            .unwrap_or_default()
    }

    /// Fails the group when the run it works for failed (another process).
    pub(super) fn poll_signal(&self) {
        let why = lock(&self.signal).as_ref().and_then(AbortSignal::reason);
        if let Some(why) = why {
            if !self.is_failed() {
                let cause = CommError::PeerAborted {
                    rank: String::new(),
                    cause: why,
                };
                self.fail(None, cause);
            }
        }
    }

    /// The error rank `rank` returns once the group failed: the failure itself when it
    /// was this rank's or the whole group's (a failed creation), else
    /// [`CommError::PeerAborted`] naming it.
    pub(super) fn peer_failed_error(&self, rank: usize) -> candle_core::Error {
        let failure = lock(&self.failure).clone();
        match failure {
            Some(Failure {
                rank: Some(r),
                error,
            }) if r == rank => error.into(),
            Some(Failure { rank: None, error })
                if !matches!(error, CommError::PeerAborted { .. }) =>
            {
                error.into()
            }
            f => CommError::PeerAborted {
                rank: format!("{}; its communicator was aborted", self.here(rank)),
                cause: f
                    .map(|f| f.error.cause())
                    .unwrap_or_else(|| "unknown reason".into()),
            }
            .into(),
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Not pooled (failed, or the process is tearing the group down): no thread uses
        // it any more, abort whatever is left.
        for s in &self.slots {
            lock(s).abort();
        }
    }
}

/// Process-wide pool of healthy groups, keyed by their GPU ordinals.
static POOL: Mutex<Vec<Arc<Group>>> = Mutex::new(Vec::new());

/// A group handed out by [`group`]; back to the pool when the last rank handle drops.
pub(super) struct Lease(Option<Arc<Group>>);

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            if !g.is_failed() {
                lock(&POOL).push(g);
            }
        }
    }
}

/// Communicators for a group over GPUs `ordinals` of this process (rank i on GPU
/// `ordinals[i]`; distinct ordinals), reused from the pool when a healthy group over the
/// same GPUs with the same `watchdog` is free. `signal`: the multi-process run this group
/// works for, whose failure fails the group (`None` in a one-process run).
///
/// Never fails: if creation fails, every handle of the returned group reports the error
/// (naming the rank at fault) from its first collective.
pub fn local_group(
    ordinals: &[usize],
    watchdog: Option<Duration>,
    signal: Option<AbortSignal>,
) -> Vec<NcclComm> {
    if ordinals.is_empty() {
        return Vec::new();
    }
    let pooled = {
        let mut pool = lock(&POOL);
        pool.iter()
            .position(|g| g.ordinals == ordinals && g.limit == watchdog)
            .map(|i| pool.swap_remove(i))
    };
    let group = pooled.unwrap_or_else(|| {
        let g = Arc::new(create(ordinals, watchdog));
        watch(&g);
        g
    });
    *lock(&group.signal) = signal;
    let lease = Arc::new(Lease(Some(group.clone())));
    (0..ordinals.len())
        .map(|rank| NcclComm {
            rank,
            group: group.clone(),
            _lease: lease.clone(),
            chunks: 1,
        })
        .collect()
}

/// A new `ncclUniqueId`, as bytes to send to the other processes of a group.
pub fn unique_id() -> std::result::Result<Vec<u8>, String> {
    set_nccl_env();
    let id = nccl::get_uniqueid()
        .map_err(|e| format!("ncclGetUniqueId failed: {}", describe(&e, None)))?;
    Ok(id.internal.iter().map(|b| *b as u8).collect())
}

/// This process's ranks of a group of `world` ranks that spans processes: `local` lists
/// (rank, GPU ordinal) of the ranks made here; `id` is [`unique_id`]'s bytes from the
/// process of rank 0; `signal` is the run's (the mesh's). Not pooled: the caller keeps
/// the handles for the whole run. Like [`local_group`], never fails: a failed creation
/// shows in every handle's first collective.
pub fn spanning_group(
    id: &[u8],
    world: usize,
    local: &[(usize, usize)],
    watchdog: Option<Duration>,
    signal: Option<AbortSignal>,
) -> Vec<NcclComm> {
    let mut raw = sys::ncclUniqueId { internal: [0; 128] };
    let failure = if id.len() == raw.internal.len() {
        for (d, s) in raw.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        None
    } else {
        Some(format!(
            "the ncclUniqueId from rank 0's process has {} bytes, expected {}",
            id.len(),
            raw.internal.len()
        ))
    };
    let g = Arc::new(match failure {
        None => create_ranks(world, Ok(raw), local, watchdog),
        Some(f) => create_ranks(world, Err(f), local, watchdog),
    });
    *lock(&g.signal) = signal;
    watch(&g);
    let lease = Arc::new(Lease(None));
    local
        .iter()
        .map(|&(rank, _)| NcclComm {
            rank,
            group: g.clone(),
            _lease: lease.clone(),
            chunks: 1,
        })
        .collect()
}

type InitResult = std::result::Result<(RawComm, Arc<CudaContext>), String>;

/// Creates the communicators of a one-process group: one helper thread per rank calls
/// `ncclCommInitRank` concurrently (it blocks until all ranks have joined).
fn create(ordinals: &[usize], limit: Option<Duration>) -> Group {
    set_nccl_env();
    let id =
        nccl::get_uniqueid().map_err(|e| format!("ncclGetUniqueId failed: {}", describe(&e, None)));
    let local: Vec<(usize, usize)> = ordinals.iter().copied().enumerate().collect();
    create_ranks(ordinals.len(), id, &local, limit)
}

/// Creates the communicators of ranks `local` ((rank, GPU ordinal)) of a group of
/// `world` ranks sharing `id`; the other ranks are made elsewhere (other processes).
fn create_ranks(
    world: usize,
    id: std::result::Result<sys::ncclUniqueId, String>,
    local: &[(usize, usize)],
    limit: Option<Duration>,
) -> Group {
    set_nccl_env();
    let tracker = Arc::new(Tracker::new(world));
    // Ranks made elsewhere keep `usize::MAX` as their ordinal and never get a communicator.
    let mut ordinals = vec![usize::MAX; world];
    let mut bad = None;
    for &(r, o) in local {
        match ordinals.get_mut(r) {
            Some(x) if *x == usize::MAX => *x = o,
            _ => {
                bad = Some(format!(
                    "rank {r} is not a distinct rank of a group of {world}"
                ))
            }
        }
    }
    let mut slots: Vec<RankSlot> = ordinals
        .iter()
        .enumerate()
        .map(|(rank, &ordinal)| RankSlot {
            rank,
            ordinal,
            comm: None,
            pending: VecDeque::new(),
            ctx: None,
            side: None,
            tracker: Some(tracker.clone()),
        })
        .collect();
    let finish = |slots: Vec<RankSlot>, failure: Option<String>| Group {
        ordinals: ordinals.clone(),
        slots: slots.into_iter().map(Mutex::new).collect(),
        failed: AtomicBool::new(failure.is_some()),
        failure: Mutex::new(failure.map(|m| Failure {
            rank: None,
            error: CommError::Local(m),
        })),
        tracker: tracker.clone(),
        limit,
        signal: Mutex::new(None),
    };

    let id = match (id, bad) {
        (_, Some(e)) | (Err(e), _) => return finish(slots, Some(e)),
        (Ok(id), None) => id,
    };
    let (tx, rx) = mpsc::channel::<(usize, InitResult)>();
    for &(rank, ordinal) in local {
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let r = init_rank(ordinal, rank, world, id);
                if let Err(mpsc::SendError((_, Ok((c, ctx))))) = tx.send((rank, r)) {
                    // Nobody waits any more (the group timed out): don't leak it live.
                    let mut s = RankSlot {
                        rank,
                        ordinal,
                        comm: Some(c),
                        pending: VecDeque::new(),
                        ctx: Some(ctx),
                        side: None,
                        tracker: None,
                    };
                    s.abort();
                }
            });
        if let Err(e) = spawned {
            // The ranks already started wait for this one: their helper threads stay
            // blocked; the group is failed.
            return finish(
                slots,
                Some(format!(
                    "rank {rank} (cuda:{ordinal}): cannot start a thread to create its \
                     NCCL communicator: {e}"
                )),
            );
        }
    }
    drop(tx);

    let start = Instant::now();
    let mut errors: Vec<String> = Vec::new();
    let mut done = 0;
    while done < local.len() {
        let msg = match limit {
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(l) => rx.recv_timeout(l.saturating_sub(start.elapsed())),
        };
        match msg {
            Ok((rank, Ok((c, ctx)))) => {
                slots[rank].comm = Some(c);
                slots[rank].ctx = Some(ctx);
                done += 1;
            }
            Ok((rank, Err(e))) => {
                errors.push(format!("rank {rank} (cuda:{}): {e}", ordinals[rank]));
                // The others wait in ncclCommInitRank for this rank: give them a moment
                // to fail too (for their messages), but don't wait for the full timeout.
                if done + 1 < local.len() {
                    std::thread::sleep(Duration::from_millis(200));
                    while let Ok((r, res)) = rx.try_recv() {
                        match res {
                            Ok((c, ctx)) => {
                                slots[r].comm = Some(c);
                                slots[r].ctx = Some(ctx);
                            }
                            Err(e) => errors.push(format!("rank {r} (cuda:{}): {e}", ordinals[r])),
                        }
                    }
                }
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                errors.push("a thread creating an NCCL communicator died".into());
                break;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let missing: Vec<String> = slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.comm.is_none() && s.ordinal != usize::MAX)
                    .map(|(r, s)| format!("rank {r} (cuda:{})", s.ordinal))
                    .collect();
                errors.push(format!(
                    "creating the NCCL communicators timed out after {:.0} s waiting for {} \
                     (another process's ranks may not have joined; set MOLD_NCCL_TIMEOUT_S \
                     to wait longer)",
                    start.elapsed().as_secs_f64(),
                    missing.join(", ")
                ));
                break;
            }
        }
    }
    if errors.is_empty() {
        finish(slots, None)
    } else {
        // Group::drop (when the handles go) aborts the communicators that were made.
        finish(
            slots,
            Some(format!(
                "creating the NCCL group of {world} ranks ({}) failed: {}",
                describe_ranks(&ordinals),
                errors.join("; ")
            )),
        )
    }
}

fn init_rank(ordinal: usize, rank: usize, world: usize, id: sys::ncclUniqueId) -> InitResult {
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("cannot open the GPU: {e:?}"))?;
    // ncclCommInitRank uses the calling thread's current device.
    ctx.bind_to_thread()
        .map_err(|e| format!("cannot make the GPU current: {e:?}"))?;
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: `comm` is a valid out pointer; rank < world; every rank gets the same id.
    unsafe { nccl::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
        .map_err(|e| format!("ncclCommInitRank failed: {}", describe(&e, None)))?;
    Ok((RawComm(comm), ctx))
}

/// Destroys the pooled group over exactly `ordinals`, if any.
pub(crate) fn release(ordinals: &[usize]) {
    let gone: Vec<Arc<Group>> = {
        let mut pool = lock(&POOL);
        let (gone, keep) = pool.drain(..).partition(|g| g.ordinals == ordinals);
        *pool = keep;
        gone
    };
    // Group::drop aborts the communicators, outside the pool's lock.
    drop(gone);
}
