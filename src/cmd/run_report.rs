//! `mold exec --report FILE`: what the CLI does around [`mold_pipeline::report`] — the
//! file checked before anything loads, the allocator probe over the plan's GPUs, the
//! simulation of the plan as run, and the file and its one-line summary at the end.

use super::progress::Reporter;
use anyhow::{bail, Context, Result};
use mold_exec::memory_probe::{allocator_probe, MemoryProbe};
use mold_plan::{DeviceId, Plan};
use mold_sim::run_report::RunReport;
use serde_json::json;
use std::path::Path;

/// Refuses a `--report` path whose directory does not exist (before any weight loads).
pub fn check_path(path: &Path) -> Result<()> {
    if path.is_dir() {
        bail!(
            "--report {}: a directory; name the JSON file to write, e.g. {}",
            path.display(),
            path.join("run.json").display()
        );
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(d) = dir {
        if !d.is_dir() {
            bail!(
                "--report {}: no directory {}; create it or write the report elsewhere",
                path.display(),
                d.display()
            );
        }
    }
    Ok(())
}

/// A probe of the allocator on every GPU the plan uses (`cuda:N` opened as ordinal N:
/// one process), made now so that its baseline is the run's start; `None` without GPUs.
pub fn probe(plan: &Plan) -> Result<Option<MemoryProbe>> {
    allocator_probe(&probed_devices(plan)).context("--report: the allocator's memory in use")
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

/// The simulation of `plan` with `steps` steps: the transformer benchmark's prediction.
pub fn simulate_steps(
    plan: &Plan,
    model: &mold_models::ModelSpec,
    machine: &mold_machine::Machine,
    steps: u32,
) -> Result<(Plan, mold_sim::SimReport)> {
    let mut run_plan = plan.clone();
    run_plan.workload.steps = steps;
    let sim = mold_sim::simulate(&run_plan, model, machine)
        .context("--report: the simulation of the plan as run")?;
    Ok((run_plan, sim))
}

/// Writes the report and prints its one-line summary (a `report` event with `--json`);
/// `probe_error` (a device whose memory could not be read) is a warning.
pub fn write(
    rep: &Reporter,
    path: &Path,
    report: &RunReport,
    probe_error: Option<String>,
) -> Result<()> {
    if let Some(e) = probe_error {
        eprintln!("warning: --report: the allocator could not be read: {e}; its samples leave that moment out");
    }
    std::fs::write(path, report.to_json())
        .with_context(|| format!("--report {}: cannot write it", path.display()))?;
    let step = report.step();
    let largest = report.largest_deviation();
    rep.result(
        format_args!("report: {}; wrote {}", report.summary(), path.display()),
        json!({
            "event": "report",
            "path": path.display().to_string(),
            "step_measured_s": step.and_then(|s| s.measured_s),
            "step_predicted_s": step.and_then(|s| s.predicted_s),
            "largest_deviation": largest.map(|(what, d)| json!({"phase": what, "deviation": d})),
        }),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_replica_s_gpus_are_probed() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let plan = Plan::load(&root.join("plans/qwen-image@2x-h200.yaml")).unwrap();
        assert!(plan.replicas.is_some());
        let ids: Vec<DeviceId> = probed_devices(&plan).into_iter().map(|(d, _)| d).collect();
        assert_eq!(ids, [DeviceId::Cuda(0), DeviceId::Cuda(1)]);
        let one = Plan::load(&root.join("plans/flux-dev@1x-rtx4090.yaml")).unwrap();
        assert_eq!(probed_devices(&one), [(DeviceId::Cuda(0), 0)]);
    }
}
