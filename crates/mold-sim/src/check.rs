//! `mold sim --check`: every plan and scenario under some paths, one line each.
//!
//! A plan (YAML with `version:` at the top) must fit the machine it records, found as
//! `<machines_dir>/<machine.name>.yaml`. A scenario (YAML with `expect:` at the top)
//! holds a plan — inline under `plan:` or as `plan_file:` relative to the repository
//! root — a `machine:` profile path (also relative to the root), optional `force: true`,
//! and what must happen: `fits`, `{overflows: cuda:1}`, `{overflows: host}` or
//! `{error: "text the error contains"}` (loading the machine profile included).

use crate::text::secs;
use crate::{compare, prepare, simulate, SimError};
use mold_cost::Evaluation;
use mold_machine::Machine;
use mold_plan::{Plan, SolverRecord};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// What a scenario must come to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Expect {
    /// Every device and the host within budget.
    Fits,
    /// This device (`cuda:1`) or `host` goes over its budget.
    Overflows(String),
    /// Loading, validating or simulating fails with an error containing this text.
    Error(String),
}

const EXPECT_FORMS: &str =
    "write `expect: fits`, `expect: {overflows: cuda:1}`, `expect: {overflows: host}` or `expect: {error: \"text\"}`";

impl<'de> Deserialize<'de> for Expect {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        use serde_yaml_ng::Value;
        let v = Value::deserialize(d)?;
        match &v {
            Value::String(s) if s == "fits" => Ok(Expect::Fits),
            Value::Mapping(m) if m.len() == 1 => {
                let (k, val) = m.iter().next().expect("one entry");
                let text = match val {
                    Value::String(s) => s.clone(),
                    _ => {
                        return Err(D::Error::custom(format!(
                            "the value must be a string: {EXPECT_FORMS}"
                        )))
                    }
                };
                match k.as_str() {
                    Some("overflows") => Ok(Expect::Overflows(text)),
                    Some("error") => Ok(Expect::Error(text)),
                    _ => Err(D::Error::custom(format!(
                        "unknown expectation {k:?}: {EXPECT_FORMS}"
                    ))),
                }
            }
            _ => Err(D::Error::custom(format!(
                "unknown expectation: {EXPECT_FORMS}"
            ))),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Scenario {
    /// For the reader of the file; mold does not print it.
    #[serde(default)]
    #[allow(dead_code)]
    pub description: String,
    /// The plan inline: the plan schema; `version`, `machine`, `predicted` and `solver`
    /// may be left out (filled from the scenario's machine, predictions zero).
    #[serde(default)]
    pub plan: Option<serde_yaml_ng::Value>,
    /// Or a plan file, relative to the repository root.
    #[serde(default)]
    pub plan_file: Option<String>,
    /// Machine profile, relative to the repository root.
    pub machine: String,
    /// Go on when the plan was made for another machine.
    #[serde(default)]
    pub force: bool,
    pub expect: Expect,
}

/// One file's verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckResult {
    pub path: PathBuf,
    pub ok: bool,
    pub message: String,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckSummary {
    pub results: Vec<CheckResult>,
}

impl CheckSummary {
    pub fn ok(&self) -> bool {
        self.results.iter().all(|r| r.ok)
    }
    fn failures(&self) -> Vec<&CheckResult> {
        self.results.iter().filter(|r| !r.ok).collect()
    }
    /// One line per file, then a count.
    pub fn lines(&self) -> String {
        let mut o = String::new();
        for r in &self.results {
            o.push_str(&format!(
                "{} {}: {}\n",
                if r.ok { "ok  " } else { "FAIL" },
                r.path.display(),
                r.message
            ));
        }
        let bad = self.failures().len();
        o.push_str(&format!(
            "{} checked, {} ok, {} failed\n",
            self.results.len(),
            self.results.len() - bad,
            bad
        ));
        o
    }
}

enum Kind {
    Plan,
    Scenario,
    Other,
}

fn kind_of(text: &str) -> Kind {
    let Ok(v) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) else {
        return Kind::Other;
    };
    match v.as_mapping() {
        Some(m) if m.contains_key("version") => Kind::Plan,
        Some(m) if m.contains_key("expect") => Kind::Scenario,
        _ => Kind::Other,
    }
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            yaml_files(&p, out)?;
        } else if matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("yaml") | Some("yml")
        ) {
            out.push(p);
        }
    }
    Ok(())
}

