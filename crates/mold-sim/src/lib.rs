//! `mold sim`: a discrete-event simulation of one request as the executor runs it.
//!
//! The simulator replays the shared cost model's figures ([`mold_cost::Ctx::block`],
//! [`mold_cost::Ctx::component_s`], …) as events on per-device streams — a compute
//! stream, a host→device copy stream and a communication lane (all-reduces and peer
//! transfers) — and tracks every device's memory over time. It never derives FLOPs or
//! bytes of its own beyond the small tensors moved between phases (conditioning,
//! latents).
//!
//! What it models beyond the planner's closed form ([`mold_cost::evaluate`]):
//! - each rank of a parallel group computes at its own speed; the all-reduces (tensor
//!   parallel) and all-to-alls (sequence parallel) start when the slowest rank is ready;
//!   a sequence-parallel run of parts ends with an all-gather of the hidden state;
//! - hand-offs between parts use the actual link of each (source, destination) pair, to
//!   every rank of the next group (the planner prices every hand-off at the machine's
//!   slowest device-to-device path);
//! - a streamed part's copies run ahead on the device's copy stream as soon as a buffer
//!   is free — during earlier parts, or the previous step (the planner charges a pipeline
//!   fill per device group per step);
//! - latents return to the first part's devices between steps; conditioning moves to
//!   the transformer's first devices, latents to the VAE's device;
//! - all-reduce, all-to-all and all-gather buffers, hand-off buffers, conditioning and
//!   latents are live memory.
//!
//! [`SimOptions::planner`] turns those refinements off; the simulator then reproduces the
//! planner's step time and peak memory, which is how [`compare`] explains every
//! difference between a plan's recorded prediction and the simulation.

mod check;
mod engine;
mod outcome;
mod report;
pub mod run_compare;
pub mod run_report;
pub mod stream;
mod svg;
mod text;

pub use check::{check_paths, CheckResult, CheckSummary};
pub use engine::simulate_with;
pub use stream::{simulate_stream, Arrivals, StreamOptions, StreamReport};

use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{DeviceId, Plan, Workload};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The plan does not fit its model or machine (`mold_cost::validate`).
    #[error("{0}")]
    Invalid(String),
    /// The plan names a model mold does not know.
    #[error("model.id: {0}")]
    Model(String),
    /// The plan was made for another machine (`mold_cost::check_machine`).
    #[error("{0}")]
    Machine(String),
    /// A file could not be read or parsed.
    #[error("{0}")]
    Load(String),
}

/// Which refinements over the planner's closed form the simulation applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SimOptions {
    /// Hand-offs use the actual link of each pair, and cost nothing where the hidden
    /// state is already on the device; off: every change of group costs the planner's
    /// slowest-link price.
    pub exact_handoff: bool,
    /// Streamed copies start as soon as a buffer is free (during earlier parts and the
    /// previous step); off: each step, a group's copies wait for its first streamed
    /// part to start.
    pub prefetch: bool,
    /// Latents move back to the first part's devices between steps.
    pub latent_return: bool,
    /// All-reduce, hand-off, conditioning and latent buffers count as live memory.
    pub transfer_buffers: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            exact_handoff: true,
            prefetch: true,
            latent_return: true,
            transfer_buffers: true,
        }
    }
}

impl SimOptions {
    /// Every refinement off: the planner's closed form, played out as events.
    pub fn planner() -> Self {
        SimOptions {
            exact_handoff: false,
            prefetch: false,
            latent_return: false,
            transfer_buffers: false,
        }
    }
}

/// The stream an event runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    Compute,
    /// Host→device copies of streamed weights.
    Copy,
    /// All-reduces and transfers between devices (hand-offs, conditioning, latents).
    Comm,
}

