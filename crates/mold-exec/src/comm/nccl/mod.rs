//! NCCL implementation of [`Comm`] (feature `nccl`): one communicator per rank of a
//! tensor-parallel group, one GPU each.
//!
//! # Design
//!
//! - **Creation** ([`group`](self::group)). [`local_group`] makes the communicators of a
//!   group eagerly: `ncclCommInitRank` blocks until every rank has joined, so it is called
//!   from one helper thread per rank, concurrently, with one shared `ncclUniqueId`. The
//!   caller waits at most the watchdog timeout; a rank that fails or does not join turns
//!   the whole group into a failed one, whose every collective returns an error naming the
//!   rank (helper threads stuck in `ncclCommInitRank` are left behind; a late
//!   communicator is aborted). [`spanning_group`] does the same for this process's ranks
//!   of a group that spans processes (the id comes from [`unique_id`] over the mesh).
//! - **Reuse.** The executor asks for a group on every forward pass; creating NCCL
//!   communicators costs seconds, so a healthy group goes back to a process-wide pool when
//!   its last handle drops and is handed out again for the same devices (a group is used
//!   by one set of rank threads at a time). A group that saw any failure is not reused.
//! - **Streams** ([`op`]). The all-reduce is enqueued on candle's own stream of the
//!   tensor's device (`CudaDevice::cuda_stream()`: the rank thread's per-thread default
//!   stream, or the device's own with `ExecOptions::deterministic`), from the rank's
//!   thread, so it is ordered after the
//!   kernels that produced the tensor and before the ones that consume the result. The
//!   result goes to a new buffer (the input may be shared); bf16, f16, f32 and f64.
//! - **Watchdog** ([`watchdog`]; `CommOptions::nccl_timeout`, `MOLD_NCCL_TIMEOUT_S` at
//!   the CLI, default 120 s). The host does not wait for each all-reduce: after enqueueing
//!   it records an event on the stream and goes on queueing kernels. The group's monitor
//!   thread (every 100 ms) fails the group when an all-reduce is still pending after the
//!   timeout ([`CommError::Timeout`]), when `ncclCommGetAsyncError` reports an error, or
//!   when another process of a multi-process run failed (the run's [`AbortSignal`]); it
//!   then aborts the communicators of every rank not inside an NCCL call
//!   (`ncclCommAbort`, which also ends their kernels, so a rank waiting for its GPU
//!   returns). A rank with more than `MAX_IN_FLIGHT` pending collectives waits for the
//!   oldest itself, polling the same conditions. After its work, each rank calls
//!   [`Comm::check`], which turns a failure that happened after the last collective was
//!   enqueued into an error ([`CommError::PeerAborted`] unless the failure was this
//!   rank's own). [`Comm::abort`] (called by the executor when a rank errors or panics)
//!   marks the group failed and aborts the failing rank's communicator. Every abort
//!   happens under the rank's slot lock, which every NCCL call on that communicator
//!   holds, so none is freed while a call on it is in flight. No timeout (`None`) turns
//!   the watchdog off (no events, no monitor) and a hang is not detected.
//! - **Environment.** `NCCL_NVLS_ENABLE=0` (no NVLink multicast) is set in the process
//!   environment before the first NCCL call unless the user set it.
//!
//! The safe `cudarc::nccl::Comm` is not used directly: its `Drop` aborts the communicator
//! (a second abort after a watchdog abort would be a double free) and it is neither `Send`
//! nor `Sync`; the raw handle from `cudarc::nccl::result` lets each abort happen exactly
//! once, under the rank's lock. All-reduce benchmarks are in [`crate::calibrate`].

mod group;
mod op;
mod overlap;
mod p2p;
mod watchdog;

pub use group::{local_group, spanning_group, unique_id};
pub(crate) use group::{release, set_nccl_env};

use super::{AbortSignal, ChunkedSum, Comm, CommError};
use candle_core::cuda::cudarc;
use candle_core::{Result, Shape, Tensor};
use cudarc::driver::CudaEvent;
use cudarc::nccl::{result as nccl, sys};
use group::{Group, Lease, RankSlot};
use op::{CollectiveOp, Kind};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Collectives a rank may have enqueued and not finished before the host waits for the
/// oldest (FLUX runs 2 or 3 a block, up to 7 a double block under token split: the host
/// stays a few blocks ahead at most).
const MAX_IN_FLIGHT: usize = 24;

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The [`Comm`] of one rank of an NCCL group.
pub struct NcclComm {
    rank: usize,
    group: Arc<Group>,
    _lease: Arc<Lease>,
    /// [`Comm::overlap_chunks`].
    chunks: usize,
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

impl NcclComm {
    /// The same handle, splitting row-parallel products into `n` token chunks whose sums
    /// run beside the compute ([`Comm::overlap_chunks`]; at least 1).
    pub fn with_overlap_chunks(mut self, n: usize) -> NcclComm {
        self.chunks = n.max(1);
        self
    }

