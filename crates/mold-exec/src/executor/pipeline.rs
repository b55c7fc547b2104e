//! Micro-batches through a block split as a pipeline: while part `p` runs micro-batch
//! `j`, part `p + 1` runs micro-batch `j − 1`, so the device groups of a split work at
//! once instead of in turn. Exact, unlike patch pipelining: every micro-batch goes
//! through the same operations in the same order as [`Executor::forward`] of it alone.
//!
//! # Stages
//!
//! The parts are grouped into *stages* ([`stages`]): the finest grouping into runs of
//! consecutive parts such that no device serves two stages. Each stage gets one thread,
//! which runs micro-batch 0 through its parts, hands the result to the next stage, then
//! runs micro-batch 1, and so on; the next stage's thread takes the micro-batches from a
//! channel, in order. Parts that share a device (a resident and a streamed part on one
//! GPU, consecutive sequence-parallel parts on the same devices) are therefore run by one
//! thread in the order `forward` runs them: a device's weight ring is fetched in its
//! order, and its communicators and profilers are used by one thread at a time. A chain
//! of stages, each waiting only on the one before it, cannot deadlock.
//!
//! # Why the GPUs overlap (CUDA)
//!
//! Nothing synchronises the whole executor between micro-batches. A stage's thread (and,
//! for a tensor-parallel part, its rank threads) queues kernels only on its own devices'
//! streams, and waits only for its own devices: at the end of each part
//! (`Executor::run_part` finishes the part's kernels, as `forward` does, so another
//! thread may read the output) and at the profiler's marks when profiling. Then it copies
//! the stage's output to each rank device of the next stage itself
//! ([`crate::runtime::hand_off`]: a peer copy, queued on the destination's stream once
//! the source's work is done), waits for that copy (with per-thread default streams; with
//! [`crate::ExecOptions::deterministic`] the destination's one stream orders the copy
//! before the next stage's kernels, so it does not wait), and sends it on. The next
//! stage's thread then queues micro-batch `j` on its GPUs while this thread is already
//! queueing micro-batch `j + 1` on its own: both run at once. With `k` micro-batches
//! through `S` balanced stages of `t` seconds each, a call takes about `(k + S − 1)·t`
//! instead of `k·S·t` (2 micro-batches through 2 stages: 3t instead of 4t).
//!
//! Copying on the sending side matters under `deterministic`: there each GPU has one
//! stream for all threads, and a copy made by the receiving thread would first wait for
//! the source GPU's stream, which by then holds the next micro-batch's work.
//!
//! # Exactness on GPUs
//!
//! The operations are `forward`'s, bit for bit on the CPU and under `deterministic`
//! (every thread queues on its device's one stream). With per-thread default streams
//! (the default) a single-device part runs on its stage's thread instead of the
//! caller's, so on another stream, and cuBLAS, whose state is per stream, may pick
//! other algorithms: the same caveat as tensor parallelism there
//! ([`crate::runtime::DeviceMap`]).
//!
//! [`Executor::last_micro_batch_timeline`] says when each part ran each micro-batch, and
//! [`Executor::profile_report`] labels the micro-batches' phases `mb0 …`, `mb1 …`.

use super::{Executor, Flow, PartRt};
use crate::error::{ExecError, Result};
use crate::model::{Activations, Transformer};
use candle_core::Tensor;
use mold_plan::DeviceId;
use serde::Serialize;
use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Mutex;
use std::time::Instant;

/// When one part ran one micro-batch of the last [`Executor::forward_micro_batches`]
/// call: from when its thread began queueing the micro-batch's work to when the part's
/// devices had finished it, in seconds since the call began.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MicroBatchSpan {
    /// The part's index in the plan.
    pub part: usize,
    /// The part's devices.
    pub devices: Vec<DeviceId>,
    pub micro_batch: usize,
    pub start_s: f64,
    pub end_s: f64,
}

/// The stages of a pipeline over parts on `devices` (each part's devices, in plan
/// order): the finest split of `0..devices.len()` into consecutive ranges such that no
/// device is in two ranges. Parts on disjoint devices each get a stage of their own.
pub fn stages(devices: &[&[DeviceId]]) -> Vec<Range<usize>> {
    let n = devices.len();
    // The last part that shares a device with part i (i itself if none).
    let last: Vec<usize> = (0..n)
        .map(|i| {
            (i..n)
                .rev()
                .find(|&j| devices[j].iter().any(|d| devices[i].contains(d)))
                .unwrap_or(i)
        })
        .collect();
    let mut out = Vec::new();
    let mut start = 0;
    while start < n {
        let mut end = last[start];
        let mut i = start;
        while i <= end {
            end = end.max(last[i]);
            i += 1;
        }
        out.push(start..end + 1);
        start = end + 1;
    }
    out
}

/// Why a stage stopped.
enum Stop {
    /// It failed.
    Failed(Box<ExecError>),
    /// Its neighbour stopped first (the channel between them closed).
    Peer,
}

impl From<ExecError> for Stop {
    fn from(e: ExecError) -> Self {
        Stop::Failed(Box::new(e))
    }
}

