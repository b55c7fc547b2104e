//! True CFG: how a step's conditional and unconditional transformer passes run, for a
//! workload with a `cfg_scale` on a model that has true CFG (Qwen-Image).
//!
//! - `serial`: the strategy families' search (`lib.rs`) with every step's passes
//!   doubled;
//! - `pipelined`: the split and mixed families, the step a pass plus its slowest stage
//!   (with its hand-off, for every stage but the last), each device in one stage
//!   (`ilp.rs`, `brute.rs`);
//! - `parallel`: two replicas, each the latency-optimal placement of one pass on half of
//!   the transformer's devices (the machinery of `throughput.rs`: the placement on the
//!   first half, shifted onto the second), the encoders and the VAE with the first.
//!
//! `auto` plans each and keeps the best by the objective among those that fit.

use crate::problem::Problem;
use crate::{Family, Objective, Outcome, PlanError, Request};
use mold_plan::{CfgMode, DeviceId};
use serde::Serialize;

/// `mold plan --cfg`: a mode, or `auto` (the best of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CfgChoice {
    Auto,
    Mode(CfgMode),
}

impl std::str::FromStr for CfgChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CfgChoice::Auto),
            _ => s.parse::<CfgMode>().map(CfgChoice::Mode).map_err(|_| {
                format!("unknown CFG mode `{s}`: use serial, parallel, pipelined or auto")
            }),
        }
    }
}

/// One CFG mode considered.
#[derive(Clone, Debug, Serialize)]
pub struct CfgCandidate {
    pub mode: CfgMode,
    /// Whether it is the plan's.
    pub chosen: bool,
    /// `placed`, or why the mode has no plan.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_time_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_time_s: Option<f64>,
}

/// Plans a true-CFG request (see the module's documentation).
pub(crate) fn plan(req: &Request) -> Result<Outcome, PlanError> {
    if let CfgChoice::Mode(m) = req.cfg {
        return plan_mode(req, m);
    }
    let mut rows = Vec::new();
    let mut best: Option<(f64, Outcome)> = None;
    let mut errors = Vec::new();
    let start = std::time::Instant::now();
    for m in CfgMode::ALL {
        match plan_mode(req, m) {
            Ok(o) => {
                let key = objective(req, &o);
                rows.push(CfgCandidate {
                    mode: m,
                    chosen: false,
                    status: "placed".into(),
                    strategy: Some(o.plan.solver.strategy.clone()),
                    step_time_s: Some(o.evaluation.step_s),
                    request_time_s: Some(o.evaluation.request_s),
                });
                if best.as_ref().is_none_or(|(b, _)| key < *b - 1e-12) {
                    best = Some((key, o));
                }
            }
            Err(e) => {
                rows.push(CfgCandidate {
                    mode: m,
                    chosen: false,
                    status: short(&e),
                    strategy: None,
                    step_time_s: None,
                    request_time_s: None,
                });
                errors.push(e);
            }
        }
    }
    let Some((_, mut o)) = best else {
        // Serial's refusal says most: it is the search over every family.
        return Err(errors.swap_remove(0));
    };
    let mode = o.plan.cfg.map(|c| c.mode);
    for r in rows.iter_mut() {
        r.chosen = Some(r.mode) == mode;
    }
    let ms = start.elapsed().as_secs_f64() * 1e3;
    o.solve_time_ms = ms;
    o.plan.solver.solve_time_ms = (ms * 1000.0).round() / 1000.0;
    o.cfg_modes = rows;
    Ok(o)
}

/// The objective of an outcome, as the families are compared.
fn objective(req: &Request, o: &Outcome) -> f64 {
    let bytes = o
        .evaluation
        .devices
        .iter()
        .map(|d| d.peak)
        .fold(0u64, u64::saturating_add);
    Problem::new(req).objective(o.evaluation.request_s, bytes)
}

/// A refusal in a few words, for the candidates' table.
fn short(e: &PlanError) -> String {
    let s = e.to_string();
    match s.split_once(": ") {
        Some((head, _)) if head.len() < 20 && s.len() > 90 => head.to_string(),
        _ => s,
    }
}

/// The plan of CFG mode `m`.
pub(crate) fn plan_mode(req: &Request, m: CfgMode) -> Result<Outcome, PlanError> {
    let mut r = req.clone();
    r.cfg = CfgChoice::Mode(m);
    match m {
        CfgMode::Serial => crate::plan_one(&r),
        CfgMode::Pipelined => crate::plan_one(&r).map_err(|e| match e {
            PlanError::Infeasible(why) => PlanError::Infeasible(format!(
                "pipelined CFG needs a block split over device groups of their own, and none fits: {why}"
            )),
            e => e,
        }),
        CfgMode::Parallel => parallel(&r),
    }
}

/// CFG-parallel: the best placement of one pass on the first half of the transformer's
/// devices (encoders and VAE there or on the host), and a replica of it on the second.
fn parallel(req: &Request) -> Result<Outcome, PlanError> {
    let devices = Problem::new(req).allowed;
    let k = devices.len() / 2;
    if k == 0 {
        return Err(PlanError::Infeasible(format!(
            "CFG-parallel runs the two passes on two device groups, and the transformer may use {} device(s)",
            devices.len()
        )));
    }
    let runs = [devices[..k].to_vec(), devices[k..2 * k].to_vec()];
    let mut sub = crate::throughput::on_devices(req, &runs[0]).map_err(PlanError::Constraint)?;
    sub.objective = req.objective;
    let mut o = crate::plan_one(&sub).map_err(|e| match e {
        PlanError::Infeasible(why) => PlanError::Infeasible(format!(
            "CFG-parallel: one pass does not fit on {}: {why}",
            list(&runs[0])
        )),
        e => e,
    })?;
    o.plan.replicas = Some(crate::throughput::replicas_over_runs(&o.plan, &runs));
    let refuse = |why: String| {
        PlanError::Infeasible(format!(
            "CFG-parallel: the replica on {} does not fit: {why}",
            list(&runs[1])
        ))
    };
    mold_cost::validate(&o.plan, &req.model, &req.machine).map_err(|e| refuse(e.to_string()))?;
    let ev = mold_cost::evaluate(&o.plan, &req.model, &req.machine);
    let family = Family::ALL
        .into_iter()
        .find(|f| f.name() == o.plan.solver.strategy)
        .unwrap_or(Family::Mixed);
    let p = Problem::new(req);
    if !p.fits(&o.plan, &ev, family) {
        return Err(refuse(
            "a device is over its budget with the transfer reserves".into(),
        ));
    }
    let bytes = ev
        .devices
        .iter()
        .map(|d| d.peak)
        .fold(0u64, u64::saturating_add);
    o.plan.predicted = ev.prediction();
    o.plan.solver.objective = req.objective.name().into();
    o.plan.solver.objective_value = mold_cost::round6(p.objective(ev.request_s, bytes));
    o.evaluation = ev;
    if req.objective == Objective::Throughput {
        o.plan.solver.objective = Objective::Latency.name().into();
    }
    Ok(o)
}

fn list(devs: &[DeviceId]) -> String {
    devs.iter()
        .map(DeviceId::to_string)
        .collect::<Vec<_>>()
        .join("+")
}