impl Lane {
    pub fn name(self) -> &'static str {
        match self {
            Lane::Compute => "compute",
            Lane::Copy => "copy",
            Lane::Comm => "comm",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Encoder,
    Vae,
    Block,
    StreamedBlock,
    Copy,
    AllReduce,
    /// Sequence-parallel all-to-alls of a block (q, k, v in, output back).
    AllToAll,
    /// The all-gather of the hidden state that ends a sequence-parallel run of parts.
    AllGather,
    HandOff,
    Transfer,
}

/// One interval on one device's lane.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    pub device: DeviceId,
    pub lane: Lane,
    pub kind: EventKind,
    pub start_s: f64,
    pub end_s: f64,
    /// What runs: `double 3`, `copy single 12`, `all-reduce ×2`, `t5`, …
    pub what: String,
    /// Where in the request: `step 1, part 2`, `encode`, `decode`.
    pub phase: String,
}

impl Event {
    pub fn duration_s(&self) -> f64 {
        self.end_s - self.start_s
    }
}

/// Something live in a device's memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Live {
    pub what: String,
    pub bytes: u64,
}

/// One device's memory and time over the request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceReport {
    pub device: DeviceId,
    pub name: String,
    pub budget: u64,
    pub headroom: u64,
    /// Weights loaded for the whole request (components, resident blocks, stem).
    pub weights: u64,
    pub stream_buffers: u64,
    pub peak: u64,
    /// When the peak is first reached, seconds from the request's start.
    pub peak_at_s: f64,
    /// The moment of the peak: `step 1, part 2, single 12`.
    pub peak_moment: String,
    /// What is live at the peak, largest first.
    pub peak_live: Vec<Live>,
    /// Busy seconds over the whole request (steps after the simulated ones
    /// extrapolated).
    pub compute_s: f64,
    pub copy_s: f64,
    pub comm_s: f64,
    /// Compute stream busy, percent of the request.
    pub busy_pct: f64,
    /// Compute seconds in one steady step.
    pub step_compute_s: f64,
    pub step_copy_s: f64,
    pub step_comm_s: f64,
    /// Memory over the simulated timeline: (seconds, bytes live).
    #[serde(skip)]
    pub curve: Vec<(f64, u64)>,
}

impl DeviceReport {
    pub fn fits(&self) -> bool {
        self.peak + self.headroom <= self.budget
    }
}

/// A budget overrun: a device (or the host) needs more than it has.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Overflow {
    /// `cuda:1`, or `host`.
    pub device: String,
    pub moment: String,
    pub at_s: f64,
    /// Peak plus headroom (devices), or bytes needed (host).
    pub need: u64,
    pub limit: u64,
    pub live: Vec<Live>,
    /// One line: device, moment, by how much, what was live.
    pub message: String,
}

/// Host memory: pinned streamed weights and components run on the CPU.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostReport {
    pub pinned: u64,
    pub pinned_limit: u64,
    pub ram: u64,
    pub memory: u64,
    pub compute_s: f64,
}

/// The simulation of one request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    pub model: String,
    pub machine: String,
    pub workload: Workload,
    pub options: SimOptions,
    pub steps: u32,
    /// Steps simulated event by event; later ones repeat the last of them.
    pub simulated_steps: u32,
    /// Each simulated step's time.
    pub step_times_s: Vec<f64>,
    pub first_step_s: f64,
    /// Steady step time (the last simulated step).
    pub step_s: f64,
    pub first_step_differs: bool,
    /// Encoders plus conditioning transfers.
    pub encode_s: f64,
    pub denoise_s: f64,
    /// Latents to the VAE's device plus decode.
    pub decode_s: f64,
    pub request_s: f64,
    pub devices: Vec<DeviceReport>,
    pub host: HostReport,
    pub overflows: Vec<Overflow>,
    /// What limits the step, in words.
    pub bottleneck: String,
    /// Simulated weight bytes copied host→device per step.
    pub streamed_per_step: u64,
    pub events: Vec<Event>,
    /// The simulated timeline ends here (encode, simulated steps, decode).
    pub sim_end_s: f64,
    /// Where each simulated step ends.
    pub step_ends_s: Vec<f64>,
    pub denoise_start_s: f64,
    /// How the block times were priced, when the profile has operation tables
    /// ([`mold_cost::ops::describe`]); empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cost_basis: Vec<String>,
    /// What each encoder's and decoder's first run in a fresh process adds, where the
    /// profile measured it ([`mold_cost::ComponentEstimate::first_use_s`]). Kept apart:
    /// `encode_s`, `decode_s`, `request_s` and the events are warm — what the planner's
    /// objective and `mold serve` (components resident, paid once at start) use — and
    /// only a one-shot `mold exec` run report adds these
    /// ([`run_report::predicted_phases`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub first_use: Vec<FirstUse>,
    /// Loading the plan's weights before a one-shot request (`mold exec`; `mold serve`
    /// pays it once at start): [`mold_cost::load_time`]. Not part of `request_s`.
    pub load: mold_cost::LoadTime,
    /// The host read rate the load was priced at (GB/s), and whether the profile measured
    /// it (else the cost model's default).
    pub host_read_gbps: f64,
    pub host_read_measured: bool,
}

