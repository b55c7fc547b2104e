//! [`HandOff`]: activations from the process that ran a part to a process that runs the
//! next one, one per pair of processes and part boundary, made once per run.
//!
//! - **NCCL** (feature `nccl`, both ends CUDA devices): a communicator of two ranks (the
//!   sender is rank 0; its process makes the `ncclUniqueId` and sends it over the mesh).
//!   The shapes and dtypes go over the mesh first, in a small header
//!   ([`encode_header`]); the tensors then go GPU to GPU as one NCCL group of
//!   `ncclSend`s / `ncclRecv`s on the stream of each end's GPU, and each end waits for
//!   its group (with the NCCL watchdog) before the tensors are used or freed.
//! - **TCP** otherwise (emulated devices, builds without NCCL): the tensors, staged
//!   through host memory, in one mesh message ([`crate::dist::encode_shaped`]).
//!
//! Both ends pick the path from the plan alone ([`HandOff::open`]), so they always agree.

use crate::dist::{decode_shaped, encode_shaped, Mesh, MAX_FRAME_BYTES};
use crate::error::{ExecError, Result};
use candle_core::{DType, Device, Shape, Tensor};
use mold_plan::DeviceId;
use std::sync::Arc;

/// At most this many tensors in one hand-off.
const MAX_TENSORS: usize = 1 << 10;
/// At most this many dimensions per tensor.
const MAX_RANK: usize = 8;

fn malformed(why: impl std::fmt::Display) -> ExecError {
    ExecError::Dist(format!(
        "malformed hand-off header ({why}): the processes run different builds, or the \
         connection is corrupt"
    ))
}

const DTYPES: [DType; 7] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F64,
    DType::U32,
    DType::I64,
    DType::U8,
];

/// A hand-off's header: the model's tag byte, then each tensor's dtype and shape.
pub fn encode_header(head: u8, metas: &[(DType, Shape)]) -> Result<Vec<u8>> {
    if metas.len() > MAX_TENSORS {
        return Err(ExecError::Dist(format!(
            "cannot hand off {} tensors at once (at most {MAX_TENSORS})",
            metas.len()
        )));
    }
    let mut out = vec![head];
    out.extend_from_slice(&(metas.len() as u32).to_le_bytes());
    for (dt, shape) in metas {
        let code = DTYPES.iter().position(|d| d == dt).ok_or_else(|| {
            ExecError::Dist(format!("cannot hand a {dt:?} tensor to another process"))
        })?;
        if shape.rank() > MAX_RANK {
            return Err(ExecError::Dist(format!(
                "cannot hand off a tensor of rank {} (at most {MAX_RANK})",
                shape.rank()
            )));
        }
        out.push(code as u8);
        out.push(shape.rank() as u8);
        for d in shape.dims() {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
    }
    Ok(out)
}

/// Inverse of [`encode_header`]. Trusts nothing: counts are checked against the bytes
/// present, and the tensors may hold at most [`MAX_FRAME_BYTES`] together (what the
/// receiver allocates).
pub fn decode_header(b: &[u8]) -> Result<(u8, Vec<(DType, Shape)>)> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let s = b
            .get(
                at..at
                    .checked_add(n)
                    .ok_or_else(|| malformed("length overflow"))?,
            )
            .ok_or_else(|| malformed(format!("needs {n} more bytes at byte {at}")))?;
        at += n;
        Ok(s)
    };
    let head = take(1)?[0];
    let n = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
    if n > MAX_TENSORS {
        return Err(malformed(format!("{n} tensors (at most {MAX_TENSORS})")));
    }
    let mut metas = Vec::with_capacity(n);
    let mut total: u64 = 0;
    for _ in 0..n {
        let code = take(1)?[0] as usize;
        let dt = *DTYPES
            .get(code)
            .ok_or_else(|| malformed(format!("dtype code {code}")))?;
        let rank = take(1)?[0] as usize;
        if rank > MAX_RANK {
            return Err(malformed(format!("rank {rank} (at most {MAX_RANK})")));
        }
        let mut dims = Vec::with_capacity(rank);
        let mut elems: u64 = 1;
        for _ in 0..rank {
            let d = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
            elems = elems
                .checked_mul(d)
                .ok_or_else(|| malformed("element count overflow"))?;
            dims.push(usize::try_from(d).map_err(|_| malformed(format!("dimension {d}")))?);
        }
        total = elems
            .checked_mul(dt.size_in_bytes() as u64)
            .and_then(|x| x.checked_add(total))
            .filter(|t| *t <= MAX_FRAME_BYTES)
            .ok_or_else(|| malformed(format!("more than {MAX_FRAME_BYTES} bytes of tensors")))?;
        metas.push((dt, Shape::from(dims)));
    }
    if at != b.len() {
        return Err(malformed(format!("{} bytes left over", b.len() - at)));
    }
    Ok((head, metas))
}

enum Path {
    Tcp,
    #[cfg(feature = "nccl")]
    Nccl {
        comm: super::nccl::NcclComm,
        /// This end's GPU.
        device: candle_core::CudaDevice,
    },
}

/// One direction between two processes: this process sends to `peer`, or receives from
/// it.
pub struct HandOff {
    mesh: Arc<Mesh>,
    peer: usize,
    path: Path,
}

impl HandOff {
    /// Over TCP, staged through host memory.
    pub fn tcp(mesh: Arc<Mesh>, peer: usize) -> HandOff {
        HandOff {
            mesh,
            peer,
            path: Path::Tcp,
        }
    }

