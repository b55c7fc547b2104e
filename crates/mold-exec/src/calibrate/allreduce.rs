//! Collective benchmarks, for `mold devices --save X.yaml --calibrate`: NCCL all-reduce
//! latency and bus bandwidth over groups of 2, 4, 8, … GPUs ([`measure_allreduce`],
//! feature `nccl`). What to time is an [`AllreduceBench`]; [`super::measure_devices`]
//! sizes it from the box's free memory ([`add_allreduce`]).

use std::time::Duration;
#[cfg(feature = "nccl")]
use {
    crate::comm::nccl::{local_group, release, set_nccl_env, NcclComm},
    crate::comm::{root_cause, Comm},
    candle_core::cuda::cudarc,
    candle_core::Result,
    cudarc::driver::{CudaContext, DevicePtrMut},
    half::bf16,
    mold_machine::inventory::{
        allreduce_bus_gbps, allreduce_group_sizes, AllreduceMeasurement, Inventory, Measurements,
    },
    mold_plan::{ByteSize, MIB},
    std::time::Instant,
};

/// What [`measure_allreduce`] times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllreduceBench {
    /// Bytes of the small message, whose time is the latency.
    pub small_bytes: usize,
    /// Bytes of the large message, whose time gives the bus bandwidth.
    pub large_bytes: usize,
    /// Untimed all-reduces of each message before its timed loop (NCCL sets up its
    /// connections and buffers on first use).
    pub warmup: usize,
    /// Timed all-reduces of the small message.
    pub small_iters: usize,
    /// Timed all-reduces of the large message.
    pub large_iters: usize,
    /// The NCCL watchdog for every wait (`MOLD_NCCL_TIMEOUT_S` at the CLI, through
    /// `CommOptions::nccl_timeout`); `None`: no watchdog.
    pub watchdog: Option<Duration>,
}

impl Default for AllreduceBench {
    /// 8 KiB and 256 MiB of bf16; 5 warm-ups; 100 and 20 timed all-reduces; the default
    /// watchdog.
    fn default() -> Self {
        AllreduceBench {
            small_bytes: 8 << 10,
            large_bytes: 256 << 20,
            warmup: 5,
            small_iters: 100,
            large_iters: 20,
            watchdog: crate::comm::CommOptions::default().nccl_timeout,
        }
    }
}

impl AllreduceBench {
    /// Refuses a benchmark that cannot run over the GPUs `ordinals`, in one line.
    pub fn check(&self, ordinals: &[usize]) -> std::result::Result<(), String> {
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ordinals.len() {
            return Err(format!(
                "measuring all-reduce: GPU ordinals {ordinals:?} are not distinct"
            ));
        }
        if self.small_iters == 0 || self.large_iters == 0 {
            return Err(
                "measuring all-reduce: small_iters and large_iters must be at least 1".into(),
            );
        }
        Ok(())
    }
}