/// A component's first use in a fresh process ([`SimReport::first_use`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FirstUse {
    /// The plan's component (`t5`, `clip`, `vae`).
    pub component: String,
    pub role: mold_plan::ComponentRole,
    pub device: DeviceId,
    pub seconds: f64,
}

impl SimReport {
    /// No device, nor the host, goes over its budget.
    pub fn fits(&self) -> bool {
        self.overflows.is_empty()
    }
    pub fn device(&self, id: &DeviceId) -> Option<&DeviceReport> {
        self.devices.iter().find(|d| &d.device == id)
    }
}

/// Simulates one request of `plan` on `machine`, with every refinement on. Checks the
/// plan first ([`mold_cost::validate`]); the machine fingerprint is the caller's
/// business ([`prepare`] or [`mold_cost::check_machine`]).
pub fn simulate(plan: &Plan, model: &ModelSpec, machine: &Machine) -> Result<SimReport, SimError> {
    simulate_with(plan, model, machine, SimOptions::default())
}

/// The catalogue model of a plan, refined by its recorded checkpoint where that file is
/// still there.
fn model_for(plan: &Plan) -> Result<ModelSpec, SimError> {
    if let Some(c) = &plan.model.checkpoint {
        let p = std::path::Path::new(&c.path);
        if p.exists() {
            return mold_models::checkpoint::refine(p, Some(&plan.model.id))
                .map(|r| r.model)
                .map_err(|e| SimError::Model(e.to_string()));
        }
    }
    mold_models::find(&plan.model.id).map_err(|e| SimError::Model(e.to_string()))
}

/// Looks up the plan's model and compares its machine fingerprint with `machine`: a
/// different machine is an error unless `force`, then a warning returned for stderr.
pub fn prepare(
    plan: &Plan,
    machine: &Machine,
    force: bool,
) -> Result<(ModelSpec, Option<String>), SimError> {
    let model = model_for(plan)?;
    let warning = match mold_cost::check_machine(plan, machine, force) {
        Ok(mold_cost::MachineCheck::Same) => None,
        Ok(mold_cost::MachineCheck::Warn(w)) => Some(w),
        Err(e) => return Err(SimError::Machine(e.to_string())),
    };
    Ok((model, warning))
}

/// One refinement's effect on the step time, against the planner's closed form.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Refinement {
    pub what: String,
    pub step_delta_s: f64,
}

/// One device's peak: recorded by the planner, simulated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeakComparison {
    pub device: DeviceId,
    pub recorded: u64,
    pub simulated: u64,
    /// The simulation with transfer buffers off (the planner's accounting).
    pub planner_model: u64,
    /// (simulated, rounded up to a MiB as plans record it − recorded) / recorded.
    pub deviation: f64,
}

/// The simulation against the plan's recorded prediction.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    pub recorded_step_s: f64,
    pub simulated_step_s: f64,
    /// The simulation with every refinement off.
    pub planner_model_step_s: f64,
    /// (simulated − recorded) / recorded.
    pub step_deviation: f64,
    pub refinements: Vec<Refinement>,
    pub peaks: Vec<PeakComparison>,
}

const PREFETCH: &str = "streamed copies run ahead: a streamed part's first copies overlap earlier compute (the planner charges a pipeline fill per group per step)";
const HANDOFF: &str =
    "exact hand-off links per pair (the planner prices each hand-off at the machine's slowest device-to-device path)";
const LATENT: &str =
    "latents returned to the first part's devices between steps (not priced by the planner)";
