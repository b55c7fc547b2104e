//! `--objective throughput`: replicas of a placement on disjoint devices, or one group.

use mold_machine::Machine;
use mold_plan::DeviceId;
use mold_planner::{Objective, Outcome, PlanError, Request, Serving};
use proptest::prelude::*;
use std::sync::OnceLock;

fn shipped(name: &str) -> Machine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Machine::load(&root.join("sim/machines").join(format!("{name}.yaml"))).unwrap()
}

fn request(model: &str, machine: &str, clients: u32, max_latency_s: Option<f64>) -> Request {
    let model = mold_models::find(model).unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, shipped(machine), w);
    req.objective = Objective::Throughput;
    req.serving = Serving {
        clients,
        max_latency_s,
    };
    req
}

fn plan(req: &Request) -> Outcome {
    mold_planner::plan(req).unwrap()
}

/// (replicas, request seconds) of the pick.
fn pick(o: &Outcome) -> (u32, f64) {
    let t = o.throughput.as_ref().unwrap();
    let c = &t.candidates[t.chosen];
    (c.replicas, c.request_time_s.unwrap())
}

#[test]
fn flux_dev_on_two_h200_picks_two_replicas_for_eight_clients() {
    for machine in ["2x-h200", "2x-h200-measured"] {
        let o = plan(&request("flux-dev", machine, 8, None));
        let t = o.throughput.as_ref().unwrap();
        // Two widths: one group on both GPUs, and a replica on each.
        assert_eq!(t.candidates.len(), 2, "{machine}");
        assert_eq!(pick(&o).0, 2, "{machine}: {t:?}");
        let cuda = DeviceId::Cuda;
        assert_eq!(
            t.candidates[t.chosen].devices,
            [vec![cuda(0)], vec![cuda(1)]]
        );
        // The plan records the replicas, each on its own GPU, and passes validation.
        let p = &o.plan;
        assert_eq!(p.solver.objective, "throughput");
        let rs = p.replica_plans().unwrap();
        assert_eq!(rs.len(), 2);
        assert_eq!(
            rs.iter()
                .map(|r| r.placement_devices().into_iter().collect::<Vec<_>>())
                .collect::<Vec<_>>(),
            [vec![cuda(0)], vec![cuda(1)]]
        );
    }
}

#[test]
fn the_plan_with_replicas_passes_validation_and_reads_back() {
    let req = request("flux-dev", "2x-h200", 8, None);
    let o = plan(&req);
    mold_cost::validate(&o.plan, &req.model, &req.machine).unwrap();
    let back = mold_plan::Plan::from_yaml(&o.plan.to_yaml(), "t.yaml").unwrap();
    assert_eq!(back, o.plan);
}

#[test]
fn a_tight_latency_bound_picks_the_faster_single_group() {
    let o = plan(&request("flux-dev", "2x-h200", 8, None));
    let t = o.throughput.as_ref().unwrap();
    let group = t.candidates.iter().find(|c| c.replicas == 1).unwrap();
    let (_, replica_s) = pick(&o);
    let group_s = group.request_time_s.unwrap();
    assert!(group_s < replica_s, "{group_s} {replica_s}");
    // A bound between the two: only the group meets it.
    let bound = (group_s + replica_s) / 2.0;
    let o = plan(&request("flux-dev", "2x-h200", 8, Some(bound)));
    let (replicas, s) = pick(&o);
    assert_eq!((replicas, s), (1, group_s));
    assert!(o.plan.replicas.is_none());
    assert_eq!(o.plan.transformer().unwrap().parts[0].devices.len(), 2);
    let text = mold_planner::report::summary(&o);
    assert!(text.contains("request over the bound"), "{text}");
}

#[test]
fn one_client_picks_the_shortest_request() {
    let o = plan(&request("flux-dev", "2x-h200", 1, None));
    let t = o.throughput.as_ref().unwrap();
    let fastest = t
        .candidates
        .iter()
        .filter_map(|c| c.request_time_s)
        .fold(f64::INFINITY, f64::min);
    assert_eq!(pick(&o).1, fastest);
}

#[test]
fn refusals_name_the_flag() {
    let e = mold_planner::plan(&request("flux-dev", "2x-h200", 0, None))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("--clients 0:"), "{e}");
    let e = mold_planner::plan(&request("flux-dev", "2x-h200", 4, Some(f64::NAN)))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("--max-latency NaN:"), "{e}");
    let e = mold_planner::plan(&request("flux-dev", "2x-h200", 4, Some(0.01)));
    assert!(
        matches!(&e, Err(PlanError::Infeasible(m)) if m.starts_with("--max-latency 0.01: the fastest request takes")),
        "{e:?}"
    );
}

/// The four-device emulated machine: widths 4, 2 and 1.
fn emu_candidates() -> &'static Outcome {
    static O: OnceLock<Outcome> = OnceLock::new();
    O.get_or_init(|| plan(&request("flux-tiny", "cpu-emu-4", 4, None)))
}

#[test]
fn four_devices_give_widths_four_two_and_one() {
    let t = emu_candidates().throughput.as_ref().unwrap();
    let widths: Vec<u32> = t.candidates.iter().map(|c| c.width).collect();
    assert_eq!(widths, [4, 2, 1]);
    for c in &t.candidates {
        // Replicas on disjoint devices.
        let mut all: Vec<&DeviceId> = c.devices.iter().flatten().collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "{c:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// The pick has the most images per second among the candidates whose request is
    /// within the bound, recomputed here from each candidate's replicas and request time.
    #[test]
    fn the_pick_is_the_best_throughput_within_the_bound(
        clients in 1u32..12,
        bound_at in 0usize..4,
        slack in 0.9f64..1.1,
    ) {
        let base = emu_candidates().throughput.as_ref().unwrap();
        let times: Vec<f64> = base.candidates.iter().filter_map(|c| c.request_time_s).collect();
        let bound = times.get(bound_at).map(|t| t * slack);
        let within = |c: &mold_planner::ThroughputCandidate| {
            c.request_time_s.is_some_and(|r| bound.is_none_or(|b| r <= b))
        };
        let o = match mold_planner::plan(&request("flux-tiny", "cpu-emu-4", clients, bound)) {
            Ok(o) => o,
            Err(e) => {
                // Refused only when no candidate is within the bound.
                prop_assert!(!base.candidates.iter().any(within), "{e}");
                prop_assert!(e.to_string().contains("raise the bound"), "{e}");
                return Ok(());
            }
        };
        let t = o.throughput.as_ref().unwrap();
        let batch = o.plan.workload.batch as f64;
        let ips = |c: &mold_planner::ThroughputCandidate| {
            batch * c.replicas.min(clients) as f64 / c.request_time_s.unwrap()
        };
        let best = t
            .candidates
            .iter()
            .filter(|c| within(c))
            .map(ips)
            .fold(0.0, f64::max);
        let chosen = &t.candidates[t.chosen];
        prop_assert!(within(chosen));
        prop_assert!((ips(chosen) - best).abs() <= 1e-9 * best, "{} vs {best}", ips(chosen));
        prop_assert!((chosen.images_per_s.unwrap() - best).abs() <= 1e-9 * best);
    }
}
