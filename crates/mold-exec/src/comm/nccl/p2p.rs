//! Point-to-point transfers on an NCCL communicator, for hand-offs between processes
//! ([`crate::comm::HandOff`]): one NCCL group of `ncclSend`s (or of `ncclRecv`s into new
//! buffers) on the stream of this rank's GPU, then a wait for it with the watchdog
//! ([`NcclComm::finish`]), so the tensors may be read, freed or reused from any stream
//! afterwards. Tensors travel as bytes (`ncclUint8`): nothing is reduced.

use super::watchdog::CALL_ALL_TO_ALL;
use super::{cudarc, describe, lock, nccl, sys, NcclComm};
use crate::comm::buffers::{address, uninit};
use candle_core::cuda::CudaDevice;
use candle_core::{DType, Device, Result, Shape, Tensor};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl NcclComm {
    /// Sends `tensors` to rank `peer` (copied to this rank's GPU `dev` first where they
    /// are elsewhere) and waits until they are sent. Empty tensors are not sent (the
    /// receiver skips them too).
    pub(crate) fn send_to(&self, tensors: &[Tensor], peer: usize, dev: &CudaDevice) -> Result<()> {
        let here = Device::Cuda(dev.clone());
        let ts: Vec<Tensor> = tensors
            .iter()
            .map(|t| t.to_device(&here)?.contiguous())
            .collect::<Result<_>>()?;
        let stream = dev.cuda_stream();
        let bufs: Vec<(CUdeviceptr, usize)> = ts
            .iter()
            .map(|t| address(t, &stream))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect();
        self.p2p(&stream, peer, &bufs, true)?;
        // `ts` lives until the sends are done.
        self.finish(&stream)?;
        drop(ts);
        Ok(())
    }

    /// Receives tensors of `metas` (dtype, shape) from rank `peer` into new buffers on
    /// this rank's GPU `dev`, and waits until they have arrived.
    pub(crate) fn recv_from(
        &self,
        metas: &[(DType, Shape)],
        peer: usize,
        dev: &CudaDevice,
    ) -> Result<Vec<Tensor>> {
        let stream = dev.cuda_stream();
        let mut out = Vec::with_capacity(metas.len());
        let mut bufs = Vec::with_capacity(metas.len());
        for (dt, shape) in metas {
            if shape.elem_count() == 0 {
                out.push(Tensor::zeros(
                    shape.clone(),
                    *dt,
                    &Device::Cuda(dev.clone()),
                )?);
                continue;
            }
            let (t, p, n) = uninit(dev, &stream, *dt, shape)?;
            out.push(t);
            bufs.push((p, n));
        }
        self.p2p(&stream, peer, &bufs, false)?;
        self.finish(&stream)?;
        Ok(out)
    }

    /// Enqueues one NCCL group of sends (`send`) or receives of `bufs` (address, bytes)
    /// with `peer` on `stream`.
    fn p2p(
        &self,
        stream: &Arc<CudaStream>,
        peer: usize,
        bufs: &[(CUdeviceptr, usize)],
        send: bool,
    ) -> Result<()> {
        let mut slot = lock(&self.group.slots[self.rank]);
        if self.group.is_failed() {
            slot.abort();
            return Err(self.group.peer_failed_error(self.rank));
        }
        if peer >= self.group.world() || peer == self.rank {
            return Err(self.fail(
                &mut slot,
                format!(
                    "hand-off to rank {peer} of a group of {}",
                    self.group.world()
                ),
            ));
        }
        let Some(comm) = slot.comm.as_ref().map(|c| c.0) else {
            return Err(self.group.peer_failed_error(self.rank));
        };
        if let Err(e) = stream.context().bind_to_thread() {
            return Err(self.fail(&mut slot, format!("cannot make the GPU current: {e:?}")));
        }
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        let tracker = &self.group.tracker;
        tracker.issued[self.rank].fetch_add(1, Ordering::SeqCst);
        let r: std::result::Result<(), nccl::NcclError> =
            tracker.busy(self.rank, CALL_ALL_TO_ALL, || {
                nccl::group_start()?;
                let mut first: std::result::Result<(), nccl::NcclError> = Ok(());
                for &(p, n) in bufs {
                    // SAFETY: `p` addresses `n` bytes on this communicator's GPU, alive
                    // and untouched by anyone else until the caller's wait returns; the
                    // peer posts the matching receive (send) of the same size, in the
                    // same order (both ends read the sizes from one header).
                    let r = unsafe {
                        if send {
                            nccl::send(
                                p as *const std::ffi::c_void,
                                n,
                                sys::ncclDataType_t::ncclUint8,
                                peer as i32,
                                comm,
                                cu_stream,
                            )
                        } else {
                            nccl::recv(
                                p as *mut std::ffi::c_void,
                                n,
                                sys::ncclDataType_t::ncclUint8,
                                peer as i32,
                                comm,
                                cu_stream,
                            )
                        }
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
            let what = if send { "send" } else { "receive" };
            let m = format!(
                "NCCL hand-off {what} with rank {peer} failed: {}",
                describe(&e, Some(comm))
            );
            self.fail(&mut slot, m)
        })
    }
}
