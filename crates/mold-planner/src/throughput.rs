//! The throughput objective: with N requests in flight, replicas of one placement on
//! disjoint devices, or one group over more devices that finishes each request sooner.
//!
//! Candidates, one per replica width `k` (devices each replica may use): the
//! transformer's allowed devices, in machine order, cut into `⌊n / k⌋` runs of `k`; the
//! latency-optimal plan on the first run (any family: one GPU, split, TP/SP group), its
//! devices shifted onto the other runs, as many as fit. For a given number of replicas
//! the widest runs are at least as fast (the plan on `k + 1` devices may use `k`), so
//! the widths are `⌊n / r⌋` for r = 1…n; `k = n` is the one latency-optimal group.
//!
//! A candidate of `r` replicas whose request takes `t` seconds serves, with `c` clients
//! in a closed loop, `min(c, r) / t` requests a second (`batch` images each); a request
//! then waits and runs `t · max(1, c / r)` seconds on average (Little's law). The pick is
//! the most images per second among the candidates whose request time is within
//! `--max-latency` (the bound is one request's time on its replica, queueing aside: how
//! long waits get is the client count's doing, and `mold sim --clients` shows it); ties
//! go to the shorter request, then to fewer replicas.

use crate::problem::Problem;
use crate::{Family, Objective, Outcome, PlanError, Request};
use mold_plan::{shifted_replicas, DeviceId, Plan};
use serde::Serialize;

/// Requests in flight and the latency bound of `--objective throughput`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Serving {
    /// Requests in flight (`--clients`).
    pub clients: u32,
    /// The most seconds one request may take on its replica (`--max-latency`).
    pub max_latency_s: Option<f64>,
}

impl Default for Serving {
    fn default() -> Self {
        Serving {
            clients: 4,
            max_latency_s: None,
        }
    }
}

/// One replica width considered.
#[derive(Clone, Debug, Serialize)]
pub struct ThroughputCandidate {
    /// Devices each replica may use.
    pub width: u32,
    /// Replicas placed (those of the `⌊n / width⌋` runs that fit); 0 when none does.
    pub replicas: u32,
    /// The devices each replica runs on.
    pub devices: Vec<Vec<DeviceId>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Family>,
    /// One request's time on its replica.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_time_s: Option<f64>,
    /// Mean time from submission to image with the clients in flight, waiting included.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub images_per_s: Option<f64>,
    /// Whether its request time is within `--max-latency` (true without one).
    pub within_bound: bool,
    /// `placed`, or why the width has no plan.
    pub status: String,
    #[serde(skip)]
    pub outcome: Option<Box<Outcome>>,
}

/// What the throughput objective weighed.
#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    pub clients: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_latency_s: Option<f64>,
    pub candidates: Vec<ThroughputCandidate>,
    /// Index of the pick in `candidates`.
    pub chosen: usize,
}

/// Requests a second that `replicas` serve with `clients` in flight, each request
/// taking `request_s` seconds, times `batch` images a request.
pub fn images_per_s(replicas: u32, clients: u32, request_s: f64, batch: u32) -> f64 {
    if request_s <= 0.0 {
        return 0.0;
    }
    batch as f64 * replicas.min(clients) as f64 / request_s
}

/// Mean seconds from submission to image in a closed loop of `clients` over `replicas`
/// (Little's law: waiting included).
pub fn latency_s(replicas: u32, clients: u32, request_s: f64) -> f64 {
    request_s * (clients as f64 / replicas.max(1) as f64).max(1.0)
}

/// The pick among `candidates`: the most images per second within the bound, then the
/// shorter request, then fewer replicas. `None` when no candidate has a plan within it.
pub fn choose(candidates: &[ThroughputCandidate]) -> Option<usize> {
    let key = |c: &ThroughputCandidate| {
        (
            c.images_per_s.unwrap_or(0.0),
            c.request_time_s.unwrap_or(f64::INFINITY),
            c.replicas,
        )
    };
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.within_bound && c.images_per_s.is_some())
        .min_by(|(_, a), (_, b)| {
            let (ia, ra, na) = key(a);
            let (ib, rb, nb) = key(b);
            ib.total_cmp(&ia).then(ra.total_cmp(&rb)).then(na.cmp(&nb))
        })
        .map(|(i, _)| i)
}

