use super::common::{load_machine, load_plan, model_of};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The plan to simulate (YAML written by `mold plan`); with --check, plan and
    /// scenario files or directories holding them.
    #[arg(value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// Simulate on this machine profile instead of the one the plan records (e.g.
    /// sim/machines/1x-rtx4090.yaml).
    #[arg(long)]
    pub machine: Option<String>,
    /// Go on, with a warning, when the plan was made for another machine.
    #[arg(long)]
    pub force: bool,
    /// Write an SVG timeline of the request here. A file there is replaced only if it is
    /// a timeline mold wrote and nobody edited since; anything else needs --overwrite.
    #[arg(long, value_name = "SVG")]
    pub timeline: Option<PathBuf>,
    /// Replace the file at --timeline whatever it is (a symlink there is replaced, never
    /// written through). Not --force: that one simulates a plan made for another machine.
    #[arg(long)]
    pub overwrite: bool,
    /// Print the simulation as JSON.
    #[arg(long)]
    pub json: bool,
    /// Check every plan and scenario under PATHS, one line each; exit 1 if any fails.
    #[arg(long)]
    pub check: bool,
    /// Where a plan's recorded machine is found, as DIR/<machine name>.yaml.
    #[arg(long, value_name = "DIR", default_value = "sim/machines")]
    pub machines: PathBuf,
    /// Also simulate a stream of N requests over the plan's replicas (default 100 with
    /// --clients or --arrival-rate): throughput and p50/p95 latency.
    #[arg(long, value_name = "N")]
    pub requests: Option<u32>,
    /// The stream as a closed loop: K clients, each submitting its next request when its
    /// last one finishes.
    #[arg(long, value_name = "K", conflicts_with = "arrival_rate")]
    pub clients: Option<u32>,
    /// The stream as arrivals at R requests a second, evenly spaced.
    #[arg(long, value_name = "R")]
    pub arrival_rate: Option<f64>,
    /// Compare a run report (`mold exec PLAN --report run.json`) with this plan: each
    /// phase's and each device peak's prediction, measurement and deviation, and the
    /// largest deviation; refused when the report is of another plan.
    #[arg(long, value_name = "RUN_JSON", conflicts_with_all = ["check", "timeline", "overwrite", "requests", "clients", "arrival_rate", "machine", "force"])]
    pub compare: Option<PathBuf>,
}

/// `--timeline PATH` as mold-files sees it: replaced only if mold wrote it and nobody
/// edited it since, or with --overwrite.
fn timeline_dest<'a>(a: &'a Args, path: &'a Path) -> mold_files::Dest<'a> {
    mold_files::Dest {
        path,
        flag: "--timeline",
        what: "timeline",
        force_flag: "--overwrite",
        force: a.overwrite,
    }
}

/// The request stream the flags ask for, if any.
fn stream_options(a: &Args) -> Result<Option<mold_sim::StreamOptions>> {
    let arrivals = match (a.clients, a.arrival_rate) {
        (Some(clients), _) => mold_sim::Arrivals::ClosedLoop { clients },
        (None, Some(per_s)) => mold_sim::Arrivals::Rate { per_s },
        (None, None) => match a.requests {
            Some(n) => bail!(
                "--requests {n}: say how requests come: --clients K (a closed loop) or --arrival-rate R (requests a second)"
            ),
            None => return Ok(None),
        },
    };
    let opts = mold_sim::StreamOptions {
        requests: a.requests.unwrap_or(100),
        arrivals,
    };
    opts.check().map_err(anyhow::Error::msg)?;
    Ok(Some(opts))
}

