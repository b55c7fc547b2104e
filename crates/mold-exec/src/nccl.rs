//! NCCL implementation of [`Comm`] (feature `nccl`): one communicator per rank of a
//! tensor-parallel group whose ranks are threads of this process, one GPU each.
//!
//! # Design
//!
//! - **Creation.** [`group`] makes the communicators of a group eagerly: `ncclCommInitRank`
//!   blocks until every rank has joined, so it is called from one helper thread per rank,
//!   concurrently, with one shared `ncclUniqueId`. The caller waits at most the watchdog
//!   timeout; a rank that fails or does not join turns the whole group into a failed one,
//!   whose every collective returns an error naming the rank (helper threads stuck in
//!   `ncclCommInitRank` are left behind; a late communicator is aborted).
//! - **Reuse.** The executor asks for a group on every forward pass; creating NCCL
//!   communicators costs seconds, so a healthy group goes back to a process-wide pool when
//!   its last handle drops and is handed out again for the same devices (a group is used
//!   by one set of rank threads at a time). A group that saw any failure is not reused.
//! - **Streams.** The all-reduce is enqueued on candle's own stream of the tensor's device
//!   (`CudaDevice::cuda_stream()`; in candle 0.11 the per-thread default stream of the
//!   calling thread), from the rank's thread, so it is ordered after the kernels that
//!   produced the tensor and before the ones that consume the result. The result goes to
//!   a new buffer (the input may be shared); bf16, f16, f32 and f64 are supported.
//! - **Watchdog** (`MOLD_NCCL_TIMEOUT_S` seconds, default 120). The host does not wait
//!   for each all-reduce: after enqueueing it records an event on the stream and goes on
//!   queueing kernels. The group's monitor thread (every 100 ms) fails the group when an
//!   all-reduce is still pending after the timeout, when `ncclCommGetAsyncError` reports
//!   an error, or when another process of a multi-process run failed
//!   ([`crate::dist::failure`]); it then aborts the communicators of every rank not
//!   inside an NCCL call (`ncclCommAbort`, which also ends their kernels, so a rank
//!   waiting for its GPU returns). A rank with more than `MAX_IN_FLIGHT` pending
//!   all-reduces waits for the oldest itself, polling the same conditions. After its
//!   work, each rank calls [`Comm::check`], which turns a failure that happened after
//!   the last collective was enqueued into an error ("another rank of the
//!   tensor-parallel group failed"). [`Comm::abort`] (called by the executor when a rank
//!   errors or panics) marks the group failed and aborts the failing rank's
//!   communicator. Every abort happens under the rank's slot lock, which every NCCL call
//!   on that communicator holds, so none is freed while a call on it is in flight.
//!   `MOLD_NCCL_TIMEOUT_S=0` turns the watchdog off (no events, no monitor) and a hang
//!   is not detected.
//! - **Environment.** `NCCL_NVLS_ENABLE=0` (no NVLink multicast) is set in the process
//!   environment before the first NCCL call unless the user set it.
//! - **Measurement.** [`measure_allreduce`] times all-reduces over groups of 2, 4, 8, …
//!   GPUs for `mold devices --calibrate` (latency and nccl-tests' bus bandwidth).
//!
//! The safe `cudarc::nccl::Comm` is not used directly: its `Drop` aborts the communicator
//! (a second abort after a watchdog abort would be a double free) and it is neither `Send`
//! nor `Sync`; the raw handle from `cudarc::nccl::result` lets each abort happen exactly
//! once, under the rank's lock.

use super::Comm;
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};
use half::bf16;
use mold_machine::inventory::{allreduce_bus_gbps, allreduce_group_sizes, AllreduceMeasurement};
use mold_plan::ByteSize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Default watchdog timeout (seconds) for group creation and for each collective.
pub const DEFAULT_TIMEOUT_S: f64 = 120.0;

/// All-reduces a rank may have enqueued and not finished before the host waits for the
/// oldest (FLUX runs 1 or 2 per block: the host stays several blocks ahead at most).
const MAX_IN_FLIGHT: usize = 8;

/// The watchdog timeout: `MOLD_NCCL_TIMEOUT_S` (seconds, may be fractional; 0 = no
/// watchdog), default [`DEFAULT_TIMEOUT_S`].
/// Read once per process.
pub fn timeout() -> Option<Duration> {
    static TIMEOUT: OnceLock<Option<Duration>> = OnceLock::new();
    *TIMEOUT.get_or_init(|| {
        let secs = match std::env::var("MOLD_NCCL_TIMEOUT_S") {
            Err(_) => DEFAULT_TIMEOUT_S,
            Ok(v) => match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s >= 0.0 => s,
                _ => {
                    eprintln!(
                        "warning: MOLD_NCCL_TIMEOUT_S={v:?} is not a number of seconds; \
                         using {DEFAULT_TIMEOUT_S}"
                    );
                    DEFAULT_TIMEOUT_S
                }
            },
        };
        (secs > 0.0).then(|| Duration::from_secs_f64(secs))
    })
}

