//! `mold plan --tune`: each placement worth measuring ([`mold_planner::tune::candidates`])
//! run for a few steps by `mold exec` in a child process of its own, one after another,
//! `rounds` times, and the measured fastest kept ([`mold_planner::tune::choose`]). The children are this
//! binary: what they run is exactly what `mold exec` of the written plan runs.

use anyhow::{bail, Context, Result};
use mold_planner::tune::{self, Candidate, Measured, TuneOptions, TuneRow};
use mold_planner::{Outcome, Request};
use mold_sim::run_report::RunReport;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What tuning needs from the command line.
pub struct TuneArgs<'a> {
    /// The weights each candidate runs.
    pub weights: &'a Path,
    /// The machine as `mold plan` resolved it (`local` or a profile's path): the children
    /// run on the same.
    pub machine: &'a str,
    /// Steps each candidate runs; the median of steps 2..N is its step.
    pub steps: u32,
    /// Runs of each candidate, each a fresh process, rounds in alternating order; the
    /// smallest median is its step.
    pub rounds: u32,
    pub options: TuneOptions,
    /// How long one candidate may take, load included.
    pub limit: Duration,
}

/// The tuned outcome (the measured fastest candidate's) and the record of every
/// candidate; the planner's outcome untouched and no record where only one placement is
/// worth measuring.
pub fn run(req: &Request, pick: Outcome, a: &TuneArgs) -> Result<(Outcome, Option<Vec<TuneRow>>)> {
    // The summary's table of strategy families stays the planner's own search, not the
    // search of the layout the kept candidate was planned with.
    let families = pick.families.clone();
    let cands = tune::candidates(req, pick, &a.options);
    if cands.len() < 2 {
        eprintln!(
            "tune: one placement is worth measuring ({}): nothing to compare, the plan is the planner's",
            cands[0].label
        );
        let only = cands.into_iter().next().expect("the pick is a candidate");
        return Ok((only.outcome, None));
    }
    let dir = work_dir()?;
    let rounds = a.rounds.max(1);
    eprintln!(
        "tune: measuring {} placements, {} steps each, {rounds} round{} (each run a `mold exec` of its own, its load included; logs in {}):",
        cands.len(),
        a.steps,
        if rounds == 1 { "" } else { "s, every other in reverse order" },
        dir.display()
    );
    let exe = std::env::current_exe().context("tune: the mold binary's path")?;
    let mut runs: Vec<Vec<Measured>> = vec![Vec::new(); cands.len()];
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..cands.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let c = &cands[i];
            // A placement that failed once is not run again.
            if runs[i].iter().any(|r| r.is_err()) {
                continue;
            }
            let t = Instant::now();
            let m = measure(&exe, &dir, i, round, c, a);
            match &m {
                Ok(s) => eprintln!(
                    "  {}: {:.1} ms a step (priced {:.1} ms) [{:.0} s]",
                    c.label,
                    s * 1e3,
                    c.predicted_step_s() * 1e3,
                    t.elapsed().as_secs_f64()
                ),
                Err(e) => eprintln!("  {}: failed: {e}", c.label),
            }
            runs[i].push(m);
        }
    }
    let measured: Vec<Measured> = runs.iter().map(|r| tune::combine(r)).collect();
    let Some(chosen) = tune::choose(&cands, &measured) else {
        bail!(
            "--tune: no placement ran ({}: {}); the logs are in {}; plan without --tune to keep the priced pick",
            cands[0].label,
            measured[0].as_ref().err().map_or("", |e| e.as_str()),
            dir.display()
        );
    };
    let rows = tune::rows(&cands, &runs, Some(chosen));
    // The logs are kept where anything failed, for the user to read.
    if runs.iter().flatten().all(|m| m.is_ok()) {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let mut kept = cands
        .into_iter()
        .nth(chosen)
        .expect("chosen is a candidate")
        .outcome;
    kept.families = families;
    Ok((kept, Some(rows)))
}

/// The lines added to the plan file under the plan: the record as YAML comments.
pub fn plan_comment(rows: &[TuneRow], steps: u32, rounds: u32) -> String {
    format!(
        "# mold plan --tune: each placement run {rounds}× by `mold exec` for {steps} steps on this box (a run's step: the median of steps 2..{steps}; measured: the smallest; request: that step, the rest as priced)\n{}",
        tune::table(rows, "# ")
    )
}

/// A fresh directory for the candidates' plans, reports and logs.
fn work_dir() -> Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("mold-tune-{}-{stamp}", std::process::id()));
    // A new directory, never one already there (nobody else's files written through).
    std::fs::create_dir(&dir).with_context(|| format!("tune: cannot create {}", dir.display()))?;
    Ok(dir)
}

/// Runs candidate `i` once (`round`) and reads its step from the run report.
fn measure(exe: &Path, dir: &Path, i: usize, round: u32, c: &Candidate, a: &TuneArgs) -> Measured {
    let plan = dir.join(format!("candidate-{i}.yaml"));
    let report = dir.join(format!("candidate-{i}-run-{round}.json"));
    let log = dir.join(format!("candidate-{i}-run-{round}.log"));
    std::fs::write(&plan, c.plan().to_yaml()).map_err(|e| format!("writing its plan: {e}"))?;
    let out = std::fs::File::create(&log).map_err(|e| format!("creating its log: {e}"))?;
    let err = out.try_clone().map_err(|e| format!("its log: {e}"))?;
    let child = Command::new(exe)
        .arg("exec")
        .arg(&plan)
        .arg("--weights")
        .arg(a.weights)
        .args(["--steps", &a.steps.to_string(), "--seed", "1", "--machine"])
        .arg(a.machine)
        .arg("--report")
        .arg(&report)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("starting `mold exec`: {e}"))?;
    // Killed and reaped on every way out but its own end: a child left running would hold
    // the GPUs.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            if let Ok(None) = self.0.try_wait() {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
    }
    let mut child = Reap(child);
    let t = Instant::now();
    let status = loop {
        match child.0.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if t.elapsed() > a.limit => {
                return Err(format!(
                    "stopped after {} s (the limit of one run, --tune-timeout)",
                    a.limit.as_secs_f64()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for `mold exec`: {e}")),
        }
    };
    if !status.success() {
        return Err(match last_line(&log) {
            Some(l) => format!("`mold exec` ended with {status}: {l}"),
            None => format!("`mold exec` ended with {status}"),
        });
    }
    let text = std::fs::read_to_string(&report).map_err(|e| format!("its report: {e}"))?;
    let r: RunReport = serde_json::from_str(&text).map_err(|e| format!("its report: {e}"))?;
    r.step()
        .and_then(|s| s.measured_s)
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| "its report has no measured step".to_string())
}

/// The log's last non-empty line, shortened: what a failed child said last.
fn last_line(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?.trim();
    Some(line.chars().take(200).collect())
}