    /// The hand-off `key` (the same text in both processes, e.g. the part boundary)
    /// between this process and `peer`: this process sends when `sends`, else receives.
    /// `from` and `to` are the plan's devices at each end (the sending part's rank 0, the
    /// receiving process's first device of the next part); `here` is this end's device
    /// as this process opens it, `device` the opened one. NCCL when built with it and
    /// both ends are CUDA devices (making the communicator waits for the peer, at most
    /// the NCCL watchdog's limit), else TCP.
    pub fn open(
        mesh: Arc<Mesh>,
        key: &str,
        sends: bool,
        peer: usize,
        (from, to): (&DeviceId, &DeviceId),
        (here, device): (&DeviceId, &Device),
    ) -> Result<HandOff> {
        let gpus = matches!(from, DeviceId::Cuda(_)) && matches!(to, DeviceId::Cuda(_));
        #[cfg(feature = "nccl")]
        if gpus {
            return Self::nccl(mesh, key, sends, peer, here, device);
        }
        let _ = (key, sends, gpus, here, device);
        Ok(Self::tcp(mesh, peer))
    }

    #[cfg(feature = "nccl")]
    fn nccl(
        mesh: Arc<Mesh>,
        key: &str,
        sends: bool,
        peer: usize,
        here: &DeviceId,
        device: &Device,
    ) -> Result<HandOff> {
        let dev_err = |m: String| ExecError::Device {
            device: here.to_string(),
            message: m,
        };
        let ordinal = match here {
            DeviceId::Cuda(o) => *o as usize,
            other => {
                return Err(dev_err(format!(
                    "hand-off {key}: an NCCL end opens {other}, not a GPU"
                )))
            }
        };
        let cuda = device.as_cuda_device()?.clone();
        let tag = format!("nccl-id/handoff/{key}");
        let id = if sends {
            let id = super::nccl::unique_id().map_err(dev_err)?;
            mesh.send(peer, &tag, &id)?;
            id
        } else {
            mesh.recv(peer, &tag)?
        };
        let rank = usize::from(!sends);
        let mut comms = super::nccl::spanning_group(
            &id,
            2,
            &[(rank, ordinal)],
            mesh.options().nccl_timeout,
            Some(mesh.abort_signal().clone()),
        );
        let comm = comms
            .pop()
            .ok_or_else(|| dev_err(format!("hand-off {key}: no NCCL communicator was made")))?;
        Ok(HandOff {
            mesh,
            peer,
            path: Path::Nccl { comm, device: cuda },
        })
    }

    /// How the tensors travel, for reports.
    pub fn path(&self) -> &'static str {
        match self.path {
            Path::Tcp => "TCP (staged through host memory)",
            #[cfg(feature = "nccl")]
            Path::Nccl { .. } => "NCCL (GPU to GPU)",
        }
    }

    /// Sends `tensors` with the model's tag byte `head` as message `tag`.
    pub fn send(&self, tag: &str, head: u8, tensors: &[Tensor]) -> Result<()> {
        match &self.path {
            Path::Tcp => {
                let refs: Vec<&Tensor> = tensors.iter().collect();
                let body = encode_shaped(&refs)?;
                let mut b = Vec::with_capacity(body.len() + 1);
                b.push(head);
                b.extend_from_slice(&body);
                self.mesh.send(self.peer, tag, &b)
            }
            #[cfg(feature = "nccl")]
            Path::Nccl { comm, device } => {
                let metas: Vec<(DType, Shape)> = tensors
                    .iter()
                    .map(|t| (t.dtype(), t.shape().clone()))
                    .collect();
                self.mesh
                    .send(self.peer, tag, &encode_header(head, &metas)?)?;
                // The sender is rank 0 of the pair, the receiver rank 1.
                comm.send_to(tensors, 1, device)?;
                Ok(())
            }
        }
    }

    /// Receives message `tag`: the tag byte and the tensors (on the host over TCP, on
    /// this end's GPU over NCCL).
    pub fn recv(&self, tag: &str) -> Result<(u8, Vec<Tensor>)> {
        let b = self.mesh.recv(self.peer, tag)?;
        match &self.path {
            Path::Tcp => {
                let (head, body) = b
                    .split_first()
                    .ok_or_else(|| ExecError::Dist("empty hand-off message".into()))?;
                Ok((*head, decode_shaped(body)?))
            }
            #[cfg(feature = "nccl")]
            Path::Nccl { comm, device } => {
                let (head, metas) = decode_header(&b)?;
                Ok((head, comm.recv_from(&metas, 0, device)?))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn headers_round_trip_and_refuse_what_they_cannot_carry() {
        let metas = vec![
            (DType::BF16, Shape::from((1, 4096, 3072))),
            (DType::F32, Shape::from(())),
            (DType::U8, Shape::from((0, 3))),
        ];
        let b = encode_header(7, &metas).unwrap();
        assert_eq!(decode_header(&b).unwrap(), (7, metas));
        let e = encode_header(0, &[(DType::F8E4M3, Shape::from(1))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot hand a F8E4M3 tensor"), "{e}");
        let mut huge = encode_header(0, &[(DType::F32, Shape::from((1 << 20, 1 << 20)))]).unwrap();
        let e = decode_header(&huge).unwrap_err().to_string();
        assert!(e.contains("more than"), "{e}");
        huge.push(0);
        assert!(decode_header(&huge).is_err());
        assert!(decode_header(&b[..b.len() - 1]).is_err());
        assert!(decode_header(&[]).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_header(&b);
        }
    }
}