/// Sets `NCCL_NVLS_ENABLE=0` unless the user set it: NVLink multicast (NVLS) is off on
/// the shared machines this runs on. Done once, before the first NCCL call.
fn set_nccl_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
}

/// `cuda:0, cuda:1, (another process)` for messages.
fn describe_ranks(ordinals: &[usize]) -> String {
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

/// NCCL's text for a result code.
fn nccl_err_str(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
    let s = unsafe { sys::ncclGetErrorString(r) };
    if s.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(s) }
            .to_string_lossy()
            .into_owned()
    }
}

/// NCCL's last error message for `comm` (may be empty).
fn nccl_last_error(comm: sys::ncclComm_t) -> String {
    // SAFETY: comm is a live communicator (callers hold it); the string is NCCL's.
    let s = unsafe { sys::ncclGetLastError(comm) };
    if s.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated.
        unsafe { std::ffi::CStr::from_ptr(s) }
            .to_string_lossy()
            .into_owned()
    }
}

/// NCCL's asynchronous error on `comm` (with its last message), if any. The caller holds
/// the communicator's slot, so no other call on it is in flight.
fn async_error(comm: sys::ncclComm_t) -> Option<String> {
    let mut async_err = sys::ncclResult_t::ncclSuccess;
    // SAFETY: live communicator (the caller holds its slot), valid out pointer.
    let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut async_err) };
    let e = [r, async_err].into_iter().find(|e| {
        !matches!(
            e,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        )
    })?;
    Some(match nccl_last_error(comm) {
        last if last.is_empty() => nccl_err_str(e),
        last => format!("{}: {last}", nccl_err_str(e)),
    })
}

fn describe(e: &nccl::NcclError, comm: Option<sys::ncclComm_t>) -> String {
    let mut m = nccl_err_str(e.0);
    if let Some(c) = comm {
        let last = nccl_last_error(c);
        if !last.is_empty() {
            m = format!("{m}: {last}");
        }
    }
    m
}

/// A raw communicator handle. NCCL communicators may be used from any thread as long as
/// calls on one communicator do not overlap; [`RankSlot`]'s mutex guarantees that.
struct RawComm(sys::ncclComm_t);
// SAFETY: see above; the handle is only used under the slot's lock.
unsafe impl Send for RawComm {}

/// What each rank is doing, for the monitor: which NCCL host call it is inside (a call
/// that never returns cannot be timed out by the rank itself) and how many all-reduces
/// it has issued.
struct Tracker {
    epoch: Instant,
    /// Per rank: ms since `epoch` + 1 when it entered an NCCL host call, 0 when outside.
    busy_since: Vec<AtomicU64>,
    /// Per rank: index into [`CALLS`] of that call.
    busy_call: Vec<AtomicUsize>,
    /// Per rank: all-reduces enqueued so far.
    issued: Vec<AtomicU64>,
    /// ms since `epoch` + 1 when the group failed, 0 while healthy.
    failed_at: AtomicU64,
}

const CALLS: [&str; 2] = ["ncclAllReduce", "ncclCommAbort"];
const CALL_ALL_REDUCE: usize = 0;
const CALL_ABORT: usize = 1;

