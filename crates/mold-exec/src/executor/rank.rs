//! One part's ranks running their blocks: one device plainly, a tensor-parallel group
//! as one thread per rank; weights fetched as their residency says.

use super::{Executor, Flow, PartRt, Rank};
use crate::comm::{Comm, LocalComm};
use crate::error::{ExecError, Result};
use crate::model::{Activations, Ctx, Inputs, Transformer, Weights};
use crate::runtime::Held;
use std::borrow::Cow;

/// Aborts the rank's groups (tensor- and sequence-parallel) if the rank's thread leaves
/// without finishing (error or panic), so the other ranks do not wait forever.
struct AbortGuard<'a>(&'a dyn Comm, &'a dyn Comm, bool);

impl Drop for AbortGuard<'_> {
    fn drop(&mut self) {
        if !self.2 {
            self.0.abort();
            self.1.abort();
        }
    }
}

/// Each rank's communicators, in the part's rank order.
type Groups = (Vec<Box<dyn Comm>>, Vec<Box<dyn Comm>>);

/// The ranks of a part's groups (indices into its devices), tensor-parallel groups first:
/// rank `i` is tensor-parallel rank `i % tp` of the group `⌊i / tp⌋·tp ..`, and
/// sequence-parallel rank `⌊i / tp⌋` of the group `i % tp, i % tp + tp, ..`. What
/// [`Executor::groups`] makes for each call, and what loading makes ahead of the first
/// ([`super::warm_groups`]).
pub(super) fn group_members(tp: usize, sp: usize) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let tp_groups = (0..sp)
        .map(|s| (0..tp).map(|t| s * tp + t).collect())
        .collect();
    let sp_groups = (0..tp)
        .map(|t| (0..sp).map(|s| s * tp + t).collect())
        .collect();
    (tp_groups, sp_groups)
}

impl<M: Transformer> Executor<M> {
    /// Runs `part` on what the previous part produced (`None`: the call's inputs, for
    /// the first part); `mb`: which micro-batch of [`Executor::forward_micro_batches`]
    /// this is (`None` for [`Executor::forward`]), for the profile's labels. `finish`:
    /// return only once the part's kernels are done ([`Executor::must_finish`]); a part
    /// of several ranks always finishes (its ranks run on threads of their own).
    pub(super) fn run_part(
        &self,
        part: &PartRt<M>,
        prev: Option<Flow<M::Acts>>,
        inputs: &M::Inputs,
        mb: Option<usize>,
        finish: bool,
    ) -> Result<Flow<M::Acts>> {
        self.run_parts(std::slice::from_ref(part), prev, inputs, mb, finish)
    }

