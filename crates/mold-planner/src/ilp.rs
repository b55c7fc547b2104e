//! The integer program.
//!
//! For each candidate group g (a device, or a tensor-parallel group of consecutive
//! devices whose size divides the heads) and block kind k:
//!   nr[g,k], ns[g,k] ∈ 0..=count_k   resident / streamed blocks of kind k on g
//!   u[g,k] ∈ {0,1}                    g runs some kind-k block   (u ≤ nr+ns ≤ count·u)
//!   s[g,k] ∈ {0,1}                    g streams some kind-k block (s ≤ ns ≤ count·s)
//!   used[g] ∈ {0,1}                   g runs some block
//!   buf[g] ≥ buffers · bytes(g,k) · s[g,k]     stream buffers on each device of g
//!   fill[g] ≥ min(copy, compute)(g,k) · s[g,k]  pipeline fill of g's streaming
//! Contiguity: the kinds a group runs form an interval, at most one group straddles each
//! boundary between kinds (a[j,g] ≥ u[g,j] + u[g,j+1] − 1, Σ_g a[j,g] ≤ 1), and a group
//! spanning three kinds runs all of the middle one. Given that, the groups can always be
//! ordered so each runs one contiguous range (`layout.rs` does it).
//! Per device d: components' weights + resident blocks + buffers + stem (if d runs any
//! transformer part) + the largest activation A[d] + headroom ≤ budget.
//! Host: streamed weights ≤ pinned limit; host components + pinned ≤ host memory.
//!   t[g,k] ≥ compute(g,k) · (nr+ns), t[g,k] ≥ copy(g,k) · ns   kind k's time on g
//! Objective (latency): Σ component times + steps · (Σ t + Σ fill + hand-offs
//! · (groups used − 1)) — `mold_cost::evaluate`'s request time, term for term.

use crate::{Family, Objective, PlanError, Request, TpChoice};
use good_lp::{
    constraint, microlp, variable, Expression, ProblemVariables, ResolutionError, Solution,
    SolverModel, Variable,
};
use mold_cost::{BlockCost, Ctx};
use mold_plan::{DeviceId, GIB};
use std::collections::BTreeMap;

/// A solution: which blocks each group runs, where each component runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Groups that run blocks, with resident and streamed block counts per kind.
    pub groups: Vec<GroupChoice>,
    /// Component name → device (or host).
    pub placement: BTreeMap<String, DeviceId>,
    /// The objective's value (request seconds, or GiB + ε·seconds for `memory`).
    pub objective: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GroupChoice {
    pub devices: Vec<DeviceId>,
    pub resident: Vec<u32>,
    pub streamed: Vec<u32>,
}

impl Choice {
    pub fn streamed_blocks(&self) -> u32 {
        self.groups.iter().flat_map(|g| g.streamed.iter()).sum()
    }
}

/// Weight of latency in the `memory` objective (GiB per second).
pub const MEMORY_LATENCY_WEIGHT: f64 = 1e-4;

/// Candidate device groups: every allowed device alone, and tensor-parallel groups of
/// consecutive allowed devices (aligned: [0,1], [2,3], …) of each permitted degree.
pub fn candidate_groups(req: &Request) -> Vec<Vec<DeviceId>> {
    let devs: Vec<DeviceId> = req
        .machine
        .devices
        .iter()
        .map(|d| d.id.clone())
        .filter(|d| req.constraints.allowed("transformer", d))
        .collect();
    let mut out: Vec<Vec<DeviceId>> = devs.iter().map(|d| vec![d.clone()]).collect();
    let n = devs.len() as u32;
    let degrees: Vec<u32> = match req.constraints.tp {
        TpChoice::Off => vec![],
        TpChoice::Degree(d) => vec![d],
        TpChoice::Auto => (2..=n).collect(),
    };
    for d in degrees {
        if d < 2 || d > n || !req.model.transformer.tp_divides(d) {
            continue;
        }
        for i in 0..(n / d) {
            out.push(devs[(i * d) as usize..((i + 1) * d) as usize].to_vec());
        }
    }
    out
}

/// Block costs of every kind on every group.
pub fn block_costs(req: &Request, ctx: &Ctx, groups: &[Vec<DeviceId>]) -> Vec<Vec<BlockCost>> {
    let dtype = req.dtype("transformer");
    groups
        .iter()
        .map(|g| {
            req.model
                .transformer
                .kinds
                .iter()
                .map(|k| ctx.block(k, g, dtype))
                .collect()
        })
        .collect()
}

/// One place a component may run, and what it costs there.
#[derive(Clone, Debug)]
pub struct ComponentOption {
    pub at: DeviceId,
    pub seconds: f64,
    pub weight_bytes: u64,
    pub activation_bytes: u64,
}