impl Tracker {
    fn new(world: usize) -> Tracker {
        Tracker {
            epoch: Instant::now(),
            busy_since: (0..world).map(|_| AtomicU64::new(0)).collect(),
            busy_call: (0..world).map(|_| AtomicUsize::new(0)).collect(),
            issued: (0..world).map(|_| AtomicU64::new(0)).collect(),
            failed_at: AtomicU64::new(0),
        }
    }
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }
    /// Runs `f` (an NCCL host call of `rank`) marked busy.
    fn busy<R>(&self, rank: usize, call: usize, f: impl FnOnce() -> R) -> R {
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
                    "  rank {r} (cuda:{o}): {} all-reduces issued, {state}",
                    self.issued[r].load(Ordering::SeqCst)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// One rank's communicator. `comm` is `None` once aborted.
struct RankSlot {
    rank: usize,
    ordinal: usize,
    comm: Option<RawComm>,
    /// All-reduces enqueued and not known to be finished: an event recorded after each,
    /// and when it was enqueued (the watchdog's clock).
    pending: VecDeque<(CudaEvent, Instant)>,
    /// Keeps the GPU's primary context alive as long as the communicator.
    ctx: Option<Arc<CudaContext>>,
    tracker: Option<Arc<Tracker>>,
}

impl RankSlot {
    /// Aborts the communicator (once); stops its kernels and frees its resources.
    fn abort(&mut self) {
        self.pending.clear();
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
    }
}

/// The shared state of one NCCL group.
struct Group {
    /// GPU ordinals of ranks 0..world (the pool key).
    ordinals: Vec<usize>,
    slots: Vec<Mutex<RankSlot>>,
    /// Set when any rank failed; the others stop and abort.
    failed: AtomicBool,
    /// The first failure, for messages.
    failure: Mutex<Option<String>>,
    tracker: Arc<Tracker>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Group {
    fn world(&self) -> usize {
        self.slots.len()
    }

    /// Records the first failure and raises the flag.
    fn fail(&self, msg: String) {
        let mut f = lock(&self.failure);
        if f.is_none() {
            *f = Some(msg);
            let _ = self.tracker.failed_at.compare_exchange(
                0,
                self.tracker.now(),
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
        self.failed.store(true, Ordering::SeqCst);
    }

    fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// The error a rank returns when another rank failed. Contains "another rank" so the
    /// executor reports the rank that failed first.
    fn peer_failed_error(&self, rank: usize) -> candle_core::Error {
        let why = lock(&self.failure)
            .clone()
            .unwrap_or_else(|| "unknown reason".into());
        candle_core::Error::Msg(format!(
            "NCCL rank {rank} (cuda:{}): another rank of the tensor-parallel group failed \
             ({why}); this rank's communicator was aborted",
            self.ordinals[rank]
        ))
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
        if let Some(why) = crate::dist::failure() {
            if !self.is_failed() {
                self.fail(why);
            }
        }
        if !self.is_failed() {
            for s in &self.slots {
                // A rank inside a call watches itself.
                let Ok(mut slot) = s.try_lock() else { continue };
                let Some(comm) = slot.comm.as_ref().map(|c| c.0) else {
                    continue;
                };
                while let Some((e, _)) = slot.pending.front() {
                    if !matches!(e.try_is_complete(), Ok(true)) {
                        break;
                    }
                    slot.pending.pop_front();
                }
                let where_ = format!("NCCL rank {} (cuda:{})", slot.rank, slot.ordinal);
                if let Some((_, t)) = slot.pending.front() {
                    if t.elapsed() > limit {
                        self.fail(format!(
                            "{where_}: an all-reduce has not finished {:.1} s after it was \
                             enqueued (watchdog MOLD_NCCL_TIMEOUT_S={}): a rank did not join \
                             or the GPUs are stuck; the group was aborted",
                            t.elapsed().as_secs_f64(),
                            limit.as_secs_f64()
                        ));
                        break;
                    }
                }
                if let Some(e) = async_error(comm) {
                    self.fail(format!("{where_}: NCCL reported an error: {e}"));
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
struct Lease(Option<Arc<Group>>);

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            if !g.is_failed() {
                lock(&POOL).push(g);
            }
        }
    }
}

/// The [`Comm`] of one rank of an NCCL group.
pub struct NcclComm {
    rank: usize,
    group: Arc<Group>,
    _lease: Arc<Lease>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {}, cuda:{})",
            self.rank,
            self.group.world(),
            self.group.ordinals[self.rank]
        )
    }
}

/// Communicators for a group over GPUs `ordinals` (rank i on GPU `ordinals[i]`; distinct
/// ordinals), reused from the pool when a healthy group over the same GPUs is free.
///
/// Never fails: if creation fails, every handle of the returned group reports the error
/// (naming the rank at fault) from its first collective.
pub fn group(ordinals: &[usize]) -> Vec<NcclComm> {
    assert!(!ordinals.is_empty(), "a group needs at least one rank");
    let pooled = {
        let mut pool = lock(&POOL);
        pool.iter()
            .position(|g| g.ordinals == ordinals)
            .map(|i| pool.swap_remove(i))
    };
    let group = pooled.unwrap_or_else(|| {
        let g = Arc::new(create(ordinals));
        watch(&g);
        g
    });
    let lease = Arc::new(Lease(Some(group.clone())));
    (0..ordinals.len())
        .map(|rank| NcclComm {
            rank,
            group: group.clone(),
            _lease: lease.clone(),
        })
        .collect()
}

/// Starts the monitor of a new group (with the watchdog on).
fn watch(g: &Arc<Group>) {
    if let Some(limit) = timeout() {
        let weak = Arc::downgrade(g);
        let _ = std::thread::Builder::new()
            .name("nccl-monitor".into())
            .spawn(move || monitor(weak, limit));
    }
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
/// process of rank 0. Not pooled: the caller keeps the handles for the whole run. Like
/// [`group`], never fails: a failed creation shows in every handle's first collective.
pub fn group_with_id(id: &[u8], world: usize, local: &[(usize, usize)]) -> Vec<NcclComm> {
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
        None => create_ranks(world, Ok(raw), local),
        Some(f) => create_ranks(world, Err(f), local),
    });
    watch(&g);
    let lease = Arc::new(Lease(None));
    local
        .iter()
        .map(|&(rank, _)| NcclComm {
            rank,
            group: g.clone(),
            _lease: lease.clone(),
        })
        .collect()
}

/// Watches a group for what the ranks cannot time out themselves, and ends the process
/// (with a report naming the ranks) rather than let it hang:
/// - a rank inside an NCCL host call (e.g. `ncclAllReduce` blocked in connection setup,
///   or `ncclCommAbort`) for longer than `limit`;
/// - a failed group whose ranks have not all let go of it `limit` after the failure (a
///   rank stuck outside NCCL keeps the executor waiting for it).
///
/// Stops when the group is dropped.
fn monitor(group: Weak<Group>, limit: Duration) {
    let limit_ms = limit.as_millis() as u64;
    loop {
        std::thread::sleep(Duration::from_millis(100).min(limit));
        let Some(g) = group.upgrade() else { return };
        g.watch_pending(limit);
        let t = &g.tracker;
        let now = t.now();
        let stuck_in_call = (0..g.world()).find(|&r| {
            let since = t.busy_since[r].load(Ordering::SeqCst);
            since != 0 && now.saturating_sub(since) > limit_ms
        });
        let failed_at = t.failed_at.load(Ordering::SeqCst);
        let stuck_after_failure = failed_at != 0 && now.saturating_sub(failed_at) > limit_ms;
        if stuck_in_call.is_none() && !stuck_after_failure {
            continue;
        }
        let what = match stuck_in_call {
            Some(r) => format!(
                "NCCL rank {r} (cuda:{}) has been inside {} for more than {:.0} s \
                 (MOLD_NCCL_TIMEOUT_S)",
                g.ordinals[r],
                CALLS[t.busy_call[r].load(Ordering::SeqCst)],
                limit.as_secs_f64()
            ),
            None => format!(
                "the NCCL group ({}) failed ({}) and its ranks have not stopped \
                 {:.0} s later",
                describe_ranks(&g.ordinals),
                lock(&g.failure).clone().unwrap_or_default(),
                limit.as_secs_f64()
            ),
        };
        eprintln!(
            "error: {what}; ending the process instead of hanging.\n{}\n\
             (NCCL_DEBUG=INFO shows NCCL's side; MOLD_NCCL_TIMEOUT_S sets the limit)",
            t.dump(&g.ordinals)
        );
        std::process::abort();
    }
}

type InitResult = std::result::Result<(RawComm, Arc<CudaContext>), String>;

/// Creates the communicators of a one-process group: one helper thread per rank calls
/// `ncclCommInitRank` concurrently (it blocks until all ranks have joined).
fn create(ordinals: &[usize]) -> Group {
    set_nccl_env();
    let id =
        nccl::get_uniqueid().map_err(|e| format!("ncclGetUniqueId failed: {}", describe(&e, None)));
    let local: Vec<(usize, usize)> = ordinals.iter().copied().enumerate().collect();
    create_ranks(ordinals.len(), id, &local)
}

/// Creates the communicators of ranks `local` ((rank, GPU ordinal)) of a group of
/// `world` ranks sharing `id`; the other ranks are made elsewhere (other processes).
fn create_ranks(
    world: usize,
    id: std::result::Result<sys::ncclUniqueId, String>,
    local: &[(usize, usize)],
) -> Group {
    set_nccl_env();
    let tracker = Arc::new(Tracker::new(world));
    // Ranks made elsewhere keep `usize::MAX` as their ordinal and never get a communicator.
    let mut ordinals = vec![usize::MAX; world];
    for &(r, o) in local {
        ordinals[r] = o;
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
            tracker: Some(tracker.clone()),
        })
        .collect();
    let finish = |slots: Vec<RankSlot>, failure: Option<String>| Group {
        ordinals: ordinals.clone(),
        slots: slots.into_iter().map(Mutex::new).collect(),
        failed: AtomicBool::new(failure.is_some()),
        failure: Mutex::new(failure),
        tracker: tracker.clone(),
    };

    let id = match id {
        Ok(id) => id,
        Err(e) => return finish(slots, Some(e)),
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

    let limit = timeout();
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

/// The all-reduce as a candle op: reads the (contiguous) input, writes a new buffer.
struct AllReduceOp<'a> {
    comm: sys::ncclComm_t,
    rank: usize,
    tracker: &'a Tracker,
}

impl AllReduceOp<'_> {
    fn run<T>(&self, s: &CudaStorage, l: &Layout, dtype: sys::ncclDataType_t) -> Result<CudaStorage>
    where
        T: candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr,
    {
        let (start, end) = l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("NCCL all-reduce: input is not contiguous".into())
        })?;
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let src = s.as_cuda_slice::<T>()?.slice(start..end);
        let n = end - start;
        // SAFETY: every element is written by the all-reduce before anyone reads it.
        let mut dst: CudaSlice<T> = unsafe { dev.alloc::<T>(n) }?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| candle_core::Error::Msg(format!("NCCL all-reduce: {e:?}")))?;
        {
            let (src_ptr, _src_guard) = src.device_ptr(&stream);
            let (dst_ptr, _dst_guard) = dst.device_ptr_mut(&stream);
            // SAFETY: both buffers hold `n` elements of the type `dtype` names, on this
            // communicator's GPU; the stream is that GPU's candle stream; the guards
            // record the use on the stream when dropped (after the enqueue).
            self.tracker.issued[self.rank].fetch_add(1, Ordering::SeqCst);
            self.tracker
                .busy(self.rank, CALL_ALL_REDUCE, || unsafe {
                    nccl::all_reduce(
                        src_ptr as *const std::ffi::c_void,
                        dst_ptr as *mut std::ffi::c_void,
                        n,
                        dtype,
                        sys::ncclRedOp_t::ncclSum,
                        self.comm,
                        stream.cu_stream() as sys::cudaStream_t,
                    )
                })
                .map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "NCCL all-reduce on rank {} failed: {}",
                        self.rank,
                        describe(&e, Some(self.comm))
                    ))
                })?;
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for AllReduceOp<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce-sum"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL all-reduce needs a CUDA tensor, got a CPU one")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        use half::{bf16, f16};
        use sys::ncclDataType_t as D;
        let out = match s.dtype() {
            DType::BF16 => self.run::<bf16>(s, l, D::ncclBfloat16)?,
            DType::F16 => self.run::<f16>(s, l, D::ncclFloat16)?,
            DType::F32 => self.run::<f32>(s, l, D::ncclFloat32)?,
            DType::F64 => self.run::<f64>(s, l, D::ncclFloat64)?,
            dt => candle_core::bail!("NCCL all-reduce: unsupported dtype {dt:?}"),
        };
        Ok((out, l.shape().clone()))
    }
}

