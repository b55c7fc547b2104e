//! A plan run as several processes: which process runs which part, activations and the
//! output between processes over the mesh ([`crate::dist`]).

use super::{Executor, Flow, Rank};
use crate::comm::Comm;
use crate::dist::{self, Mesh, Ownership};
use crate::error::{ExecError, Result};
use crate::model::{Activations, Transformer};
use candle_core::Tensor;
use mold_plan::DeviceId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A multi-process run: this process's mesh and which process runs which device.
pub(super) struct DistRt {
    pub mesh: Arc<Mesh>,
    pub own: Ownership,
    /// Forward calls so far (names the messages of each).
    pub calls: AtomicU64,
}

/// The wire tag of the model's output ([`Flow::Out`]); activations use the model's own
/// tags, which must differ from it.
const OUT_TAG: u8 = 255;

impl DistRt {
    fn owner(&self, x: &DeviceId) -> Result<usize> {
        self.own.owner(x).ok_or_else(|| {
            ExecError::Dist(format!("{x} has no owning process (the plan changed?)"))
        })
    }

    /// The communicators of this process's ranks of part `pi`, whose group spans
    /// processes ([`crate::comm::cross_process_group`]: NCCL between GPUs, else
    /// host-staged over the mesh).
    pub(super) fn group<M: Transformer>(
        &self,
        pi: usize,
        devices: &[DeviceId],
        ranks: &[Rank<M>],
        local_ids: &[DeviceId],
    ) -> Result<Vec<Box<dyn Comm>>> {
        let owners: Vec<usize> = devices
            .iter()
            .map(|x| self.owner(x))
            .collect::<Result<_>>()?;
        let local: Vec<(usize, DeviceId)> = ranks
            .iter()
            .zip(local_ids)
            .map(|(r, l)| (r.index, l.clone()))
            .collect();
        crate::comm::cross_process_group(&self.mesh, pi, devices, &owners, &local)
    }
}

impl<M: Transformer> Executor<M> {
    /// [`Executor::forward`] in a multi-process run: runs the parts this process has
    /// ranks in; the process running a part's rank 0 sends the part's output to the
    /// processes that run the next part without running this one (for the last part: to
    /// every other process).
    pub(super) fn forward_multi_process(&self, d: &DistRt, inputs: &M::Inputs) -> Result<Tensor> {
        let me = d.mesh.rank();
        let call = d.calls.fetch_add(1, Ordering::SeqCst);
        let n = self.parts.len();
        // The previous part's output, when this process ran it.
        let mut flow: Option<Flow<M::Acts>> = None;
        for (pi, part) in self.parts.iter().enumerate() {
            let out = if part.ranks.is_empty() {
                None
            } else {
                if pi > 0 && flow.is_none() {
                    let from = d.owner(&self.parts[pi - 1].devices[0])?;
                    let b = d.mesh.recv(from, &format!("acts/{call}/{pi}"))?;
                    flow = Some(decode_flow(&b)?);
                }
                Some(self.run_part(part, flow.as_ref(), inputs)?)
            };
            if d.owner(&part.devices[0])? == me {
                let out = out.as_ref().ok_or_else(|| {
                    ExecError::Dist(format!("part {pi}: rank 0's process ran nothing"))
                })?;
                let (tag, to): (String, Vec<usize>) = if pi + 1 < n {
                    let mut to: Vec<usize> = self.parts[pi + 1]
                        .devices
                        .iter()
                        .map(|x| d.owner(x))
                        .collect::<Result<_>>()?;
                    let ran: Vec<usize> = part
                        .devices
                        .iter()
                        .map(|x| d.owner(x))
                        .collect::<Result<_>>()?;
                    to.retain(|p| !ran.contains(p));
                    to.sort_unstable();
                    to.dedup();
                    (format!("acts/{call}/{}", pi + 1), to)
                } else {
                    let to = (0..d.mesh.world()).filter(|p| *p != me).collect();
                    (format!("out/{call}"), to)
                };
                if !to.is_empty() {
                    let b = encode_flow(out)?;
                    for p in to {
                        d.mesh.send(p, &tag, &b)?;
                    }
                }
            }
            flow = out;
        }
        match flow {
            Some(Flow::Out(t)) => Ok(t),
            _ => {
                let from = d.owner(&self.parts[n - 1].devices[0])?;
                match decode_flow::<M::Acts>(&d.mesh.recv(from, &format!("out/{call}"))?)? {
                    Flow::Out(t) => Ok(t),
                    Flow::Acts(_) | Flow::Sliced(_) => Err(ExecError::Dist(format!(
                        "process {from} sent activations where the output was expected"
                    ))),
                }
            }
        }
    }
}

/// What flows on the wire: a tag byte, then the tensors ([`dist::encode_shaped`]).
fn encode_flow<A: Activations>(f: &Flow<A>) -> Result<Vec<u8>> {
    let (tag, tensors) = match f {
        Flow::Acts(a) => {
            let (tag, t) = a.to_wire()?;
            if tag == OUT_TAG {
                return Err(ExecError::Dist(format!(
                    "activation tag {OUT_TAG} is reserved for the output"
                )));
            }
            (tag, t)
        }
        Flow::Out(t) => (OUT_TAG, vec![t.clone()]),
        Flow::Sliced(_) => {
            return Err(ExecError::Dist(
                "a slice of the sequence cannot cross processes".into(),
            ))
        }
    };
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let body = dist::encode_shaped(&refs)?;
    let mut out = Vec::with_capacity(body.len() + 1);
    out.push(tag);
    out.extend_from_slice(&body);
    Ok(out)
}

fn decode_flow<A: Activations>(b: &[u8]) -> Result<Flow<A>> {
    let bad = |m: String| ExecError::Dist(format!("malformed activations message: {m}"));
    let (tag, body) = b.split_first().ok_or_else(|| bad("empty".into()))?;
    let tensors = dist::decode_shaped(body)?;
    if *tag == OUT_TAG {
        let [t] = <[Tensor; 1]>::try_from(tensors)
            .map_err(|v| bad(format!("the output is one tensor, got {}", v.len())))?;
        return Ok(Flow::Out(t));
    }
    Ok(Flow::Acts(
        A::from_wire(*tag, tensors).map_err(|e| bad(e.to_string()))?,
    ))
}