    /// This rank's GPU ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.group.ordinals[self.rank]
    }

    /// This rank's own failure, `what`.
    pub(crate) fn err(&self, what: String) -> candle_core::Error {
        CommError::Local(format!("{}: {what}", self.group.here(self.rank))).into()
    }

    /// Marks the group failed with this rank's `msg`, aborts this rank's communicator,
    /// returns the error for this rank.
    fn fail(&self, slot: &mut RankSlot, msg: String) -> candle_core::Error {
        self.fail_with(
            slot,
            CommError::Local(format!("{}: {msg}", self.group.here(self.rank))),
        )
    }

    /// [`NcclComm::fail`] with a typed error.
    fn fail_with(&self, slot: &mut RankSlot, e: CommError) -> candle_core::Error {
        self.group.fail(Some(self.rank), e.clone());
        slot.abort();
        e.into()
    }

    /// Waits for a collective enqueued at `start` (done when `event` is), with the
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
                        format!("CUDA error while waiting for the collective: {e:?}"),
                    ))
                }
            }
            if let Some(e) = async_error(comm) {
                let m = format!("NCCL reported an error during the collective: {e}");
                return Err(self.fail(slot, m));
            }
            self.group.poll_signal();
            if self.group.is_failed() {
                slot.abort();
                return Err(self.group.peer_failed_error(self.rank));
            }
            let waited = start.elapsed();
            if waited > limit {
                let e = CommError::Timeout {
                    rank: self.group.here(self.rank),
                    what: "the collective".into(),
                    waited,
                    why: watchdog::why(limit),
                };
                return Err(self.fail_with(slot, e));
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

    /// After a collective was enqueued on the stream of `out`'s device: the host does
    /// not wait for it; the monitor watches it, and the host waits only when more than
    /// `MAX_IN_FLIGHT` are pending (for the oldest).
    fn watch(&self, slot: &mut RankSlot, out: &Tensor) -> Result<()> {
        let stream = out.device().as_cuda_device()?.cuda_stream();
        self.watch_stream(slot, &stream)
    }

    /// [`NcclComm::watch`] for a collective enqueued on `stream`.
    fn watch_stream(&self, slot: &mut RankSlot, stream: &cudarc::driver::CudaStream) -> Result<()> {
        if let Some(limit) = self.group.limit {
            // The host does not wait for the collective: it goes on queueing kernels
            // (waiting here would leave the GPU idle while the next ones are launched).
            // The monitor watches the pending collectives; the host waits only when more
            // than MAX_IN_FLIGHT are pending, for the oldest.
            let event = stream
                .record_event(Some(
                    cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
                ))
                .map_err(|e| self.fail(slot, format!("cannot record a CUDA event: {e:?}")))?;
            slot.pending.push_back((event, Instant::now()));
            while let Some((e, _)) = slot.pending.front() {
                if !matches!(e.try_is_complete(), Ok(true)) {
                    break;
                }
                slot.pending.pop_front();
            }
            if slot.pending.len() > MAX_IN_FLIGHT {
                let (e, t) = slot.pending.pop_front().expect("non-empty");
                self.wait(slot, &e, t, limit)?;
            }
        }
        Ok(())
    }
}

