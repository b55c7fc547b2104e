//! `mold plan`: places a model's components and transformer blocks on a machine's
//! devices by solving an integer program (good_lp, pure-Rust microlp solver).
//!
//! Decisions: the device (or host) of each encoder and VAE; for the transformer, how many
//! blocks of each kind run resident or streamed on each candidate device group (a single
//! device, or a tensor-parallel group whose degree divides the heads). Groups take
//! contiguous ranges of the execution order, which the program enforces through
//! "kind-interval" constraints (see `ilp.rs`). Costs come from `mold-cost`, so the
//! program's objective is exactly `mold_cost::evaluate`'s request time.
//!
//! The solver is run once per strategy family (one GPU, block split, tensor parallel,
//! mixed): the families partition the plans, so the best of the four is the optimum and
//! the user sees what each strategy would give.

pub mod brute;
mod constraints;
mod diagnose;
mod ilp;
mod layout;
pub mod report;

pub use constraints::{parse_cap, parse_pin, Constraints, ConstraintsFile, OneOrMany, TpChoice};
pub use ilp::{candidate_groups, Choice, GroupChoice};
pub use layout::plan_from_choice;

use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{CheckpointRef, DType, DeviceId, Plan, Workload};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Constraint(String),
    #[error("no plan fits: {0}")]
    Infeasible(String),
    #[error("the solver failed: {0}")]
    Solver(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Shortest request (encode + steps × step + decode).
    Latency,
    /// Least device memory in total, then shortest request.
    Memory,
}

impl std::str::FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "latency" => Ok(Objective::Latency),
            "memory" => Ok(Objective::Memory),
            _ => Err(format!("unknown objective `{s}`: use latency or memory")),
        }
    }
}

impl Objective {
    pub fn name(self) -> &'static str {
        match self {
            Objective::Latency => "latency",
            Objective::Memory => "memory",
        }
    }
}

/// Strategy families; they partition all plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// The transformer on one GPU, streaming what does not fit.
    Single,
    /// Blocks split over several GPUs, no tensor parallel.
    Split,
    /// One tensor-parallel group runs every block.
    Tensor,
    /// Tensor-parallel groups together with other groups.
    Mixed,
}

impl Family {
    pub const ALL: [Family; 4] = [Family::Single, Family::Split, Family::Tensor, Family::Mixed];
    pub fn name(self) -> &'static str {
        match self {
            Family::Single => "single",
            Family::Split => "split",
            Family::Tensor => "tensor",
            Family::Mixed => "mixed",
        }
    }
    pub fn describe(self) -> &'static str {
        match self {
            Family::Single => "one GPU + streaming",
            Family::Split => "block split",
            Family::Tensor => "tensor parallel",
            Family::Mixed => "tensor parallel + split",
        }
    }
}

/// Everything the planner needs.
#[derive(Clone, Debug)]
pub struct Request {
    pub model: ModelSpec,
    /// The machine after `--devices` and `--max-vram` are applied.
    pub machine: Machine,
    pub workload: Workload,
    /// Storage type of each component, the transformer included.
    pub dtypes: BTreeMap<String, DType>,
    pub constraints: Constraints,
    pub objective: Objective,
    pub checkpoint: Option<CheckpointRef>,
}

impl Request {
    pub fn new(model: ModelSpec, machine: Machine, workload: Workload) -> Request {
        let mut dtypes: BTreeMap<String, DType> = model
            .components
            .iter()
            .map(|c| (c.name.clone(), c.default_dtype))
            .collect();
        dtypes.insert("transformer".into(), model.transformer.default_dtype);
        Request {
            model,
            machine,
            workload,
            dtypes,
            constraints: Constraints::default(),
            objective: Objective::Latency,
            checkpoint: None,
        }
    }

    pub fn dtype(&self, component: &str) -> DType {
        self.dtypes[component]
    }
}

/// The best plan of one family, or why there is none.
#[derive(Clone, Debug, Serialize)]
pub struct FamilyResult {
    pub family: Family,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_time_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_time_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_peak_fraction: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub streamed_blocks: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective_value: Option<f64>,
    pub solve_time_ms: f64,
    #[serde(skip)]
    pub choice: Option<Choice>,
}

