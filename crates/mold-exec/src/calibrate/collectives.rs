//! The collectives of a model's operation tables: all-reduce, all-gather and all-to-all
//! over groups of 2, 3, 4, … of the devices, through [`Comm`] groups from [`make_group`]
//! (NCCL on GPUs with the `nccl` feature, the thread backend otherwise). A run is
//! [`BATCH`] collectives queued back to back on each rank's stream between two timing
//! events, as a step queues them between its products (the host never waits for one to
//! end before queueing the next); a collective's time is the run's span over [`BATCH`],
//! the slowest rank's. Before each run the ranks meet at a barrier, then run one
//! untimed collective of the same kind: it ends on every device only once every rank
//! has queued it, so the timed batch starts with the devices lined up, and a rank whose
//! host queued late (a thread scheduled late) is not timed as the others' wait — in a
//! step the devices' queues are full of products and hide that. Timing each collective
//! alone, the host waiting for it, priced the host's launch and wait into every
//! collective. A group of two GPUs with peer access times its all-to-all as `mold exec`
//! runs it, by the copy engines (`comm/copy_engine.rs`): there each exchange also meets
//! the other rank on the host, which the untimed lead collective lines up too.

use super::bench::{list, OpBench};
use super::loads::random;
use super::mix::OpClock;
use super::timing::median_of;
use crate::comm::{make_group, Comm};
use crate::error::{ExecError, Result};
use crate::runtime::DeviceMap;
use candle_core::{DType, Device, Shape, Tensor};
use mold_cost::ops::CalibrationShapes;
use mold_machine::{CollectiveOp, CollectivePoint, CollectiveTables};
use mold_plan::DeviceId;
use std::sync::{Condvar, Mutex};

/// Collectives per timed run.
const BATCH: usize = 8;

/// What a rank released by another's failure reports.
const RELEASED: &str = "another rank's measurement failed";

/// A barrier the measuring threads meet at before each run, which a failing rank opens for
/// the others ([`Gate::fail`]): they return an error instead of waiting for it for ever.
struct Gate {
    n: usize,
    /// (arrived in this round, round, failed)
    state: Mutex<(usize, u64, bool)>,
    turn: Condvar,
}

impl Gate {
    fn new(n: usize) -> Gate {
        Gate {
            n,
            state: Mutex::new((0, 0, false)),
            turn: Condvar::new(),
        }
    }

    /// Waits until every rank has arrived, or one has failed.
    fn wait(&self) -> candle_core::Result<()> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let round = s.1;
        s.0 += 1;
        if s.0 == self.n {
            s.0 = 0;
            s.1 += 1;
            self.turn.notify_all();
        }
        while s.1 == round && !s.2 {
            s = self.turn.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if s.2 {
            return Err(candle_core::Error::Msg(RELEASED.into()));
        }
        Ok(())
    }

    fn fail(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.2 = true;
        self.turn.notify_all();
    }
}

/// Every collective of `shapes` over the first `n` of `devices` (where there are `n`).
pub(super) fn measure_collectives(
    map: &mut DeviceMap,
    devices: &[DeviceId],
    dtype: DType,
    shapes: &CalibrationShapes,
    bench: &OpBench,
    progress: &mut dyn FnMut(&str),
) -> Result<CollectiveTables> {
    let mut out = CollectiveTables::default();
    let mut sizes: Vec<u32> = shapes.collectives.iter().map(|c| c.1).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for n in sizes {
        let n_us = n as usize;
        if n_us > devices.len() || n < 2 {
            continue;
        }
        let group = &devices[..n_us];
        let devs: Vec<Device> = group.iter().map(|d| map.get(d)).collect::<Result<_>>()?;
        let jobs: Vec<(CollectiveOp, u64)> = shapes
            .collectives
            .iter()
            .filter(|c| c.1 == n)
            .map(|c| (c.0, c.2))
            .collect();
        progress(&format!(
            "{} collectives over {} (all-reduce, all-gather, all-to-all)",
            jobs.len(),
            list(group)
        ));
        let comms = make_group(group, &bench.comm, None);
        for (op, bytes) in jobs {
            let (seconds, actual) = time_collective(&comms, &devs, dtype, op, bytes, bench)
                .map_err(|e| ExecError::Device {
                    device: list(group),
                    message: format!("measuring {} of {bytes} bytes: {e}", op.name()),
                })?;
            let p = CollectivePoint {
                devices: n,
                bytes: actual,
                seconds,
            };
            let l = match op {
                CollectiveOp::AllReduce => &mut out.all_reduce,
                CollectiveOp::AllGather => &mut out.all_gather,
                CollectiveOp::AllToAll => &mut out.all_to_all,
            };
            // Rounding to whole elements can make two sizes one: keep the first.
            if !l.iter().any(|q| q.devices == n && q.bytes == actual) {
                l.push(p);
            }
        }
    }
    Ok(out)
}