/// Where each component may run, and what it costs there (seconds, bytes, activation).
pub fn component_options(req: &Request, ctx: &Ctx) -> Vec<(String, Vec<ComponentOption>)> {
    let mut locs: Vec<DeviceId> = req.machine.devices.iter().map(|d| d.id.clone()).collect();
    locs.push(DeviceId::Host);
    req.model
        .components
        .iter()
        .map(|c| {
            let dtype = req.dtype(&c.name);
            let opts = locs
                .iter()
                .filter(|l| req.constraints.allowed(&c.name, l))
                .map(|l| ComponentOption {
                    at: l.clone(),
                    seconds: ctx.component_s(c, l, dtype),
                    weight_bytes: c.weight_bytes(dtype),
                    activation_bytes: ctx.component_activation(c, dtype),
                })
                .collect();
            (c.name.clone(), opts)
        })
        .collect()
}

fn gib(b: u64) -> f64 {
    b as f64 / GIB as f64
}

fn sum<I: IntoIterator<Item = Expression>>(it: I) -> Expression {
    it.into_iter().fold(Expression::from(0.0), |a, b| a + b)
}

/// Solves the program restricted to `family` (or unrestricted); `None` when no plan of
/// that family fits.
///
/// Ties (identical devices, say) are broken by a second solve that keeps the optimum and
/// prefers fewer device groups and lower device indices, so equal machines get the plan
/// a person would write (`cuda:0` before `cuda:3`).
pub fn solve(req: &Request, family: Option<Family>) -> Result<Option<Choice>, PlanError> {
    let Some(first) = solve_with(req, family, None)? else {
        return Ok(None);
    };
    // The second solve is a nicety: if the solver trips on it, or its answer costs
    // measurably more than the first (beyond 1e-7 relative: the optimum constraint is
    // met only to the solver's tolerances), keep the first answer.
    let tidy = solve_with(req, family, Some(first.objective))
        .ok()
        .flatten()
        .filter(|t| t.objective <= first.objective + 1e-7 * first.objective.abs());
    Ok(Some(tidy.unwrap_or(first)))
}