/// Plans `req` for throughput (see the module's documentation).
pub(crate) fn plan(req: &Request) -> Result<Outcome, PlanError> {
    let s = &req.serving;
    if s.clients == 0 {
        return Err(PlanError::Constraint(
            "--clients 0: at least one request is in flight: use --clients 1 or more".into(),
        ));
    }
    if let Some(b) = s.max_latency_s {
        if !(b.is_finite() && b > 0.0) {
            return Err(PlanError::Constraint(format!(
                "--max-latency {b}: give the seconds one request may take, above 0"
            )));
        }
    }
    req.model
        .check_workload(&req.workload)
        .map_err(|e| PlanError::Constraint(e.to_string()))?;
    req.constraints.check(&req.model, &req.machine)?;
    let start = std::time::Instant::now();
    let devices = Problem::new(req).allowed;
    let n = devices.len();
    let mut widths: Vec<usize> = (1..=n).map(|r| n / r).collect();
    widths.dedup();
    let mut candidates: Vec<ThroughputCandidate> = widths
        .into_iter()
        .map(|k| candidate(req, &devices, k))
        .collect();
    let chosen = choose(&candidates).ok_or_else(|| no_pick(req, &candidates))?;
    let c = &mut candidates[chosen];
    let mut outcome = *c
        .outcome
        .take()
        .expect("a candidate with figures has a plan");
    let ips = c.images_per_s.unwrap_or(0.0);
    outcome.plan.solver.objective = Objective::Throughput.name().into();
    outcome.plan.solver.objective_value = mold_cost::round6(ips);
    let ms = start.elapsed().as_secs_f64() * 1e3;
    outcome.plan.solver.solve_time_ms = (ms * 1000.0).round() / 1000.0;
    outcome.solve_time_ms = ms;
    for c in candidates.iter_mut() {
        c.outcome = None;
    }
    outcome.throughput = Some(Throughput {
        clients: s.clients,
        max_latency_s: s.max_latency_s,
        candidates,
        chosen,
    });
    Ok(outcome)
}

/// Why no candidate was picked: none fits, or none is fast enough.
fn no_pick(req: &Request, candidates: &[ThroughputCandidate]) -> PlanError {
    let fastest = candidates
        .iter()
        .filter_map(|c| c.request_time_s.map(|t| (t, c)))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    match (fastest, req.serving.max_latency_s) {
        (Some((t, c)), Some(b)) => PlanError::Infeasible(format!(
            "--max-latency {b}: the fastest request takes {t:.3} s ({} on {}): raise the bound",
            c.strategy.map(Family::describe).unwrap_or("one group"),
            devices_text(&c.devices[0])
        )),
        _ => PlanError::Infeasible(
            candidates
                .iter()
                .map(|c| format!("{} device(s) a replica: {}", c.width, c.status))
                .collect::<Vec<_>>()
                .join("; "),
        ),
    }
}

fn devices_text(devs: &[DeviceId]) -> String {
    devs.iter()
        .map(DeviceId::to_string)
        .collect::<Vec<_>>()
        .join("+")
}