/// One stage's end of the channels: from the previous stage, to the next.
struct Ends<A> {
    rx: Option<Receiver<Flow<A>>>,
    tx: Option<SyncSender<Flow<A>>>,
}

impl<M: Transformer> Executor<M> {
    /// Runs several independent transformer calls (micro-batches: e.g. true CFG's
    /// conditional and unconditional passes) through the parts as a pipeline ([module
    /// docs](self)): part `p` works on micro-batch `j` while part `p + 1` works on
    /// `j − 1`. Returns each micro-batch's output, in order, each equal to
    /// [`Executor::forward`] of it alone, where `forward` would put it.
    ///
    /// Every input is checked before anything runs. The same conditions on inputs as
    /// `forward`'s hold. Parts on devices of their own overlap; parts sharing a device
    /// run in turn on one thread. In a multi-process run the micro-batches go through
    /// [`Executor::forward`] one after another (exact, without overlap).
    pub fn forward_micro_batches(&self, batches: &[&M::Inputs]) -> Result<Vec<Tensor>> {
        let r = self.micro_batches_once(batches);
        if r.is_err() {
            self.release_modulation_ahead();
        }
        r
    }

    fn micro_batches_once(&self, batches: &[&M::Inputs]) -> Result<Vec<Tensor>> {
        for b in batches {
            self.model.check_inputs(b)?;
        }
        if self.dist.is_some() {
            return batches.iter().map(|b| self.forward(b)).collect();
        }
        if batches.is_empty() {
            self.set_timeline(Vec::new());
            return Ok(Vec::new());
        }
        // As in `forward`: the first copies of every streaming device start now.
        for i in 0..self.rings.len() {
            self.ring(i).prime()?;
        }
        let stages = self.pipeline_stages();
        let n = stages.len();
        let mut ends: Vec<Ends<M::Acts>> = (0..n).map(|_| Ends { rx: None, tx: None }).collect();
        for s in 1..n {
            // One micro-batch may wait while its successor is computed: enough to keep
            // both sides busy, and at most one extra output held per stage.
            let (tx, rx) = sync_channel(1);
            ends[s - 1].tx = Some(tx);
            ends[s].rx = Some(rx);
        }
        let t0 = Instant::now();
        let spans = Mutex::new(Vec::new());
        let results: Vec<std::thread::Result<std::result::Result<Vec<Tensor>, Stop>>> =
            std::thread::scope(|sc| {
                let handles: Vec<_> = stages
                    .iter()
                    .cloned()
                    .zip(ends)
                    .map(|(parts, ends)| {
                        let spans = &spans;
                        sc.spawn(move || self.run_stage(parts, batches, ends, t0, spans))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join()).collect()
            });
        let mut spans = spans.into_inner().unwrap_or_else(|e| e.into_inner());
        spans.sort_by_key(|s| (s.part, s.micro_batch));
        self.set_timeline(spans);
        // The first stage that failed by itself (not because a neighbour stopped).
        let mut outputs = None;
        for (si, r) in results.into_iter().enumerate() {
            match r {
                Err(_) => {
                    return Err(ExecError::Device {
                        device: self.parts[stages[si].start].devices[0].to_string(),
                        message: format!(
                            "the thread of pipeline stage {si} (parts {}..{}) panicked",
                            stages[si].start, stages[si].end
                        ),
                    })
                }
                Ok(Err(Stop::Failed(e))) => return Err(*e),
                Ok(Err(Stop::Peer)) => {}
                Ok(Ok(v)) if si + 1 == n => outputs = Some(v),
                Ok(Ok(_)) => {}
            }
        }
        outputs.ok_or_else(|| ExecError::Plan("the last stage produced no output".into()))
    }

    /// The stages [`Executor::forward_micro_batches`] runs at once ([`stages`]), as
    /// ranges of the plan's parts.
    pub fn pipeline_stages(&self) -> Vec<Range<usize>> {
        let devices: Vec<&[DeviceId]> = self.parts.iter().map(|p| p.devices.as_slice()).collect();
        stages(&devices)
    }

    /// When each part ran each micro-batch in the last
    /// [`Executor::forward_micro_batches`] call, by part then micro-batch: spans of parts
    /// on different devices that overlap in time ran at once.
    pub fn last_micro_batch_timeline(&self) -> Vec<MicroBatchSpan> {
        self.timeline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_timeline(&self, spans: Vec<MicroBatchSpan>) {
        *self.timeline.lock().unwrap_or_else(|e| e.into_inner()) = spans;
    }

    /// One stage's thread: every micro-batch in order through `parts`, each taken from
    /// the previous stage (or the inputs) and handed to the next (or returned).
    fn run_stage(
        &self,
        parts: Range<usize>,
        batches: &[&M::Inputs],
        ends: Ends<M::Acts>,
        t0: Instant,
        spans: &Mutex<Vec<MicroBatchSpan>>,
    ) -> std::result::Result<Vec<Tensor>, Stop> {
        let mut outputs = Vec::new();
        for (j, inputs) in batches.iter().enumerate() {
            let mut flow = match &ends.rx {
                None => None,
                Some(rx) => Some(rx.recv().map_err(|_| Stop::Peer)?),
            };
            for pi in parts.clone() {
                let part = &self.parts[pi];
                let start_s = t0.elapsed().as_secs_f64();
                // `run_part` returns once the part's devices have finished it.
                let out = self.run_part(part, flow.take(), inputs, Some(j), true)?;
                spans
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(MicroBatchSpan {
                        part: pi,
                        devices: part.devices.clone(),
                        micro_batch: j,
                        start_s,
                        end_s: t0.elapsed().as_secs_f64(),
                    });
                flow = Some(out);
            }
            match (flow, &ends.tx) {
                (Some(Flow::Out(t)), None) => outputs.push(t),
                (Some(f), Some(tx)) => {
                    let placed = self.place(f, &self.parts[parts.end])?;
                    tx.send(placed).map_err(|_| Stop::Peer)?;
                }
                _ => {
                    return Err(ExecError::Plan(format!(
                        "pipeline stage of parts {}..{}: the last part produced no output",
                        parts.start, parts.end
                    ))
                    .into())
                }
            }
        }
        Ok(outputs)
    }

    /// A stage's output copied to each rank device of `next` (the next stage's first
    /// part), from this thread, finished before it is handed on ([module docs](self));
    /// the output itself travels along, so that it is freed only once the next part
    /// has finished (its kernels, and so the copy queued before them on the same
    /// stream, are done by then).
    pub(super) fn place(&self, flow: Flow<M::Acts>, next: &PartRt<M>) -> Result<Flow<M::Acts>> {
        let Flow::Acts(a) = flow else {
            return Err(ExecError::Plan(
                "a part before the last produced no activations to hand on".into(),
            ));
        };
        let placed = self.copy_to_ranks(next, "handing activations on", |dev| {
            a.map(&mut self.hand_off_to(dev))
        })?;
        Ok(Flow::Placed {
            copies: placed,
            _source: a,
        })
    }

    /// `copy(device)` for each rank of `part`, from this thread, finished before it is
    /// handed on: the ranks' threads read the copies from their own streams, which are
    /// not ordered with this thread's unless there is one stream per device.
    pub(super) fn copy_to_ranks<T>(
        &self,
        part: &PartRt<M>,
        what: &str,
        copy: impl Fn(&candle_core::Device) -> candle_core::Result<T>,
    ) -> Result<Vec<T>> {
        let mut placed = Vec::with_capacity(part.ranks.len());
        for rank in &part.ranks {
            let dev = &rank.device;
            let failed = |e: candle_core::Error| ExecError::Device {
                device: rank.id.to_string(),
                message: format!("{what}: {e}"),
            };
            let c = copy(dev).map_err(failed)?;
            if !self.opts.deterministic {
                dev.synchronize().map_err(failed)?;
            }
            placed.push(c);
        }
        Ok(placed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(v: &[u32]) -> Vec<DeviceId> {
        v.iter().map(|&i| DeviceId::Emu(i)).collect()
    }

    fn stages_of(parts: &[Vec<u32>]) -> Vec<Range<usize>> {
        let devs: Vec<Vec<DeviceId>> = parts.iter().map(|p| ids(p)).collect();
        let refs: Vec<&[DeviceId]> = devs.iter().map(|d| d.as_slice()).collect();
        stages(&refs)
    }

    #[test]
    fn stages_of_common_placements() {
        // A split over two devices: two stages.
        assert_eq!(stages_of(&[vec![0], vec![1]]), vec![0..1, 1..2]);
        // TP2 then TP2 on other devices, then a part back on the first group.
        assert_eq!(stages_of(&[vec![0, 1], vec![2, 3], vec![1]]), vec![0..3]);
        // A resident and a streamed part on one GPU, then another GPU.
        assert_eq!(stages_of(&[vec![0], vec![0], vec![1]]), vec![0..2, 2..3]);
        assert_eq!(stages_of(&[]), Vec::<Range<usize>>::new());
    }

    proptest! {
        /// Stages cover the parts in order, share no device, and are as fine as
        /// possible: every stage of several parts is held together by a device.
        #[test]
        fn stages_are_the_finest_device_disjoint_split(
            parts in proptest::collection::vec(proptest::collection::vec(0u32..5, 1..3), 0..7)
        ) {
            let st = stages_of(&parts);
            let mut next = 0;
            for r in &st {
                prop_assert_eq!(r.start, next);
                prop_assert!(r.end > r.start);
                next = r.end;
            }
            prop_assert_eq!(next, parts.len());
            let devs = |r: &Range<usize>| -> Vec<u32> {
                parts[r.clone()].iter().flatten().copied().collect()
            };
            for (i, a) in st.iter().enumerate() {
                for b in &st[i + 1..] {
                    prop_assert!(devs(a).iter().all(|d| !devs(b).contains(d)));
                }
                // Finest: no cut inside a stage leaves its two sides device-disjoint.
                for cut in a.start + 1..a.end {
                    let (l, r) = (devs(&(a.start..cut)), devs(&(cut..a.end)));
                    prop_assert!(l.iter().any(|d| r.contains(d)));
                }
            }
        }
    }
}
