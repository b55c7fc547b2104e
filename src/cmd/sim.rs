use super::common::{load_machine, load_plan, model_of};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

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
    /// Write an SVG timeline of the request here.
    #[arg(long, value_name = "SVG")]
    pub timeline: Option<PathBuf>,
    /// Print the simulation as JSON.
    #[arg(long)]
    pub json: bool,
    /// Check every plan and scenario under PATHS, one line each; exit 1 if any fails.
    #[arg(long)]
    pub check: bool,
    /// Where a plan's recorded machine is found, as DIR/<machine name>.yaml.
    #[arg(long, value_name = "DIR", default_value = "sim/machines")]
    pub machines: PathBuf,
}

pub fn run(a: Args) -> Result<i32> {
    if a.check {
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
        std::fs::write(t, report.svg()).with_context(|| format!("--timeline {}", t.display()))?;
    }
    if a.json {
        println!("{}", report.to_json(comparison.as_ref()));
    } else {
        println!("{profile_line}");
        print!("{}", report.table());
        if let Some(c) = &comparison {
            print!("{}", c.table());
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