    /// [`Executor::run_part`] over `run`: consecutive parts of one tensor-parallel group
    /// ([`Executor::same_group`]; one part otherwise). Each rank's thread runs every part
    /// of the run in turn on its own activations (replicated by the all-reduces, so its
    /// own equal rank 0's), and the host waits once, after the last: a wait and a copy
    /// of the activations to every rank at each boundary cost a TP2 plan with 39 parts a
    /// pass about 3.5 ms each (BENCHMARKS.md, history 2026-11-24).
    ///
    /// `prev` is taken by value: where it is the activations already on a one-device
    /// part's device, the part's first block holds the only reference and frees its input
    /// after its last use. Anything else (a copy from another device, the copies a stage
    /// placed, sequence slices) is kept until the part has finished: a copy's source must
    /// outlive it, and nothing else orders its stream with this part's.
    pub(super) fn run_parts(
        &self,
        run: &[PartRt<M>],
        prev: Option<Flow<M::Acts>>,
        inputs: &M::Inputs,
        mb: Option<usize>,
        finish: bool,
    ) -> Result<Flow<M::Acts>> {
        let part = run
            .first()
            .ok_or_else(|| ExecError::Plan("an empty run of parts".into()))?;
        if part.devices.len() == 1 && run.len() == 1 {
            let rank = &part.ranks[0];
            let (give, keep) = match prev {
                Some(Flow::Acts(a)) if on_device(&a, &rank.device)? => {
                    (Some(Cow::Owned(Flow::Acts(a))), None)
                }
                other => (None, other),
            };
            let prev = give.or(keep.as_ref().map(Cow::Borrowed));
            let out = self.run_rank(part, rank, &LocalComm, &LocalComm, prev, inputs, mb)?;
            // Another device's part reads it on its own streams (from another thread
            // under tensor parallelism), which are not ordered with this one: finish it.
            if finish {
                rank.device.synchronize()?;
                self.waits
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            drop(keep);
            return Ok(out);
        }
        self.waits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let made;
        let (tp_comms, sp_comms): (Vec<&dyn Comm>, Vec<&dyn Comm>) = match &part.comms {
            // Made once for a multi-process run: only tensor parallelism spans processes
            // (the executor refuses the rest).
            Some(c) => (
                c.iter().map(|b| b.as_ref()).collect(),
                vec![&LocalComm as &dyn Comm; c.len()],
            ),
            None => {
                made = self.groups(part);
                (
                    made.0.iter().map(|b| b.as_ref()).collect(),
                    made.1.iter().map(|b| b.as_ref()).collect(),
                )
            }
        };
        // Every rank's input is copied to its device here, before any rank starts. A
        // rank that copied it itself, from another GPU, would wait for that GPU's stream,
        // which with a stream per device (`--deterministic`) can already hold its peer's
        // first collective, waiting for this rank: the TP2 hang seen on 2 × H200.
        let placed_prev: Vec<Flow<M::Acts>> = match &prev {
            Some(Flow::Acts(a)) => self
                .copy_to_ranks(part, "handing activations on", |dev| {
                    a.map(&mut self.hand_off_to(dev))
                })?
                .into_iter()
                .map(Flow::Acts)
                .collect(),
            _ => Vec::new(),
        };
        let placed_inputs: Vec<M::Inputs> = match &prev {
            None => self.copy_to_ranks(part, "copying the step's inputs", |dev| {
                inputs.map(&mut self.hand_off_to(dev))
            })?,
            Some(_) => Vec::new(),
        };
        let results: Vec<std::thread::Result<candle_core::Result<Flow<M::Acts>>>> =
            std::thread::scope(|s| {
                let handles: Vec<_> = part
                    .ranks
                    .iter()
                    .enumerate()
                    .map(|(i, rank)| {
                        let (comm, sp) = (tp_comms[i], sp_comms[i]);
                        let inputs = placed_inputs.get(i).unwrap_or(inputs);
                        let prev = placed_prev.get(i).or(prev.as_ref());
                        s.spawn(move || {
                            let mut guard = AbortGuard(comm, sp, false);
                            // The run's parts in turn, each on what this rank's previous
                            // part left on its device.
                            let prev = prev.map(Cow::Borrowed);
                            let mut r = self.run_rank(part, rank, comm, sp, prev, inputs, mb);
                            for next in &run[1..] {
                                // This rank's own output, on its device: given up to the
                                // next part's first block.
                                r = r.and_then(|a| {
                                    self.run_rank(
                                        next,
                                        &next.ranks[i],
                                        comm,
                                        sp,
                                        Some(Cow::Owned(a)),
                                        inputs,
                                        mb,
                                    )
                                });
                            }
                            // Finish this rank's kernels before its thread hands the
                            // result on: other devices' streams are not ordered with
                            // this one (a no-op on the CPU).
                            let r = r
                                .and_then(|a| rank.device.synchronize().map(|_| a))
                                // A collective may fail after it was enqueued.
                                .and_then(|a| comm.check().map(|_| a))
                                .and_then(|a| sp.check().map(|_| a));
                            guard.2 = r.is_ok();
                            r
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join()).collect()
            });
        // A panicked rank is an error of its own (never a peer's abort).
        let results: Vec<candle_core::Result<Flow<M::Acts>>> = results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|_| {
                    Err(candle_core::Error::Msg("the rank's thread panicked".into()))
                })
            })
            .collect();
        // Report the rank that failed first (by the error's type), not the ranks it
        // released.
        if let Some((i, e)) = crate::comm::root_cause(&results) {
            return Err(ExecError::Device {
                device: part.ranks[i].id.to_string(),
                message: e.to_string(),
            });
        }
        let last = run.last().unwrap_or(part);
        if last.keep_sliced {
            // Every rank's slice, in rank order, for the same ranks of the next part.
            let mut slices = Vec::with_capacity(results.len());
            for r in results {
                match r {
                    Ok(Flow::Sliced(mut v)) if v.len() == 1 => slices.extend(v.pop()),
                    _ => return Err(ExecError::Plan("a rank produced no sequence slice".into())),
                }
            }
            return Ok(Flow::Sliced(slices));
        }
        // The lowest rank this process runs (rank 0 holds the final layer).
        match results.into_iter().next() {
            Some(Ok(a)) => Ok(a),
            _ => Err(ExecError::Plan("rank 0 produced no result".into())),
        }
    }

    /// The communicators of a part's ranks: rank `i` is tensor-parallel rank `i % tp` of
    /// the group of devices `⌊i / tp⌋·tp ..`, and sequence-parallel rank `⌊i / tp⌋` of the
    /// devices `i % tp, i % tp + tp, ..`, from [`crate::comm::make_group`] (NCCL groups
    /// are pooled). A one-process run only: all of the part's ranks are here.
    fn groups(&self, part: &PartRt<M>) -> Groups {
        let n = part.ranks.len();
        let abort = self.dist.as_ref().map(|d| d.mesh.abort_signal());
        let (tp_groups, sp_groups) = group_members(part.tp, part.sp);
        // Without peer copies (`--no-peer`) the all-to-alls stay on NCCL too.
        let mut opts = self.opts.comm.clone();
        opts.exchange_beside &= self.opts.peer_copies;
        let mut tp_comms: Vec<Option<Box<dyn Comm>>> = (0..n).map(|_| None).collect();
        let mut sp_comms: Vec<Option<Box<dyn Comm>>> = (0..n).map(|_| None).collect();
        for (groups, comms) in [(tp_groups, &mut tp_comms), (sp_groups, &mut sp_comms)] {
            for members in groups {
                let ids: Vec<_> = members.iter().map(|&i| part.local_ids[i].clone()).collect();
                let group = if members.len() == 1 {
                    vec![Box::new(LocalComm) as Box<dyn Comm>]
                } else {
                    crate::comm::make_group(&ids, &opts, abort)
                };
                for (i, c) in members.into_iter().zip(group) {
                    comms[i] = Some(c);
                }
            }
        }
        let fill = |v: Vec<Option<Box<dyn Comm>>>| -> Vec<Box<dyn Comm>> {
            v.into_iter()
                .map(|c| c.unwrap_or_else(|| Box::new(LocalComm)))
                .collect()
        };
        (fill(tp_comms), fill(sp_comms))
    }

    #[allow(clippy::too_many_arguments)]
    fn run_rank(
        &self,
        part: &PartRt<M>,
        rank: &Rank<M>,
        comm: &dyn Comm,
        sp: &dyn Comm,
        prev: Option<Cow<'_, Flow<M::Acts>>>,
        inputs: &M::Inputs,
        mb: Option<usize>,
    ) -> candle_core::Result<Flow<M::Acts>> {
        let dev = &rank.device;
        let mb_profile = mb
            .filter(|_| self.opts.profiling)
            .map(|j| rank.mb_profile(j));
        let profile = match &mb_profile {
            Some(p) => p.as_ref(),
            None => &rank.profile,
        };
        let ctx = Ctx {
            comm,
            sp,
            meter: &rank.meter,
            kernels: self.opts.kernels,
            token_split: self.opts.comm.token_split,
            profile: self.opts.profiling.then_some(profile),
            ahead: self.opts.modulation_ahead.then_some(&rank.ahead),
            slot: 0,
            fp8_attention: self.fp8_attention,
        };
        // Start the clock here: the stem's first phase is not charged with whatever ran
        // on this thread since its last mark (the previous call, or waiting for a
        // micro-batch).
        if let Some(p) = ctx.profile {
            p.mark(None, dev);
        }
        let mut sliced = false;
        let acts = match prev {
            // Given up by the caller: on this device (the hand-off clones), and dropped
            // here so that the first block holds the only reference.
            Some(Cow::Owned(Flow::Acts(a))) => {
                let acts = a.map(&mut self.hand_off_to(dev))?;
                drop(a);
                acts
            }
            Some(Cow::Owned(f)) => candle_core::bail!(
                "a part was given {} to own; only activations on its device are",
                flow_name(&f)
            ),
            Some(Cow::Borrowed(Flow::Acts(a))) => a.map(&mut self.hand_off_to(dev))?,
            // The previous stage's thread copied them here (a no-op hand-off, unless
            // they arrived elsewhere).
            Some(Cow::Borrowed(Flow::Placed { copies: v, .. })) => v
                .get(rank.index)
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "no placed activations for rank {}",
                        rank.index
                    ))
                })?
                .map(&mut self.hand_off_to(dev))?,
            // The previous part ran on these devices with this layout: this rank's slice
            // is already here.
            Some(Cow::Borrowed(Flow::Sliced(v))) => {
                sliced = true;
                v.get(rank.index).cloned().ok_or_else(|| {
                    candle_core::Error::Msg(format!("no sequence slice for rank {}", rank.index))
                })?
            }
            Some(Cow::Borrowed(Flow::Out(_))) => candle_core::bail!("a part after the final layer"),
            None => {
                let stem = rank.stem.as_ref().ok_or_else(|| {
                    candle_core::Error::Msg("the first part holds the stem".into())
                })?;
                self.model.stem(stem, inputs, self.dtype, dev, &ctx)?
            }
        };
        // Under sequence parallelism each rank keeps its slice of the tokens through
        // the part's blocks.
        let mut acts = if sliced {
            acts
        } else {
            self.model.scatter_sequence(acts, &ctx)?
        };
        let ring_err = |e: ExecError| candle_core::Error::Msg(e.to_string());
        for (slot, (step, held)) in part.steps.iter().zip(&rank.blocks).enumerate() {
            if let Some(f) = &self.opts.fault {
                f.trigger(&rank.id, *step)?;
            }
            if let Some(p) = ctx.profile {
                p.mark(None, dev);
            }
            let block: Cow<M::Block> = match held {
                Held::Resident(b) => Cow::Borrowed(b),
                Held::Streamed(ri, k) => Cow::Owned(self.ring(*ri).fetch(*k).map_err(ring_err)?),
                Held::Sync(b) => Cow::Owned(b.to_device(dev)?),
            };
            if let Some(p) = ctx.profile {
                p.mark(Some("weight fetch (streamed)"), dev);
            }
            // The block's position in the part keys its modulation outputs computed
            // ahead (the rank's cache serves this part only).
            let bctx = Ctx { slot, ..ctx };
            acts = self.model.block(block.as_ref(), acts, &bctx)?;
            match held {
                Held::Resident(_) => {}
                // The buffer is refilled once this block's kernels are done.
                Held::Streamed(ri, _) => self.ring(*ri).release().map_err(ring_err)?,
                // The baseline: wait for the block, then free its weights.
                Held::Sync(_) => {
                    dev.synchronize()?;
                    drop(block);
                }
            }
        }
        if part.keep_sliced {
            return Ok(Flow::Sliced(vec![acts]));
        }
        // The whole sequence again, for the next part or the final layer.
        let acts = self.model.gather_sequence(acts, &ctx)?;
        match &rank.final_layer {
            Some(fl) => Ok(Flow::Out(self.model.final_layer(fl, acts, &ctx)?)),
            None => Ok(Flow::Acts(acts)),
        }
    }
}