impl NcclComm {
    fn err(&self, what: String) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "NCCL rank {} (cuda:{}): {what}",
            self.rank, self.group.ordinals[self.rank]
        ))
    }

    /// Marks the group failed with `msg`, aborts this rank's communicator, returns the
    /// error for this rank.
    fn fail(&self, slot: &mut RankSlot, msg: String) -> candle_core::Error {
        let e = self.err(msg);
        self.group.fail(e.to_string());
        slot.abort();
        e
    }

    /// Waits for an all-reduce enqueued at `start` (done when `event` is), with the
    /// watchdog.
    fn wait(
        &self,
        slot: &mut RankSlot,
        event: &CudaEvent,
        start: Instant,
        limit: Duration,
    ) -> Result<()> {
        let comm = slot.comm.as_ref().map(|c| c.0).expect("live communicator");
        let mut polls: u32 = 0;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(self.fail(
                        slot,
                        format!("CUDA error while waiting for the all-reduce: {e:?}"),
                    ))
                }
            }
            if let Some(e) = async_error(comm) {
                let m = format!("NCCL reported an error during the all-reduce: {e}");
                return Err(self.fail(slot, m));
            }
            if let Some(why) = crate::dist::failure() {
                self.group.fail(why);
            }
            if self.group.is_failed() {
                slot.abort();
                return Err(self.group.peer_failed_error(self.rank));
            }
            let waited = start.elapsed();
            if waited > limit {
                return Err(self.fail(
                    slot,
                    format!(
                        "all-reduce timed out after {:.1} s (watchdog MOLD_NCCL_TIMEOUT_S={}): \
                         a rank did not join or the GPUs are stuck; the group was aborted",
                        waited.as_secs_f64(),
                        limit.as_secs_f64()
                    ),
                ));
            }
            polls += 1;
            if polls < 256 {
                std::thread::yield_now();
            } else {
                let us = (50u64 << ((polls - 256) / 64).min(5)).min(1000);
                std::thread::sleep(Duration::from_micros(us));
            }
        }
    }
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world()
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let ordinal = self.group.ordinals[self.rank];
        if self.group.is_failed() {
            let mut slot = lock(&self.group.slots[self.rank]);
            slot.abort();
            return Err(self.group.peer_failed_error(self.rank));
        }
        match t.device().location() {
            candle_core::DeviceLocation::Cuda { gpu_id } if gpu_id == ordinal => {}
            loc => {
                let mut slot = lock(&self.group.slots[self.rank]);
                return Err(self.fail(
                    &mut slot,
                    format!("all_reduce_sum got a tensor on {loc:?}, expected this rank's GPU"),
                ));
            }
        }
        let t = t.contiguous()?;
        let mut slot = lock(&self.group.slots[self.rank]);
        let Some(comm) = slot.comm.as_ref().map(|c| c.0) else {
            return Err(self.group.peer_failed_error(self.rank));
        };
        let op = AllReduceOp {
            comm,
            rank: self.rank,
            tracker: &self.group.tracker,
        };
        let out = match t.apply_op1_no_bwd(&op) {
            Ok(o) => o,
            Err(e) => return Err(self.fail(&mut slot, e.to_string())),
        };
        if let Some(limit) = timeout() {
            // The host does not wait for the all-reduce: it goes on queueing kernels
            // (waiting here would leave the GPU idle while the next ones are launched).
            // The monitor watches the pending all-reduces; the host waits only when more
            // than MAX_IN_FLIGHT are pending, for the oldest.
            let stream = out.device().as_cuda_device()?.cuda_stream();
            let event = stream
                .record_event(Some(
                    cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
                ))
                .map_err(|e| self.fail(&mut slot, format!("cannot record a CUDA event: {e:?}")))?;
            slot.pending.push_back((event, Instant::now()));
            while let Some((e, _)) = slot.pending.front() {
                if !matches!(e.try_is_complete(), Ok(true)) {
                    break;
                }
                slot.pending.pop_front();
            }
            if slot.pending.len() > MAX_IN_FLIGHT {
                let (e, t) = slot.pending.pop_front().expect("non-empty");
                self.wait(&mut slot, &e, t, limit)?;
            }
        }
        Ok(out)
    }

    /// The group failed (here, in another rank, or in another process) after this
    /// rank's last all-reduce was enqueued: an error, and this rank's communicator is
    /// aborted. Otherwise forgets the finished all-reduces.
    fn check(&self) -> Result<()> {
        let mut slot = lock(&self.group.slots[self.rank]);
        if let Some(why) = crate::dist::failure() {
            self.group.fail(why);
        }
        if self.group.is_failed() {
            slot.abort();
            return Err(self.group.peer_failed_error(self.rank));
        }
        slot.pending
            .retain(|(e, _)| !matches!(e.try_is_complete(), Ok(true)));
        Ok(())
    }

    /// Marks the group failed (releasing ranks waiting in a collective) and aborts this
    /// rank's communicator if no call on it is in flight.
    fn abort(&self) {
        self.group.fail(format!(
            "rank {} (cuda:{}) failed",
            self.rank, self.group.ordinals[self.rank]
        ));
        if let Ok(mut slot) = self.group.slots[self.rank].try_lock() {
            slot.abort();
        }
    }
}

