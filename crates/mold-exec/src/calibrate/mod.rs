//! Calibration: what `mold devices --calibrate` measures on the devices themselves and,
//! with `--model M`, a model's own operations, for the machine profile the cost model
//! prices plans from.
//!
//! The entry points, each what one step of the calibration measures (the CLI, through
//! `mold-pipeline`'s `calibrate`, runs them in order and builds the profile):
//! - [`measure_devices`]: the devices' own figures (the `mold-machine` inventory's matrix
//!   product, memory bandwidth, host and peer copies) and, on builds with the `nccl`
//!   feature, NCCL all-reduce over groups of 2, 4, … GPUs ([`measure_allreduce`]);
//! - [`measure_ops`]: a model's operation tables — its blocks' matrix products, attention,
//!   element-wise kernels and collectives, timed as [`Timing`] says, and on GPUs the
//!   host→device copy beside them;
//! - [`measure_footprint`]: the CUDA libraries' device memory, in a fresh process;
//! - [`median_time`]: the timing the tables share, for `mold-pipeline`'s encoders and
//!   decoder.
//!
//! The modules form a tree, no circle: `loads` (the operations built, ready to run),
//! `timing` and `bench` (what to time) are leaves; `mix` (each operation timed inside
//! its block's mix), `copy` (the host→device copy beside compute), `collectives` and
//! `footprint` use the leaves; `ops` puts the tables together from all of them;
//! `allreduce` stands alone.

mod allreduce;
mod bench;
mod collectives;
mod copy;
mod footprint;
mod loads;
mod mix;
mod ops;
mod timing;

#[cfg(feature = "nccl")]
pub use allreduce::measure_allreduce;
pub use allreduce::AllreduceBench;
pub use bench::{OpBench, Timing};
pub use footprint::{footprint_ops, measure_footprint, Footprint};
pub use ops::{measure_ops, OpTarget};
pub use timing::median_time;

use mold_machine::inventory::{self, Inventory, InventoryError, Measurements};
use std::time::Duration;

/// The devices of `inv` measured (`mold devices --save X.yaml --calibrate`): the
/// inventory's figures ([`inventory::calibrate`]: bf16 matrix products, memory
/// bandwidth, host and peer copies), then, on builds with the `nccl` feature, NCCL
/// all-reduce over 2, 4, … of them under `watchdog` (the NCCL watchdog as the CLI
/// resolved it, or why it could not: the all-reduce is then noted as not measured). An
/// all-reduce that fails is noted in `not_measured`, not an error; without `nccl` the
/// profile keeps estimated all-reduce figures.
pub fn measure_devices(
    inv: &Inventory,
    watchdog: std::result::Result<Option<Duration>, String>,
    progress: &mut dyn FnMut(&str),
) -> std::result::Result<Measurements, InventoryError> {
    let r = inventory::calibrate(inv, progress)?;
    #[cfg(feature = "nccl")]
    let r = allreduce::add_allreduce(inv, r, watchdog, progress);
    #[cfg(not(feature = "nccl"))]
    let _ = watchdog;
    let mut r = r;
    progress("host read rate (1 GiB scratch file in the temporary directory, every core)");
    match inventory::host_read::measure(&std::env::temp_dir(), 1 << 30) {
        Ok(g) => r.host_read_gbps = Some(g),
        Err(e) => r.not_measured.push(e.to_string()),
    }
    Ok(r)
}
