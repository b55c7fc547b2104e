//! `mold plan --tune`: the placements worth measuring, and the pick among them once
//! measured.
//!
//! The cost model prices every placement, but a price is an estimate: on a 4 × H100 box
//! a calibrated profile still prices some layouts 5–9 % high and others 5–7 % low
//! (BENCHMARKS.md), enough to rank two placements wrongly. Tuning plans the request once
//! more for each tensor × sequence-parallel layout the devices allow and takes each
//! strategy family's best (the planner's own pick among them), keeps those priced within a margin of the fastest, and — after the
//! caller has run a few steps of each on the box — picks the one whose request is the
//! shortest with its measured step (the rest of the request as priced). The measuring is
//! the caller's (the CLI runs `mold exec` on each candidate in a child process); this
//! module only chooses, so the choice is tested without GPUs.

use crate::{Objective, Outcome, ParallelChoice, Request};
use mold_plan::{Plan, Residency};
use serde::Serialize;

/// How many placements tuning measures at most, and how far above the fastest price a
/// placement may be priced and still be measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TuneOptions {
    /// The most candidates measured (the planner's pick always among them).
    pub max_candidates: usize,
    /// A candidate priced above `(1 + margin) ×` the fastest priced step is not measured.
    pub margin: f64,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            max_candidates: 6,
            margin: 0.25,
        }
    }
}

/// One placement to measure.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The transformer's placement in a few words (`SP2 × TP2 on cuda:0–3`).
    pub label: String,
    /// The planner's outcome with this placement (its plan, families and evaluation).
    pub outcome: Outcome,
    /// Whether this is the plan `mold plan` picks without tuning.
    pub planner_pick: bool,
}

impl Candidate {
    pub fn plan(&self) -> &Plan {
        &self.outcome.plan
    }
    /// The priced step, seconds.
    pub fn predicted_step_s(&self) -> f64 {
        self.outcome.plan.predicted.step_time_s
    }
    /// The request with the step as `step_s` and the rest (encode, decode, whatever a
    /// step does not cover) as priced.
    pub fn request_with_step(&self, step_s: f64) -> f64 {
        let p = &self.outcome.plan.predicted;
        let steps = self.outcome.plan.workload.steps as f64;
        (p.request_time_s - p.denoise_time_s).max(0.0) + step_s * steps
    }
}

/// What measuring one candidate gave: its step's median, or why it has none.
pub type Measured = Result<f64, String>;

/// A candidate's step from its runs (fresh processes, a median of steps each): the
/// smallest — a slow start or a clock dip in one process lengthens its median, nothing
/// shortens it — or, where no run gave one, the first run's error.
pub fn combine(runs: &[Measured]) -> Measured {
    let best = runs
        .iter()
        .filter_map(|r| r.as_ref().ok().copied())
        .fold(None, |b: Option<f64>, x| Some(b.map_or(x, |b| b.min(x))));
    match (best, runs.first()) {
        (Some(s), _) => Ok(s),
        (None, Some(Err(e))) => Err(e.clone()),
        (None, _) => Err("not run".into()),
    }
}

/// One candidate's row in the tuning record.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TuneRow {
    pub label: String,
    pub planner_pick: bool,
    pub predicted_step_s: f64,
    /// The step: the smallest of the runs' medians ([`combine`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_step_s: Option<f64>,
    /// Each run's median step, in the order they ran.
    pub runs_s: Vec<f64>,
    /// The request with the measured step, the rest as priced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub chosen: bool,
}

/// Why tuning cannot run for a request, in one line naming the flag; `None` when it can.
pub fn refuse(req: &Request) -> Option<String> {
    match req.objective {
        Objective::Latency => None,
        o => Some(format!(
            "--tune measures steps to pick the fastest placement, which is the latency objective's aim; the objective here is {} (--objective, MOLD_OBJECTIVE or `objective` in config.toml): plan for latency or drop --tune",
            o.name()
        )),
    }
}

