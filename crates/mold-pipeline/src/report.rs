//! The measured side of the run report (`mold exec --report`): a [`Recorder`] sees a
//! run's progress (encoders, steps, decode), its executor's phase profile
//! (`MOLD_PROFILE`) and its device memory ([`mold_exec::memory_probe`]), and
//! [`Recorder::finish`] sets it beside the simulator's prediction of the same plan in a
//! [`RunReport`] (the schema: [`mold_sim::run_report`]).

use crate::error::{PipelineError, Result};
use crate::{DevicePeak, Progress, Timings};
use mold_exec::memory_probe::{allocator_probe, MemoryProbe};
use mold_exec::PhaseTime;
use mold_plan::{DeviceId, Plan};
use mold_sim::run_report::{
    phase_rows, plan_fingerprint, MeasuredPeak, Measurements, MemoryRow, MemorySample,
    MemorySource, PartMeasured, PlanId, RunInfo, RunKind, RunReport, RUN_REPORT_VERSION,
};
use mold_sim::SimReport;
use std::collections::BTreeMap;

/// A profile label without the micro-batch prefix `mbJ ` that
/// `Executor::forward_micro_batches` puts on its phases (pipelined CFG): both passes'
/// phases count as the step's.
fn without_micro_batch(label: &str) -> &str {
    if let Some((digits, rest)) = label.strip_prefix("mb").and_then(|r| r.split_once(' ')) {
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            return rest;
        }
    }
    label
}

/// Profile labels that are a part's collectives (`mold-exec`'s `Ctx::mark` labels).
fn is_collective(label: &str) -> bool {
    label.starts_with("all-reduce")
        || label.starts_with("all-to-all")
        || label.starts_with("all-gather")
}

/// The profile label of compute waiting for a streamed block (`executor/rank.rs`).
const STREAM_WAIT: &str = "weight fetch (streamed)";

/// Profile labels outside the blocks: the simulator prices blocks per part.
fn outside_blocks(label: &str) -> bool {
    matches!(label, "stem" | "final layer")
}

/// What a run measured, gathered as it goes.
pub struct Recorder {
    kind: RunKind,
    encoders: Vec<(String, f64)>,
    steps: Vec<f64>,
    decode_s: Option<f64>,
    parts: BTreeMap<usize, PartMeasured>,
    stream_wait: Vec<(DeviceId, f64)>,
    profiled: bool,
    probe: Option<MemoryProbe>,
    /// Seconds loading weights, summed over what loaded.
    load_s: Option<f64>,
}

/// What [`Recorder::finish`] needs besides the measurements.
pub struct ReportInputs<'a> {
    /// The plan as loaded from its file (what the fingerprint is of).
    pub plan: &'a Plan,
    /// The plan as run (the run's steps and size in its workload).
    pub run_plan: &'a Plan,
    /// The simulation of `run_plan`: every prediction comes from it.
    pub sim: &'a SimReport,
    /// The machine profile the simulation ran on, for `predicted_by`.
    pub machine_profile: &'a str,
    /// A text-to-image run's timings (`None`: the transformer alone).
    pub timings: Option<&'a Timings>,
    /// The predicted peak per device (the plan's, or the simulation's for another size).
    pub predicted_peaks: Vec<(DeviceId, u64)>,
    /// The accounted peak per device (from tensor shapes).
    pub accounted_peaks: Vec<DevicePeak>,
}

impl Recorder {
    /// `probe`, when given, was made before anything loaded: its baseline is the run's start.
    pub fn new(kind: RunKind, probe: Option<MemoryProbe>) -> Recorder {
        Recorder {
            kind,
            encoders: Vec::new(),
            steps: Vec::new(),
            decode_s: None,
            load_s: None,
            parts: BTreeMap::new(),
            stream_wait: Vec::new(),
            profiled: false,
            probe,
        }
    }

    /// Samples device memory at the end of `phase`.
    pub fn sample(&mut self, phase: &str) {
        if let Some(p) = &mut self.probe {
            p.sample(phase);
        }
    }

