//! `mold plan`: places a model's components and transformer blocks on a machine's
//! devices by solving an integer program (written with good_lp, solved by the pure-Rust
//! microlp).
//!
//! Decisions: the device (or host) of each encoder and VAE; for the transformer, how many
//! blocks of each kind run resident or streamed on each candidate device group (a single
//! device, or a parallel group of `tp × sp` devices — tensor parallel, sequence parallel
//! or both — whose size divides the heads). Groups take contiguous ranges of the
//! execution order, which the program enforces through "kind-interval" constraints (see
//! `ilp.rs`). Costs come from `mold-cost`, so the program's objective is exactly
//! `mold_cost::evaluate`'s request time.
//!
//! The solver is run once per strategy family (one GPU, block split, tensor parallel,
//! sequence parallel, hybrid, mixed), each within a time limit (`search.rs`): the
//! families partition the plans, so the best of them is the optimum when each is
//! proven, and the user sees what each strategy would give. A family whose solver fails,
//! or runs out of time before any plan, says so in its row; the exhaustive enumerator
//! stands in where its instance is small, the local search elsewhere (its plan labelled
//! not proven optimal).
//!
//! Files: `problem.rs` the problem as data, `candidates.rs` the program's device groups,
//! `ilp.rs` its encoding, `lp.rs` the program handed to microlp, `brute.rs` the
//! independent enumerator, `local.rs` the local search that stands in where the solver
//! gives a family no plan, `search.rs` one family's search, `layout.rs` choice → plan,
//! `throughput.rs` the throughput objective (replicas of a placement versus one group),
//! `tune.rs` the placements `mold plan --tune` measures and the pick among them.

pub mod brute;
mod candidates;
pub mod cfg;
mod constraints;
mod diagnose;
mod ilp;
mod layout;
pub mod local;
mod lp;
mod problem;
pub mod report;
mod search;
pub mod throughput;
pub mod tune;
mod vae_bands;

pub use cfg::{CfgCandidate, CfgChoice};
pub use constraints::{
    parse_cap, parse_pin, Constraints, ConstraintsFile, OneOrMany, ParallelChoice, SpChoice,
    TpChoice,
};
pub use layout::plan_from_choice;
pub use problem::{Choice, GroupChoice, MEMORY_LATENCY_WEIGHT};
pub use search::{solve_family, with_solver_failing, FamilySolution, Method};
pub use throughput::{Serving, Throughput, ThroughputCandidate};

use mold_machine::Machine;
use mold_models::ModelSpec;
use mold_plan::{CfgMode, CheckpointRef, DType, MemoryPhases, Plan, Workload};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// How long each strategy family's search may take by default.
pub const FAMILY_TIME_LIMIT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Constraint(String),
    #[error("no plan fits: {0}")]
    Infeasible(String),
    /// No family has a plan, and not every family was proven to have none: a family's
    /// solver failed or ran out of time, and no other search found a plan for it.
    #[error("no plan found, nor a proof that none fits: {0}")]
    Solver(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Shortest request (encode + steps × step + decode).
    Latency,
    /// Least device memory in total, then shortest request.
    Memory,
    /// Most images per second with [`Serving::clients`] requests in flight, a request
    /// within [`Serving::max_latency_s`]: replicas of a placement on disjoint devices,
    /// or one group (`throughput.rs`).
    Throughput,
}

impl std::str::FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "latency" => Ok(Objective::Latency),
            "memory" => Ok(Objective::Memory),
            "throughput" => Ok(Objective::Throughput),
            _ => Err(format!(
                "unknown objective `{s}`: use latency, memory or throughput"
            )),
        }
    }
}

impl Objective {
    pub fn name(self) -> &'static str {
        match self {
            Objective::Latency => "latency",
            Objective::Memory => "memory",
            Objective::Throughput => "throughput",
        }
    }
}

/// Strategy families; they partition all plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// The transformer on one GPU, streaming what does not fit.
    Single,
    /// Blocks split over several GPUs, no parallel group.
    Split,
    /// One tensor-parallel group (`tp` > 1, `sp` = 1) runs every block.
    Tensor,
    /// One sequence-parallel group (`sp` > 1, `tp` = 1) runs every block.
    Sequence,
    /// One group with both (`sp` > 1 and `tp` > 1) runs every block.
    Hybrid,
    /// Parallel groups (of any layout) together with other groups.
    Mixed,
}