// All-reduce measurement, for `mold devices --save X.yaml --calibrate`.

/// What [`measure_allreduce`] times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllreduceBench {
    /// Bytes of the small message, whose time is the latency.
    pub small_bytes: usize,
    /// Bytes of the large message, whose time gives the bus bandwidth.
    pub large_bytes: usize,
    /// Untimed all-reduces of each message before its timed loop (NCCL sets up its
    /// connections and buffers on first use).
    pub warmup: usize,
    /// Timed all-reduces of the small message.
    pub small_iters: usize,
    /// Timed all-reduces of the large message.
    pub large_iters: usize,
}

impl Default for AllreduceBench {
    /// 8 KiB and 256 MiB of bf16; 5 warm-ups; 100 and 20 timed all-reduces.
    fn default() -> Self {
        AllreduceBench {
            small_bytes: 8 << 10,
            large_bytes: 256 << 20,
            warmup: 5,
            small_iters: 100,
            large_iters: 20,
        }
    }
}

/// Measures NCCL all-reduce over the GPUs `ordinals` (distinct): for each group size of
/// [`allreduce_group_sizes`] (2, 4, 8, … and all of them), over the first that many GPUs.
///
/// Each group gets its communicators from [`group`] and one thread per rank. A rank
/// allocates a bf16 buffer per message size on a stream of its own and enqueues
/// `warmup` in-place sum all-reduces of it; then a one-element all-reduce, waited for,
/// lines the ranks up (it completes on a rank only once every rank has enqueued it, after
/// its warm-ups); then it enqueues the timed all-reduces back to back (no host wait in
/// between, as nccl-tests does) and waits for its stream. A message's time is the slowest
/// rank's wall time over the timed loop divided by its iterations.
///
/// `latency_us` is the small message's time; `gbps` is the bus bandwidth of the large
/// one, [`allreduce_bus_gbps`]: `2(n−1)/n · bytes / time / 1e9` (nccl-tests' "busbw"),
/// which is what [`mold_machine::Collective`] holds.
///
/// The watchdog ([`timeout`]) bounds every wait, and `NCCL_NVLS_ENABLE=0` is set unless
/// the user set it. An error on any rank aborts the group and comes back naming the rank
/// that failed first. The measured groups' communicators are destroyed afterwards (not
/// kept in the pool).
pub fn measure_allreduce(
    ordinals: &[usize],
    bench: &AllreduceBench,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<AllreduceMeasurement>> {
    let mut seen = ordinals.to_vec();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != ordinals.len() {
        candle_core::bail!("measuring all-reduce: GPU ordinals {ordinals:?} are not distinct");
    }
    if bench.small_iters == 0 || bench.large_iters == 0 {
        candle_core::bail!("measuring all-reduce: needs at least one timed iteration");
    }
    set_nccl_env();
    let elems = |bytes: usize| (bytes / std::mem::size_of::<bf16>()).max(1);
    let (small, large) = (elems(bench.small_bytes), elems(bench.large_bytes));
    let bytes = |n: usize| ByteSize((n * std::mem::size_of::<bf16>()) as u64);
    let mut out = Vec::new();
    for n in allreduce_group_sizes(ordinals.len()) {
        let gpus = &ordinals[..n];
        progress(&format!(
            "NCCL all-reduce over {}: bf16, {} ({} times) and {} ({} times)",
            gpus.iter()
                .map(|o| format!("cuda:{o}"))
                .collect::<Vec<_>>()
                .join(","),
            bytes(small),
            bench.small_iters,
            bytes(large),
            bench.large_iters
        ));
        let s = bench_group(
            gpus,
            &[(small, bench.small_iters), (large, bench.large_iters)],
            bench.warmup,
        )?;
        out.push(AllreduceMeasurement {
            group_size: n as u32,
            latency_us: s[0] * 1e6,
            gbps: allreduce_bus_gbps(n, bytes(large).0, s[1]),
        });
    }
    Ok(out)
}

/// Aborts the rank's communicator (releasing the other ranks) unless marked done.
struct AbortUnlessDone<'a>(&'a NcclComm, bool);