    /// A pipeline event: encoder, step and decode times; a memory sample at each
    /// boundary (a component loaded, encoded, released; a step; the decode).
    pub fn progress(&mut self, p: &Progress) {
        let phase = match p {
            Progress::Loaded {
                component, seconds, ..
            } => {
                *self.load_s.get_or_insert(0.0) += seconds;
                format!("loaded {component}")
            }
            Progress::Encoded {
                component, seconds, ..
            } => {
                self.encoders.push((component.clone(), *seconds));
                format!("encoded {component}")
            }
            Progress::Released { component } => format!("released {component}"),
            Progress::Step { index, seconds, .. } => {
                self.steps.push(*seconds);
                format!("step {index}")
            }
            Progress::Decoded { seconds, .. } => {
                self.decode_s = Some(*seconds);
                "decoded".to_string()
            }
            Progress::Loading { .. } | Progress::Note(_) => return,
        };
        self.sample(&phase);
    }

    /// The transformer's load in a transformer-only run.
    pub fn loaded(&mut self, seconds: f64) {
        *self.load_s.get_or_insert(0.0) += seconds;
        self.sample("loaded transformer");
    }

    /// A step of a transformer-only run (1-based `index`).
    pub fn step(&mut self, index: usize, seconds: f64) {
        self.steps.push(seconds);
        self.sample(&format!("step {index}"));
    }

    /// The executor's phase profile (`MOLD_PROFILE`), over `steps` steps: each part's
    /// blocks and collectives (its slowest rank) and each device's wait for streamed
    /// weights, per step. `profile` lists ranks part by part in the plan's order, as
    /// [`mold_exec::Executor::profile_report`] gives them.
    pub fn profile(&mut self, plan: &Plan, profile: &[(DeviceId, Vec<PhaseTime>)], steps: f64) {
        if profile.is_empty() || steps <= 0.0 {
            return;
        }
        self.profiled = true;
        let ranks: Vec<(usize, DeviceId)> = plan
            .transformer()
            .map(|t| {
                t.parts
                    .iter()
                    .enumerate()
                    .flat_map(|(pi, p)| p.devices.iter().map(move |d| (pi, d.clone())))
                    .collect()
            })
            .unwrap_or_default();
        // Ranks without marks are left out of the profile: match in order.
        let mut next = 0;
        let mut wait: BTreeMap<DeviceId, f64> = BTreeMap::new();
        for (dev, phases) in profile {
            let Some(k) = ranks[next..].iter().position(|(_, d)| d == dev) else {
                continue;
            };
            let pi = ranks[next + k].0;
            next += k + 1;
            let (mut compute, mut collective) = (0.0, 0.0);
            for (label, secs, _) in phases {
                let label = without_micro_batch(label);
                if is_collective(label) {
                    collective += secs;
                } else if label == STREAM_WAIT {
                    *wait.entry(dev.clone()).or_default() += secs / steps;
                } else if !outside_blocks(label) {
                    compute += secs;
                }
            }
            let m = self.parts.entry(pi).or_default();
            m.compute_s = m.compute_s.max(compute / steps);
            m.collective_s = m.collective_s.max(collective / steps);
        }
        self.stream_wait = wait.into_iter().collect();
    }

