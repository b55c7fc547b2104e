//! What a calibration of a model's operations is asked to do: how many runs, which
//! kernels and streams, the collectives' options and how an operation on one device is
//! timed ([`OpBench`], [`Timing`]), resolved by the CLI.

use crate::comm::CommOptions;
use crate::model::ops::Kernels;
use mold_plan::DeviceId;
use std::time::Duration;

/// How [`super::measure_ops`] times.
#[derive(Clone, Debug, PartialEq)]
pub struct OpBench {
    /// Untimed runs before the timed ones (kernels loaded, allocator warm).
    pub warmup: usize,
    /// Timed runs; the median is kept.
    pub iters: usize,
    /// Which attention and element-wise implementations run (`MOLD_KERNELS`).
    pub kernels: Kernels,
    /// Open each GPU with a stream of its own, as `mold exec` does with it on.
    pub own_streams: bool,
    /// The collectives' options (the NCCL watchdog).
    pub comm: CommOptions,
    /// How an operation on one device is timed.
    pub timing: Timing,
}

/// How [`super::measure_ops`] times an operation on one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Timing {
    /// Each run alone, the device drained before and after it (`warmup`, then the
    /// median of `iters`): a GPU idle between runs, at the clocks of a light load.
    Alone,
    /// Runs back to back, one synchronise per round of about `round`, rounds for at
    /// least `span`: the per-run time of the median round of the later half — the
    /// device as loaded as in a step, at the clocks its power limit then allows.
    Sustained { round: Duration, span: Duration },
    /// Each operation inside the mix of the block it belongs to, the block's operations
    /// run back to back in its order, rounds of about `round` for at least `span` per
    /// block ([`super::mix`]): the clock the block's whole mix runs at under
    /// the power limit. An operation in no block is timed sustained.
    Mixed { round: Duration, span: Duration },
}

impl Timing {
    /// The sustained timing `mold devices --calibrate` uses on GPUs: rounds of 20 ms
    /// for 250 ms.
    pub const SUSTAINED: Timing = Timing::Sustained {
        round: Duration::from_millis(20),
        span: Duration::from_millis(250),
    };

    /// The mixed timing `mold devices --calibrate --timing mixed` uses: rounds of 20 ms
    /// for 250 ms per block.
    pub const MIXED: Timing = Timing::Mixed {
        round: Duration::from_millis(20),
        span: Duration::from_millis(250),
    };

    /// How a profile's note describes it.
    pub fn describe(&self) -> String {
        match self {
            Timing::Alone => "alone, the median of timed runs".into(),
            Timing::Sustained { round, span } => format!(
                "back to back for {} ms, median per-run time of rounds of {} ms",
                span.as_millis(),
                round.as_millis()
            ),
            Timing::Mixed { round, span } => format!(
                "products and attention inside their blocks, each block's operations back \
                 to back for {} ms, the median of rounds of {} ms; element-wise kernels and \
                 layout copies back to back alone",
                span.as_millis(),
                round.as_millis()
            ),
        }
    }
}

impl Default for OpBench {
    /// 3 warm-ups, median of 10, the default kernels and streams.
    fn default() -> Self {
        OpBench {
            warmup: 3,
            iters: 10,
            kernels: Kernels::Auto,
            own_streams: false,
            comm: CommOptions::default(),
            timing: Timing::Alone,
        }
    }
}

impl OpBench {
    /// Refuses a benchmark that cannot run, in one line.
    pub fn check(&self, devices: &[DeviceId]) -> std::result::Result<(), String> {
        if self.iters == 0 {
            return Err("measuring operations: iters must be at least 1".into());
        }
        if let Timing::Sustained { round, span } | Timing::Mixed { round, span } = self.timing {
            if round.is_zero() || span < round {
                return Err(format!(
                    "measuring operations: {} timing needs a round above 0 and a span of at \
                     least one round (round {round:?}, span {span:?})",
                    if matches!(self.timing, Timing::Mixed { .. }) {
                        "mixed"
                    } else {
                        "sustained"
                    }
                ));
            }
        }
        if devices.is_empty() {
            return Err("measuring operations: no device to measure on".into());
        }
        if devices.iter().any(|d| d.is_host()) {
            return Err(
                "measuring operations: `host` is not a device: name GPUs or emulated devices"
                    .into(),
            );
        }
        let mut seen = devices.to_vec();
        seen.sort();
        seen.dedup();
        if seen.len() != devices.len() {
            return Err(format!(
                "measuring operations: devices {} are not distinct",
                list(devices)
            ));
        }
        Ok(())
    }
}

pub(super) fn list(devices: &[DeviceId]) -> String {
    devices
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
