//! `mold plan --tune`'s planner side: the placements measured (the planner's pick first,
//! every other layout's best once, within the margin, at most the cap) and the pick by
//! measured step.

use mold_machine::Machine;
use mold_planner::tune::{self, Candidate, TuneOptions};
use mold_planner::{Objective, ParallelChoice, Request};

fn shipped(name: &str) -> Machine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Machine::load(&root.join(format!("sim/machines/{name}.yaml"))).unwrap()
}

fn flux_on(machine: &str) -> Request {
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    Request::new(model, shipped(machine), w)
}

/// No margin or cap in the way: every candidate.
const ALL: TuneOptions = TuneOptions {
    max_candidates: 100,
    margin: 100.0,
};

fn cands(req: &Request, opts: TuneOptions) -> Vec<Candidate> {
    let pick = mold_planner::plan(req).unwrap();
    tune::candidates(req, pick, &opts)
}

fn labels(c: &[Candidate]) -> Vec<String> {
    c.iter().map(|c| c.label.clone()).collect()
}

/// On the measured 4 × H100 profile with no margin or cap in the way, every layout the
/// four GPUs allow is a candidate once, the planner's pick first; each candidate's plan
/// keeps its layout and reads back.
#[test]
fn every_layout_once_with_the_pick_first() {
    let req = flux_on("4x-h100-measured");
    let all = ALL;
    let c = cands(&req, all);
    let pick = mold_planner::plan(&req).unwrap();
    assert!(c[0].planner_pick);
    assert_eq!(c[0].plan().components, pick.plan.components);
    assert!(c[1..].iter().all(|c| !c.planner_pick));
    let l = labels(&c);
    for want in [
        "1 GPU on cuda:0",
        "TP2 on cuda:0,cuda:1",
        "SP2 on cuda:0,cuda:1",
        "TP4 on cuda:0–3",
        "SP4 on cuda:0–3",
        "SP2 × TP2 on cuda:0–3",
    ] {
        assert_eq!(
            l.iter().filter(|x| x.as_str() == want).count(),
            1,
            "{want} once in {l:?}"
        );
    }
    for i in 0..c.len() {
        for j in 0..i {
            assert_ne!(
                c[i].plan().transformer().unwrap().parts,
                c[j].plan().transformer().unwrap().parts,
                "{l:?}"
            );
        }
        let back = mold_plan::Plan::from_yaml(&c[i].plan().to_yaml(), "c.yaml").unwrap();
        assert_eq!(&back, c[i].plan());
    }
}

/// The margin drops placements priced far above the fastest, the cap keeps the fastest
/// priced, and the pick stays whatever its price.
#[test]
fn margin_and_cap() {
    let req = flux_on("4x-h100-measured");
    let all = cands(&req, ALL);
    let best = all
        .iter()
        .map(Candidate::predicted_step_s)
        .fold(f64::INFINITY, f64::min);
    let near = cands(
        &req,
        TuneOptions {
            max_candidates: 100,
            margin: 0.25,
        },
    );
    assert!(near.len() < all.len(), "{:?}", labels(&near));
    assert!(near[1..]
        .iter()
        .all(|c| c.predicted_step_s() <= best * 1.25 + 1e-12));
    assert!(!labels(&near).contains(&"1 GPU on cuda:0".to_string()));
    let two = cands(
        &req,
        TuneOptions {
            max_candidates: 2,
            margin: 100.0,
        },
    );
    assert_eq!(two.len(), 2);
    assert!(two[0].planner_pick);
    let fastest_other = all[1..]
        .iter()
        .map(Candidate::predicted_step_s)
        .fold(f64::INFINITY, f64::min);
    assert_eq!(two[1].predicted_step_s(), fastest_other);
}

/// A layout the user fixed stays fixed: `--tp off` leaves sequence parallelism and one
/// GPU; `--sp off --tp 2` leaves TP2 groups (and single devices).
#[test]
fn a_given_layout_stays() {
    let mut req = flux_on("4x-h100-measured");
    let all = ALL;
    req.constraints.tp = ParallelChoice::Off;
    let c = cands(&req, all);
    assert!(c.iter().all(|c| c
        .plan()
        .transformer()
        .unwrap()
        .parts
        .iter()
        .all(|p| p.tp == 1)));
    assert!(labels(&c).contains(&"SP4 on cuda:0–3".to_string()));
    req.constraints.tp = ParallelChoice::Degree(2);
    req.constraints.sp = ParallelChoice::Off;
    // Every parallel group has the degree given (single devices stay allowed, as in the
    // planner's own search).
    let c = cands(&req, all);
    assert!(c.iter().all(|c| c
        .plan()
        .transformer()
        .unwrap()
        .parts
        .iter()
        .all(|p| (p.tp == 2 || p.degree() == 1) && p.sp == 1)));
    assert!(labels(&c).iter().any(|l| l.contains("TP2")));
}