    /// The report, and the first failure to read a device's memory (for a warning).
    pub fn finish(self, i: ReportInputs) -> (RunReport, Option<String>) {
        let t = i.timings;
        let m = Measurements {
            encoders: self.encoders.clone(),
            encode_s: t.map(|t| t.encode_s),
            step_s: median_step(&self.steps),
            denoise_s: match t {
                Some(t) => Some(t.denoise_s),
                None => (!self.steps.is_empty()).then(|| self.steps.iter().sum()),
            },
            decode_s: self.decode_s,
            request_s: t.map(|t| (t.total_s - t.load_s).max(0.0)),
            load_s: t.map(|t| t.load_s).or(self.load_s),
            parts: self.parts.clone(),
            stream_wait: self.stream_wait.clone(),
            profiled: self.profiled,
        };
        let mut phases = phase_rows(i.run_plan, i.sim, self.kind, &m);
        // An encoder's measurement may come in several passes (Qwen-Image's negative
        // prompt: `qwen2.5-vl (negative)`): each counts toward its encoder.
        for r in &mut phases {
            if let Some(name) = r.phase.strip_prefix("encode: ") {
                let own = format!("{name} (");
                let passes: Vec<f64> = self
                    .encoders
                    .iter()
                    .filter(|(n, _)| n == name || n.starts_with(&own))
                    .map(|(_, s)| *s)
                    .collect();
                if !passes.is_empty() {
                    r.measured_s = Some(passes.iter().sum());
                }
            }
        }
        let (probed, error) = match self.probe {
            Some(p) => p.finish(),
            None => (Vec::new(), None),
        };
        let mut devices: Vec<DeviceId> = Vec::new();
        let mut add = |d: &DeviceId| {
            if !devices.contains(d) {
                devices.push(d.clone());
            }
        };
        // Devices the plan leaves unused (predicted 0) are left out unless measured.
        i.predicted_peaks
            .iter()
            .filter(|(_, b)| *b > 0)
            .for_each(|(d, _)| add(d));
        i.accounted_peaks.iter().for_each(|p| add(&p.device));
        probed.iter().for_each(|p| add(&p.device));
        let memory = devices
            .into_iter()
            .map(|d| {
                let accounted = i
                    .accounted_peaks
                    .iter()
                    .find(|p| p.device == d)
                    .map(|p| p.peak_bytes);
                let measured = match probed.iter().find(|p| p.device == d) {
                    Some(p) => Some(MeasuredPeak {
                        source: MemorySource::Allocator,
                        peak_bytes: p.peak_bytes,
                        pool_high_bytes: p.pool_high_bytes,
                        outside_pool_bytes: p.outside_pool_bytes,
                        samples: p
                            .samples
                            .iter()
                            .map(|(phase, bytes)| MemorySample {
                                phase: phase.clone(),
                                bytes: *bytes,
                            })
                            .collect(),
                    }),
                    None => accounted.map(|b| MeasuredPeak {
                        source: MemorySource::Accounted,
                        peak_bytes: b,
                        pool_high_bytes: None,
                        outside_pool_bytes: None,
                        samples: Vec::new(),
                    }),
                };
                MemoryRow {
                    predicted_peak_bytes: i
                        .predicted_peaks
                        .iter()
                        .find(|(x, _)| x == &d)
                        .map(|(_, b)| *b),
                    device: d,
                    accounted_peak_bytes: accounted,
                    measured,
                }
            })
            .collect();
        let w = &i.run_plan.workload;
        let report = RunReport {
            version: RUN_REPORT_VERSION,
            plan: PlanId {
                fingerprint: plan_fingerprint(i.plan),
                model: i.plan.model.id.clone(),
                machine: i.plan.machine.name.clone(),
            },
            run: RunInfo {
                kind: self.kind,
                steps: w.steps,
                width: w.width,
                height: w.height,
                profiled: self.profiled,
                predicted_by: format!("mold sim on {}", i.machine_profile),
            },
            phases,
            memory,
        };
        (report, error)
    }
}

