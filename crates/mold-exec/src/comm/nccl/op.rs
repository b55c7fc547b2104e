//! The NCCL collectives themselves: the all-reduce, all-gather and reduce-scatter as
//! candle ops on the tensor's stream (for [`Comm::all_reduce_sum`](super::Comm::
//! all_reduce_sum), [`Comm::all_gather_cat`](super::Comm::all_gather_cat) and
//! [`Comm::reduce_scatter_sum`](super::Comm::reduce_scatter_sum)), the all-to-all as one
//! group of sends and receives (for [`Comm::all_to_all`](super::Comm::all_to_all)), and
//! an in-place all-reduce enqueue without allocation or host wait (for
//! [`crate::calibrate`]).

use super::watchdog::{
    Tracker, CALL_ALL_GATHER, CALL_ALL_REDUCE, CALL_ALL_TO_ALL, CALL_REDUCE_SCATTER,
};
use super::{cudarc, describe, lock, nccl, sys, NcclComm};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Which collective a [`CollectiveOp`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// The sum over ranks, the input's shape.
    AllReduce,
    /// Every rank's input concatenated along dimension 0, in rank order.
    AllGather,
    /// The sum over ranks of the input, whose dimension 0 is `world` equal slices: this
    /// rank's slice of it.
    ReduceScatter,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all-reduce",
            Kind::AllGather => "all-gather",
            Kind::ReduceScatter => "reduce-scatter",
        }
    }
}

/// A collective as a candle op: reads the (contiguous) input, writes a new buffer.
pub(super) struct CollectiveOp<'a> {
    pub(super) kind: Kind,
    pub(super) comm: sys::ncclComm_t,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) tracker: &'a Tracker,
}

impl CollectiveOp<'_> {
    /// The output's shape for an input of `shape` (checked: a reduce-scatter's dimension 0
    /// must split evenly).
    fn out_shape(&self, shape: &Shape) -> Result<Shape> {
        let mut dims = shape.dims().to_vec();
        if self.kind == Kind::AllReduce {
            return Ok(shape.clone());
        }
        let Some(d0) = dims.first_mut() else {
            candle_core::bail!("NCCL {}: a scalar has no dimension 0", self.kind.name());
        };
        match self.kind {
            Kind::AllGather => *d0 *= self.world,
            _ if *d0 % self.world != 0 => candle_core::bail!(
                "NCCL reduce-scatter: dimension 0 ({}) does not split over {} ranks",
                d0,
                self.world
            ),
            _ => *d0 /= self.world,
        }
        Ok(Shape::from(dims))
    }

    fn run<T>(&self, s: &CudaStorage, l: &Layout, dtype: sys::ncclDataType_t) -> Result<CudaStorage>
    where
        T: candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr,
    {
        let what = self.kind.name();
        let (start, end) = l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg(format!("NCCL {what}: input is not contiguous"))
        })?;
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let src = s.as_cuda_slice::<T>()?.slice(start..end);
        let n = end - start;
        let out = self.out_shape(l.shape())?.elem_count();
        // SAFETY: every element is written by the collective before anyone reads it.
        let mut dst: CudaSlice<T> = unsafe { dev.alloc::<T>(out) }?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| candle_core::Error::Msg(format!("NCCL {what}: {e:?}")))?;
        {
            let (src_ptr, _src_guard) = src.device_ptr(&stream);
            let (dst_ptr, _dst_guard) = dst.device_ptr_mut(&stream);
            let (sp, dp) = (
                src_ptr as *const std::ffi::c_void,
                dst_ptr as *mut std::ffi::c_void,
            );
            let cs = stream.cu_stream() as sys::cudaStream_t;
            let sum = sys::ncclRedOp_t::ncclSum;
            let call = match self.kind {
                Kind::AllReduce => CALL_ALL_REDUCE,
                Kind::AllGather => CALL_ALL_GATHER,
                Kind::ReduceScatter => CALL_REDUCE_SCATTER,
            };
            // SAFETY: the input holds `n` elements and the output `out` (n, n · world or
            // n / world, as the collective writes) of the type `dtype` names, on this
            // communicator's GPU; the stream is that GPU's candle stream; the guards
            // record the use on the stream when dropped (after the enqueue).
            self.tracker.issued[self.rank].fetch_add(1, Ordering::SeqCst);
            self.tracker
                .busy(self.rank, call, || unsafe {
                    match self.kind {
                        Kind::AllReduce => nccl::all_reduce(sp, dp, n, dtype, sum, self.comm, cs),
                        Kind::AllGather => nccl::all_gather(sp, dp, n, dtype, self.comm, cs),
                        Kind::ReduceScatter => {
                            nccl::reduce_scatter(sp, dp, out, dtype, sum, self.comm, cs)
                        }
                    }
                })
                .map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "NCCL {what} on rank {} failed: {}",
                        self.rank,
                        describe(&e, Some(self.comm))
                    ))
                })?;
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for CollectiveOp<'_> {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::AllReduce => "nccl-all-reduce-sum",
            Kind::AllGather => "nccl-all-gather",
            Kind::ReduceScatter => "nccl-reduce-scatter-sum",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!(
            "NCCL {} needs a CUDA tensor, got a CPU one",
            self.kind.name()
        )
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        use half::{bf16, f16};
        use sys::ncclDataType_t as D;
        let shape = self.out_shape(l.shape())?;
        let out = match s.dtype() {
            DType::BF16 => self.run::<bf16>(s, l, D::ncclBfloat16)?,
            DType::F16 => self.run::<f16>(s, l, D::ncclFloat16)?,
            DType::F32 => self.run::<f32>(s, l, D::ncclFloat32)?,
            DType::F64 => self.run::<f64>(s, l, D::ncclFloat64)?,
            dt => candle_core::bail!("NCCL {}: unsupported dtype {dt:?}", self.kind.name()),
        };
        Ok((out, shape))
    }
}