const BUFFERS: &str = "all-reduce, hand-off, conditioning and latent buffers live beside activations (not counted by the planner)";

impl Comparison {
    /// Within `tol` (relative) on step time and every device's peak.
    pub fn agrees(&self, tol: f64) -> bool {
        self.step_deviation.abs() <= tol && self.peaks.iter().all(|p| p.deviation.abs() <= tol)
    }

    /// Why the simulation differs from the plan: the refinements that move it, largest
    /// first, and how the planner's own model compares.
    pub fn explain(&self) -> String {
        let mut out = format!(
            "step: simulated {:.6} s vs recorded {:.6} s ({:+.2}%)",
            self.simulated_step_s,
            self.recorded_step_s,
            100.0 * self.step_deviation
        );
        let mut rs: Vec<&Refinement> = self
            .refinements
            .iter()
            .filter(|r| r.step_delta_s.abs() > 1e-9)
            .collect();
        rs.sort_by(|a, b| b.step_delta_s.abs().total_cmp(&a.step_delta_s.abs()));
        if !rs.is_empty() {
            out.push_str("; the simulator models more finely: ");
            out.push_str(
                &rs.iter()
                    .map(|r| format!("{} ({:+.6} s)", r.what, r.step_delta_s))
                    .collect::<Vec<_>>()
                    .join("; "),
            );
        }
        out.push_str(&format!(
            "; with those off it gives {:.6} s ({:+.2}%)",
            self.planner_model_step_s,
            100.0 * rel(self.planner_model_step_s, self.recorded_step_s)
        ));
        let off: Vec<String> = self
            .peaks
            .iter()
            .filter(|p| p.deviation.abs() > 0.005)
            .map(|p| {
                format!(
                    "{} {} vs recorded {} ({:+.2}%; planner accounting gives {})",
                    p.device,
                    mold_plan::ByteSize(p.simulated).human(),
                    mold_plan::ByteSize(p.recorded).human(),
                    100.0 * p.deviation,
                    mold_plan::ByteSize(p.planner_model).human(),
                )
            })
            .collect();
        if !off.is_empty() {
            out.push_str(&format!("; peaks: {}: {BUFFERS}", off.join(", ")));
        }
        out
    }
}

pub(crate) fn rel(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        if a == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (a - b) / b
    }
}

/// Simulates `plan` with and without each refinement and compares with its recorded
/// prediction.
pub fn compare(plan: &Plan, model: &ModelSpec, machine: &Machine) -> Result<Comparison, SimError> {
    let fine = simulate(plan, model, machine)?;
    let coarse = simulate_with(plan, model, machine, SimOptions::planner())?;
    let mut refinements = Vec::new();
    let base = SimOptions::planner();
    for (what, opts) in [
        (
            PREFETCH,
            SimOptions {
                prefetch: true,
                ..base
            },
        ),
        (
            HANDOFF,
            SimOptions {
                exact_handoff: true,
                ..base
            },
        ),
        (
            LATENT,
            SimOptions {
                latent_return: true,
                ..base
            },
        ),
    ] {
        let r = simulate_with(plan, model, machine, opts)?;
        refinements.push(Refinement {
            what: what.to_string(),
            step_delta_s: r.step_s - coarse.step_s,
        });
    }
    let recorded = plan.predicted.step_time_s;
    let peaks = plan
        .predicted
        .devices
        .iter()
        .map(|p| {
            let sim = fine.device(&p.device).map(|d| d.peak).unwrap_or(0);
            let planner = coarse.device(&p.device).map(|d| d.peak).unwrap_or(0);
            PeakComparison {
                device: p.device.clone(),
                recorded: p.peak.0,
                simulated: sim,
                planner_model: planner,
                // Plans record peaks rounded up to a MiB: compare like with like.
                deviation: rel(
                    mold_plan::ByteSize(sim).ceil_mib().0 as f64,
                    p.peak.0 as f64,
                ),
            }
        })
        .collect();
    Ok(Comparison {
        recorded_step_s: recorded,
        simulated_step_s: fine.step_s,
        planner_model_step_s: coarse.step_s,
        step_deviation: rel(fine.step_s, recorded),
        refinements,
        peaks,
    })
}

#[cfg(test)]
mod tests;
