//! The local search (`mold plan`'s stand-in where the solver gives a family no plan on an
//! instance too large to enumerate), checked against the exhaustive enumeration on
//! instances small enough for it: on each family it finds a plan wherever one fits, a
//! plan of that family that fits every budget and the simulator, and costs no less than
//! the optimum and at most a little more.

use mold_machine::Machine;
use mold_planner::brute::{self, Space};
use mold_planner::{local, plan_from_choice, Family, Objective, Request, SpChoice};
use std::time::Duration;

fn shipped(name: &str) -> Machine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Machine::load(&root.join("sim/machines").join(format!("{name}.yaml"))).unwrap()
}

#[test]
fn local_search_is_near_the_exhaustive_optimum_on_small_instances() {
    let mut worst: f64 = 1.0;
    for (machine, objective) in [
        ("cpu-emu-4", Objective::Latency),
        ("cpu-emu-4", Objective::Memory),
        ("2x-rtx4090", Objective::Latency),
        ("rtx3090+rtx4060ti", Objective::Memory),
    ] {
        let model = mold_models::find("flux-tiny").unwrap();
        let w = model.default_workload.clone();
        let mut req = Request::new(model, shipped(machine), w);
        req.objective = objective;
        // Sequence parallel off: its layouts take the enumeration past a few seconds.
        req.constraints.sp = SpChoice::Off;
        let exact = brute::best_per_family(&req, Space::Aligned);
        for (i, family) in Family::ALL.into_iter().enumerate() {
            let found = local::best(&req, family, Duration::from_secs(10));
            let optimum = exact[i].0.as_ref();
            match (&found, optimum) {
                (Some(c), Some(o)) => {
                    let ratio = c.objective / o.objective;
                    assert!(ratio >= 1.0 - 1e-9, "{family:?}: {c:?} beats {o:?}");
                    worst = worst.max(ratio);
                    let plan = plan_from_choice(&req, c, family, "feasible", 0.0);
                    assert_eq!(plan.solver.strategy, family.name());
                    let ev = mold_cost::evaluate(&plan, &req.model, &req.machine);
                    assert!(ev.fits(), "{family:?}: {:?}", ev.devices);
                    let sim = mold_sim::simulate(&plan, &req.model, &req.machine).unwrap();
                    assert!(sim.fits(), "{family:?}: {:?}", sim.overflows);
                }
                (None, None) => {}
                _ => panic!(
                    "{machine} {objective:?} {family:?}: local {found:?}, exhaustive {optimum:?}"
                ),
            }
        }
    }
    assert!(worst <= 1.05, "{worst}");
}