/// The pick is the shortest request with the measured step, not the lowest price; a
/// failed measurement is never picked; ties go to the earlier; nothing measured, no pick.
#[test]
fn the_measured_fastest_is_kept() {
    let req = flux_on("4x-h100-measured");
    let c = cands(&req, ALL);
    assert!(c.len() >= 4);
    // The candidate priced slowest measures fastest.
    let slowest = (0..c.len())
        .max_by(|&a, &b| c[a].predicted_step_s().total_cmp(&c[b].predicted_step_s()))
        .unwrap();
    let mut m: Vec<tune::Measured> = c.iter().map(|c| Ok(c.predicted_step_s())).collect();
    m[slowest] = Ok(0.010);
    assert_eq!(tune::choose(&c, &m), Some(slowest));
    m[slowest] = Err("out of memory".into());
    let chosen = tune::choose(&c, &m).unwrap();
    assert_ne!(chosen, slowest);
    let runs: Vec<Vec<tune::Measured>> = m.iter().map(|x| vec![x.clone()]).collect();
    let rows = tune::rows(&c, &runs, Some(chosen));
    assert!(rows[chosen].chosen && rows.iter().filter(|r| r.chosen).count() == 1);
    assert_eq!(rows[slowest].error.as_deref(), Some("out of memory"));
    let text = tune::table(&rows, "# ");
    assert!(text.lines().all(|l| l.starts_with("# ")), "{text}");
    assert!(text.contains("kept") && text.contains("failed"), "{text}");
    // Ties: the earlier, the planner's pick first.
    let same: Vec<tune::Measured> = c.iter().map(|_| Ok(0.05)).collect();
    let steps = c[0].plan().workload.steps as f64;
    let rest = |c: &Candidate| c.request_with_step(0.05) - 0.05 * steps;
    let min_rest = c.iter().map(rest).fold(f64::INFINITY, f64::min);
    let first_min = c.iter().position(|x| rest(x) == min_rest).unwrap();
    assert_eq!(tune::choose(&c, &same), Some(first_min));
    let none: Vec<tune::Measured> = c.iter().map(|_| Err("x".to_string())).collect();
    assert_eq!(tune::choose(&c, &none), None);
}

/// Tuning measures latency: the other objectives are refused in one line naming the flag.
#[test]
fn other_objectives_are_refused() {
    let mut req = flux_on("4x-h100-measured");
    assert!(tune::refuse(&req).is_none());
    for o in [Objective::Memory, Objective::Throughput] {
        req.objective = o;
        let e = tune::refuse(&req).unwrap();
        assert!(
            e.contains("--tune") && e.contains(o.name()) && !e.contains('\n'),
            "{e}"
        );
    }
}

/// A candidate's step is its fastest run; errors count only where no run gave a step.
#[test]
fn runs_combine_to_the_fastest() {
    assert_eq!(tune::combine(&[Ok(0.061), Ok(0.057)]), Ok(0.057));
    assert_eq!(tune::combine(&[Err("oom".into()), Ok(0.07)]), Ok(0.07));
    assert_eq!(
        tune::combine(&[Err("oom".into()), Err("later".into())]),
        Err("oom".to_string())
    );
    assert!(tune::combine(&[]).is_err());
}

/// Each strategy family's best is a candidate too: on two GPUs the mixed placement (one
/// layout for the double blocks, another for the single ones) is measured whatever the
/// pick, and each family's plan once.
#[test]
fn every_family_best_is_a_candidate() {
    let mut req = flux_on("4x-h100-measured");
    req.machine = req
        .machine
        .select(&[mold_plan::DeviceId::Cuda(0), mold_plan::DeviceId::Cuda(1)])
        .unwrap();
    let pick = mold_planner::plan(&req).unwrap();
    let families: Vec<String> = pick
        .families
        .iter()
        .filter(|f| f.choice.is_some())
        .map(|f| f.family.name().to_string())
        .collect();
    let c = tune::candidates(&req, pick, &ALL);
    let strategies: Vec<&str> = c
        .iter()
        .map(|c| c.plan().solver.strategy.as_str())
        .collect();
    for f in &families {
        assert!(
            strategies.contains(&f.as_str()),
            "{f} not in {strategies:?}"
        );
    }
    assert!(
        labels(&c).iter().any(|l| l.contains(" + ")),
        "{:?}",
        labels(&c)
    );
}

/// Every candidate keeps the pick's transformer dtype: where `--allow-fp8` picked FP8 for
/// a request asked in bf16, the layouts and family bests are FP8 plans, priced and sized
/// as FP8.
#[test]
fn an_fp8_pick_keeps_fp8_candidates() {
    let req = flux_on("4x-h100-measured");
    let mut r8 = req.clone();
    r8.dtypes
        .insert("transformer".into(), mold_plan::DType::Fp8);
    let pick = mold_planner::plan(&r8).unwrap();
    let c = tune::candidates(&req, pick, &ALL);
    assert!(c.len() >= 3, "{:?}", labels(&c));
    for x in &c {
        assert_eq!(
            x.plan().transformer().unwrap().dtype,
            mold_plan::DType::Fp8,
            "{}",
            x.label
        );
    }
}