impl Family {
    pub const ALL: [Family; 6] = [
        Family::Single,
        Family::Split,
        Family::Tensor,
        Family::Sequence,
        Family::Hybrid,
        Family::Mixed,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Family::Single => "single",
            Family::Split => "split",
            Family::Tensor => "tensor",
            Family::Sequence => "sequence",
            Family::Hybrid => "hybrid",
            Family::Mixed => "mixed",
        }
    }
    pub fn describe(self) -> &'static str {
        match self {
            Family::Single => "one GPU + streaming",
            Family::Split => "block split",
            Family::Tensor => "tensor parallel",
            Family::Sequence => "sequence parallel",
            Family::Hybrid => "sequence × tensor",
            Family::Mixed => "parallel + split",
        }
    }
    /// The family of a plan whose only group has this layout.
    pub(crate) fn of_layout(tp: u32, sp: u32) -> Family {
        match (tp > 1, sp > 1) {
            (false, false) => Family::Single,
            (true, false) => Family::Tensor,
            (false, true) => Family::Sequence,
            (true, true) => Family::Hybrid,
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
    /// How long each strategy family's search may take ([`FAMILY_TIME_LIMIT`]): past it,
    /// the best plan found so far stands, reported as not proven optimal.
    pub time_limit: Duration,
    /// Requests in flight and the latency bound, for [`Objective::Throughput`].
    pub serving: Serving,
    /// How true CFG's two passes run, for a workload with a `cfg_scale` on a model that
    /// has true CFG (`cfg.rs`).
    pub cfg: CfgChoice,
    /// Whether the components are loaded one phase at a time (a one-shot request) or
    /// all at once (a server).
    pub memory_phases: MemoryPhases,
    /// The transformer's attention in FP8 (`--fp8-attention`), where its products are FP8:
    /// the plan says `attention: fp8` and is priced with the tables' FP8 attention.
    pub fp8_attention: bool,
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
            time_limit: FAMILY_TIME_LIMIT,
            serving: Serving::default(),
            cfg: CfgChoice::Auto,
            memory_phases: MemoryPhases::Resident,
            fp8_attention: false,
        }
    }

    /// The transformer's attention precision as the plan writes it: `fp8` where asked
    /// for and the transformer is in FP8.
    pub fn attention(&self) -> Option<DType> {
        (self.fp8_attention && self.dtype("transformer") == DType::Fp8).then_some(DType::Fp8)
    }

    /// The cost model's context for this request.
    pub fn cost_ctx(&self) -> mold_cost::Ctx<'_> {
        mold_cost::Ctx {
            fp8_attention: self.attention().is_some(),
            ..mold_cost::Ctx::new(&self.model, &self.machine, &self.workload)
        }
    }

    /// Whether the workload runs true CFG: a `cfg_scale`, on a model that has it (a
    /// guidance-distilled model given a scale is priced as two passes, written without
    /// `cfg`).
    pub fn true_cfg(&self) -> bool {
        self.workload.cfg_scale.is_some() && self.model.default_workload.cfg_scale.is_some()
    }

    /// The CFG mode a single search prices: the one asked for (`auto` searches each,
    /// `cfg.rs`; a single search prices serial); `None` without true CFG, and serial for a
    /// guidance-distilled model given a scale.
    pub fn cfg_mode(&self) -> Option<CfgMode> {
        if !self.true_cfg() {
            return None;
        }
        Some(match self.cfg {
            CfgChoice::Auto => CfgMode::Serial,
            CfgChoice::Mode(m) => m,
        })
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
    /// Whether the plan is proven the family's best (or, without one, that none fits).
    pub proven_optimal: bool,
    pub method: Method,
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
    /// The model planned (for what the summary prices beside the plan: its load).
    #[serde(skip)]
    pub model: mold_models::ModelSpec,
    pub families: Vec<FamilyResult>,
    pub evaluation: mold_cost::Evaluation,
    pub solve_time_ms: f64,
    /// With [`Objective::Throughput`]: every replica width considered, and the pick.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throughput: Option<Throughput>,
    /// With true CFG and `--cfg auto`: every CFG mode considered (the pick's row first
    /// marked chosen).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cfg_modes: Vec<CfgCandidate>,
}

/// Plans `req`: searches each strategy family and returns the best plan. A family whose
/// search fails says so in its row; the others still count.
pub fn plan(req: &Request) -> Result<Outcome, PlanError> {
    if req.objective == Objective::Throughput {
        return throughput::plan(req);
    }
    if req.true_cfg() {
        return cfg::plan(req);
    }
    plan_one(req)
}