/// Measures NCCL all-reduce over the GPUs `ordinals` (distinct): for each group size of
/// [`allreduce_group_sizes`] (every size from 2), over the first that many GPUs.
///
/// Each group gets its communicators from `comm::nccl::local_group` and one thread per
/// rank. A rank
/// allocates a bf16 buffer per message size on a stream of its own and enqueues
/// `warmup` in-place sum all-reduces of it; then a one-element all-reduce, waited for,
/// lines the ranks up (it completes on a rank only once every rank has enqueued it, after
/// its warm-ups); then it enqueues the timed all-reduces back to back (no host wait in
/// between, as nccl-tests does) and waits for its stream. A message's time is the slowest
/// rank's wall time over the timed loop divided by its iterations.
///
/// `latency_us` is the small message's time; `gbps` is the bus bandwidth of the large
/// one, [`allreduce_bus_gbps`]: `2(n−1)/n · bytes / time / 1e9` (nccl-tests' "busbw"),
/// which is what [`mold_machine::Collective`] holds.
///
/// The watchdog (`bench.watchdog`) bounds every wait, and `NCCL_NVLS_ENABLE=0` is set unless
/// the user set it. An error on any rank aborts the group and comes back naming the rank
/// that failed first. The measured groups' communicators are destroyed afterwards (not
/// kept in the pool).
#[cfg(feature = "nccl")]
pub fn measure_allreduce(
    ordinals: &[usize],
    bench: &AllreduceBench,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<AllreduceMeasurement>> {
    bench.check(ordinals).map_err(candle_core::Error::Msg)?;
    set_nccl_env();
    let elems = |bytes: usize| (bytes / std::mem::size_of::<bf16>()).max(1);
    let (small, large) = (elems(bench.small_bytes), elems(bench.large_bytes));
    let bytes = |n: usize| ByteSize((n * std::mem::size_of::<bf16>()) as u64);
    let mut out = Vec::new();
    for n in allreduce_group_sizes(ordinals.len()) {
        let gpus = &ordinals[..n];
        progress(&format!(
            "NCCL all-reduce over {}: bf16, {} ({} times) and {} ({} times)",
            gpus.iter()
                .map(|o| format!("cuda:{o}"))
                .collect::<Vec<_>>()
                .join(","),
            bytes(small),
            bench.small_iters,
            bytes(large),
            bench.large_iters
        ));
        let s = bench_group(
            gpus,
            &[(small, bench.small_iters), (large, bench.large_iters)],
            bench.warmup,
            bench.watchdog,
        )?;
        out.push(AllreduceMeasurement {
            group_size: n as u32,
            latency_us: s[0] * 1e6,
            gbps: allreduce_bus_gbps(n, bytes(large).0, s[1]),
        });
    }
    Ok(out)
}

/// `r` with NCCL all-reduce measured over the GPUs of `inv` (`r.allreduce`), the large
/// message 256 MiB or an eighth of the least free memory where that is less, under
/// `watchdog` (the NCCL watchdog as the CLI resolved it, or why it could not). A failure
/// does not end the calibration: it is noted in `r.not_measured` and the profile keeps
/// estimates.
#[cfg(feature = "nccl")]
pub(super) fn add_allreduce(
    inv: &Inventory,
    mut r: Measurements,
    watchdog: std::result::Result<Option<Duration>, String>,
    progress: &mut dyn FnMut(&str),
) -> Measurements {
    let ordinals: Vec<usize> = inv.devices.iter().map(|g| g.ordinal as usize).collect();
    if ordinals.len() < 2 {
        r.not_measured
            .push("all-reduce: not measured (fewer than two GPUs)".into());
        return r;
    }
    // The large message: 256 MiB, or an eighth of the least free memory where that is less.
    let min_free = inv.devices.iter().map(|g| g.free.0).min().unwrap_or(0);
    let watchdog = match watchdog {
        Ok(w) => w,
        Err(e) => {
            r.not_measured
                .push(format!("all-reduce: not measured ({e})"));
            return r;
        }
    };
    let bench = AllreduceBench {
        large_bytes: (min_free / 8 / MIB * MIB).clamp(MIB, 256 * MIB) as usize,
        watchdog,
        ..Default::default()
    };
    match measure_allreduce(&ordinals, &bench, progress) {
        Ok(a) => r.allreduce = Some(a),
        Err(e) => {
            progress(&format!("all-reduce not measured: {e}"));
            r.not_measured.push(format!(
                "all-reduce: not measured (NCCL failed: {e}); the peer domains' and \
                 host-staged all-reduce figures are estimates"
            ));
        }
    }
    r
}

/// Aborts the rank's communicator (releasing the other ranks) unless marked done.
#[cfg(feature = "nccl")]
struct AbortUnlessDone<'a>(&'a NcclComm, bool);

#[cfg(feature = "nccl")]
impl Drop for AbortUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.1 {
            Comm::abort(self.0);
        }
    }
}