/// Enqueues the all-to-all of `send` (on this rank's GPU) into new buffers of the
/// `recv` shapes: one NCCL group of a send and a receive per peer, on the device's
/// stream (ordered after the kernels that made `send`, before those that read the
/// result). With `cat` (the shape of the pieces one after another along dimension 0),
/// every piece lands in one buffer — the given one, whose own piece is already written,
/// else a new one into which this rank's own piece is copied on the stream; else
/// `send[rank]` is returned as is (contiguous).
pub(super) fn all_to_all(
    comm: sys::ncclComm_t,
    rank: usize,
    tracker: &Tracker,
    send: &[candle_core::Tensor],
    recv: &[Shape],
    cat: Option<(&Shape, Option<&candle_core::Tensor>)>,
) -> Result<Vec<candle_core::Tensor>> {
    use half::{bf16, f16};
    use sys::ncclDataType_t as D;
    let a = (comm, rank, tracker, send, recv, cat);
    match send[rank].dtype() {
        DType::BF16 => all_to_all_t::<bf16>(a, D::ncclBfloat16),
        DType::F16 => all_to_all_t::<f16>(a, D::ncclFloat16),
        DType::F32 => all_to_all_t::<f32>(a, D::ncclFloat32),
        DType::F64 => all_to_all_t::<f64>(a, D::ncclFloat64),
        // Moved, never summed: bytes (FP8 attention's q, k, v and output).
        DType::F8E4M3 => all_to_all_t::<float8::F8E4M3>(a, D::ncclUint8),
        dt => candle_core::bail!("NCCL all-to-all: unsupported dtype {dt:?}"),
    }
}

type AllToAllArgs<'a> = (
    sys::ncclComm_t,
    usize,
    &'a Tracker,
    &'a [candle_core::Tensor],
    &'a [Shape],
    Option<(&'a Shape, Option<&'a candle_core::Tensor>)>,
);