/// The placements to measure for `req`, whose plan (the planner's pick) is `pick`: the
/// pick first, then the best plan of every other tensor × sequence-parallel layout the
/// request leaves open (a layout given with `--tp N`/`--sp N`/`off` stays fixed) and of
/// every strategy family the pick's search priced, each transformer placement once, those priced within `opts.margin` of the fastest price, at
/// most `opts.max_candidates`, fastest price first after the pick. A layout no plan fits
/// is left out.
pub fn candidates(req: &Request, pick: Outcome, opts: &TuneOptions) -> Vec<Candidate> {
    let mut out = vec![Candidate {
        label: describe(&pick.plan),
        outcome: pick,
        planner_pick: true,
    }];
    let n = req.machine.devices.len() as u32;
    let tps = degrees(req.constraints.tp, n);
    let sps = degrees(req.constraints.sp, n);
    let mut dtype_req = req.clone();
    if let Some(t) = out[0].plan().transformer() {
        dtype_req.dtypes.insert("transformer".into(), t.dtype);
    }
    for &tp in &tps {
        for &sp in &sps {
            if tp * sp > n.max(1) {
                continue;
            }
            let mut r = dtype_req.clone();
            r.constraints.tp = choice(tp);
            r.constraints.sp = choice(sp);
            let Ok(o) = crate::plan(&r) else {
                continue;
            };
            if out.iter().any(|c| same_transformer(c.plan(), &o.plan)) {
                continue;
            }
            out.push(Candidate {
                label: describe(&o.plan),
                outcome: o,
                planner_pick: false,
            });
        }
    }
    // Each strategy family's best plan too: a mixed placement (one layout for the double
    // blocks, another for the single ones) is no single layout's. Without true CFG only,
    // where a family's choice is a plan as it stands.
    if !req.true_cfg() {
        for f in &out[0].outcome.families.clone() {
            let Some(choice) = &f.choice else {
                continue;
            };
            // In the pick's transformer dtype (FP8 where the pick is), as the layouts above.
            let mut plan =
                crate::plan_from_choice(&dtype_req, choice, f.family, "feasible", f.solve_time_ms);
            if crate::vae_bands::widen(&dtype_req, &mut plan, f.family).is_err() {
                continue;
            }
            if out.iter().any(|c| same_transformer(c.plan(), &plan)) {
                continue;
            }
            let first = &out[0].outcome;
            let o = Outcome {
                evaluation: mold_cost::evaluate(&plan, &dtype_req.model, &dtype_req.machine),
                plan,
                machine: first.machine.clone(),
                model: first.model.clone(),
                families: first.families.clone(),
                solve_time_ms: f.solve_time_ms,
                throughput: None,
                cfg_modes: vec![],
            };
            out.push(Candidate {
                label: describe(&o.plan),
                outcome: o,
                planner_pick: false,
            });
        }
    }
    let best = out
        .iter()
        .map(Candidate::predicted_step_s)
        .fold(f64::INFINITY, f64::min);
    let (first, mut rest) = (out.remove(0), out);
    rest.retain(|c| c.predicted_step_s() <= best * (1.0 + opts.margin.max(0.0)));
    rest.sort_by(|a, b| a.predicted_step_s().total_cmp(&b.predicted_step_s()));
    rest.truncate(opts.max_candidates.max(1) - 1);
    let mut all = vec![first];
    all.extend(rest);
    all
}

/// The candidate to keep: the shortest request with its measured step (the rest as
/// priced); ties go to the earlier candidate (the planner's pick first). `None` when no
/// candidate was measured.
pub fn choose(cands: &[Candidate], measured: &[Measured]) -> Option<usize> {
    cands
        .iter()
        .zip(measured)
        .enumerate()
        .filter_map(|(i, (c, m))| m.as_ref().ok().map(|&s| (i, c.request_with_step(s))))
        .fold(None, |best: Option<(usize, f64)>, (i, r)| match best {
            Some((_, b)) if b <= r => best,
            _ => Some((i, r)),
        })
        .map(|(i, _)| i)
}

/// The tuning record from each candidate's runs: a row per candidate, `chosen` marking
/// the kept one.
pub fn rows(cands: &[Candidate], runs: &[Vec<Measured>], chosen: Option<usize>) -> Vec<TuneRow> {
    cands
        .iter()
        .zip(runs)
        .enumerate()
        .map(|(i, (c, r))| {
            let m = combine(r);
            TuneRow {
                label: c.label.clone(),
                planner_pick: c.planner_pick,
                predicted_step_s: c.predicted_step_s(),
                measured_step_s: m.as_ref().ok().copied(),
                runs_s: r.iter().filter_map(|x| x.as_ref().ok().copied()).collect(),
                request_s: m.as_ref().ok().map(|&s| c.request_with_step(s)),
                error: m.as_ref().err().cloned(),
                chosen: chosen == Some(i),
            }
        })
        .collect()
}

