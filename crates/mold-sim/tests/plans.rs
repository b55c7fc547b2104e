//! One cost model for planner and simulator: every plan `mold plan` wrote to plans/
//! must simulate to its recorded step time and per-device peaks within 2 %, or the
//! difference must be what the simulator models more finely (named per plan), with the
//! planner's own model, replayed as events, back within 2 %.

use mold_machine::Machine;
use mold_plan::Plan;
use std::path::{Path, PathBuf};

const TOL: f64 = 0.02;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn plan_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn shipped_plans_agree_with_their_predictions() {
    let root = root();
    let files = plan_files(&root.join("plans"));
    if files.is_empty() {
        eprintln!("plans/ holds no plans: nothing to compare");
    }
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let plan = Plan::load(f).unwrap_or_else(|e| panic!("{e}"));
        let mpath = root
            .join("sim/machines")
            .join(format!("{}.yaml", plan.machine.name));
        let machine = Machine::load(&mpath).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (model, warning) =
            mold_sim::prepare(&plan, &machine, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(warning.is_none());
        let c =
            mold_sim::compare(&plan, &model, &machine).unwrap_or_else(|e| panic!("{name}: {e}"));
        let max_peak = c
            .peaks
            .iter()
            .map(|p| p.deviation.abs())
            .fold(0.0, f64::max);
        let line = format!(
            "{name}: step {:+.2}%, max peak {:+.2}%",
            100.0 * c.step_deviation,
            100.0 * max_peak
        );
        if c.agrees(TOL) {
            report.push(format!("{line}: within 2%"));
            continue;
        }
        // Beyond 2 %: the refinements must account for it.
        let replay_step = (c.planner_model_step_s - c.recorded_step_s) / c.recorded_step_s;
        let replay_peaks_ok = c.peaks.iter().all(|p| {
            let replay = mold_plan::ByteSize(p.planner_model).ceil_mib().0 as f64;
            ((replay - p.recorded as f64) / p.recorded.max(1) as f64).abs() <= TOL
        });
        let explained = replay_step.abs() <= TOL && replay_peaks_ok;
        let why = c.explain();
        if explained {
            report.push(format!("{line}: beyond 2%, explained: {why}"));
        } else {
            failures.push(format!("{line}: NOT explained: {why}"));
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn plans_and_scenarios_check() {
    let root = root();
    let s = mold_sim::check_paths(
        &[root.join("plans"), root.join("sim/scenarios")],
        &root.join("sim/machines"),
    );
    eprint!("{}", s.lines());
    assert!(s.ok(), "{}", s.lines());
    let scenarios = s
        .results
        .iter()
        .filter(|r| r.path.starts_with(root.join("sim/scenarios")))
        .count();
    assert!(scenarios >= 5, "{}", s.lines());
    // The expectations bite: an overflow expected where everything fits fails.
    let tmp = std::env::temp_dir().join(format!("mold-sim-check-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let f = tmp.join("wrong.yaml");
    std::fs::write(
        &f,
        format!(
            "machine: {}\nplan_file: {}\nexpect: {{overflows: cuda:1}}\n",
            root.join("sim/machines/2x-l40s.yaml").display(),
            root.join("sim/scenarios/plans/flux-dev-one-l40s.yaml")
                .display()
        ),
    )
    .unwrap();
    let s = mold_sim::check_paths(std::slice::from_ref(&f), &root.join("sim/machines"));
    assert!(!s.ok());
    assert!(
        s.results[0].message.contains("expected cuda:1 to overflow"),
        "{}",
        s.lines()
    );
    std::fs::write(&f, "machine: x.yaml\nexpect: fits\nbogus: 1\n").unwrap();
    let s = mold_sim::check_paths(std::slice::from_ref(&f), &root.join("sim/machines"));
    assert!(
        s.results[0].message.contains("unknown field `bogus`"),
        "{}",
        s.lines()
    );
    std::fs::remove_dir_all(&tmp).ok();
}
