//! The run report: a plan's prediction beside what one run measured, phase by phase and
//! device by device. `mold exec PLAN --report run.json` writes it; `mold sim PLAN
//! --compare run.json` reads it back ([`crate::run_compare`]). The serde types here are
//! the schema, versioned by [`RUN_REPORT_VERSION`]:
//!
//! ```text
//! version: 1
//! plan:    {fingerprint, model, machine}        the plan the run ran (plan_fingerprint)
//! run:     {kind, steps, width, height, profiled, predicted_by}
//! phases:  [{phase, kind, per_step, devices, predicted_s, measured_s, note}]
//! memory:  [{device, predicted_peak_bytes, accounted_peak_bytes,
//!            measured: {source, peak_bytes, pool_high_bytes, outside_pool_bytes,
//!                       samples: [{phase, bytes}]}}]
//! ```
//!
//! Times are seconds (per denoising step where `per_step`, else per request), sizes bytes;
//! a side that was not predicted or not measured is `null`. Every prediction comes from
//! the simulator ([`crate::simulate`], the cost model `mold sim` prints), never
//! re-derived: [`predicted_phases`] reads the simulated steady step's events, and for a
//! text-to-image run adds the components' first use in a fresh process
//! ([`SimReport::first_use`]) to encode and decode, saying so in the row's note.

use crate::{EventKind, Lane, SimReport};
use mold_plan::{DeviceId, Plan};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The schema version this mold writes and reads.
pub const RUN_REPORT_VERSION: u32 = 1;

/// A predicted-vs-measured report of one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunReport {
    /// [`RUN_REPORT_VERSION`].
    pub version: u32,
    pub plan: PlanId,
    pub run: RunInfo,
    pub phases: Vec<PhaseRow>,
    pub memory: Vec<MemoryRow>,
}

/// Which plan a report is for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanId {
    /// [`plan_fingerprint`] of the plan file as loaded.
    pub fingerprint: String,
    pub model: String,
    pub machine: String,
}

/// What ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// Text to image (`mold exec --prompt`): encoders, transformer, VAE.
    Pipeline,
    /// The transformer alone on random inputs (the benchmark).
    Transformer,
}

impl RunKind {
    pub fn name(self) -> &'static str {
        match self {
            RunKind::Pipeline => "text to image",
            RunKind::Transformer => "transformer only",
        }
    }
}

/// The run's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunInfo {
    pub kind: RunKind,
    pub steps: u32,
    pub width: u32,
    pub height: u32,
    /// Per-part phases were measured with `MOLD_PROFILE`'s marks (which synchronise the
    /// device at each mark, so the run's steps were slower than plain ones).
    pub profiled: bool,
    /// Where the predictions come from (`mold sim on <machine profile>`).
    pub predicted_by: String,
}

/// What a phase row times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseKind {
    /// One text encoder, or all of encoding.
    Encode,
    /// A part's blocks on its devices (the slowest rank).
    Compute,
    /// A part's all-reduces, all-to-alls and all-gathers.
    Collective,
    /// Activations between parts and latents back to the first part.
    HandOff,
    /// Streamed weights: copies host→device, or compute waiting for them.
    Streaming,
    Decode,
    /// One denoising step.
    Step,
    /// Every denoising step.
    Denoise,
    /// Encode, denoise and decode (loading left out).
    Request,
    /// Loading the weights the run reads (a one-shot run's; `mold serve` loads once).
    Load,
}

/// One phase: the prediction beside the measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseRow {
    /// `encode: t5`, `part 1: blocks`, `part 1: collectives`, `hand-offs`,
    /// `streaming copies: cuda:0`, `streamed weight wait: cuda:0`, `decode`, `step`, …
    pub phase: String,
    pub kind: PhaseKind,
    /// Seconds per denoising step; else per request.
    pub per_step: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceId>,
    pub predicted_s: Option<f64>,
    pub measured_s: Option<f64>,
    /// Why a side is missing, or what the measurement covers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl PhaseRow {
    /// (measured − predicted) / predicted, where both exist and the prediction is not 0.
    pub fn deviation(&self) -> Option<f64> {
        deviation(self.measured_s?, self.predicted_s?)
    }
}

/// Where a measured peak comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorySource {
    /// The device's allocator (CUDA: memory in use at each phase boundary less the
    /// value before the run, and the memory pool's high-water mark).
    Allocator,
    /// Accounted from tensor shapes (emulated devices, the host, CPU builds).
    Accounted,
}

impl MemorySource {
    pub fn name(self) -> &'static str {
        match self {
            MemorySource::Allocator => "allocator",
            MemorySource::Accounted => "accounted",
        }
    }
}