/// The record as text, a line per candidate (`prefix` before each: `# ` in a plan file).
pub fn table(rows: &[TuneRow], prefix: &str) -> String {
    let w = rows.iter().map(|r| r.label.len()).max().unwrap_or(0).max(9);
    let mut s = format!(
        "{prefix}{:<w$}  {:>10}  {:>10}  {:>7}  {:>10}  runs\n",
        "placement", "priced", "measured", "dev.", "request"
    );
    for r in rows {
        let ms = |x: f64| format!("{:.1} ms", x * 1e3);
        let runs = r
            .runs_s
            .iter()
            .map(|x| format!("{:.1}", x * 1e3))
            .collect::<Vec<_>>()
            .join(", ");
        let (measured, dev, request) = match (r.measured_step_s, r.request_s) {
            (Some(m), Some(q)) => (
                ms(m),
                format!("{:+.1} %", (r.predicted_step_s - m) / m * 100.0),
                format!("{q:.3} s"),
            ),
            _ => ("failed".into(), String::new(), String::new()),
        };
        let mut marks = Vec::new();
        if r.chosen {
            marks.push("kept".to_string());
        }
        if r.planner_pick {
            marks.push("the cost model's pick".to_string());
        }
        if let Some(e) = &r.error {
            marks.push(e.clone());
        }
        let marks = if marks.is_empty() {
            String::new()
        } else {
            format!("  ({})", marks.join("; "))
        };
        s += &format!(
            "{prefix}{:<w$}  {:>10}  {measured:>10}  {dev:>7}  {request:>10}  {runs}{marks}\n",
            r.label,
            ms(r.predicted_step_s),
        );
    }
    s
}

/// The degrees a layout may take: the one given, or 1..=n when left to the planner.
fn degrees(c: ParallelChoice, n: u32) -> Vec<u32> {
    match c {
        ParallelChoice::Auto => (1..=n.max(1)).collect(),
        ParallelChoice::Off => vec![1],
        ParallelChoice::Degree(d) => vec![d],
    }
}

fn choice(d: u32) -> ParallelChoice {
    if d <= 1 {
        ParallelChoice::Off
    } else {
        ParallelChoice::Degree(d)
    }
}

/// Whether two plans place the transformer alike (parts, devices, layouts, residency).
fn same_transformer(a: &Plan, b: &Plan) -> bool {
    a.transformer().map(|t| (&t.parts, t.dtype)) == b.transformer().map(|t| (&t.parts, t.dtype))
        && a.cfg == b.cfg
        && a.replicas == b.replicas
}

/// The transformer's placement in a few words: each part's layout and devices, `+`
/// between the parts of a split.
pub fn describe(plan: &Plan) -> String {
    let Some(t) = plan.transformer() else {
        return "no transformer".into();
    };
    let parts: Vec<String> = t
        .parts
        .iter()
        .map(|p| {
            let layout = match (p.tp, p.sp) {
                (1, 1) => "1 GPU".to_string(),
                (tp, 1) => format!("TP{tp}"),
                (1, sp) => format!("SP{sp}"),
                (tp, sp) => format!("SP{sp} × TP{tp}"),
            };
            let on = devices(&p.devices);
            let streamed = if p.residency == Residency::Streamed {
                ", streamed"
            } else {
                ""
            };
            if t.parts.len() > 1 {
                let n = p.block_count();
                let blocks = if n == 1 { "block" } else { "blocks" };
                format!("{layout} on {on} ({n} {blocks}{streamed})")
            } else {
                format!("{layout} on {on}{streamed}")
            }
        })
        .collect();
    let mut s = parts.join(" + ");
    if let Some(c) = plan.cfg {
        s += &format!(", CFG {}", c.mode.name());
    }
    s
}

/// `cuda:0–3` for a run of ordinals of one kind, else the list.
fn devices(d: &[mold_plan::DeviceId]) -> String {
    let ords: Option<Vec<u32>> = d.iter().map(|x| x.ordinal()).collect();
    let kind = |x: &mold_plan::DeviceId| x.to_string().split(':').next().map(str::to_string);
    if let (Some(o), true) = (ords, d.len() > 2) {
        let same_kind = d.iter().all(|x| kind(x) == kind(&d[0]));
        if same_kind && o.windows(2).all(|w| w[1] == w[0] + 1) {
            return format!(
                "{}:{}–{}",
                kind(&d[0]).unwrap_or_default(),
                o[0],
                o[o.len() - 1]
            );
        }
    }
    d.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
