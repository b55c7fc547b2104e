//! True CFG's modes (serial, parallel, pipelined) and memory phases in the planner.

use mold_machine::Machine;
use mold_plan::{ByteSize, CfgMode, DeviceId, MemoryPhases, Residency, GIB};
use mold_planner::{CfgChoice, Objective, Request, SpChoice, TpChoice};

fn shipped(name: &str) -> Machine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Machine::load(&root.join(format!("sim/machines/{name}.yaml"))).unwrap()
}

fn qwen(machine: Machine, phases: MemoryPhases) -> Request {
    let model = mold_models::find("qwen-image").unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, machine, w);
    req.memory_phases = phases;
    req
}

fn streamed(p: &mold_plan::Plan) -> u32 {
    p.transformer()
        .unwrap()
        .parts
        .iter()
        .filter(|x| x.residency == Residency::Streamed)
        .map(|x| x.block_count())
        .sum()
}

/// Two H200s each hold the whole transformer: the two passes run at once.
#[test]
fn parallel_on_two_h200_when_it_fits() {
    let o = mold_planner::plan(&qwen(shipped("2x-h200"), MemoryPhases::OneShot)).unwrap();
    assert_eq!(o.plan.cfg_mode(), Some(CfgMode::Parallel));
    assert_eq!(o.plan.replica_count(), 2);
    assert_eq!(o.cfg_modes.len(), 3);
    let chosen: Vec<_> = o.cfg_modes.iter().filter(|c| c.chosen).collect();
    assert_eq!(chosen.len(), 1);
    assert_eq!(chosen[0].mode, CfgMode::Parallel);
    // Faster than every other mode placed.
    for c in &o.cfg_modes {
        if let Some(t) = c.request_time_s {
            assert!(o.evaluation.request_s <= t + 1e-9, "{c:?}");
        }
    }
    // The written plan reads back, validates and simulates within budget.
    let back = mold_plan::Plan::from_yaml(&o.plan.to_yaml(), "p.yaml").unwrap();
    assert_eq!(back, o.plan);
    let r = mold_sim::simulate(&back, &o_model(), &o.machine).unwrap();
    assert!(r.fits(), "{:?}", r.overflows);
    // Asked for serial, it is serial, and slower.
    let mut req = qwen(shipped("2x-h200"), MemoryPhases::OneShot);
    req.cfg = CfgChoice::Mode(CfgMode::Serial);
    let s = mold_planner::plan(&req).unwrap();
    assert_eq!(s.plan.cfg_mode(), Some(CfgMode::Serial));
    assert!(s.evaluation.step_s > o.evaluation.step_s);
    assert!(s.cfg_modes.is_empty());
}

fn o_model() -> mold_models::ModelSpec {
    mold_models::find("qwen-image").unwrap()
}

/// 22 GiB a GPU (a 2 × 24 GB box's budget on 2x-h200): among splits, the two passes as
/// micro-batches through the two stages beat running them in turn.
#[test]
fn pipelined_under_a_22_gib_cap_beats_the_serial_split() {
    let mut m = shipped("2x-h200");
    for d in [DeviceId::Cuda(0), DeviceId::Cuda(1)] {
        m.cap_budget(&d, ByteSize(22 * GIB)).unwrap();
    }
    let mut req = qwen(m, MemoryPhases::OneShot);
    req.constraints.tp = TpChoice::Off;
    req.constraints.sp = SpChoice::Off;
    let o = mold_planner::plan(&req).unwrap();
    assert_eq!(o.plan.cfg_mode(), Some(CfgMode::Pipelined));
    assert_eq!(o.plan.solver.strategy, "split");
    assert_eq!(streamed(&o.plan), 0, "the pick runs without streaming");
    let row = |m: CfgMode| o.cfg_modes.iter().find(|c| c.mode == m).unwrap();
    let serial = row(CfgMode::Serial).step_time_s.unwrap();
    let piped = row(CfgMode::Pipelined).step_time_s.unwrap();
    assert!(piped < serial, "{piped} vs {serial}");
    // The same split run in turn: about 4/3 for two equal stages (a little under: both
    // hand off twice a step, in turn beside four stage times, pipelined beside three).
    let mut again = o.plan.clone();
    again.cfg = Some(mold_plan::CfgPlan {
        mode: CfgMode::Serial,
    });
    let in_turn = mold_cost::evaluate(&again, &req.model, &req.machine).step_s;
    let ratio = in_turn / o.evaluation.step_s;
    assert!(ratio > 1.25 && ratio < 1.34, "{ratio}");
    let r = mold_sim::simulate(&o.plan, &req.model, &req.machine).unwrap();
    assert!(r.fits(), "{:?}", r.overflows);
}

/// The text encoder (16.6 GB) parked on cuda:0 during denoising forced streaming; with
/// one-shot phases it is freed before the transformer loads. Both pipelined: the same
/// split of the same passes, only the phases differ. (Left to choose, one-shot takes
/// CFG-parallel on two streaming replicas, by under a millisecond a step, once each
/// stage of the pipelined split pays for its own hand-off.)
#[test]
fn one_shot_phases_stream_less_on_two_rtx4090() {
    let pipelined = |phases| {
        let mut req = qwen(shipped("2x-rtx4090"), phases);
        req.cfg = CfgChoice::Mode(CfgMode::Pipelined);
        mold_planner::plan(&req).unwrap()
    };
    let resident = pipelined(MemoryPhases::Resident);
    let shot = pipelined(MemoryPhases::OneShot);
    assert_eq!(shot.plan.cfg_mode(), Some(CfgMode::Pipelined));
    assert_eq!(streamed(&shot.plan), 0);
    assert!(
        streamed(&resident.plan) >= 20,
        "{}",
        streamed(&resident.plan)
    );
    assert!(
        streamed(&shot.plan) < streamed(&resident.plan),
        "{} vs {}",
        streamed(&shot.plan),
        streamed(&resident.plan)
    );
    assert!(shot.evaluation.request_s < resident.evaluation.request_s);
    assert_eq!(shot.plan.memory_phases, MemoryPhases::OneShot);
    assert_eq!(resident.plan.memory_phases, MemoryPhases::Resident);
}

/// Throughput keeps each replica's passes on its own devices: never CFG-parallel.
#[test]
fn throughput_replicas_run_their_passes_themselves() {
    let mut req = qwen(shipped("2x-h200"), MemoryPhases::Resident);
    req.objective = Objective::Throughput;
    let o = mold_planner::plan(&req).unwrap();
    assert_ne!(o.plan.cfg_mode(), Some(CfgMode::Parallel));
    mold_cost::validate(&o.plan, &req.model, &req.machine).unwrap();
}