/// The candidate of replicas `k` devices wide.
fn candidate(req: &Request, devices: &[DeviceId], k: usize) -> ThroughputCandidate {
    let runs: Vec<Vec<DeviceId>> = devices.chunks_exact(k).map(<[_]>::to_vec).collect();
    let mut c = ThroughputCandidate {
        width: k as u32,
        replicas: 0,
        devices: vec![],
        strategy: None,
        request_time_s: None,
        latency_s: None,
        images_per_s: None,
        within_bound: false,
        status: String::new(),
        outcome: None,
    };
    let sub = match on_devices(req, &runs[0]) {
        // The replicas serve requests: CFG's passes stay on each replica's devices.
        Ok(mut sub) => {
            if matches!(
                sub.cfg,
                crate::CfgChoice::Auto | crate::CfgChoice::Mode(mold_plan::CfgMode::Parallel)
            ) {
                sub.cfg = crate::CfgChoice::Mode(mold_plan::CfgMode::Serial);
            }
            sub
        }
        Err(why) => {
            c.status = why;
            return c;
        }
    };
    let mut outcome = match crate::plan(&sub) {
        Ok(o) => o,
        Err(PlanError::Infeasible(_)) => {
            c.status = format!("does not fit on {}", devices_text(&runs[0]));
            return c;
        }
        Err(e) => {
            c.status = e.to_string();
            return c;
        }
    };
    let family = Family::ALL
        .into_iter()
        .find(|f| f.name() == outcome.plan.solver.strategy);
    outcome.plan.replicas = replicas_that_fit(req, &sub, &outcome.plan, family, &runs);
    let plans = outcome
        .plan
        .replica_plans()
        .expect("replicas are built valid");
    let t = outcome.evaluation.request_s;
    let r = plans.len() as u32;
    let s = &req.serving;
    c.replicas = r;
    c.devices = plans
        .iter()
        .map(|p| {
            let used = p.placement_devices();
            devices
                .iter()
                .filter(|d| used.contains(d))
                .cloned()
                .collect()
        })
        .collect();
    c.strategy = family;
    c.request_time_s = Some(t);
    c.latency_s = Some(latency_s(r, s.clients, t));
    c.images_per_s = Some(images_per_s(r, s.clients, t, req.workload.batch));
    c.within_bound = s.max_latency_s.is_none_or(|b| t <= b);
    c.status = if r as usize == runs.len() {
        "placed".into()
    } else {
        format!(
            "placed; {} of the {} runs of {k} device(s) do not fit it",
            runs.len() - r as usize,
            runs.len()
        )
    };
    c.outcome = Some(Box::new(outcome));
    c
}

/// `req` with every component and the transformer kept to `run` (and the host, where
/// components may use it), solved for latency.
pub(crate) fn on_devices(req: &Request, run: &[DeviceId]) -> Result<Request, String> {
    let mut sub = req.clone();
    sub.objective = Objective::Latency;
    let names = req
        .model
        .components
        .iter()
        .map(|c| c.name.clone())
        .chain(["transformer".to_string()]);
    for name in names {
        let places: Vec<DeviceId> = run
            .iter()
            .chain((name != "transformer").then_some(&DeviceId::Host))
            .filter(|d| req.constraints.allowed(&name, d))
            .cloned()
            .collect();
        if places.is_empty() {
            return Err(format!(
                "{name} may not run on {}: its pin keeps it off these devices",
                devices_text(run)
            ));
        }
        sub.constraints.pins.insert(name, places);
    }
    Ok(sub)
}

/// The replicas that put `plan` (placed on devices of `runs[0]`) on every run: the
/// device at place `i` of the first run maps to place `i` of each (replica 0 is the plan
/// itself).
pub(crate) fn replicas_over_runs(plan: &Plan, runs: &[Vec<DeviceId>]) -> Vec<mold_plan::Replica> {
    let used = plan.placement_devices();
    // The used devices in their run's order, each with its place in the run.
    let (at, from): (Vec<usize>, Vec<DeviceId>) = runs[0]
        .iter()
        .enumerate()
        .filter(|(_, d)| used.contains(d))
        .map(|(i, d)| (i, d.clone()))
        .unzip();
    let onto: Vec<Vec<DeviceId>> = runs
        .iter()
        .map(|r| at.iter().map(|&i| r[i].clone()).collect())
        .collect();
    shifted_replicas(&from, &onto)
}

/// The replicas of `plan` (placed on `runs[0]`) shifted onto the following runs, as long
/// as each fits its run's budgets with the planner's transfer reserves and the whole
/// passes validation; `None` for one replica.
fn replicas_that_fit(
    req: &Request,
    sub: &Request,
    plan: &Plan,
    family: Option<Family>,
    runs: &[Vec<DeviceId>],
) -> Option<Vec<mold_plan::Replica>> {
    let all = replicas_over_runs(plan, runs);
    let p = Problem::new(sub);
    let mut kept = 1;
    for j in 1..all.len() {
        let mut with = plan.clone();
        with.replicas = Some(all[..=j].to_vec());
        if mold_cost::validate(&with, &req.model, &req.machine).is_err() {
            break;
        }
        let Ok(rs) = with.replica_plans() else { break };
        let ev = mold_cost::evaluate(&rs[j], &req.model, &req.machine);
        if !family.is_none_or(|f| p.fits(&rs[j], &ev, f)) {
            break;
        }
        kept = j + 1;
    }
    (kept > 1).then(|| all[..kept].to_vec())
}