/// Bytes above the run's start at one phase boundary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySample {
    pub phase: String,
    pub bytes: u64,
}

/// A measured peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredPeak {
    pub source: MemorySource,
    pub peak_bytes: u64,
    /// The allocator pool's own high-water mark (CUDA's default memory pool), when it
    /// keeps one; `peak_bytes` is the larger of the samples and it plus
    /// `outside_pool_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_high_bytes: Option<u64>,
    /// The most memory in use outside that pool at a sample (kernel code, library handles
    /// and workspaces allocated directly), where it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outside_pool_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples: Vec<MemorySample>,
}

/// One device's peak memory: the plan's, the accounted and the measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryRow {
    pub device: DeviceId,
    pub predicted_peak_bytes: Option<u64>,
    pub accounted_peak_bytes: Option<u64>,
    pub measured: Option<MeasuredPeak>,
}

impl MemoryRow {
    /// (measured − predicted) / predicted.
    pub fn deviation(&self) -> Option<f64> {
        deviation(
            self.measured.as_ref()?.peak_bytes as f64,
            self.predicted_peak_bytes? as f64,
        )
    }
}

fn deviation(measured: f64, predicted: f64) -> Option<f64> {
    (predicted > 0.0).then(|| (measured - predicted) / predicted)
}

/// A malformed run report, named in one line.
#[derive(Debug, thiserror::Error)]
pub enum RunReportError {
    #[error("{source_name}: not a mold run report ({message}); write one with `mold exec PLAN --report FILE`")]
    Parse {
        source_name: String,
        message: String,
    },
    #[error("{source_name}: run report version {found}, this mold reads version {RUN_REPORT_VERSION}; write it again with this mold's `mold exec --report`")]
    Version { source_name: String, found: u32 },
    #[error("{source_name}: {field}: {message}")]
    Field {
        source_name: String,
        field: String,
        message: String,
    },
}

impl RunReport {
    /// Reads a report, checking its version and that every time is a finite number ≥ 0.
    pub fn from_json(text: &str, source_name: &str) -> Result<RunReport, RunReportError> {
        let parse = |message: String| RunReportError::Parse {
            source_name: source_name.to_string(),
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| parse(e.to_string()))?;
        // The version first: a newer schema is named as such, not as unknown fields.
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v == RUN_REPORT_VERSION as u64 => {}
            Some(v) => {
                return Err(RunReportError::Version {
                    source_name: source_name.to_string(),
                    found: u32::try_from(v).unwrap_or(u32::MAX),
                })
            }
            None => return Err(parse("no `version` number".into())),
        }
        let r: RunReport = serde_json::from_value(value).map_err(|e| parse(e.to_string()))?;
        let field = |field: String, message: String| RunReportError::Field {
            source_name: source_name.to_string(),
            field,
            message,
        };
        for (i, p) in r.phases.iter().enumerate() {
            for (name, v) in [("predicted_s", p.predicted_s), ("measured_s", p.measured_s)] {
                if let Some(x) = v {
                    if !x.is_finite() || x < 0.0 {
                        return Err(field(
                            format!("phases[{i}].{name}"),
                            format!("{x} is not a time in seconds (a finite number >= 0)"),
                        ));
                    }
                }
            }
        }
        if r.plan.fingerprint.is_empty() {
            return Err(field(
                "plan.fingerprint".into(),
                "empty: the report cannot be matched with its plan".into(),
            ));
        }
        Ok(r)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a run report always serializes")
    }

    /// The row with the largest deviation, phases and peaks alike: (what, deviation).
    pub fn largest_deviation(&self) -> Option<(String, f64)> {
        let phases = self
            .phases
            .iter()
            .filter_map(|p| Some((p.phase.clone(), p.deviation()?)));
        let peaks = self
            .memory
            .iter()
            .filter_map(|m| Some((format!("{} peak", m.device), m.deviation()?)));
        phases
            .chain(peaks)
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
    }

    /// The step row.
    pub fn step(&self) -> Option<&PhaseRow> {
        self.phases.iter().find(|p| p.kind == PhaseKind::Step)
    }

    /// One line: the step measured against its prediction and the largest deviation.
    pub fn summary(&self) -> String {
        let step = match self.step() {
            Some(PhaseRow {
                predicted_s: Some(p),
                measured_s: Some(m),
                ..
            }) => format!(
                "step {} measured vs {} predicted ({})",
                ms(*m),
                ms(*p),
                pct(deviation(*m, *p))
            ),
            _ => "step not measured".to_string(),
        };
        match self.largest_deviation() {
            Some((what, d)) => format!("{step}, largest deviation: {what} {}", pct(Some(d))),
            None => step,
        }
    }
}