impl Drop for AbortUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.1 {
            Comm::abort(self.0);
        }
    }
}

/// Seconds per all-reduce for each `(elements, iterations)` of `loops` over the GPUs
/// `ordinals`: the slowest rank's.
fn bench_group(ordinals: &[usize], loops: &[(usize, usize)], warmup: usize) -> Result<Vec<f64>> {
    let comms = group(ordinals);
    let results: Vec<std::result::Result<Vec<f64>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                std::thread::Builder::new()
                    .name(format!("nccl-bench-{}", comm.rank))
                    .spawn_scoped(s, move || {
                        let mut guard = AbortUnlessDone(comm, false);
                        let r = comm.bench_rank(loops, warmup);
                        guard.1 = r.is_ok();
                        r
                    })
                    .map_err(|e| {
                        // The ranks already started are released by the abort.
                        Comm::abort(comm);
                        comm.err(format!("cannot start a thread for this rank: {e}"))
                    })
            })
            .collect();
        handles
            .into_iter()
            .zip(&comms)
            .map(|(h, comm)| match h {
                Err(e) => Err(e.to_string()),
                Ok(h) => match h.join() {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(comm.err("the measuring thread panicked".into()).to_string()),
                },
            })
            .collect()
    });
    drop(comms);
    release(ordinals);
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    // Report the rank that failed first, not the ranks it released.
    if let Some(e) = errors
        .iter()
        .find(|m| !m.contains("another rank"))
        .or(errors.first())
    {
        candle_core::bail!("measuring all-reduce over GPUs {ordinals:?}: {e}");
    }
    let per_rank: Vec<Vec<f64>> = results.into_iter().filter_map(|r| r.ok()).collect();
    Ok((0..loops.len())
        .map(|i| per_rank.iter().map(|r| r[i]).fold(0.0, f64::max))
        .collect())
}