/// What `mold plan` produced.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    pub plan: Plan,
    #[serde(skip)]
    pub machine: Machine,
    pub families: Vec<FamilyResult>,
    pub evaluation: mold_cost::Evaluation,
    pub solve_time_ms: f64,
}

/// Plans `req`: solves each strategy family and returns the best plan.
pub fn plan(req: &Request) -> Result<Outcome, PlanError> {
    req.model
        .check_workload(&req.workload)
        .map_err(|e| PlanError::Constraint(e.to_string()))?;
    req.constraints.check(&req.model, &req.machine)?;
    let start = std::time::Instant::now();
    let mut families = Vec::new();
    let mut best: Option<(f64, Family, Choice)> = None;
    for fam in Family::ALL {
        let t0 = std::time::Instant::now();
        let r = ilp::solve(req, Some(fam))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match r {
            Some(choice) => {
                let plan = plan_from_choice(req, &choice, fam, "optimal", ms);
                let ev = mold_cost::evaluate(&plan, &req.model, &req.machine);
                let frac = ev
                    .devices
                    .iter()
                    .map(|d| (d.peak + d.headroom) as f64 / d.budget as f64)
                    .fold(0.0, f64::max);
                families.push(FamilyResult {
                    family: fam,
                    status: "optimal".into(),
                    step_time_s: Some(ev.step_s),
                    request_time_s: Some(ev.request_s),
                    max_peak_fraction: Some(frac),
                    streamed_blocks: Some(choice.streamed_blocks()),
                    objective_value: Some(choice.objective),
                    solve_time_ms: ms,
                    choice: Some(choice.clone()),
                });
                if best
                    .as_ref()
                    .is_none_or(|(o, _, _)| choice.objective < *o - 1e-12)
                {
                    best = Some((choice.objective, fam, choice));
                }
            }
            None => families.push(FamilyResult {
                family: fam,
                status: why_empty(req, fam),
                step_time_s: None,
                request_time_s: None,
                max_peak_fraction: None,
                streamed_blocks: None,
                objective_value: None,
                solve_time_ms: ms,
                choice: None,
            }),
        }
    }
    let solve_time_ms = start.elapsed().as_secs_f64() * 1e3;
    let Some((_, fam, choice)) = best else {
        return Err(PlanError::Infeasible(diagnose::explain(req)));
    };
    let plan = plan_from_choice(req, &choice, fam, "optimal", solve_time_ms);
    let evaluation = mold_cost::evaluate(&plan, &req.model, &req.machine);
    Ok(Outcome {
        plan,
        machine: req.machine.clone(),
        families,
        evaluation,
        solve_time_ms,
    })
}

fn why_empty(req: &Request, fam: Family) -> String {
    let groups = ilp::candidate_groups(req);
    let singles = groups.iter().filter(|g| g.len() == 1).count();
    let tps = groups.len() - singles;
    match fam {
        Family::Split | Family::Mixed if singles + tps < 2 => "needs 2+ devices".into(),
        Family::Tensor | Family::Mixed if tps == 0 => match req.constraints.tp {
            TpChoice::Off => "off (--tp off)".into(),
            _ => "no group: heads or devices".into(),
        },
        Family::Single if singles == 0 => "no device allowed".into(),
        _ => "does not fit".into(),
    }
}

/// Solves one strategy family (or, with `None`, all plans at once): the best choice, or
/// `None` when nothing of that family fits.
pub fn solve_family(req: &Request, family: Option<Family>) -> Result<Option<Choice>, PlanError> {
    ilp::solve(req, family)
}

/// Device groups used by a plan's transformer, for reports.
pub fn groups_of(plan: &Plan) -> Vec<Vec<DeviceId>> {
    let mut out: Vec<Vec<DeviceId>> = Vec::new();
    if let Some(t) = plan.transformer() {
        for p in &t.parts {
            if !out.contains(&p.devices) {
                out.push(p.devices.clone());
            }
        }
    }
    out
}