/// Checks every plan and scenario under `paths` (files, or directories walked
/// recursively; YAML that is neither, such as machine profiles, is passed over).
pub fn check_paths(paths: &[PathBuf], machines_dir: &Path) -> CheckSummary {
    let mut summary = CheckSummary::default();
    for p in paths {
        let mut files = Vec::new();
        let explicit = !p.is_dir();
        if explicit {
            files.push(p.clone());
        } else if let Err(e) = yaml_files(p, &mut files) {
            summary.results.push(CheckResult {
                path: p.clone(),
                ok: false,
                message: format!("cannot read the directory: {e}"),
            });
            continue;
        }
        for f in files {
            let text = match std::fs::read_to_string(&f) {
                Ok(t) => t,
                Err(e) => {
                    summary.results.push(CheckResult {
                        path: f.clone(),
                        ok: false,
                        message: format!("cannot read: {e}"),
                    });
                    continue;
                }
            };
            let outcome = match kind_of(&text) {
                Kind::Plan => check_plan(&f, machines_dir),
                Kind::Scenario => check_scenario(&f, &text),
                Kind::Other if explicit => Err(
                    "neither a plan (`version:` at the top) nor a scenario (`expect:` at the top)"
                        .into(),
                ),
                Kind::Other => continue,
            };
            summary.results.push(match outcome {
                Ok(m) => CheckResult {
                    path: f,
                    ok: true,
                    message: m,
                },
                Err(m) => CheckResult {
                    path: f,
                    ok: false,
                    message: m,
                },
            });
        }
    }
    summary
}

/// A plan must fit the machine it was made for.
fn check_plan(path: &Path, machines_dir: &Path) -> Result<String, String> {
    let plan = Plan::load(path).map_err(|e| e.to_string())?;
    let mpath = machines_dir.join(format!("{}.yaml", plan.machine.name));
    let machine = Machine::load(&mpath).map_err(|e| {
        format!(
            "machine `{}`: {e} (pass --machines DIR where its profile is)",
            plan.machine.name
        )
    })?;
    let (model, _) = prepare(&plan, &machine, false).map_err(|e| e.to_string())?;
    let r = simulate(&plan, &model, &machine).map_err(|e| e.to_string())?;
    if !r.fits() {
        return Err(overflow_text(&r));
    }
    let mut msg = format!(
        "fits {}: step {}, request {}",
        machine.name,
        secs(r.step_s),
        secs(r.request_s)
    );
    if plan.predicted.step_time_s > 0.0 {
        if let Ok(c) = compare(&plan, &model, &machine) {
            msg.push_str(&format!(
                " (plan {}, {:+.2}%)",
                secs(c.recorded_step_s),
                100.0 * c.step_deviation
            ));
        }
    }
    Ok(msg)
}