/// Destroys the pooled group over exactly `ordinals`, if any.
fn release(ordinals: &[usize]) {
    let gone: Vec<Arc<Group>> = {
        let mut pool = lock(&POOL);
        let (gone, keep) = pool.drain(..).partition(|g| g.ordinals == ordinals);
        *pool = keep;
        gone
    };
    // Group::drop aborts the communicators, outside the pool's lock.
    drop(gone);
}

impl NcclComm {
    /// This rank's part of [`bench_group`].
    fn bench_rank(&self, loops: &[(usize, usize)], warmup: usize) -> Result<Vec<f64>> {
        let ordinal = self.group.ordinals[self.rank];
        let cuda =
            |what: String, e: cudarc::driver::DriverError| self.err(format!("{what}: {e:?}"));
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda("cannot open the GPU".into(), e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda("cannot create a CUDA stream".into(), e))?;
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<bf16>(n)
                .map_err(|e| cuda(format!("cannot allocate {}", ByteSize((2 * n) as u64)), e))
        };
        let mut token = alloc(1)?;
        // The buffers are only used on `stream`; the guards (dropped after the last use)
        // record that use for cudarc's event tracking, once rather than per all-reduce.
        let (token_ptr, _token_guard) = token.device_ptr_mut(&stream);
        let mut out = Vec::with_capacity(loops.len());
        for &(elems, iters) in loops {
            // Zeros: the sums stay zero however often they are repeated.
            let mut buf = alloc(elems)?;
            let (ptr, _guard) = buf.device_ptr_mut(&stream);
            for _ in 0..warmup {
                self.enqueue_in_place(ptr, elems, &stream)?;
            }
            self.enqueue_in_place(token_ptr, 1, &stream)?;
            self.finish(&stream)?;
            let start = Instant::now();
            for _ in 0..iters {
                self.enqueue_in_place(ptr, elems, &stream)?;
            }
            self.finish(&stream)?;
            out.push(start.elapsed().as_secs_f64() / iters.max(1) as f64);
        }
        Ok(out)
    }

    /// Enqueues an in-place bf16 sum all-reduce of the `n` elements at `ptr` on `stream`
    /// without waiting for it (for timing: no allocation and no host wait, unlike
    /// [`Comm::all_reduce_sum`]).
    fn enqueue_in_place(
        &self,
        ptr: cudarc::driver::sys::CUdeviceptr,
        n: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let mut slot = lock(&self.group.slots[self.rank]);
        if self.group.is_failed() {
            slot.abort();
            return Err(self.group.peer_failed_error(self.rank));
        }
        let Some(comm) = slot.comm.as_ref().map(|c| c.0) else {
            return Err(self.group.peer_failed_error(self.rank));
        };
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.fail(&mut slot, format!("cannot make the GPU current: {e:?}")))?;
        let tracker = &self.group.tracker;
        tracker.issued[self.rank].fetch_add(1, Ordering::SeqCst);
        // SAFETY: the caller's buffer at `ptr` holds `n` bf16 on this communicator's GPU
        // (send and receive buffer alike: in place) and is freed in the stream's order,
        // after the all-reduce (cudarc's `CudaSlice::drop`); the stream is one of that GPU.
        let r = tracker.busy(self.rank, CALL_ALL_REDUCE, || unsafe {
            nccl::all_reduce(
                ptr as *const std::ffi::c_void,
                ptr as *mut std::ffi::c_void,
                n,
                sys::ncclDataType_t::ncclBfloat16,
                sys::ncclRedOp_t::ncclSum,
                comm,
                stream.cu_stream() as sys::cudaStream_t,
            )
        });
        r.map(|_| ()).map_err(|e| {
            let m = format!("NCCL all-reduce failed: {}", describe(&e, Some(comm)));
            self.fail(&mut slot, m)
        })
    }

    /// Waits until `stream` has finished its work, with the watchdog.
    fn finish(&self, stream: &CudaStream) -> Result<()> {
        let mut slot = lock(&self.group.slots[self.rank]);
        if self.group.is_failed() || slot.comm.is_none() {
            slot.abort();
            return Err(self.group.peer_failed_error(self.rank));
        }
        match timeout() {
            Some(limit) => {
                let event = stream.record_event(None).map_err(|e| {
                    self.fail(&mut slot, format!("cannot record a CUDA event: {e:?}"))
                })?;
                self.wait(&mut slot, &event, Instant::now(), limit)
            }
            None => stream.synchronize().map_err(|e| {
                self.fail(
                    &mut slot,
                    format!("CUDA error while waiting for the all-reduces: {e:?}"),
                )
            }),
        }
    }
}