/// `139.7 ms`, `2.41 s`.
pub(crate) fn ms(s: f64) -> String {
    if s == 0.0 {
        "0 ms".to_string()
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.3} ms", s * 1e3)
    }
}

/// `+35.0 %`, `-1.1 %`, `-` when there is nothing to compare.
pub(crate) fn pct(d: Option<f64>) -> String {
    match d {
        Some(d) if d.is_finite() => format!("{:+.1} %", 100.0 * d),
        _ => "-".to_string(),
    }
}

/// A plan's identity: FNV-1a over its canonical YAML ([`Plan::to_yaml`]), so the same
/// plan gives the same fingerprint however its file was formatted or migrated.
pub fn plan_fingerprint(plan: &Plan) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in plan.to_yaml().bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("fnv1a:{h:016x}")
}

/// What a run measured, in the units of the rows; `None` where it was not measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measurements {
    /// Seconds per encoder, by component name.
    pub encoders: Vec<(String, f64)>,
    pub encode_s: Option<f64>,
    /// The median step (the warm-up step left out when there are others).
    pub step_s: Option<f64>,
    pub denoise_s: Option<f64>,
    pub decode_s: Option<f64>,
    pub request_s: Option<f64>,
    /// Loading every weight the run read (a transformer-only run: the transformer's).
    pub load_s: Option<f64>,
    /// Per part (0-based index): blocks' compute and collectives, seconds per step, the
    /// slowest rank's (`MOLD_PROFILE`).
    pub parts: BTreeMap<usize, PartMeasured>,
    /// Per device: seconds per step compute waited for streamed weights.
    pub stream_wait: Vec<(DeviceId, f64)>,
    /// The per-part figures come from `MOLD_PROFILE`'s marks.
    pub profiled: bool,
}

/// One part's measured seconds per step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PartMeasured {
    pub compute_s: f64,
    pub collective_s: f64,
}

const NOT_PROFILED: &str = "per-part phases are measured in transformer-only runs with MOLD_PROFILE=events (GPU time by CUDA events) or MOLD_PROFILE=1 (synchronised: slows the step)";

/// The prediction of every phase of `plan` (the plan as run: its workload is the run's)
/// from its simulation `sim`, with `m`'s measurements beside them. Rows: encoders,
/// encode, each part's blocks and collectives per step, hand-offs, each streaming
/// device's copies and waits, step, denoise, decode, request.
pub fn phase_rows(plan: &Plan, sim: &SimReport, kind: RunKind, m: &Measurements) -> Vec<PhaseRow> {
    let mut rows = predicted_phases(plan, sim, kind);
    for r in &mut rows {
        r.measured_s = match r.kind {
            PhaseKind::Encode => match r.phase.strip_prefix("encode: ") {
                Some(name) => m.encoders.iter().find(|(n, _)| n == name).map(|(_, s)| *s),
                None => m.encode_s,
            },
            PhaseKind::Compute | PhaseKind::Collective => {
                let part = part_of(&r.phase).and_then(|i| m.parts.get(&i));
                if m.parts.is_empty() {
                    r.note = Some(NOT_PROFILED.into());
                }
                part.map(|p| {
                    if r.kind == PhaseKind::Compute {
                        p.compute_s
                    } else {
                        p.collective_s
                    }
                })
            }
            PhaseKind::HandOff => {
                r.note = Some("not timed apart: inside the step time".into());
                None
            }
            PhaseKind::Streaming => {
                if r.phase.starts_with("streaming copies") {
                    r.note = Some(
                        "copies run on the copy stream beside compute: not timed apart".into(),
                    );
                    None
                } else {
                    let found = m
                        .stream_wait
                        .iter()
                        .find(|(d, _)| r.devices.first() == Some(d))
                        .map(|(_, s)| *s);
                    if found.is_none() && !m.profiled {
                        r.note = Some(NOT_PROFILED.into());
                    }
                    found
                }
            }
            PhaseKind::Decode => m.decode_s,
            PhaseKind::Step => m.step_s,
            PhaseKind::Denoise => m.denoise_s,
            PhaseKind::Request => m.request_s,
            PhaseKind::Load => m.load_s,
        };
    }
    rows
}

/// `part 3: blocks` → 2.
fn part_of(phase: &str) -> Option<usize> {
    let rest = phase.strip_prefix("part ")?;
    let n: usize = rest.split(':').next()?.trim().parse().ok()?;
    n.checked_sub(1)
}