/// The median over runs of the slowest rank's time of one `op` of about `bytes` per
/// rank ([`mold_machine::CollectiveTables`] says which bytes), and the bytes it moved
/// (whole elements, divisible by the ranks).
fn time_collective(
    comms: &[Box<dyn Comm>],
    devs: &[Device],
    dtype: DType,
    op: CollectiveOp,
    bytes: u64,
    bench: &OpBench,
) -> candle_core::Result<(f64, u64)> {
    let n = comms.len();
    let size = dtype.size_in_bytes() as u64;
    // Elements per rank of the message: a multiple of the ranks, at least one each.
    let elems = (bytes / size).div_ceil(n as u64).max(1) * n as u64;
    let runs = bench.warmup + bench.iters.max(1);
    let gate = Gate::new(n);
    let per_rank: Vec<candle_core::Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(devs)
            .map(|(comm, dev)| {
                let gate = &gate;
                s.spawn(move || {
                    // A panic is a failure too: the other ranks must not wait for this one.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        rank_runs(comm.as_ref(), dev, dtype, op, elems, runs, gate, &|| {})
                    }))
                    .unwrap_or_else(|_| {
                        Err(candle_core::Error::Msg(
                            "a measuring thread panicked".into(),
                        ))
                    });
                    if r.is_err() {
                        gate.fail();
                        comm.abort();
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(candle_core::Error::Msg(
                        "a measuring thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    // The failing rank's error, not the others' "another rank failed".
    if let Some(Err(e)) = per_rank
        .iter()
        .find(|r| matches!(r, Err(e) if !e.to_string().contains(RELEASED)))
    {
        return Err(candle_core::Error::Msg(e.to_string()));
    }
    let mut slowest = vec![0.0f64; runs];
    for r in per_rank {
        for (s, t) in slowest.iter_mut().zip(r?) {
            *s = s.max(t);
        }
    }
    let timed = slowest.split_off(bench.warmup.min(slowest.len()));
    Ok((median_of(timed), elems * size))
}

/// One rank's runs of `op`; `elems` is the message per rank in elements (for an
/// all-gather the gathered output, for an all-to-all the whole send buffer). `late` runs
/// after each barrier, before the rank queues anything: nothing in a calibration, a
/// late host in the tests.
#[allow(clippy::too_many_arguments)]
fn rank_runs(
    comm: &dyn Comm,
    dev: &Device,
    dtype: DType,
    op: CollectiveOp,
    elems: u64,
    runs: usize,
    gate: &Gate,
    late: &dyn Fn(),
) -> candle_core::Result<Vec<f64>> {
    let n = comm.world_size();
    let piece = elems / n as u64;
    let input = match op {
        CollectiveOp::AllReduce => random(&[elems], dtype, dev)?,
        CollectiveOp::AllGather => random(&[piece], dtype, dev)?,
        CollectiveOp::AllToAll => random(&[elems], dtype, dev)?,
    };
    let pieces: Vec<Tensor> = match op {
        CollectiveOp::AllToAll => (0..n)
            .map(|j| input.narrow(0, j * piece as usize, piece as usize))
            .collect::<candle_core::Result<_>>()?,
        _ => Vec::new(),
    };
    let recv: Vec<Shape> = (0..n).map(|_| Shape::from(piece as usize)).collect();
    dev.synchronize()?;
    let mut clock = OpClock::new(dev, 2)?;
    let mut times = Vec::with_capacity(runs);
    // Each output is freed as soon as it is queued: the stream-ordered allocator hands
    // its memory to the next collective after this one ends.
    let one = || -> candle_core::Result<()> {
        match op {
            CollectiveOp::AllReduce => drop(comm.all_reduce_sum(&input)?),
            CollectiveOp::AllGather => drop(comm.all_gather(&input)?),
            CollectiveOp::AllToAll => drop(comm.all_to_all(&pieces, &recv)?),
        }
        Ok(())
    };
    for _ in 0..runs {
        gate.wait()?;
        late();
        // Untimed: the devices leave it together, whenever each host queued it.
        one()?;
        clock.mark(0)?;
        for _ in 0..BATCH {
            one()?;
        }
        clock.mark(1)?;
        dev.synchronize()?;
        times.push(clock.read()?[0] / BATCH as f64);
    }
    comm.check()?;
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank whose host queues each run 30 ms late does not make the collective look
    /// 30 ms long: the untimed collective before the batch lines the ranks up, and the
    /// batch is timed from there (two emulated devices, the thread backend).
    #[test]
    fn a_late_host_is_not_timed() {
        let ids: Vec<DeviceId> = (0..2).map(DeviceId::Emu).collect();
        let mut map = DeviceMap::new(false);
        let devs: Vec<Device> = ids.iter().map(|d| map.get(d).unwrap()).collect();
        let comms = make_group(&ids, &crate::comm::CommOptions::default(), None);
        let gate = Gate::new(2);
        let delay = std::time::Duration::from_millis(30);
        let per_rank: Vec<Vec<f64>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&devs)
                .enumerate()
                .map(|(rank, (comm, dev))| {
                    let gate = &gate;
                    s.spawn(move || {
                        let late = move || {
                            if rank == 1 {
                                std::thread::sleep(delay);
                            }
                        };
                        rank_runs(
                            comm.as_ref(),
                            dev,
                            DType::F32,
                            CollectiveOp::AllGather,
                            64,
                            3,
                            gate,
                            &late,
                        )
                        .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, times) in per_rank.iter().enumerate() {
            assert_eq!(times.len(), 3);
            for t in times {
                // A late host timed would read at least 30 ms / BATCH = 3.75 ms.
                assert!(*t < 0.002, "rank {rank}: {times:?}");
            }
        }
    }

    /// Ranks meet round after round; one that fails releases those waiting for it, which
    /// then fail instead of waiting for ever (a plain barrier hung the calibration there).
    #[test]
    fn a_failing_rank_opens_the_gate() {
        let gate = Gate::new(3);
        let rounds: Vec<candle_core::Result<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let gate = &gate;
                    s.spawn(move || -> candle_core::Result<usize> {
                        for round in 0..5 {
                            if rank == 2 && round == 3 {
                                gate.fail();
                                return Err(candle_core::Error::Msg("rank 2 broke".into()));
                            }
                            gate.wait()?;
                        }
                        Ok(5)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(rounds[2]
            .as_ref()
            .is_err_and(|e| e.to_string().contains("rank 2 broke")));
        for r in &rounds[..2] {
            assert!(
                r.as_ref().is_err_and(|e| e.to_string().contains(RELEASED)),
                "{r:?}"
            );
        }
        // Without a failure every rank gets through every round.
        let ok = Gate::new(2);
        std::thread::scope(|s| {
            let a = s.spawn(|| (0..100).try_for_each(|_| ok.wait()));
            let b = s.spawn(|| (0..100).try_for_each(|_| ok.wait()));
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
    }
}