impl NcclComm {
    /// One collective of `kind` on `t` (on this rank's GPU), watched like every other.
    fn collective(&self, t: &Tensor, kind: Kind) -> Result<Tensor> {
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
                    format!("{kind:?} got a tensor on {loc:?}, expected this rank's GPU"),
                ));
            }
        }
        let world = self.group.world();
        // A caller's mistake is refused before anything is enqueued, without failing the
        // group here (the executor still aborts it for the rank's error).
        if kind != Kind::AllReduce && t.dims().is_empty() {
            candle_core::bail!("{kind:?} of a scalar: it needs a dimension 0");
        }
        if kind == Kind::ReduceScatter && t.dims().first().is_some_and(|d| d % world != 0) {
            candle_core::bail!(
                "reduce-scatter of shape {:?}: dimension 0 must split evenly over {world} ranks",
                t.dims()
            );
        }
        if !matches!(
            t.dtype(),
            candle_core::DType::BF16
                | candle_core::DType::F16
                | candle_core::DType::F32
                | candle_core::DType::F64
        ) {
            candle_core::bail!("{kind:?}: unsupported dtype {:?}", t.dtype());
        }
        let t = t.contiguous()?;
        let mut slot = lock(&self.group.slots[self.rank]);
        let Some(comm) = slot.comm.as_ref().map(|c| c.0) else {
            return Err(self.group.peer_failed_error(self.rank));
        };
        let op = CollectiveOp {
            kind,
            comm,
            rank: self.rank,
            world,
            tracker: &self.group.tracker,
        };
        let out = match t.apply_op1_no_bwd(&op) {
            Ok(o) => o,
            Err(e) => return Err(self.fail(&mut slot, e.to_string())),
        };
        self.watch(&mut slot, &out)?;
        Ok(out)
    }
}

impl NcclComm {
    /// [`Comm::all_to_all`], its pieces into one buffer of shape `cat.0` where given (the
    /// buffer `cat.1`, whose own piece is already written, where given).
    fn exchange(
        &self,
        send: &[Tensor],
        recv: &[Shape],
        cat: Option<(&Shape, Option<&Tensor>)>,
    ) -> Result<Vec<Tensor>> {
        super::check_all_to_all(self.rank, self.group.world(), send, recv)?;
        let ordinal = self.group.ordinals[self.rank];
        if self.group.is_failed() {
            let mut slot = lock(&self.group.slots[self.rank]);
            slot.abort();
            return Err(self.group.peer_failed_error(self.rank));
        }
        if let Some(t) = send.iter().find(|t| {
            !matches!(t.device().location(),
                candle_core::DeviceLocation::Cuda { gpu_id } if gpu_id == ordinal)
        }) {
            let mut slot = lock(&self.group.slots[self.rank]);
            let loc = t.device().location();
            return Err(self.fail(
                &mut slot,
                format!("all_to_all got a tensor on {loc:?}, expected this rank's GPU"),
            ));
        }
        let mut slot = lock(&self.group.slots[self.rank]);
        let Some(comm) = slot.comm.as_ref().map(|c| c.0) else {
            return Err(self.group.peer_failed_error(self.rank));
        };
        let got = match op::all_to_all(comm, self.rank, &self.group.tracker, send, recv, cat) {
            Ok(g) => g,
            Err(e) => return Err(self.fail(&mut slot, e.to_string())),
        };
        self.watch(&mut slot, &send[self.rank])?;
        Ok(got)
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
        self.collective(t, Kind::AllReduce)
    }

    fn all_gather_cat(&self, t: &Tensor) -> Result<Tensor> {
        self.collective(t, Kind::AllGather)
    }

    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.collective(t, Kind::ReduceScatter)
    }

    fn overlap_chunks(&self) -> usize {
        self.chunks
    }

    /// Each chunk summed on the rank's side stream beside the compute
    /// ([`overlap`](self::overlap)).
    fn chunked_sum(&self, total: usize) -> Box<dyn ChunkedSum + '_> {
        Box::new(overlap::OverlapSum::new(self, total))
    }

    fn all_to_all(&self, send: &[Tensor], recv: &[Shape]) -> Result<Vec<Tensor>> {
        self.exchange(send, recv, None)
    }

    fn all_to_all_cat(
        &self,
        send: &[Tensor],
        recv: &[Shape],
        into: Option<&Tensor>,
    ) -> Result<Tensor> {
        let shape = super::cat_shape(recv)?;
        if let Some(t) = into {
            super::check_cat_buffer(&send[self.rank], &shape, t)?;
        }
        let mut got = self.exchange(send, recv, Some((&shape, into)))?;
        got.pop()
            .ok_or_else(|| candle_core::Error::Msg("NCCL all-to-all: nothing received".into()))
    }

    /// The group failed (here, in another rank, or in another process) after this
    /// rank's last all-reduce was enqueued: an error, and this rank's communicator is
    /// aborted. Otherwise forgets the finished all-reduces.
    fn check(&self) -> Result<()> {
        let mut slot = lock(&self.group.slots[self.rank]);
        self.group.poll_signal();
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
        self.group.fail(
            Some(self.rank),
            CommError::Local(format!("{} failed", self.group.here(self.rank))),
        );
        if let Ok(mut slot) = self.group.slots[self.rank].try_lock() {
            slot.abort();
        }
    }
}
