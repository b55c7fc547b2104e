//! How long an operation takes on its device: the median of runs each drained
//! ([`median_time`]), or runs back to back at the clocks a load settles to
//! ([`sustained_time`]). Shared by every table of the calibration and by
//! `mold-pipeline`'s encoder and decoder timing.

use candle_core::{Device, Tensor};
use std::time::{Duration, Instant};

/// The most runs in one round of [`sustained_time`], whatever the estimate says.
const MOST_PER_ROUND: usize = 100_000;

/// `f` run back to back on `dev`: after one warm-up and one timed run (the estimate of a
/// round's length), rounds of about `round` with one synchronise each, until `span` has
/// passed (four rounds at least). The per-run time of the median round of the later
/// half, in seconds: the earlier rounds are the clocks settling under the load.
pub fn sustained_time(
    dev: &Device,
    round: Duration,
    span: Duration,
    mut f: impl FnMut() -> candle_core::Result<Tensor>,
) -> candle_core::Result<f64> {
    drop(f()?);
    dev.synchronize()?;
    let start = Instant::now();
    drop(f()?);
    dev.synchronize()?;
    let one = start.elapsed().as_secs_f64().max(1e-7);
    let per_round = ((round.as_secs_f64() / one).round() as usize).clamp(1, MOST_PER_ROUND);
    let begin = Instant::now();
    let mut rounds = Vec::new();
    while rounds.len() < 4 || begin.elapsed() < span {
        let t = Instant::now();
        for _ in 0..per_round {
            drop(f()?);
        }
        dev.synchronize()?;
        rounds.push(t.elapsed().as_secs_f64() / per_round as f64);
    }
    let later = rounds.split_off(rounds.len() / 2);
    Ok(median_of(later))
}

/// `f` run `warmup` times untimed, then timed `iters` times (at least once), each run
/// synchronised on `dev`: the median of the timed runs, in seconds.
pub fn median_time(
    dev: &Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> candle_core::Result<Tensor>,
) -> candle_core::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let start = Instant::now();
        let out = f()?;
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
        drop(out);
    }
    Ok(median_of(times))
}

pub(super) fn median_of(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let m = if n == 0 {
        0.0
    } else if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    };
    // Nanoseconds: what a clock resolves; never 0.
    ((m * 1e9).round() / 1e9).max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// Sustained timing runs the operation back to back for the whole span, rounds of
    /// many runs with one synchronise each, and reports one run's time: well below a
    /// round's, and above 0.
    #[test]
    fn sustained_timing_runs_back_to_back_for_its_span() {
        let dev = Device::Cpu;
        let x = Tensor::ones((64, 64), DType::F32, &dev).unwrap();
        let mut runs = 0usize;
        let start = Instant::now();
        let (round, span) = (Duration::from_millis(5), Duration::from_millis(60));
        let t = sustained_time(&dev, round, span, || {
            runs += 1;
            x.matmul(&x)
        })
        .unwrap();
        assert!(start.elapsed() >= span);
        // Two runs to estimate, then at least four rounds of several runs each.
        assert!(runs > 2 + 4, "{runs} runs");
        assert!(t > 0.0 && t < round.as_secs_f64(), "{t} s per run");
        let per_run = start.elapsed().as_secs_f64() / runs as f64;
        assert!(t < 4.0 * per_run, "{t} s per run, {per_run} s on average");
    }
}
