//! Chunked sums beside the compute ([`Comm::chunked_sum`](super::Comm::chunked_sum)): each
//! chunk's all-reduce runs on a stream of its own (the rank's *side* stream, highest
//! priority, made once per communicator), so the GPU sums chunk i while it computes chunk
//! i+1 on the compute stream.
//!
//! Ordering, with cudarc's automatic cross-stream waits off (the executor's devices do not
//! rely on them):
//! - **push**: the chunk's sum is enqueued on the side stream after an event recorded on
//!   the compute stream once the chunk (and the result buffer) are made;
//! - **finish**: the compute stream waits for an event recorded on the side stream after
//!   the last sum, so everything queued after `finish` sees the sums;
//! - **memory**: the chunks stay referenced until the compute stream has waited, so their
//!   stream-ordered frees come after the sums read them (also when the sum is dropped
//!   without `finish`, on an error between pushes).
//!
//! With a batch of one the sums are written straight into one result buffer at each
//! chunk's offset (no concatenation); a larger batch sums each chunk into a buffer of its
//! own and concatenates them at `finish`.

use super::watchdog::CALL_ALL_REDUCE;
use super::{cudarc, describe, lock, nccl, sys, ChunkedSum, NcclComm};
use crate::comm::buffers::{address, uninit};
use candle_core::{DType, Result, Shape, Tensor};
use cudarc::driver::CudaStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A chunked sum in progress on one rank.
pub(super) struct OverlapSum<'a> {
    comm: &'a NcclComm,
    total: usize,
    /// Tokens pushed so far.
    len: usize,
    /// The compute stream (the chunks' device's candle stream) and the side stream.
    streams: Option<(Arc<CudaStream>, Arc<CudaStream>)>,
    /// The result written in place (batch of one), allocated at the first push.
    out: Option<Tensor>,
    /// Each chunk's sum (larger batches).
    sums: Vec<Tensor>,
    /// The chunks, referenced until the compute stream has waited for their sums.
    keep: Vec<Tensor>,
    /// The compute stream waited for the side stream (`finish` ran, or nothing pushed).
    joined: bool,
}

impl<'a> OverlapSum<'a> {
    pub(super) fn new(comm: &'a NcclComm, total: usize) -> Self {
        OverlapSum {
            comm,
            total,
            len: 0,
            streams: None,
            out: None,
            sums: Vec::new(),
            keep: Vec::new(),
            joined: true,
        }
    }

    /// The compute stream waits for everything queued on the side stream so far.
    fn join(&mut self) -> Result<()> {
        if self.joined {
            return Ok(());
        }
        self.joined = true;
        let Some((compute, side)) = &self.streams else {
            return Ok(());
        };
        let ev = side
            .record_event(Some(sys_flags()))
            .map_err(|e| self.comm.err(format!("cannot record a CUDA event: {e:?}")))?;
        compute.wait(&ev).map_err(|e| {
            self.comm
                .err(format!("cannot wait for a CUDA event: {e:?}"))
        })
    }
}

fn sys_flags() -> cudarc::driver::sys::CUevent_flags {
    cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
}

/// NCCL's type for a candle dtype the sums support.
fn nccl_dtype(d: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as D;
    Some(match d {
        DType::BF16 => D::ncclBfloat16,
        DType::F16 => D::ncclFloat16,
        DType::F32 => D::ncclFloat32,
        DType::F64 => D::ncclFloat64,
        _ => return None,
    })
}

