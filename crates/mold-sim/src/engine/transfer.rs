//! What moves between devices outside a block: CFG-parallel's combine, the next step's
//! input, hand-offs between parts' groups and the sequence-parallel all-gather.

use super::Sim;
use crate::text::{gbps_text, human};
use crate::{EventKind, Lane};
use mold_cost::Group;
use mold_plan::{DType, DeviceId};

impl<'a> Sim<'a> {
    /// CFG-parallel's combine: the unconditional pass's output to the conditional one's
    /// output device.
    pub(super) fn combine(
        &mut self,
        from: &DeviceId,
        to: &DeviceId,
        bytes: u64,
        s: u32,
        ready: &mut [f64],
    ) {
        if from == to {
            return;
        }
        let (fi, ti) = (self.di(from), self.di(to));
        let start = ready[fi].max(self.devs[ti].comm);
        let end = start + self.machine.transfer_s(from, to, bytes);
        self.devs[ti].comm = end;
        let g = self.machine.transfer_gbps(from, to);
        let phase = format!("step {s}, combine");
        let what = format!(
            "unconditional output from {from} ({}, {})",
            human(bytes),
            gbps_text(g)
        );
        self.event(
            ti,
            Lane::Comm,
            EventKind::Transfer,
            start,
            end,
            what,
            &phase,
        );
        if self.opts.transfer_buffers {
            self.alloc(ti, start, Some(end), bytes, "CFG combine".into(), &phase);
        }
        ready[ti] = ready[ti].max(end);
    }

    /// Moves the next step's input to the first part's devices.
    pub(super) fn step_input(
        &mut self,
        last: &[DeviceId],
        first: &[DeviceId],
        bytes: u64,
        ready: &mut [f64],
        phase: &str,
    ) {
        let done = last.iter().map(|d| ready[self.di(d)]).fold(0.0, f64::max);
        for d in first {
            let i = self.di(d);
            if last.contains(d) {
                continue;
            }
            if !self.opts.latent_return {
                ready[i] = ready[i].max(done);
                continue;
            }
            let (src, g) = self.best_source(last, d);
            let s = ready[self.di(&src)].max(self.devs[i].comm);
            let e = s + self.machine.transfer_s(&src, d, bytes);
            self.devs[i].comm = e;
            let what = format!("latents from {src} ({}, {})", human(bytes), gbps_text(g));
            self.event(i, Lane::Comm, EventKind::Transfer, s, e, what, phase);
            if self.opts.transfer_buffers {
                self.alloc(i, s, Some(e), bytes, "latents (next step)".into(), phase);
            }
            ready[i] = e;
        }
    }

    /// Hands the hidden state from one part's group to the next part's, to every rank.
    ///
    /// The sending devices take nothing else until the last copy has ended: the
    /// executor's thread that ran the sending part makes the copies itself and waits
    /// for them before it runs anything more (`mold-exec`'s `executor/pipeline.rs`,
    /// `Executor::place`), so under pipelined CFG the next micro-batch starts on those
    /// devices after its predecessor's hand-off, as `mold_cost::pipelined_bottleneck`
    /// charges it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn handoff(
        &mut self,
        from: &[DeviceId],
        to: &[DeviceId],
        bytes: u64,
        dtype: DType,
        ready: &mut [f64],
        phase: &str,
    ) {
        let moment = format!("{phase}, hand-off");
        if !self.opts.exact_handoff {
            // The planner's price: the slowest device-to-device path, for any change of
            // group.
            let done = from.iter().map(|d| ready[self.di(d)]).fold(0.0, f64::max);
            let t = self.ctx.handoff_s(dtype);
            for d in to {
                let i = self.di(d);
                let e = done + t;
                if t > 0.0 {
                    self.event(
                        i,
                        Lane::Comm,
                        EventKind::HandOff,
                        done,
                        e,
                        format!("hand-off ({}, slowest link)", human(bytes)),
                        phase,
                    );
                    self.devs[i].comm = self.devs[i].comm.max(e);
                }
                if self.opts.transfer_buffers {
                    self.alloc(i, done, Some(e), bytes, "hand-off in".into(), &moment);
                }
                ready[i] = ready[i].max(e);
            }
            self.sender_waits(from, done + t);
            return;
        }
        let mut last_end: Option<f64> = None;
        for d in to {
            if from.contains(d) {
                continue;
            }
            let i = self.di(d);
            let (src, g) = self.best_source(from, d);
            let si = self.di(&src);
            let s = ready[si].max(self.devs[i].comm);
            let e = s + self.machine.transfer_s(&src, d, bytes);
            self.devs[i].comm = e;
            let how = if let Some(net) = self.machine.network_between(&src, d) {
                format!("{} between nodes", net.kind.name())
            } else if self.machine.domain_of(&[src.clone(), d.clone()]).is_some() {
                "peer".to_string()
            } else {
                "staged through host".to_string()
            };
            let what = format!(
                "hand-off from {src} ({}, {how}, {})",
                human(bytes),
                gbps_text(g)
            );
            self.event(i, Lane::Comm, EventKind::HandOff, s, e, what, phase);
            if self.opts.transfer_buffers {
                self.alloc(
                    i,
                    s,
                    Some(e),
                    bytes,
                    format!("hand-off in from {src}"),
                    &moment,
                );
                self.alloc(
                    si,
                    ready[si],
                    Some(e),
                    bytes,
                    format!("hand-off out to {d}"),
                    &moment,
                );
            }
            ready[i] = e;
            last_end = Some(last_end.map_or(e, |x: f64| x.max(e)));
        }
        if let Some(end) = last_end {
            self.sender_waits(from, end);
        }
    }

    /// The sending devices of a hand-off take no more work until `end`, when its last
    /// copy has ended ([`Self::handoff`]): their compute lane waits, without computing
    /// (a streamed copy beside it keeps its idle rate).
    pub(super) fn sender_waits(&mut self, from: &[DeviceId], end: f64) {
        for d in from {
            let i = self.di(d);
            self.devs[i].compute = self.devs[i].compute.max(end);
        }
    }

    /// The all-gather that ends a run of parts on a sequence-parallel group: every rank
    /// receives the others' token shards of the hidden state (`bytes` in all).
    pub(super) fn gather(
        &mut self,
        group: &Group,
        bytes: u64,
        dtype: DType,
        ready: &mut [f64],
        phase: &str,
    ) {
        let t = self.ctx.gather_s(group, dtype);
        if t <= 0.0 {
            return;
        }
        let s = group
            .devices
            .iter()
            .map(|d| {
                let i = self.di(d);
                ready[i].max(self.devs[i].comm)
            })
            .fold(0.0, f64::max);
        let e = s + t;
        let moment = format!("{phase}, all-gather");
        for d in &group.devices {
            let i = self.di(d);
            self.devs[i].comm = e;
            let what = format!(
                "all-gather of the hidden state ({}, sp{})",
                human(bytes),
                group.sp
            );
            self.event(i, Lane::Comm, EventKind::AllGather, s, e, what, phase);
            if self.opts.transfer_buffers {
                self.alloc(i, s, Some(e), bytes, "all-gather buffer".into(), &moment);
            }
            ready[i] = e;
            // On the compute stream, as a block's collectives ([`Self::block`]).
            self.devs[i].compute = self.devs[i].compute.max(e);
        }
    }
}