/// The rows of [`phase_rows`] with their predictions only.
///
/// A run report is of one `mold exec` run: a fresh process that runs each component
/// once, where the CUDA libraries load their kernels on first use inside whatever runs
/// first (the encoders). So a text-to-image run's encoder, `encode`, `decode` and
/// `request` rows predict the simulator's warm time plus the profile's measured first
/// use of those components ([`SimReport::first_use`]; each row's note gives both parts).
/// Nothing else adds it: `mold sim`'s encode and decode, the planner's objective (a cost
/// per process, not per request) and `mold serve` (components resident, paid once at
/// start) stay warm. A profile without first-use figures predicts as before.
pub fn predicted_phases(plan: &Plan, sim: &SimReport, kind: RunKind) -> Vec<PhaseRow> {
    let row =
        |phase: String, k: PhaseKind, per_step: bool, devices: Vec<DeviceId>, s: f64| PhaseRow {
            phase,
            kind: k,
            per_step,
            devices,
            predicted_s: Some(s),
            measured_s: None,
            note: None,
        };
    let dur = |e: &crate::Event| e.duration_s();
    // First use in a fresh process, by component, where the profile has it.
    let first_of = |keep: &dyn Fn(&crate::FirstUse) -> bool| -> Option<(f64, Vec<&str>)> {
        let f: Vec<&crate::FirstUse> = sim.first_use.iter().filter(|f| keep(f)).collect();
        (!f.is_empty()).then(|| {
            (
                f.iter().map(|f| f.seconds).sum(),
                f.iter().map(|f| f.component.as_str()).collect(),
            )
        })
    };
    // `warm` plus `first` as a row.
    let with_first = |mut r: PhaseRow, first: Option<(f64, Vec<&str>)>| {
        if let (Some(warm), Some((f, names))) = (r.predicted_s, first) {
            r.predicted_s = Some(warm + f);
            r.note = Some(format!(
                "predicted: {} warm + {} first use in a fresh process ({}; measured by \
                 `mold devices --calibrate --model`)",
                ms(warm),
                ms(f),
                names.join(", ")
            ));
        }
        r
    };
    let role = |r: mold_plan::ComponentRole| move |f: &crate::FirstUse| f.role == r;
    let mut rows = Vec::new();
    if kind == RunKind::Pipeline {
        for e in sim.events.iter().filter(|e| e.kind == EventKind::Encoder) {
            let first = first_of(&|f| f.component == e.what && f.device == e.device);
            rows.push(with_first(
                row(
                    format!("encode: {}", e.what),
                    PhaseKind::Encode,
                    false,
                    vec![e.device.clone()],
                    dur(e),
                ),
                first,
            ));
        }
        // `generate` runs the encoders one after another: their first uses add up.
        rows.push(with_first(
            row(
                "encode".into(),
                PhaseKind::Encode,
                false,
                vec![],
                sim.encode_s,
            ),
            first_of(&role(mold_plan::ComponentRole::Encoder)),
        ));
    }
    // The steady step: the last one simulated. Its events' phases are `step S, part P`,
    // or `step S, LABEL, part P` for a pass of true CFG (`cond`, `uncond`) or a
    // micro-batch (`mb0`, `mb1`): a part's passes in one step add up.
    let step = sim.simulated_steps;
    let prefix = format!("step {step}, ");
    let in_step = move |phase: &str| -> Option<usize> {
        let rest = phase.strip_prefix(&prefix)?;
        let last = rest.rsplit(", ").next()?;
        last.strip_prefix("part ")?.parse::<usize>().ok()
    };
    if let Some(tc) = plan.transformer() {
        for (pi, p) in tc.parts.iter().enumerate() {
            // The slowest rank sets the pace; collectives are the group's.
            let per_device = |kinds: &[EventKind]| {
                p.devices
                    .iter()
                    .map(|d| {
                        sim.events
                            .iter()
                            .filter(|e| {
                                &e.device == d
                                    && kinds.contains(&e.kind)
                                    && in_step(&e.phase) == Some(pi + 1)
                            })
                            .map(dur)
                            .sum::<f64>()
                    })
                    .fold(0.0, f64::max)
            };
            rows.push(row(
                format!("part {}: blocks", pi + 1),
                PhaseKind::Compute,
                true,
                p.devices.clone(),
                per_device(&[EventKind::Block, EventKind::StreamedBlock]),
            ));
            let collective = per_device(&[
                EventKind::AllReduce,
                EventKind::AllToAll,
                EventKind::AllGather,
            ]);
            if p.devices.len() > 1 || collective > 0.0 {
                rows.push(row(
                    format!("part {}: collectives", pi + 1),
                    PhaseKind::Collective,
                    true,
                    p.devices.clone(),
                    collective,
                ));
            }
        }
        // Hand-offs between parts, latents back to the first part and a CFG combine:
        // per phase of the step, the slowest receiving device.
        let step_prefix = format!("step {step},");
        let mut by_phase: BTreeMap<&str, f64> = BTreeMap::new();
        for e in &sim.events {
            if matches!(e.kind, EventKind::HandOff | EventKind::Transfer)
                && e.phase.starts_with(&step_prefix)
            {
                let v = by_phase.entry(e.phase.as_str()).or_default();
                *v = v.max(dur(e));
            }
        }
        if !by_phase.is_empty() || tc.parts.len() > 1 {
            rows.push(row(
                "hand-offs".into(),
                PhaseKind::HandOff,
                true,
                vec![],
                by_phase.values().sum(),
            ));
        }
        // Streamed weights, per device: copy-stream time, and compute waiting for it.
        let mut streaming: Vec<DeviceId> = Vec::new();
        for p in tc.parts.iter() {
            if p.residency == mold_plan::Residency::Streamed {
                for d in &p.devices {
                    if !streaming.contains(d) {
                        streaming.push(d.clone());
                    }
                }
            }
        }
        for d in &streaming {
            let copies: f64 = sim
                .events
                .iter()
                .filter(|e| &e.device == d && e.lane == Lane::Copy && in_step(&e.phase).is_some())
                .map(dur)
                .sum();
            rows.push(row(
                format!("streaming copies: {d}"),
                PhaseKind::Streaming,
                true,
                vec![d.clone()],
                copies,
            ));
            rows.push(row(
                format!("streamed weight wait: {d}"),
                PhaseKind::Streaming,
                true,
                vec![d.clone()],
                stream_wait(sim, d, &in_step),
            ));
        }
    }
    rows.push(row(
        "step".into(),
        PhaseKind::Step,
        true,
        vec![],
        sim.step_s,
    ));
    rows.push(row(
        "denoise".into(),
        PhaseKind::Denoise,
        false,
        vec![],
        sim.denoise_s,
    ));
    if kind == RunKind::Pipeline {
        rows.push(with_first(
            row(
                "decode".into(),
                PhaseKind::Decode,
                false,
                vec![],
                sim.decode_s,
            ),
            first_of(&role(mold_plan::ComponentRole::Vae)),
        ));
        rows.push(with_first(
            row(
                "request".into(),
                PhaseKind::Request,
                false,
                vec![],
                sim.request_s,
            ),
            first_of(&|_| true),
        ));
    }
    // Loading, as the cost model prices it (mold_cost::load_time): what a text-to-image
    // run reads, or the transformer alone.
    let load = match kind {
        RunKind::Pipeline => sim.load.total_s,
        _ => sim.load.transformer_s,
    };
    if load > 0.0 {
        let mut r = row("load".into(), PhaseKind::Load, false, vec![], load);
        r.note = Some(format!(
            "host read {:.1} GB/s{}",
            sim.host_read_gbps,
            if sim.host_read_measured {
                " (measured)"
            } else {
                " (the cost model's default; `mold devices --calibrate` measures it)"
            }
        ));
        rows.push(r);
    }
    rows
}

