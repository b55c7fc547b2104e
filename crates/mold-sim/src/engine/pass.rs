//! One transformer pass through a placement's parts, and one block on its group: its
//! streamed copy, each rank's compute, its all-reduces and all-to-alls.

use super::{copy_end, BlockInfo, GroupStream, PassRun, Sim};
use crate::text::human;
use crate::{EventKind, Lane};
use mold_plan::Residency;

impl<'a> Sim<'a> {
    /// One transformer pass of step `s` through `run`'s parts (`label`: which pass or
    /// micro-batch, in the events' phase), from and into `ready`.
    pub(super) fn pass(&mut self, run: &mut PassRun, s: u32, label: &str, ready: &mut [f64]) {
        let tc = run.tc;
        let dtype = tc.dtype;
        let hand_bytes = self.ctx.handoff_bytes(dtype);
        for st in run.streams.iter_mut() {
            st.seen_this_step = false;
        }
        for (pi, p) in tc.parts.iter().enumerate() {
            let phase = if label.is_empty() {
                format!("step {s}, part {}", pi + 1)
            } else {
                format!("step {s}, {label}, part {}", pi + 1)
            };
            let g = run.group_of[pi];
            if pi > 0 && run.group_of[pi - 1] != g {
                let prev = tc.parts[pi - 1].devices.clone();
                self.handoff(&prev, &p.devices, hand_bytes, dtype, ready, &phase);
            }
            if p.residency == Residency::Streamed && !run.streams[g].seen_this_step {
                run.streams[g].seen_this_step = true;
                if !self.opts.prefetch {
                    for (li, d) in p.devices.iter().enumerate() {
                        run.streams[g].gate[li] = ready[self.di(d)];
                    }
                }
            }
            for r in &p.blocks {
                let info = self.info(&r.kind, &run.groups[g], dtype);
                for b in r.start..r.end {
                    let what = format!("{} {b}", r.kind);
                    let moment = format!("{phase}, {what}");
                    self.block(p, &info, &what, &moment, &phase, &mut run.streams[g], ready);
                }
            }
            // A run of parts on a sequence-parallel group ends with an all-gather of
            // the hidden state.
            if run.group_of.get(pi + 1) != Some(&g) {
                let group = run.groups[g].clone();
                self.gather(&group, hand_bytes, dtype, ready, &phase);
            }
        }
    }

    /// One block on its group: copy (streamed), compute on each rank, all-reduces and
    /// all-to-alls.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block(
        &mut self,
        p: &mold_plan::Part,
        info: &BlockInfo,
        what: &str,
        moment: &str,
        phase: &str,
        st: &mut GroupStream,
        ready: &mut [f64],
    ) {
        let group = &p.devices;
        let streamed = p.residency == Residency::Streamed;
        let bc = info.cost;
        let mut starts = Vec::with_capacity(group.len());
        let mut ends = Vec::with_capacity(group.len());
        for (li, d) in group.iter().enumerate() {
            let i = self.di(d);
            let mut copied = 0.0f64;
            if streamed {
                let j = st.done[li].len();
                let buffer_free = if j >= st.buffers {
                    st.done[li][j - st.buffers]
                } else {
                    0.0
                };
                let s = self.devs[i].copy.max(st.gate[li]).max(buffer_free);
                let e = copy_end(&self.devs[i].busy, s, bc.copy_s, 1.0 - bc.copy_contention);
                self.devs[i].copy = e;
                self.event(
                    i,
                    Lane::Copy,
                    EventKind::Copy,
                    s,
                    e,
                    format!("copy {what} ({})", human(bc.weight_bytes)),
                    phase,
                );
                copied = e;
            }
            let s = self.devs[i].compute.max(ready[i]).max(copied);
            let e = s + info.per_rank_s[li];
            self.devs[i].compute = e;
            let kind = if streamed {
                EventKind::StreamedBlock
            } else {
                EventKind::Block
            };
            self.event(i, Lane::Compute, kind, s, e, what.to_string(), phase);
            starts.push(s);
            ends.push(e);
        }
        let mut done = ends.clone();
        let link = self.machine.group_link(group);
        let via = match (link.network, link.staged, link.kind) {
            (Some(n), ..) => format!("{} between nodes", n.name()),
            (None, true, _) => "staged through host".to_string(),
            (None, false, Some(k)) => format!("{k:?}").to_lowercase(),
            (None, false, None) => "peer".to_string(),
        };
        let allreduce = if info.allgathers > 0 {
            format!(
                "all-reduce ×{} + all-gather after {what} ({} each, {} gathered, {via})",
                info.allreduces,
                human(info.hidden),
                human(info.gathered)
            )
        } else {
            format!(
                "all-reduce ×{} after {what} ({} each, {via})",
                info.allreduces,
                human(info.hidden)
            )
        };
        let alltoall = format!(
            "all-to-all ×{} in {what} (q/k/v stacked, 3 × {}; then the output, {}; {via})",
            mold_cost::ALLTOALL_SHARDS.len(),
            human(info.shard),
            human(info.shard)
        );
        // Tensor-parallel all-reduces, then sequence-parallel all-to-alls: each joins
        // the group, starting when its slowest rank is ready.
        let collectives = [
            (
                bc.allreduce_s,
                EventKind::AllReduce,
                allreduce,
                info.hidden,
                "all-reduce buffer",
            ),
            (
                bc.alltoall_s,
                EventKind::AllToAll,
                alltoall,
                info.shard,
                "all-to-all buffer",
            ),
        ];
        for (seconds, kind, w, bytes, buffer) in collectives {
            if group.len() < 2 || seconds <= 0.0 {
                continue;
            }
            let mut s = 0.0f64;
            for (li, d) in group.iter().enumerate() {
                s = s.max(done[li]).max(self.devs[self.di(d)].comm);
            }
            let e = s + seconds;
            for (li, d) in group.iter().enumerate() {
                let i = self.di(d);
                self.devs[i].comm = e;
                self.event(i, Lane::Comm, kind, s, e, w.clone(), phase);
                if self.opts.transfer_buffers {
                    self.alloc(i, s, Some(e), bytes, buffer.into(), moment);
                }
                done[li] = e;
            }
        }
        for (li, d) in group.iter().enumerate() {
            let i = self.di(d);
            self.alloc(
                i,
                starts[li],
                Some(done[li]),
                bc.activation_bytes,
                format!("activations of {what}"),
                moment,
            );
            ready[i] = done[li];
            // The executor runs a block's collectives on the device's compute stream:
            // nothing else (another micro-batch's block under pipelined CFG) computes
            // there before they end.
            self.devs[i].compute = self.devs[i].compute.max(done[li]);
            if streamed {
                st.done[li].push(done[li]);
            }
        }
    }
}
