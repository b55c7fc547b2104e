//! The calibration `mold devices --calibrate` runs, in order, and the machine profile
//! built from what it measured: [`calibrate`], the one entry point.
//!
//! - The devices' own figures (`--save X.yaml --calibrate` on this box):
//!   [`mold_exec::calibrate::measure_devices`] — matrix products, memory bandwidth, host
//!   and peer copies, NCCL all-reduce — applied to the profile.
//! - A model's operation tables (`--model M`), one per kind of device of the profile's
//!   first node ([`device_kinds`]): its blocks' operations and collectives
//!   ([`mold_exec::calibrate::measure_ops`], timed as [`op_timing`] picks), for FLUX and
//!   Qwen-Image also its text encoders and VAE decoder ([`time_components`]) and their
//!   first run in fresh processes ([`first_use`], through [`Host::first_use`]), and on GPUs the CUDA
//!   libraries' device memory in fresh processes ([`Host::footprint`]); each table added
//!   to the profile with a note of how it was measured ([`add_tables`]).
//!
//! The program running it (the CLI) resolves every option before, shows progress and
//! starts the fresh processes ([`Host`]); nothing here reads the environment.

mod components;
mod model;

pub use components::{
    components_timed, first_use, record_first_use, time_components, ComponentBench, FirstUseRun,
};
pub use model::{add_tables, check_model, device_kinds, op_timing, ModelCalibration};

use crate::error::PipelineError;
use mold_exec::calibrate::{Footprint, Timing};
use mold_exec::ExecError;
use mold_machine::inventory::{self, Inventory, InventoryError, Measurements};
use mold_machine::{Machine, OpTables};
use mold_plan::DeviceId;
use std::time::Duration;

/// What the calibration asks of the program running it: showing its progress, and the
/// measurements that need a fresh process (nothing loaded yet), which the program starts
/// (`mold calibrate-first-use`, `mold calibrate-footprint`: children of the CLI binary).
pub trait Host {
    /// One line of progress, to show as it is.
    fn say(&mut self, line: &str);
    /// The devices' figures once measured, before any model's operations are.
    fn measured(&mut self, _r: &Measurements) {}
    /// `model`'s components run first in a fresh process on `device`, the decoder at
    /// `size` ([`first_use`] there); why not, in one line, where the process could not
    /// start or failed.
    fn first_use(
        &mut self,
        model: &str,
        device: &DeviceId,
        size: (u32, u32),
    ) -> Result<Vec<FirstUseRun>, String>;
    /// The CUDA libraries' device memory on `device` once `model`'s blocks ran in
    /// `dtype` in a fresh process ([`mold_exec::calibrate::measure_footprint`] there);
    /// why not, in one line.
    fn footprint(
        &mut self,
        model: &str,
        dtype: mold_plan::DType,
        device: &DeviceId,
    ) -> Result<Footprint, String>;
}

/// The devices of this box to measure ([`mold_exec::calibrate::measure_devices`]).
pub struct DeviceCalibration<'a> {
    /// This box's GPUs as queried.
    pub inventory: &'a Inventory,
    /// The NCCL watchdog for the all-reduce (`MOLD_NCCL_TIMEOUT_S`), or why it could not
    /// be resolved (the all-reduce is then noted as not measured).
    pub watchdog: Result<Option<Duration>, String>,
}

/// What [`calibrate`] measures.
pub struct Calibration<'a> {
    /// The devices' own figures, applied to the profile; `None`: kept as they are.
    pub devices: Option<DeviceCalibration<'a>>,
    /// A model's operation tables, added to the profile.
    pub model: Option<ModelCalibration>,
    /// The date the profile's calibration notes give (`inventory::today()`).
    pub date: String,
    /// The mold version they give.
    pub mold_version: String,
}

/// What [`calibrate`] measured (already in the profile).
#[derive(Debug, Default)]
pub struct Calibrated {
    /// The devices' figures, where measured.
    pub measurements: Option<Measurements>,
    /// The model's tables, one per kind of device ([`device_kinds`]' order), and how
    /// their operations were timed.
    pub tables: Vec<(OpTables, Timing)>,
}

/// A calibration that could not run; each names what is at fault.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// The request or the profile cannot be calibrated; the message says why.
    #[error("{0}")]
    Refused(String),
    /// A device could not be opened.
    #[error("{device}: {message}")]
    Device { device: String, message: String },
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    /// Boxed: exec's errors are large.
    #[error(transparent)]
    Exec(Box<ExecError>),
    #[error(transparent)]
    Pipeline(Box<PipelineError>),
}

impl From<ExecError> for CalibrateError {
    fn from(e: ExecError) -> Self {
        CalibrateError::Exec(Box::new(e))
    }
}

impl From<PipelineError> for CalibrateError {
    fn from(e: PipelineError) -> Self {
        CalibrateError::Pipeline(Box::new(e))
    }
}

/// Runs calibration `c` on `machine` (the profile of this box, or of the devices
/// `--machine` names), in order: the devices' figures (applied to `machine` and shown
/// through [`Host::measured`]), then the model's tables, every kind of device measured
/// before any table is added to `machine` ([`add_tables`]). What was measured comes back
/// too, for printing.
pub fn calibrate(
    machine: &mut Machine,
    c: Calibration,
    host: &mut dyn Host,
) -> Result<Calibrated, CalibrateError> {
    let mut out = Calibrated::default();
    if let Some(d) = c.devices {
        let r = mold_exec::calibrate::measure_devices(d.inventory, d.watchdog, &mut |s| {
            host.say(&format!("calibrating: {s}"))
        })?;
        inventory::apply_measurements(machine, &r, &c.date, &c.mold_version);
        host.measured(&r);
        out.measurements = Some(r);
    }
    if let Some(req) = &c.model {
        out.tables = model::measure_model(req, machine, host)?;
        for (t, timing) in &out.tables {
            add_tables(machine, t.clone(), *timing, &c.date, &c.mold_version);
        }
    }
    Ok(out)
}