/// Seconds per all-reduce for each `(elements, iterations)` of `loops` over the GPUs
/// `ordinals`: the slowest rank's.
#[cfg(feature = "nccl")]
fn bench_group(
    ordinals: &[usize],
    loops: &[(usize, usize)],
    warmup: usize,
    watchdog: Option<Duration>,
) -> Result<Vec<f64>> {
    let comms = local_group(ordinals, watchdog, None);
    let results: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                std::thread::Builder::new()
                    .name(format!("nccl-bench-{}", comm.rank()))
                    .spawn_scoped(s, move || {
                        let mut guard = AbortUnlessDone(comm, false);
                        let r = bench_rank(comm, loops, warmup);
                        guard.1 = r.is_ok();
                        r
                    })
                    .map_err(|e| {
                        // The ranks already started are released by the abort.
                        Comm::abort(comm);
                        comm.err(format!("cannot start a thread for this rank: {e}"))
                    })
            })
            .collect();
        handles
            .into_iter()
            .zip(&comms)
            .map(|(h, comm)| match h {
                Err(e) => Err(e),
                Ok(h) => match h.join() {
                    Ok(r) => r,
                    Err(_) => Err(comm.err("the measuring thread panicked".into())),
                },
            })
            .collect()
    });
    drop(comms);
    release(ordinals);
    // Report the rank that failed first, not the ranks it released.
    if let Some((_, e)) = root_cause(&results) {
        candle_core::bail!("measuring all-reduce over GPUs {ordinals:?}: {e}");
    }
    let per_rank: Vec<Vec<f64>> = results.into_iter().filter_map(|r| r.ok()).collect();
    Ok((0..loops.len())
        .map(|i| per_rank.iter().map(|r| r[i]).fold(0.0, f64::max))
        .collect())
}

/// This rank's part of [`bench_group`].
#[cfg(feature = "nccl")]
fn bench_rank(comm: &NcclComm, loops: &[(usize, usize)], warmup: usize) -> Result<Vec<f64>> {
    let ordinal = comm.ordinal();
    let cuda = |what: String, e: cudarc::driver::DriverError| comm.err(format!("{what}: {e:?}"));
    let ctx = CudaContext::new(ordinal).map_err(|e| cuda("cannot open the GPU".into(), e))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| cuda("cannot create a CUDA stream".into(), e))?;
    let alloc = |n: usize| {
        stream
            .alloc_zeros::<bf16>(n)
            .map_err(|e| cuda(format!("cannot allocate {}", ByteSize((2 * n) as u64)), e))
    };
    let mut token = alloc(1)?;
    // The buffers are only used on `stream`; the guards (dropped after the last use)
    // record that use for cudarc's event tracking, once rather than per all-reduce.
    let (token_ptr, _token_guard) = token.device_ptr_mut(&stream);
    let mut out = Vec::with_capacity(loops.len());
    for &(elems, iters) in loops {
        // Zeros: the sums stay zero however often they are repeated.
        let mut buf = alloc(elems)?;
        let (ptr, _guard) = buf.device_ptr_mut(&stream);
        for _ in 0..warmup {
            comm.enqueue_in_place(ptr, elems, &stream)?;
        }
        comm.enqueue_in_place(token_ptr, 1, &stream)?;
        comm.finish(&stream)?;
        let start = Instant::now();
        for _ in 0..iters {
            comm.enqueue_in_place(ptr, elems, &stream)?;
        }
        comm.finish(&stream)?;
        out.push(start.elapsed().as_secs_f64() / iters.max(1) as f64);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_benchmark_that_cannot_run_is_refused_in_one_line() {
        let b = AllreduceBench::default();
        assert_eq!(b.check(&[0, 1, 2]), Ok(()));
        assert!(b.check(&[0, 1, 0]).unwrap_err().contains("not distinct"));
        let none = AllreduceBench {
            large_iters: 0,
            ..AllreduceBench::default()
        };
        assert!(none.check(&[0, 1]).unwrap_err().contains("large_iters"));
    }
}
