//! The NCCL collectives themselves: the all-reduce as a candle op on the tensor's stream
//! (for [`Comm::all_reduce_sum`](super::Comm::all_reduce_sum)), the all-to-all as one
//! group of sends and receives (for [`Comm::all_to_all`](super::Comm::all_to_all)), and
//! an in-place all-reduce enqueue without allocation or host wait (for
//! [`crate::calibrate`]).

use super::watchdog::{Tracker, CALL_ALL_REDUCE, CALL_ALL_TO_ALL};
use super::{cudarc, describe, lock, nccl, sys, NcclComm};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// The all-reduce as a candle op: reads the (contiguous) input, writes a new buffer.
pub(super) struct AllReduceOp<'a> {
    pub(super) comm: sys::ncclComm_t,
    pub(super) rank: usize,
    pub(super) tracker: &'a Tracker,
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

/// Enqueues the all-to-all of `send` (on this rank's GPU) into new buffers of the
/// `recv` shapes: one NCCL group of a send and a receive per peer, on the device's
/// stream (ordered after the kernels that made `send`, before those that read the
/// result). `send[rank]` is returned as is (contiguous).
pub(super) fn all_to_all(
    comm: sys::ncclComm_t,
    rank: usize,
    tracker: &Tracker,
    send: &[candle_core::Tensor],
    recv: &[Shape],
) -> Result<Vec<candle_core::Tensor>> {
    use half::{bf16, f16};
    use sys::ncclDataType_t as D;
    match send[rank].dtype() {
        DType::BF16 => all_to_all_t::<bf16>(comm, rank, tracker, send, recv, D::ncclBfloat16),
        DType::F16 => all_to_all_t::<f16>(comm, rank, tracker, send, recv, D::ncclFloat16),
        DType::F32 => all_to_all_t::<f32>(comm, rank, tracker, send, recv, D::ncclFloat32),
        DType::F64 => all_to_all_t::<f64>(comm, rank, tracker, send, recv, D::ncclFloat64),
        dt => candle_core::bail!("NCCL all-to-all: unsupported dtype {dt:?}"),
    }
}

fn all_to_all_t<T>(
    comm: sys::ncclComm_t,
    rank: usize,
    tracker: &Tracker,
    send: &[candle_core::Tensor],
    recv: &[Shape],
    dtype: sys::ncclDataType_t,
) -> Result<Vec<candle_core::Tensor>>
where
    T: candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr,
{
    use candle_core::{Storage, Tensor};
    let send: Vec<Tensor> = send.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let dev = send[rank].device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let mut outs: Vec<Option<CudaSlice<T>>> = Vec::with_capacity(recv.len());
    for (j, s) in recv.iter().enumerate() {
        outs.push(if j == rank {
            None
        } else {
            // SAFETY: every element is written by the receive before anyone reads it.
            Some(unsafe { dev.alloc::<T>(s.elem_count()) }?)
        });
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| candle_core::Error::Msg(format!("NCCL all-to-all: {e:?}")))?;
    let held: Vec<_> = send.iter().map(|t| t.storage_and_layout()).collect();
    let mut srcs = Vec::with_capacity(held.len());
    for (st, l) in &held {
        let Storage::Cuda(cs) = &**st else {
            candle_core::bail!("NCCL all-to-all needs CUDA tensors");
        };
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("NCCL all-to-all: not contiguous".into()))?;
        srcs.push(cs.as_cuda_slice::<T>()?.slice(a..b));
    }
    let cu_stream = stream.cu_stream() as sys::cudaStream_t;
    tracker.issued[rank].fetch_add(1, Ordering::SeqCst);
    let r: std::result::Result<(), nccl::NcclError> = tracker.busy(rank, CALL_ALL_TO_ALL, || {
        nccl::group_start()?;
        let mut first: std::result::Result<(), nccl::NcclError> = Ok(());
        for (j, out) in outs.iter_mut().enumerate() {
            let Some(out) = out.as_mut() else { continue };
            let (sp, _sg) = srcs[j].device_ptr(&stream);
            let (rp, _rg) = out.device_ptr_mut(&stream);
            // SAFETY: the send buffer holds `srcs[j].len()` elements and the receive buffer
            // `recv[j].elem_count()`, both of `dtype` on this communicator's GPU; the peer
            // sends and receives the matching counts (the same call on every rank).
            let r = unsafe {
                nccl::send(
                    sp as *const std::ffi::c_void,
                    srcs[j].len(),
                    dtype,
                    j as i32,
                    comm,
                    cu_stream,
                )
                .and_then(|_| {
                    nccl::recv(
                        rp as *mut std::ffi::c_void,
                        recv[j].elem_count(),
                        dtype,
                        j as i32,
                        comm,
                        cu_stream,
                    )
                })
            };
            if first.is_ok() {
                first = r.map(|_| ());
            }
        }
        // Always close the group, even after a failed call inside it.
        let end = nccl::group_end().map(|_| ());
        first.and(end)
    });
    r.map_err(|e| {
        candle_core::Error::Msg(format!(
            "NCCL all-to-all on rank {rank} failed: {}",
            describe(&e, Some(comm))
        ))
    })?;
    drop(held);
    let mut got = Vec::with_capacity(recv.len());
    for (j, out) in outs.into_iter().enumerate() {
        got.push(match out {
            None => send[rank].clone(),
            Some(o) => Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(o, dev.clone())),
                recv[j].clone(),
                candle_core::op::BackpropOp::none(),
                false,
            ),
        });
    }
    Ok(got)
}

impl NcclComm {
    /// Enqueues an in-place bf16 sum all-reduce of the `n` elements at `ptr` on `stream`
    /// without waiting for it (for timing: no allocation and no host wait, unlike
    /// [`Comm::all_reduce_sum`](super::Comm::all_reduce_sum)).
    pub(crate) fn enqueue_in_place(
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
    pub(crate) fn finish(&self, stream: &CudaStream) -> Result<()> {
        let mut slot = lock(&self.group.slots[self.rank]);
        if self.group.is_failed() || slot.comm.is_none() {
            slot.abort();
            return Err(self.group.peer_failed_error(self.rank));
        }
        match self.group.limit {
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