impl ChunkedSum for OverlapSum<'_> {
    fn push(&mut self, partial: Tensor) -> Result<()> {
        let comm = self.comm;
        let group = &comm.group;
        if group.is_failed() {
            let mut slot = lock(&group.slots[comm.rank]);
            slot.abort();
            return Err(group.peer_failed_error(comm.rank));
        }
        let ordinal = group.ordinals[comm.rank];
        if !matches!(partial.device().location(),
            candle_core::DeviceLocation::Cuda { gpu_id } if gpu_id == ordinal)
        {
            let mut slot = lock(&group.slots[comm.rank]);
            let loc = partial.device().location();
            return Err(comm.fail(
                &mut slot,
                format!("chunked sum got a tensor on {loc:?}, expected this rank's GPU"),
            ));
        }
        let Some(dtype) = nccl_dtype(partial.dtype()) else {
            candle_core::bail!("NCCL chunked sum: unsupported dtype {:?}", partial.dtype());
        };
        let dims = partial.dims().to_vec();
        if dims.len() < 2 || self.len + dims[1] > self.total {
            candle_core::bail!(
                "NCCL chunked sum: a chunk of shape {dims:?} after {} of {} tokens",
                self.len,
                self.total
            );
        }
        let partial = partial.contiguous()?;
        let dev = partial.device().as_cuda_device()?.clone();
        let mut slot = lock(&group.slots[comm.rank]);
        let Some(raw) = slot.comm.as_ref().map(|c| c.0) else {
            return Err(group.peer_failed_error(comm.rank));
        };
        if self.streams.is_none() {
            let side = match &slot.side {
                Some(s) => s.clone(),
                None => {
                    let Some(ctx) = slot.ctx.clone() else {
                        return Err(group.peer_failed_error(comm.rank));
                    };
                    let made = ctx.bind_to_thread().and_then(|_| {
                        let (_, greatest) = cudarc::driver::result::stream::get_priority_range()?;
                        ctx.new_stream_with_priority(greatest)
                    });
                    let s = made.map_err(|e| {
                        comm.fail(&mut slot, format!("cannot make a CUDA stream: {e:?}"))
                    })?;
                    slot.side = Some(s.clone());
                    s
                }
            };
            self.streams = Some((dev.cuda_stream(), side));
        }
        let (compute, side) = self.streams.clone().expect("made above");
        // Where this chunk's sum goes: the shared result (batch of one) or its own buffer.
        let batch_one = dims[0] == 1;
        let dst = if batch_one {
            if self.out.is_none() {
                let mut full = dims.clone();
                full[1] = self.total;
                self.out = Some(uninit(&dev, &compute, partial.dtype(), &Shape::from(full))?.0);
            }
            None
        } else {
            Some(uninit(&dev, &compute, partial.dtype(), partial.shape())?.0)
        };
        let row: usize = dims[2..].iter().product();
        let n = partial.elem_count();
        // The side stream starts once the chunk and its result buffer are made.
        compute
            .record_event(Some(sys_flags()))
            .and_then(|ev| side.wait(&ev))
            .map_err(|e| comm.fail(&mut slot, format!("cannot order the streams: {e:?}")))?;
        let src = address(&partial, &side)?.0;
        let dst_ptr = match (&dst, &self.out) {
            (Some(d), _) => address(d, &side)?.0,
            (None, Some(out)) => {
                let size = out.dtype().size_in_bytes();
                address(out, &side)?.0 + (self.len * row * size) as u64
            }
            (None, None) => unreachable!("the result buffer is made above"),
        };
        self.joined = false;
        let tracker = &group.tracker;
        tracker.issued[comm.rank].fetch_add(1, Ordering::SeqCst);
        // SAFETY: `src` holds `n` elements of `dtype` (the contiguous chunk) and `dst_ptr`
        // room for `n` more (its own buffer, or the result's rows `len..len + chunk`), both
        // on this communicator's GPU and alive until the compute stream has waited for the
        // side stream (`keep`, `out`, `sums`); the side stream is that GPU's.
        let r = tracker.busy(comm.rank, CALL_ALL_REDUCE, || unsafe {
            nccl::all_reduce(
                src as *const std::ffi::c_void,
                dst_ptr as *mut std::ffi::c_void,
                n,
                dtype,
                sys::ncclRedOp_t::ncclSum,
                raw,
                side.cu_stream() as sys::cudaStream_t,
            )
        });
        if let Err(e) = r {
            let m = format!(
                "NCCL all-reduce on rank {} failed: {}",
                comm.rank,
                describe(&e, Some(raw))
            );
            return Err(comm.fail(&mut slot, m));
        }
        // Referenced before anything else can fail: the side stream now reads the chunk and
        // writes the sum, so neither may be freed before the compute stream waited for it.
        self.len += dims[1];
        self.keep.push(partial);
        if let Some(d) = dst {
            self.sums.push(d);
        }
        comm.watch_stream(&mut slot, &side)?;
        drop(slot);
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<Tensor> {
        if self.len != self.total || self.len == 0 {
            candle_core::bail!(
                "NCCL chunked sum: chunks {} tokens long in all, expected {}",
                self.len,
                self.total
            );
        }
        self.join()?;
        self.keep.clear();
        if let Some(out) = self.out.take() {
            return Ok(out);
        }
        let sums = std::mem::take(&mut self.sums);
        if sums.len() == 1 {
            return Ok(sums.into_iter().next().expect("one"));
        }
        Tensor::cat(&sums, 1)
    }
}

impl Drop for OverlapSum<'_> {
    /// Dropped without `finish` (an error between pushes): the chunks are freed only
    /// after the compute stream waited for the sums that read them.
    fn drop(&mut self) {
        let _ = self.join();
    }
}
