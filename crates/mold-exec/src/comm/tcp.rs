//! [`TcpComm`]: a tensor-parallel group whose ranks live in several processes,
//! all-reducing over the [`Mesh`] (host-staged).

use super::{Comm, CommError};
use crate::dist::{decode_shaped, encode_shaped, Mesh};
use candle_core::{Device, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A tensor-parallel rank whose group spans processes, all-reducing over the [`Mesh`]:
/// every rank sends its tensor (host-staged) to every other rank and sums all of them in
/// rank order, so every rank, and a one-process run with [`super::ThreadComm`], gets
/// bit-identical results. For emulated devices and builds without NCCL.
pub struct TcpComm {
    mesh: Arc<Mesh>,
    /// Names the group in tags (the part index).
    group: String,
    rank: usize,
    /// The process of each rank of the group.
    procs: Vec<usize>,
    seq: AtomicU64,
}

impl TcpComm {
    /// The handle of group rank `rank`; `procs[r]` is the process running rank r.
    pub fn new(mesh: Arc<Mesh>, group: String, rank: usize, procs: Vec<usize>) -> TcpComm {
        TcpComm {
            mesh,
            group,
            rank,
            procs,
            seq: AtomicU64::new(0),
        }
    }

    fn here(&self) -> String {
        format!(
            "rank {} of group {} (process {})",
            self.rank,
            self.group,
            self.mesh.rank()
        )
    }
}

impl Comm for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.procs.len()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let local = |e: crate::ExecError| CommError::Local(format!("{}: {e}", self.here()));
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let host = t.to_device(&Device::Cpu)?;
        let bytes = encode_shaped(&[&host]).map_err(local)?;
        let tag = |from: usize, to: usize| format!("ar/{}/{seq}/{from}>{to}", self.group);
        for (r, &p) in self.procs.iter().enumerate() {
            if r != self.rank {
                self.mesh
                    .send_typed(p, &tag(self.rank, r), &bytes, &self.here())?;
            }
        }
        let mut acc: Option<Tensor> = None;
        for (r, &p) in self.procs.iter().enumerate() {
            let part = if r == self.rank {
                host.clone()
            } else {
                let b = self.mesh.recv_typed(p, &tag(r, self.rank), &self.here())?;
                match decode_shaped(&b).map_err(local)?.pop() {
                    Some(t) => t,
                    None => {
                        return Err(
                            local(crate::ExecError::Dist("empty tensor message".into())).into()
                        )
                    }
                }
            };
            acc = Some(match acc {
                None => part,
                Some(a) if a.shape() != part.shape() || a.dtype() != part.dtype() => {
                    return Err(CommError::Local(format!(
                        "{}: all_reduce_sum: ranks passed {:?}/{:?} and {:?}/{:?}",
                        self.here(),
                        a.shape(),
                        a.dtype(),
                        part.shape(),
                        part.dtype()
                    ))
                    .into());
                }
                Some(a) => (a + part)?,
            });
        }
        acc.unwrap_or(host).to_device(t.device())
    }
    fn all_to_all(&self, send: &[Tensor], recv: &[Shape]) -> candle_core::Result<Vec<Tensor>> {
        let me = self.rank;
        super::check_all_to_all(me, self.procs.len(), send, recv)?;
        let local = |e: crate::ExecError| CommError::Local(format!("{}: {e}", self.here()));
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let tag = |from: usize, to: usize| format!("a2a/{}/{seq}/{from}>{to}", self.group);
        for (r, &p) in self.procs.iter().enumerate() {
            if r != me {
                let host = send[r].to_device(&Device::Cpu)?;
                let bytes = encode_shaped(&[&host]).map_err(local)?;
                self.mesh.send_typed(p, &tag(me, r), &bytes, &self.here())?;
            }
        }
        let mut got = Vec::with_capacity(recv.len());
        for (r, &p) in self.procs.iter().enumerate() {
            if r == me {
                got.push(send[me].contiguous()?);
                continue;
            }
            let b = self.mesh.recv_typed(p, &tag(r, me), &self.here())?;
            let t = decode_shaped(&b)
                .map_err(local)?
                .pop()
                .ok_or_else(|| local(crate::ExecError::Dist("empty tensor message".into())))?;
            if t.shape() != &recv[r] || t.dtype() != send[me].dtype() {
                return Err(CommError::Local(format!(
                    "{}: all_to_all: rank {r} sent {:?}/{:?}, expected {:?}/{:?}",
                    self.here(),
                    t.shape(),
                    t.dtype(),
                    recv[r],
                    send[me].dtype()
                ))
                .into());
            }
            got.push(t.to_device(send[me].device())?);
        }
        Ok(got)
    }
    /// Releases this process's ranks waiting on the mesh (they fail with
    /// [`CommError::PeerAborted`]); the executor then tells the other processes, with the
    /// error that stopped this rank.
    fn abort(&self) {
        self.mesh.fail_local(&format!("{} failed", self.here()));
    }
}
