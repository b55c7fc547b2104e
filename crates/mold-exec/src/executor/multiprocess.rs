//! A plan run as several processes: which process runs which part, activations between
//! processes through [`HandOff`]s (NCCL between GPUs, else TCP), made once per run, and
//! the output to every process over the mesh ([`crate::dist`]).

use super::{Executor, Flow, PartRt, Rank};
use crate::comm::{Comm, HandOff};
use crate::dist::{LocalDevices, Mesh};
use crate::error::{ExecError, Result};
use crate::model::{Activations, Transformer};
use candle_core::Tensor;
use mold_plan::DeviceId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A multi-process run: this process's mesh, which process runs which device and how
/// this one opens its own.
pub(super) struct DistRt {
    pub mesh: Arc<Mesh>,
    pub local: LocalDevices,
    /// Forward calls so far (names the messages of each).
    pub calls: AtomicU64,
    /// This process's hand-offs: (the part whose output it carries, the sending process,
    /// the receiving one, the hand-off).
    hand_offs: Vec<(usize, usize, usize, HandOff)>,
}

/// The wire tag of the model's output ([`Flow::Out`]); activations use the model's own
/// tags, which must differ from it.
const OUT_TAG: u8 = 255;

impl DistRt {
    /// Checks that `local` was resolved for this mesh's process and for these parts'
    /// devices.
    pub(super) fn new(
        mesh: Arc<Mesh>,
        local: LocalDevices,
        parts: &[mold_plan::Part],
    ) -> Result<DistRt> {
        if (local.rank(), local.world()) != (mesh.rank(), mesh.world()) {
            return Err(ExecError::Launch(format!(
                "the devices were resolved for process {} of {}, but this is process {} of {}",
                local.rank(),
                local.world(),
                mesh.rank(),
                mesh.world()
            )));
        }
        if let Some(d) = parts
            .iter()
            .flat_map(|p| &p.devices)
            .find(|d| local.ownership().owner(d).is_none())
        {
            return Err(ExecError::Launch(format!(
                "{d} has no owning process: the devices were resolved for another plan"
            )));
        }
        Ok(DistRt {
            mesh,
            local,
            calls: AtomicU64::new(0),
            hand_offs: Vec::new(),
        })
    }

    /// The processes that receive part `pi`'s output: those running part `pi + 1` and
    /// not part `pi`, in order (none for the last part: the output goes to everyone).
    fn receivers<M: Transformer>(&self, parts: &[PartRt<M>], pi: usize) -> Result<Vec<usize>> {
        let Some(next) = parts.get(pi + 1) else {
            return Ok(Vec::new());
        };
        let ran: Vec<usize> = parts[pi]
            .devices
            .iter()
            .map(|x| self.owner(x))
            .collect::<Result<_>>()?;
        let mut to: Vec<usize> = next
            .devices
            .iter()
            .map(|x| self.owner(x))
            .collect::<Result<_>>()?;
        to.retain(|p| !ran.contains(p));
        to.sort_unstable();
        to.dedup();
        Ok(to)
    }

    /// Makes this process's hand-offs, part boundary by part boundary (every process in
    /// the same order, so making NCCL communicators, which waits for the peer, cannot
    /// deadlock). Both ends pick NCCL or TCP from the plan's devices
    /// ([`HandOff::open`]).
    pub(super) fn open_hand_offs<M: Transformer>(&mut self, parts: &[PartRt<M>]) -> Result<()> {
        let me = self.mesh.rank();
        for pi in 0..parts.len().saturating_sub(1) {
            let (a, b) = (&parts[pi], &parts[pi + 1]);
            let from = &a.devices[0];
            let sender = self.owner(from)?;
            for q in self.receivers(parts, pi)? {
                let to = b
                    .devices
                    .iter()
                    .find(|x| self.owner(x).ok() == Some(q))
                    .ok_or_else(|| {
                        ExecError::Dist(format!("part {}: no device of process {q}", pi + 1))
                    })?;
                let key = format!("{pi}/{sender}>{q}");
                // This end: the sending part's rank 0, or the receiving process's first
                // rank of the next part.
                let end = if me == sender {
                    let i = a.ranks.iter().position(|r| r.index == 0);
                    i.map(|i| (&a.local_ids[i], &a.ranks[i].device, true, q))
                } else if me == q {
                    b.ranks
                        .first()
                        .map(|r| (&b.local_ids[0], &r.device, false, sender))
                } else {
                    continue;
                };
                let (here, device, sends, peer) = end.ok_or_else(|| {
                    ExecError::Dist(format!("hand-off {key}: this process runs no end of it"))
                })?;
                let h = HandOff::open(
                    self.mesh.clone(),
                    &key,
                    sends,
                    peer,
                    (from, to),
                    (here, device),
                )?;
                self.hand_offs.push((pi, sender, q, h));
            }
        }
        Ok(())
    }

