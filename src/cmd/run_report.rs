//! `mold exec --report FILE`: what the CLI does around [`mold_pipeline::report`] — the
//! file checked before anything loads, the simulation of the plan as run, and the file
//! and its one-line summary at the end (the allocator probe over the plan's GPUs is
//! [`mold_pipeline::report::probe`]).

use super::progress::Reporter;
use anyhow::{bail, Context, Result};
use mold_plan::Plan;
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

/// `--report PATH` as mold-files sees it: an existing file is replaced only if it reads
/// as a run report ([`is_report`]) or with --overwrite. A run report's JSON has no room
/// for a stamp (its schema refuses unknown fields), so mold knows its own by reading it.
pub fn dest(path: &Path, overwrite: bool) -> mold_files::Dest<'_> {
    mold_files::Dest {
        path,
        flag: "--report",
        what: "run report",
        force_flag: "--overwrite",
        force: overwrite,
    }
}

/// Whether `bytes` read as a run report of any schema version: a JSON object with the
/// report's top-level fields, `version` a number (another version's report is mold's
/// too).
pub fn is_report(bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(bytes).is_ok_and(|v| {
        v.get("version").is_some_and(|x| x.is_u64())
            && ["plan", "run", "phases", "memory"]
                .iter()
                .all(|k| v.get(k).is_some())
    })
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
    overwrite: bool,
    report: &RunReport,
    probe_error: Option<String>,
) -> Result<()> {
    if let Some(e) = probe_error {
        eprintln!("warning: --report: the allocator could not be read: {e}; its samples leave that moment out");
    }
    // Replaced only if it reads as a run report (or with --overwrite), atomically: never
    // through a symlink, never half a file.
    dest(path, overwrite)
        .write(
            mold_files::Mine::Recognised(&is_report),
            report.to_json().as_bytes(),
        )
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