pub fn run(a: Args) -> Result<i32> {
    let stream = stream_options(&a)?;
    if a.check {
        if stream.is_some() {
            bail!("--check runs each plan once: simulate a request stream on one plan, without --check");
        }
        if a.paths.is_empty() {
            bail!("--check: name plan or scenario files or directories, e.g. `mold sim --check plans/ sim/scenarios/`");
        }
        let summary = mold_sim::check_paths(&a.paths, &a.machines);
        print!("{}", summary.lines());
        return Ok(if summary.ok() { 0 } else { 1 });
    }
    let path = match a.paths.as_slice() {
        [p] => p,
        [] => bail!("name a plan: `mold sim plan.yaml` (or `mold sim --check DIR...`)"),
        _ => bail!("name one plan (several paths are for --check)"),
    };
    let plan = load_plan(path)?;
    if let Some(run) = &a.compare {
        return compare(&plan, path, run, a.json);
    }
    // A file at --timeline that mold may not replace is refused before simulating.
    if let Some(t) = &a.timeline {
        timeline_dest(&a, t).check(mold_files::Mine::Stamped(mold_files::Stamp::XmlComment))?;
    }
    let (machine, profile) = match &a.machine {
        Some(m) => (load_machine(m)?, m.clone()),
        None => {
            let p = a.machines.join(format!("{}.yaml", plan.machine.name));
            if !p.exists() {
                bail!(
                    "{}: the plan was made for machine `{}` but {} does not exist: pass --machine PROFILE (or --machines DIR)",
                    path.display(),
                    plan.machine.name,
                    p.display()
                );
            }
            (
                load_machine(&p.display().to_string())?,
                p.display().to_string(),
            )
        }
    };
    let profile_line = format!(
        "machine profile: {profile} ({}{})",
        machine.calibration.source,
        machine
            .calibration
            .date
            .as_deref()
            .map(|d| format!(", {d}"))
            .unwrap_or_default()
    );
    let model = model_of(&plan)?;
    match mold_cost::check_machine(&plan, &machine, a.force) {
        Ok(mold_cost::MachineCheck::Same) => {}
        Ok(mold_cost::MachineCheck::Warn(w)) => eprintln!("warning: {w}"),
        Err(e) => bail!("{}: {e}", path.display()),
    }
    let report = mold_sim::simulate(&plan, &model, &machine)
        .with_context(|| format!("cannot simulate {}", path.display()))?;
    // The recorded prediction holds only on the machine it was made for.
    let comparison =
        if plan.machine.fingerprint == machine.fingerprint() && plan.predicted.step_time_s > 0.0 {
            Some(mold_sim::compare(&plan, &model, &machine)?)
        } else {
            None
        };
    if let Some(t) = &a.timeline {
        timeline_dest(&a, t)
            .write_stamped(mold_files::Stamp::XmlComment, report.svg().as_bytes())?;
    }
    // The stream needs every replica to fit: an overflow is reported below instead.
    let stream = match stream {
        Some(opts) if report.fits() => Some(
            mold_sim::simulate_stream(&plan, &model, &machine, opts).with_context(|| {
                format!("cannot simulate a request stream on {}", path.display())
            })?,
        ),
        _ => None,
    };
    if a.json {
        let json = report.to_json(comparison.as_ref());
        match &stream {
            None => println!("{json}"),
            Some(s) => {
                let mut v: serde_json::Value = serde_json::from_str(&json)?;
                v["stream"] = serde_json::to_value(s)?;
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
        }
    } else {
        println!("{profile_line}");
        print!("{}", report.table());
        if let Some(c) = &comparison {
            print!("{}", c.table());
        }
        if let Some(s) = &stream {
            print!("{}", s.table());
        }
        if let Some(t) = &a.timeline {
            println!("timeline written to {}", t.display());
        }
    }
    if !report.fits() {
        for o in &report.overflows {
            eprintln!("error: {}", o.message);
        }
        return Ok(1);
    }
    Ok(0)
}

/// `mold sim PLAN --compare run.json`: the report checked against the plan, then its
/// table (or JSON); a malformed report or one of another plan is refused in one line.
fn compare(plan: &mold_plan::Plan, plan_path: &Path, run: &Path, json: bool) -> Result<i32> {
    let name = run.display().to_string();
    let text = std::fs::read_to_string(run).with_context(|| {
        format!(
            "--compare {name}: cannot read it (write one with `mold exec PLAN --report {name}`)"
        )
    })?;
    let report = mold_sim::run_report::RunReport::from_json(&text, &name)?;
    mold_sim::run_compare::check_plan(&report, &name, plan, &plan_path.display().to_string())?;
    if json {
        let largest = report.largest_deviation();
        let v = serde_json::json!({
            "report": report,
            "largest_deviation": largest.map(|(what, d)| serde_json::json!({"phase": what, "deviation": d})),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", report.table());
    }
    Ok(0)
}