/// Whether every tensor of `a` is on `dev` (a hand-off there only clones it).
fn on_device<A: Activations>(a: &A, dev: &candle_core::Device) -> candle_core::Result<bool> {
    let mut here = true;
    a.map(&mut |t| {
        here &= t.device().same_device(dev);
        Ok(t.clone())
    })?;
    Ok(here)
}

/// What a flow is, for an error line.
fn flow_name<A>(f: &Flow<A>) -> &'static str {
    match f {
        Flow::Acts(_) => "activations from another device",
        Flow::Sliced(_) => "sequence slices",
        Flow::Placed { .. } => "a stage's placed copies",
        Flow::Out(_) => "the output",
    }
}

#[cfg(test)]
mod tests {
    use super::group_members;

    #[test]
    fn ranks_are_grouped_tensor_parallel_within_and_sequence_parallel_across() {
        assert_eq!(
            group_members(2, 2),
            (vec![vec![0, 1], vec![2, 3]], vec![vec![0, 2], vec![1, 3]])
        );
        assert_eq!(
            group_members(4, 1),
            (
                vec![vec![0, 1, 2, 3]],
                vec![vec![0], vec![1], vec![2], vec![3]]
            )
        );
        assert_eq!(
            group_members(1, 2),
            (vec![vec![0], vec![1]], vec![vec![0, 1]])
        );
    }
}