/// [`plan`] for one CFG mode (the request's [`Request::cfg_mode`]), latency or memory.
pub(crate) fn plan_one(req: &Request) -> Result<Outcome, PlanError> {
    req.model
        .check_workload(&req.workload)
        .map_err(|e| PlanError::Constraint(e.to_string()))?;
    req.constraints.check(&req.model, &req.machine)?;
    let start = std::time::Instant::now();
    let mut families = Vec::new();
    let mut best: Option<(Family, Choice, bool, Method)> = None;
    let mut failures = Vec::new();
    for fam in Family::ALL {
        let t0 = std::time::Instant::now();
        let r = solve_family(req, Some(fam), req.time_limit);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut row = FamilyResult {
            family: fam,
            status: String::new(),
            proven_optimal: r.proven,
            method: r.method,
            step_time_s: None,
            request_time_s: None,
            max_peak_fraction: None,
            streamed_blocks: None,
            objective_value: None,
            solve_time_ms: ms,
            choice: None,
        };
        match r.choice {
            Some(choice) => {
                let plan = plan_from_choice(req, &choice, fam, "", ms);
                let ev = mold_cost::evaluate(&plan, &req.model, &req.machine);
                row.status = match (r.method, r.proven) {
                    (Method::Solver, true) => "optimal".into(),
                    (Method::Exhaustive, _) => format!(
                        "optimal by exhaustive search ({})",
                        r.trouble.as_deref().unwrap_or("solver failed")
                    ),
                    (Method::LocalSearch, _) => format!(
                        "best found by local search, not proven optimal ({})",
                        r.trouble.as_deref().unwrap_or("solver failed")
                    ),
                    (Method::Solver, false) => r
                        .trouble
                        .clone()
                        .unwrap_or_else(|| "not proven optimal".into()),
                };
                row.step_time_s = Some(ev.step_s);
                row.request_time_s = Some(ev.request_s);
                row.max_peak_fraction = Some(
                    ev.devices
                        .iter()
                        .map(|d| (d.peak + d.headroom) as f64 / d.budget.max(1) as f64)
                        .fold(0.0, f64::max),
                );
                row.streamed_blocks = Some(choice.streamed_blocks());
                row.objective_value = Some(choice.objective);
                row.choice = Some(choice.clone());
                if best
                    .as_ref()
                    .is_none_or(|(_, b, ..)| choice.objective < b.objective - 1e-12)
                {
                    best = Some((fam, choice, r.proven, r.method));
                }
            }
            None => {
                row.status = match &r.trouble {
                    Some(t) => {
                        failures.push(format!("{}: {t}", fam.name()));
                        t.clone()
                    }
                    None => why_empty(req, fam),
                };
            }
        }
        families.push(row);
    }
    let solve_time_ms = start.elapsed().as_secs_f64() * 1e3;
    let Some((fam, choice, proven, method)) = best else {
        if !failures.is_empty() {
            return Err(PlanError::Solver(failures.join("; ")));
        }
        return Err(PlanError::Infeasible(diagnose::explain(req)));
    };
    // The best of the families is the optimum only if every family's answer is proven.
    let all_proven = families.iter().all(|f| f.proven_optimal);
    let status = if proven && all_proven {
        "optimal"
    } else {
        "feasible"
    };
    let mut plan = plan_from_choice(req, &choice, fam, status, solve_time_ms);
    match method {
        Method::Exhaustive => {
            plan.solver.solver = "exhaustive enumeration (microlp failed)".into();
        }
        Method::LocalSearch => {
            plan.solver.solver = "local search, not proven optimal (microlp gave no plan)".into();
        }
        Method::Solver => {}
    }
    vae_bands::widen(req, &mut plan, fam)?;
    let evaluation = mold_cost::evaluate(&plan, &req.model, &req.machine);
    Ok(Outcome {
        plan,
        machine: req.machine.clone(),
        model: req.model.clone(),
        families,
        evaluation,
        solve_time_ms,
        throughput: None,
        cfg_modes: vec![],
    })
}

fn why_empty(req: &Request, fam: Family) -> String {
    let p = problem::Problem::new(req);
    let groups = candidates::candidate_groups(&p);
    let singles = groups.iter().filter(|g| g.len() == 1).count();
    let of = |f: Family| {
        groups
            .iter()
            .filter(|g| g.len() > 1 && Family::of_layout(g.tp, g.sp) == f)
            .count()
    };
    let parallel = groups.len() - singles;
    let (tp, sp) = (req.constraints.tp, req.constraints.sp);
    if !p.family_allowed(fam) {
        if p.pipelined && !matches!(fam, Family::Split | Family::Mixed) {
            return "one stage: pipelined CFG needs a split".into();
        }
        if let SpChoice::Degree(n) = sp {
            return format!("excluded by --sp {n}");
        }
    }
    let sp_off = "off (--sp off, mold plan's default with --tp or without peer links)";
    match fam {
        Family::Split | Family::Mixed if singles + parallel < 2 => "needs 2+ devices".into(),
        Family::Tensor | Family::Sequence | Family::Hybrid if p.allowed.len() < 2 => {
            "needs 2+ devices".into()
        }
        Family::Tensor if of(Family::Tensor) == 0 => match (tp, sp) {
            (TpChoice::Off, _) => "off (--tp off)".into(),
            (_, SpChoice::Degree(n)) => format!("excluded by --sp {n}"),
            _ => "no group: heads or devices".into(),
        },
        Family::Sequence if of(Family::Sequence) == 0 => match (sp, tp) {
            (SpChoice::Off, _) => sp_off.into(),
            (_, TpChoice::Degree(n)) => format!("excluded by --tp {n}"),
            _ => "no group: heads or devices".into(),
        },
        Family::Hybrid if of(Family::Hybrid) == 0 => match (tp, sp) {
            (TpChoice::Off, _) => "off (--tp off)".into(),
            (_, SpChoice::Off) => sp_off.into(),
            _ => "no group: heads or devices".into(),
        },
        Family::Mixed if parallel == 0 => "no parallel group".into(),
        Family::Single if singles == 0 => "no device allowed".into(),
        _ => "does not fit".into(),
    }
}