fn solve_with(
    req: &Request,
    family: Option<Family>,
    optimum: Option<f64>,
) -> Result<Option<Choice>, PlanError> {
    let ctx = Ctx::new(&req.model, &req.machine, &req.workload);
    let groups = candidate_groups(req);
    let single: Vec<bool> = groups.iter().map(|g| g.len() == 1).collect();
    match family {
        Some(Family::Single) | Some(Family::Split) if !single.iter().any(|s| *s) => {
            return Ok(None)
        }
        Some(Family::Tensor) | Some(Family::Mixed) if single.iter().all(|s| *s) => return Ok(None),
        _ => {}
    }
    let kinds = &req.model.transformer.kinds;
    let nk = kinds.len();
    let counts: Vec<f64> = kinds.iter().map(|k| k.count as f64).collect();
    let bc = block_costs(req, &ctx, &groups);
    let comps = component_options(req, &ctx);
    let stream = req.constraints.stream;
    let nbuf = req.constraints.stream_buffers as f64;
    let steps = req.workload.steps as f64;
    let handoff = ctx.handoff_s(req.dtype("transformer"));
    let stem = gib(req.model.transformer.stem_bytes(req.dtype("transformer")));

    let mut vars = ProblemVariables::new();
    let mut nr = vec![vec![]; groups.len()];
    let mut ns: Vec<Vec<Option<Variable>>> = vec![vec![]; groups.len()];
    let mut u = vec![vec![]; groups.len()];
    let mut s: Vec<Vec<Option<Variable>>> = vec![vec![]; groups.len()];
    for g in 0..groups.len() {
        for c in &counts {
            nr[g].push(vars.add(variable().integer().min(0).max(*c)));
            ns[g].push(stream.then(|| vars.add(variable().integer().min(0).max(*c))));
            u[g].push(vars.add(variable().binary()));
            s[g].push(stream.then(|| vars.add(variable().binary())));
        }
    }
    let used: Vec<Variable> = groups
        .iter()
        .map(|_| vars.add(variable().binary()))
        .collect();
    let buf: Vec<Variable> = groups.iter().map(|_| vars.add(variable().min(0))).collect();
    let fill: Vec<Variable> = groups.iter().map(|_| vars.add(variable().min(0))).collect();
    let straddle: Vec<Vec<Variable>> = (0..nk.saturating_sub(1))
        .map(|_| {
            groups
                .iter()
                .map(|_| vars.add(variable().binary()))
                .collect()
        })
        .collect();
    let devs = &req.machine.devices;
    let act: Vec<Variable> = devs.iter().map(|_| vars.add(variable().min(0))).collect();
    let ud: Vec<Variable> = devs.iter().map(|_| vars.add(variable().binary())).collect();
    let x: Vec<Vec<Variable>> = comps
        .iter()
        .map(|(_, opts)| opts.iter().map(|_| vars.add(variable().binary())).collect())
        .collect();

    let blocks_of = |g: usize, k: usize| -> Expression {
        let mut e: Expression = nr[g][k].into();
        if let Some(v) = ns[g][k] {
            e += v;
        }
        e
    };

    // Objective pieces.
    let mut comp_time = Expression::from(0.0);
    for (ci, (_, opts)) in comps.iter().enumerate() {
        for (oi, o) in opts.iter().enumerate() {
            comp_time += o.seconds * x[ci][oi];
        }
    }
    // Kind k on group g: max(compute of all its blocks, copies of the streamed ones)
    // (`BlockCost::group_kind_s`), as t[g][k] ≥ both.
    let t: Vec<Vec<Option<Variable>>> = (0..groups.len())
        .map(|g| {
            (0..nk)
                .map(|k| ns[g][k].map(|_| vars.add(variable().min(0))))
                .collect()
        })
        .collect();
    let mut step = Expression::from(-handoff);
    for g in 0..groups.len() {
        for k in 0..nk {
            match t[g][k] {
                Some(tv) => step += tv,
                None => step += bc[g][k].resident_s() * nr[g][k],
            }
        }
        step += fill[g];
        step += handoff * used[g];
    }
    let latency = comp_time + steps * step;

    // Per-device memory (GiB), reused by the memory objective.
    let mut dev_mem: Vec<Expression> = Vec::new();
    for (di, d) in devs.iter().enumerate() {
        let mut e = Expression::from(0.0);
        for (ci, (_, opts)) in comps.iter().enumerate() {
            for (oi, o) in opts.iter().enumerate() {
                if o.at == d.id {
                    e += gib(o.weight_bytes) * x[ci][oi];
                }
            }
        }
        for (g, grp) in groups.iter().enumerate() {
            if grp.contains(&d.id) {
                for k in 0..nk {
                    e += gib(bc[g][k].weight_bytes) * nr[g][k];
                }
                e += buf[g];
            }
        }
        e += stem * ud[di];
        e += act[di];
        dev_mem.push(e);
    }

    let objective = match req.objective {
        Objective::Latency => latency.clone(),
        Objective::Memory => sum(dev_mem.iter().cloned()) + MEMORY_LATENCY_WEIGHT * latency.clone(),
    };
    // The tie-break: a group or placement costs 1 + the indices of its devices (the host
    // counts as the last).
    let index = |id: &DeviceId| devs.iter().position(|d| &d.id == id).unwrap_or(devs.len()) as f64;
    let mut tiebreak = Expression::from(0.0);
    for (g, grp) in groups.iter().enumerate() {
        tiebreak += (1.0 + grp.iter().map(index).sum::<f64>()) * used[g];
    }
    for (ci, (_, opts)) in comps.iter().enumerate() {
        for (oi, o) in opts.iter().enumerate() {
            tiebreak += (1.0 + index(&o.at)) * x[ci][oi];
        }
    }
    let mut problem = match optimum {
        None => vars.minimise(objective.clone()).using(microlp),
        Some(v) => vars.minimise(tiebreak).using(microlp).with(constraint!(
            objective.clone() <= v + 1e-8 * v.abs().max(1e-9)
        )),
    };

    for (k, c) in counts.iter().enumerate() {
        problem = problem.with(constraint!(
            sum((0..groups.len()).map(|g| blocks_of(g, k))) == *c
        ));
    }
    for g in 0..groups.len() {
        for k in 0..nk {
            problem = problem.with(constraint!(blocks_of(g, k) <= counts[k] * u[g][k]));
            problem = problem.with(constraint!(u[g][k] <= blocks_of(g, k)));
            problem = problem.with(constraint!(used[g] >= u[g][k]));
            if let (Some(sv), Some(nv), Some(tv)) = (s[g][k], ns[g][k], t[g][k]) {
                problem = problem.with(constraint!(tv >= bc[g][k].resident_s() * (nr[g][k] + nv)));
                problem = problem.with(constraint!(tv >= bc[g][k].copy_s * nv));
                problem = problem.with(constraint!(nv <= counts[k] * sv));
                problem = problem.with(constraint!(sv <= nv));
                problem = problem.with(constraint!(
                    buf[g] >= nbuf * gib(bc[g][k].weight_bytes) * sv
                ));
                problem = problem.with(constraint!(fill[g] >= bc[g][k].fill_s() * sv));
            }
        }
        problem = problem.with(constraint!(
            used[g] <= sum(u[g].iter().map(|v| Expression::from(*v)))
        ));
        for j in 0..nk.saturating_sub(1) {
            problem = problem.with(constraint!(straddle[j][g] >= u[g][j] + u[g][j + 1] - 1.0));
        }
        for i in 0..nk {
            for m in i + 1..nk {
                for l in m + 1..nk {
                    problem = problem.with(constraint!(u[g][m] >= u[g][i] + u[g][l] - 1.0));
                    problem = problem.with(constraint!(
                        blocks_of(g, m) >= counts[m] * (u[g][i] + u[g][l] - 1.0)
                    ));
                }
            }
        }
    }
    for row in &straddle {
        problem = problem.with(constraint!(
            sum(row.iter().map(|v| Expression::from(*v))) <= 1.0
        ));
    }
    for (di, d) in devs.iter().enumerate() {
        for (g, grp) in groups.iter().enumerate() {
            if grp.contains(&d.id) {
                problem = problem.with(constraint!(ud[di] >= used[g]));
                for k in 0..nk {
                    problem = problem.with(constraint!(
                        act[di] >= gib(bc[g][k].activation_bytes) * u[g][k]
                    ));
                }
            }
        }
        for (ci, (_, opts)) in comps.iter().enumerate() {
            for (oi, o) in opts.iter().enumerate() {
                if o.at == d.id {
                    problem =
                        problem.with(constraint!(act[di] >= gib(o.activation_bytes) * x[ci][oi]));
                }
            }
        }
        let cap = gib(d.budget.0.saturating_sub(d.headroom.0));
        problem = problem.with(constraint!(dev_mem[di].clone() <= cap));
    }
    let mut pinned = Expression::from(0.0);
    for (g, grp) in groups.iter().enumerate() {
        for k in 0..nk {
            if let Some(v) = ns[g][k] {
                pinned += gib(bc[g][k].weight_bytes) * grp.len() as f64 * v;
            }
        }
    }
    problem = problem.with(constraint!(
        pinned.clone() <= gib(req.machine.host.pinned_limit.0)
    ));
    let mut host = pinned;
    for (ci, (_, opts)) in comps.iter().enumerate() {
        problem = problem.with(constraint!(
            sum(x[ci].iter().map(|v| Expression::from(*v))) == 1.0
        ));
        for (oi, o) in opts.iter().enumerate() {
            if o.at.is_host() {
                host += gib(o.weight_bytes + o.activation_bytes) * x[ci][oi];
            }
        }
    }
    problem = problem.with(constraint!(host <= gib(req.machine.host.memory.0)));

    let used_where = |pred: &dyn Fn(usize) -> bool| {
        sum((0..groups.len())
            .filter(|g| pred(*g))
            .map(|g| Expression::from(used[g])))
    };
    match family {
        None => {}
        Some(Family::Single) => {
            problem = problem.with(constraint!(used_where(&|g| single[g]) == 1.0));
            problem = problem.with(constraint!(used_where(&|g| !single[g]) == 0.0));
        }
        Some(Family::Split) => {
            problem = problem.with(constraint!(used_where(&|g| single[g]) >= 2.0));
            problem = problem.with(constraint!(used_where(&|g| !single[g]) == 0.0));
        }
        Some(Family::Tensor) => {
            problem = problem.with(constraint!(used_where(&|g| !single[g]) == 1.0));
            problem = problem.with(constraint!(used_where(&|g| single[g]) == 0.0));
        }
        Some(Family::Mixed) => {
            problem = problem.with(constraint!(used_where(&|g| !single[g]) >= 1.0));
            problem = problem.with(constraint!(used_where(&|_| true) >= 2.0));
        }
    }

    let sol = match problem.solve() {
        Ok(s) => s,
        Err(ResolutionError::Infeasible) => return Ok(None),
        Err(e) => return Err(PlanError::Solver(e.to_string())),
    };
    let round = |v: Variable| sol.value(v).round() as u32;
    let mut chosen = Vec::new();
    for g in 0..groups.len() {
        let resident: Vec<u32> = (0..nk).map(|k| round(nr[g][k])).collect();
        let streamed: Vec<u32> = (0..nk).map(|k| ns[g][k].map(round).unwrap_or(0)).collect();
        if resident.iter().chain(streamed.iter()).any(|n| *n > 0) {
            chosen.push(GroupChoice {
                devices: groups[g].clone(),
                resident,
                streamed,
            });
        }
    }
    let mut placement = BTreeMap::new();
    for (ci, (name, opts)) in comps.iter().enumerate() {
        let oi = (0..opts.len())
            .max_by(|a, b| sol.value(x[ci][*a]).total_cmp(&sol.value(x[ci][*b])))
            .expect("a component has at least one allowed place");
        placement.insert(name.clone(), opts[oi].at.clone());
    }
    Ok(Some(Choice {
        groups: chosen,
        placement,
        objective: sol.eval(&objective),
    }))
}