/// Seconds of the steady step in which `d`'s compute stream waits for a streamed block's
/// copy: the gap before each streamed block that starts as its copy ends.
fn stream_wait(sim: &SimReport, d: &DeviceId, in_step: &dyn Fn(&str) -> Option<usize>) -> f64 {
    let mut compute: Vec<&crate::Event> = sim
        .events
        .iter()
        .filter(|e| &e.device == d && e.lane == Lane::Compute)
        .collect();
    compute.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    let mut wait = 0.0;
    for (i, e) in compute.iter().enumerate() {
        if e.kind != EventKind::StreamedBlock || in_step(&e.phase).is_none() {
            continue;
        }
        let copy = format!("copy {} (", e.what);
        let copy_end = sim
            .events
            .iter()
            .find(|c| {
                &c.device == d
                    && c.lane == Lane::Copy
                    && c.phase == e.phase
                    && c.what.starts_with(&copy)
            })
            .map(|c| c.end_s);
        let prev_end = if i > 0 { compute[i - 1].end_s } else { 0.0 };
        if let Some(c) = copy_end {
            if (c - e.start_s).abs() <= 1e-12 * e.start_s.abs().max(1.0) {
                wait += (e.start_s - prev_end).max(0.0);
            }
        }
    }
    wait
}

#[cfg(test)]
mod tests;