/// The median step, the first (warm-up: kernel loading, allocator) left out when there
/// are others.
pub fn median_step(times: &[f64]) -> Option<f64> {
    let rest = if times.len() > 1 { &times[1..] } else { times };
    let mut v = rest.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// A probe of the allocator on every GPU the plan uses (`cuda:N` opened as ordinal N:
/// one process), made now so that its baseline is the run's start; `None` without GPUs.
pub fn probe(plan: &Plan) -> Result<Option<MemoryProbe>> {
    allocator_probe(&probed_devices(plan)).map_err(|e| PipelineError::Report {
        what: "the allocator's memory in use",
        source: Box::new(e),
    })
}

/// The GPUs `plan` uses, every replica's (CFG-parallel runs its second pass on the
/// second replica's devices), each once, with its ordinal.
fn probed_devices(plan: &Plan) -> Vec<(DeviceId, usize)> {
    let replicas = plan.replica_plans().unwrap_or_else(|_| vec![plan.clone()]);
    let mut devices: Vec<(DeviceId, usize)> = Vec::new();
    for d in replicas
        .iter()
        .flat_map(|r| r.components.iter())
        .flat_map(|c| c.parts.iter().flat_map(|p| p.devices.iter()))
    {
        if let DeviceId::Cuda(n) = d {
            if !devices.iter().any(|(x, _)| x == d) {
                devices.push((d.clone(), *n as usize));
            }
        }
    }
    devices
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        Plan::load(&root.join("plans/flux-tiny@cpu-emu-4.yaml")).unwrap()
    }

    #[test]
    fn the_median_step_leaves_out_the_warm_up() {
        assert_eq!(median_step(&[9.0, 0.3, 0.1, 0.2]), Some(0.2));
        assert_eq!(median_step(&[0.5]), Some(0.5));
        assert_eq!(median_step(&[]), None);
    }

    #[test]
    fn the_profile_goes_to_each_part_per_step() {
        let plan = plan();
        let tc = plan.transformer().unwrap();
        let ranks: Vec<(usize, DeviceId)> = tc
            .parts
            .iter()
            .enumerate()
            .flat_map(|(pi, p)| p.devices.iter().map(move |d| (pi, d.clone())))
            .collect();
        // Each rank: 2 s of attention, 1 s of all-reduce, 0.5 s of stem, over 2 steps;
        // the last rank is slower.
        let profile: Vec<(DeviceId, Vec<PhaseTime>)> = ranks
            .iter()
            .enumerate()
            .map(|(i, (_, d))| {
                let extra = if i + 1 == ranks.len() { 2.0 } else { 0.0 };
                (
                    d.clone(),
                    vec![
                        ("attention", 2.0 + extra, 10),
                        ("all-reduce", 1.0, 10),
                        ("stem", 0.5, 1),
                        ("weight fetch (streamed)", 0.25, 4),
                    ],
                )
            })
            .collect();
        let mut r = Recorder::new(RunKind::Transformer, None);
        r.profile(&plan, &profile, 2.0);
        assert!(r.profiled);
        let last = ranks.last().unwrap().0;
        for (pi, _) in &ranks {
            let m = r.parts[pi];
            let want = if *pi == last { 2.0 } else { 1.0 };
            assert_eq!(m.compute_s, want, "part {pi}");
            assert_eq!(m.collective_s, 0.5);
        }
        assert!(r.stream_wait.iter().all(|(_, s)| *s >= 0.125));
    }

    #[test]
    fn a_transformer_only_report_measures_steps_and_accounts_memory() {
        let plan = plan();
        let machine = mold_machine::Machine::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../sim/machines/cpu-emu-4.yaml"),
        )
        .unwrap();
        let model = mold_models::find(&plan.model.id).unwrap();
        let sim = mold_sim::simulate(&plan, &model, &machine).unwrap();
        let mut r = Recorder::new(RunKind::Transformer, None);
        for (i, s) in [0.9, 0.2, 0.4, 0.3].iter().enumerate() {
            r.step(i + 1, *s);
        }
        let dev = plan.transformer().unwrap().parts[0].devices[0].clone();
        let (rep, err) = r.finish(ReportInputs {
            plan: &plan,
            run_plan: &plan,
            sim: &sim,
            machine_profile: "cpu-emu-4.yaml",
            timings: None,
            predicted_peaks: vec![(dev.clone(), 1000)],
            accounted_peaks: vec![DevicePeak {
                device: dev.clone(),
                peak_bytes: 1100,
            }],
        });
        assert!(err.is_none());
        let step = rep.step().unwrap();
        assert_eq!(step.measured_s, Some(0.3));
        assert_eq!(step.predicted_s, Some(sim.step_s));
        let denoise = rep.phases.iter().find(|p| p.phase == "denoise").unwrap();
        assert!((denoise.measured_s.unwrap() - 1.8).abs() < 1e-12);
        let m = &rep.memory[0];
        assert_eq!(m.device, dev);
        let measured = m.measured.as_ref().unwrap();
        assert_eq!(measured.source, MemorySource::Accounted);
        assert_eq!(measured.peak_bytes, 1100);
        assert!((m.deviation().unwrap() - 0.1).abs() < 1e-12);
        assert_eq!(rep.plan.fingerprint, plan_fingerprint(&plan));
    }

    #[test]
    fn every_replica_s_gpus_are_probed() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let plan = Plan::load(&root.join("plans/qwen-image@2x-h200.yaml")).unwrap();
        assert!(plan.replicas.is_some());
        let ids: Vec<DeviceId> = probed_devices(&plan).into_iter().map(|(d, _)| d).collect();
        assert_eq!(ids, [DeviceId::Cuda(0), DeviceId::Cuda(1)]);
        let one = Plan::load(&root.join("plans/flux-dev@1x-rtx4090.yaml")).unwrap();
        assert_eq!(probed_devices(&one), [(DeviceId::Cuda(0), 0)]);
    }
}

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn micro_batch_phases_are_classified_as_their_own_labels() {
        for (label, want) in [
            ("mb0 all-reduce", "all-reduce"),
            ("mb1 weight fetch (streamed)", STREAM_WAIT),
            ("mb12 stem", "stem"),
            ("all-to-all q/k/v", "all-to-all q/k/v"),
            ("mbx stem", "mbx stem"),
            ("mb stem", "mb stem"),
        ] {
            assert_eq!(without_micro_batch(label), want, "{label}");
        }
        assert!(is_collective(without_micro_batch("mb0 all-reduce")));
        assert!(outside_blocks(without_micro_batch("mb1 final layer")));
    }
}