fn all_to_all_t<T>(
    (comm, rank, tracker, send, recv, cat): AllToAllArgs,
    dtype: sys::ncclDataType_t,
) -> Result<Vec<candle_core::Tensor>>
where
    T: candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr,
{
    use candle_core::{Storage, Tensor};
    let send: Vec<Tensor> = send.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let dev = send[rank].device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    // Where each piece lands: its own buffer, or its range of the one buffer.
    let mut offsets = Vec::with_capacity(recv.len());
    let mut total = 0usize;
    for s in recv {
        offsets.push(total);
        total += s.elem_count();
    }
    let mut outs: Vec<Option<CudaSlice<T>>> = Vec::with_capacity(recv.len());
    let mut whole: Option<CudaSlice<T>> = None;
    // The caller's buffer: its device address (its own piece already written).
    let given = match cat {
        Some((_, Some(t))) => {
            let (st, l) = t.storage_and_layout();
            let Storage::Cuda(cs) = &*st else {
                candle_core::bail!("NCCL all-to-all: the receive buffer is not on the GPU");
            };
            let v = cs.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            let (p, _g) = v.device_ptr(&stream);
            Some((t.clone(), p))
        }
        _ => None,
    };
    if cat.is_some() {
        if given.is_none() {
            // SAFETY: every element is written, by a receive or the copy of this rank's
            // own piece, before anyone reads it.
            whole = Some(unsafe { dev.alloc::<T>(total.max(1)) }?);
        }
    } else {
        for (j, s) in recv.iter().enumerate() {
            outs.push(if j == rank {
                None
            } else {
                // SAFETY: every element is written by the receive before anyone reads it.
                Some(unsafe { dev.alloc::<T>(s.elem_count()) }?)
            });
        }
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
    if let (Some(w), None) = (whole.as_mut(), &given) {
        let own = offsets[rank]..offsets[rank] + recv[rank].elem_count();
        stream
            .memcpy_dtod(&srcs[rank], &mut w.slice_mut(own))
            .map_err(|e| candle_core::Error::Msg(format!("NCCL all-to-all: own piece: {e:?}")))?;
    }
    let cu_stream = stream.cu_stream() as sys::cudaStream_t;
    tracker.issued[rank].fetch_add(1, Ordering::SeqCst);
    let r: std::result::Result<(), nccl::NcclError> = tracker.busy(rank, CALL_ALL_TO_ALL, || {
        nccl::group_start()?;
        let mut first: std::result::Result<(), nccl::NcclError> = Ok(());
        for j in 0..recv.len() {
            if j == rank {
                continue;
            }
            let (sp, _sg) = srcs[j].device_ptr(&stream);
            let mut view;
            let (rp, _rg) = match (&given, whole.as_mut(), outs.get_mut(j)) {
                (Some((_, base)), ..) => {
                    let at = *base + (offsets[j] * std::mem::size_of::<T>()) as u64;
                    // SAFETY (of the write through it): the caller's buffer holds the cat
                    // shape, so piece j's range lies inside it; it was made for this
                    // exchange and nothing reads it before the stream has run it.
                    (at, None)
                }
                (None, Some(w), _) => {
                    view = w.slice_mut(offsets[j]..offsets[j] + recv[j].elem_count());
                    let (p, g) = view.device_ptr_mut(&stream);
                    (p, Some(g))
                }
                (None, None, Some(Some(o))) => {
                    let (p, g) = o.device_ptr_mut(&stream);
                    (p, Some(g))
                }
                _ => continue,
            };
            // SAFETY: the send buffer holds `srcs[j].len()` elements and the receive buffer
            // `recv[j].elem_count()`, both of `dtype` on this communicator's GPU; the peer
            // sends and receives the matching counts (the same call on every rank). Both
            // stay allocated until the stream has run the group (cudarc frees in stream
            // order).
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
    drop(srcs);
    drop(held);
    let wrap = |o: CudaSlice<T>, shape: Shape| {
        Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(o, dev.clone())),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        )
    };
    if let Some((t, _)) = given {
        return Ok(vec![t]);
    }
    if let (Some(w), Some((shape, _))) = (whole, cat) {
        return Ok(vec![wrap(w, shape.clone())]);
    }
    let mut got = Vec::with_capacity(recv.len());
    for (j, out) in outs.into_iter().enumerate() {
        got.push(match out {
            None => send[rank].clone(),
            Some(o) => wrap(o, recv[j].clone()),
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