fn overflow_text(r: &crate::SimReport) -> String {
    r.overflows
        .iter()
        .map(|o| o.message.clone())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The repository root a scenario's paths are relative to: the nearest ancestor with
/// `sim/machines`, else the current directory.
fn root_of(path: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    for a in abs.ancestors().skip(1) {
        if a.join("sim").join("machines").is_dir() {
            return a.to_path_buf();
        }
    }
    PathBuf::from(".")
}

/// Fills what an inline scenario plan may leave out.
fn inline_plan(value: &serde_yaml_ng::Value, machine: &Machine) -> Result<Plan, SimError> {
    use serde_yaml_ng::Value;
    let mut v = value.clone();
    let m = v
        .as_mapping_mut()
        .ok_or_else(|| SimError::Load("plan: must be a mapping (the plan schema)".into()))?;
    let to_value = |x: serde_yaml_ng::Result<Value>| x.expect("serializes");
    if !m.contains_key("version") {
        m.insert("version".into(), Value::from(mold_plan::PLAN_VERSION));
    }
    if !m.contains_key("machine") {
        m.insert(
            "machine".into(),
            to_value(serde_yaml_ng::to_value(machine.identity())),
        );
    }
    if !m.contains_key("predicted") {
        m.insert(
            "predicted".into(),
            to_value(serde_yaml_ng::to_value(Evaluation::default_prediction())),
        );
    }
    if !m.contains_key("solver") {
        let s = SolverRecord {
            solver: "hand-written".into(),
            status: "scenario".into(),
            objective: "none".into(),
            objective_value: 0.0,
            strategy: "scenario".into(),
            solve_time_ms: 0.0,
        };
        m.insert("solver".into(), to_value(serde_yaml_ng::to_value(s)));
    }
    let text = serde_yaml_ng::to_string(&v).expect("serializes");
    Plan::from_yaml(&text, "plan").map_err(|e| SimError::Load(e.to_string()))
}

/// Loads and simulates a scenario: `Ok` with what happened, or the error.
fn run_scenario(
    path: &Path,
    text: &str,
) -> Result<(Scenario, Result<crate::SimReport, SimError>), String> {
    let sc: Scenario = serde_yaml_ng::from_str(text).map_err(|e| format!("scenario: {e}"))?;
    let root = root_of(path);
    // A profile refused is a result too: scenarios check that bad figures are named.
    let machine = match Machine::load(&root.join(&sc.machine)) {
        Ok(m) => m,
        Err(e) => return Ok((sc, Err(SimError::Load(format!("machine: {e}"))))),
    };
    let plan = match (&sc.plan, &sc.plan_file) {
        (Some(v), None) => inline_plan(v, &machine),
        (None, Some(f)) => Plan::load(&root.join(f)).map_err(|e| SimError::Load(e.to_string())),
        _ => return Err("scenario: give exactly one of `plan:` (inline) and `plan_file:`".into()),
    };
    let result = plan.and_then(|plan| {
        let (model, _warning) = prepare(&plan, &machine, sc.force)?;
        simulate(&plan, &model, &machine)
    });
    Ok((sc, result))
}

fn check_scenario(path: &Path, text: &str) -> Result<String, String> {
    let (sc, result) = run_scenario(path, text)?;
    let forced = if sc.force { " (forced)" } else { "" };
    match (&sc.expect, result) {
        (Expect::Error(want), Err(e)) => {
            let e = e.to_string();
            if e.contains(want.as_str()) {
                Ok(format!("rejected as expected: {e}"))
            } else {
                Err(format!("expected an error containing `{want}`, got: {e}"))
            }
        }
        (_, Err(e)) => Err(e.to_string()),
        (Expect::Error(want), Ok(r)) => Err(format!(
            "expected an error containing `{want}`, but it simulated ({})",
            if r.fits() { "fits" } else { "overflows" }
        )),
        (Expect::Fits, Ok(r)) => {
            if r.fits() {
                Ok(format!(
                    "fits {}{forced} as expected: step {}, peaks {}",
                    r.machine,
                    secs(r.step_s),
                    peaks(&r)
                ))
            } else {
                Err(format!("expected to fit: {}", overflow_text(&r)))
            }
        }
        (Expect::Overflows(dev), Ok(r)) => {
            if let Some(o) = r.overflows.iter().find(|o| &o.device == dev) {
                Ok(format!(
                    "{dev} overflows as expected{forced}: {}",
                    o.message
                ))
            } else if r.fits() {
                Err(format!(
                    "expected {dev} to overflow, but everything fits: peaks {}",
                    peaks(&r)
                ))
            } else {
                Err(format!(
                    "expected {dev} to overflow, but the overruns are: {}",
                    overflow_text(&r)
                ))
            }
        }
    }
}

fn peaks(r: &crate::SimReport) -> String {
    r.devices
        .iter()
        .filter(|d| d.peak > 0)
        .map(|d| {
            format!(
                "{} {:.1}/{:.1} GiB",
                d.device,
                (d.peak + d.headroom) as f64 / mold_plan::GIB as f64,
                d.budget as f64 / mold_plan::GIB as f64
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