    /// The hand-off of part `pi`'s output between processes `from` and `to`.
    fn hand_off(&self, pi: usize, from: usize, to: usize) -> Result<&HandOff> {
        self.hand_offs
            .iter()
            .find(|(p, f, t, _)| (*p, *f, *t) == (pi, from, to))
            .map(|(_, _, _, h)| h)
            .ok_or_else(|| {
                ExecError::Dist(format!(
                    "no hand-off of part {pi}'s output from process {from} to process {to}"
                ))
            })
    }

    fn owner(&self, x: &DeviceId) -> Result<usize> {
        self.local.ownership().owner(x).ok_or_else(|| {
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
    /// How part outputs cross processes in a multi-process run, for reports:
    /// `(part, sending process, receiving process, path)` for each hand-off this process
    /// sends or receives (empty in a one-process run).
    pub fn process_hand_offs(&self) -> Vec<(usize, usize, usize, &'static str)> {
        self.dist.as_ref().map_or_else(Vec::new, |d| {
            d.hand_offs
                .iter()
                .map(|(pi, f, t, h)| (*pi, *f, *t, h.path()))
                .collect()
        })
    }

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
                    let (head, ts) = d
                        .hand_off(pi - 1, from, me)?
                        .recv(&format!("acts/{call}/{pi}"))?;
                    flow = Some(flow_from_wire(head, ts)?);
                }
                Some(self.run_part(part, flow.take(), inputs, None, self.must_finish(pi))?)
            };
            if d.owner(&part.devices[0])? == me {
                let out = out.as_ref().ok_or_else(|| {
                    ExecError::Dist(format!("part {pi}: rank 0's process ran nothing"))
                })?;
                if pi + 1 < n {
                    let to = d.receivers(&self.parts, pi)?;
                    if !to.is_empty() {
                        let (head, ts) = flow_to_wire(out)?;
                        let tag = format!("acts/{call}/{}", pi + 1);
                        for p in to {
                            d.hand_off(pi, me, p)?.send(&tag, head, &ts)?;
                        }
                    }
                } else {
                    // The output (small) goes to every other process over TCP.
                    let (head, ts) = flow_to_wire(out)?;
                    for p in (0..d.mesh.world()).filter(|p| *p != me) {
                        HandOff::tcp(d.mesh.clone(), p).send(&format!("out/{call}"), head, &ts)?;
                    }
                }
            }
            flow = out;
        }
        match flow {
            Some(Flow::Out(t)) => Ok(t),
            _ => {
                let from = d.owner(&self.parts[n - 1].devices[0])?;
                let (head, ts) = HandOff::tcp(d.mesh.clone(), from).recv(&format!("out/{call}"))?;
                match flow_from_wire::<M::Acts>(head, ts)? {
                    Flow::Out(t) => Ok(t),
                    Flow::Acts(_) | Flow::Sliced(_) | Flow::Placed { .. } => Err(ExecError::Dist(
                        format!("process {from} sent activations where the output was expected"),
                    )),
                }
            }
        }
    }
}

/// What flows between processes: a tag byte and the tensors.
fn flow_to_wire<A: Activations>(f: &Flow<A>) -> Result<(u8, Vec<Tensor>)> {
    match f {
        Flow::Acts(a) => {
            let (tag, t) = a.to_wire()?;
            if tag == OUT_TAG {
                return Err(ExecError::Dist(format!(
                    "activation tag {OUT_TAG} is reserved for the output"
                )));
            }
            Ok((tag, t))
        }
        Flow::Out(t) => Ok((OUT_TAG, vec![t.clone()])),
        Flow::Sliced(_) => Err(ExecError::Dist(
            "a slice of the sequence cannot cross processes".into(),
        )),
        Flow::Placed { .. } => Err(ExecError::Dist(
            "activations placed on the next part's devices cannot cross processes".into(),
        )),
    }
}

fn flow_from_wire<A: Activations>(tag: u8, tensors: Vec<Tensor>) -> Result<Flow<A>> {
    let bad = |m: String| ExecError::Dist(format!("malformed activations message: {m}"));
    if tag == OUT_TAG {
        let [t] = <[Tensor; 1]>::try_from(tensors)
            .map_err(|v| bad(format!("the output is one tensor, got {}", v.len())))?;
        return Ok(Flow::Out(t));
    }
    Ok(Flow::Acts(
        A::from_wire(tag, tensors).map_err(|e| bad(e.to_string()))?,
    ))
}
