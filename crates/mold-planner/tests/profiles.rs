//! `mold plan` as users with mixed GPUs run it: random machine profiles (1–8 GPUs of
//! mixed memory and speed, with and without peer links, PCIe pairs each a node of its
//! own on a network, random headroom and pinned limits) × the catalogue's models, each
//! objective. Every instance answers within its time limit per family, never fails as a
//! whole because one family's search did (nor loses a family's plan to a solver
//! failure), and the plan it writes passes `mold sim` on its machine.

use mold_machine::{
    Calibration, Collective, Device, Host, InterNode, LinkKind, Links, Machine, NetworkKind,
    PeerDomain,
};
use mold_plan::{ByteSize, DeviceId, Plan, GIB};
use mold_planner::{with_solver_failing, Family, Method, Objective, PlanError, Request};
use proptest::prelude::*;
use std::time::{Duration, Instant};

/// GPUs of assorted sizes and speeds, some sharing one peer domain (NVLink), some PCIe
/// pairs, some none.
pub fn machine() -> impl Strategy<Value = Machine> {
    let device = (
        prop::sample::select(vec![8u64, 12, 16, 24, 32, 40, 48, 80, 96, 141]),
        0.0f64..2.0,  // GiB the CUDA context and others take
        0.25f64..3.0, // headroom, GiB
        20.0f64..1000.0,
        300.0f64..4800.0,
        any::<bool>(),
    );
    (
        prop::collection::vec(device, 1..=8),
        0u8..3,
        16u64..1024,
        0.0f64..1.5,
        5.0f64..64.0,
    )
        .prop_map(|(devs, peer, host_gib, pinned_frac, host_gbps)| {
            let ids: Vec<DeviceId> = (0..devs.len() as u32).map(DeviceId::Cuda).collect();
            let pairs = peer == 2;
            let devices = devs
                .iter()
                .enumerate()
                .map(|(i, (gib, taken, headroom, tflops, bw, fused))| {
                    let memory = gib * GIB;
                    Device {
                        id: ids[i].clone(),
                        name: format!("GPU {gib} GiB"),
                        memory: ByteSize(memory),
                        budget: ByteSize(memory - (taken * GIB as f64) as u64),
                        headroom: ByteSize((headroom * GIB as f64) as u64),
                        bf16_tflops: *tflops,
                        f32_tflops: None,
                        model_efficiency: None,
                        elementwise_efficiency: None,
                        mem_bandwidth_gbps: *bw,
                        fused_attention: *fused,
                        uuid: None,
                        pci_bus: None,
                        compute_capability: None,
                        // PCIe pairs: each pair a node of its own, on a network.
                        node: if pairs { i as u32 / 2 } else { 0 },
                    }
                })
                .collect();
            let peer = match peer {
                1 if ids.len() > 1 => vec![PeerDomain {
                    devices: ids.clone(),
                    kind: LinkKind::Nvlink,
                    gbps: 300.0,
                    allreduce: Collective {
                        latency_us: 10.0,
                        gbps: 200.0,
                    },
                }],
                2 => ids
                    .chunks_exact(2)
                    .map(|c| PeerDomain {
                        devices: c.to_vec(),
                        kind: LinkKind::Pcie,
                        gbps: 20.0,
                        allreduce: Collective {
                            latency_us: 30.0,
                            gbps: 15.0,
                        },
                    })
                    .collect(),
                _ => vec![],
            };
            let host_memory = host_gib * GIB;
            Machine {
                name: "random".into(),
                description: String::new(),
                calibration: Calibration {
                    source: "test".into(),
                    date: None,
                    mold_version: None,
                    notes: String::new(),
                },
                host: Host {
                    memory: ByteSize(host_memory),
                    pinned_limit: ByteSize((host_memory as f64 * pinned_frac) as u64),
                    tflops: 1.0,
                    mem_bandwidth_gbps: 100.0,
                    read_gbps: None,
                },
                devices,
                links: Links {
                    host_pinned_gbps: host_gbps,
                    host_pinned_busy_gbps: None,
                    host_pageable_gbps: host_gbps / 2.0,
                    peer,
                    host_staged_allreduce: Collective {
                        latency_us: 80.0,
                        gbps: 8.0,
                    },
                    inter_node: (pairs && ids.len() > 2).then_some(InterNode {
                        kind: NetworkKind::Ethernet,
                        gbps: 12.5,
                        latency_us: 20.0,
                    }),
                },
                ops: Vec::new(),
            }
        })
}

/// Plans `model` on `machine` and checks what the issue asked: an answer within the time
/// limit per family, and a written plan that the simulator accepts.
fn check(
    machine: Machine,
    model: &str,
    objective: Objective,
    limit: Duration,
) -> Result<(), TestCaseError> {
    let model = mold_models::find(model).unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, machine, w);
    req.objective = objective;
    req.time_limit = limit;
    let t = Instant::now();
    let r = mold_planner::plan(&req);
    let took = t.elapsed();
    // Six families, each within its limit and, where the solver gives no plan, a local
    // search within as long again (a fifth of a second at least); building and pricing
    // take a little beside (generously: CI's cores are shared).
    let fallback = limit.max(Duration::from_millis(200));
    prop_assert!(
        took <= (limit + fallback) * 6 + Duration::from_secs(2),
        "{} families took {took:?} with a {limit:?} limit each",
        req.model.id
    );
    // No plan is lost to the solver: it fails as a whole only where no family has a
    // plan, and a family whose solver failed answers by another search.
    let o = match r {
        Ok(o) => o,
        Err(PlanError::Infeasible(_)) => return Ok(()),
        // Every family without a plan ran out of time and none failed: a search too slow
        // for the limit (proving a mixed family infeasible can take the solver seconds),
        // not a solver failure.
        Err(PlanError::Solver(e)) if !e.contains("solver failed") => return Ok(()),
        Err(e) => return Err(TestCaseError::fail(format!("{}: {e}", req.model.id))),
    };
    for f in &o.families {
        prop_assert!(
            f.choice.is_some() || !f.status.contains("solver failed"),
            "{}: {:?}: {}",
            req.model.id,
            f.family,
            f.status
        );
    }
    for f in &o.families {
        prop_assert!(
            f.solve_time_ms <= (limit * 2 + Duration::from_millis(500)).as_secs_f64() * 1e3,
            "{:?}: {} ms",
            f.family,
            f.solve_time_ms
        );
    }
    // What `mold sim plan.yaml` does: read the file back, simulate on its machine.
    let plan = Plan::from_yaml(&o.plan.to_yaml(), "plan.yaml")
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(
        mold_cost::check_machine(&plan, &req.machine, false).ok(),
        Some(mold_cost::MachineCheck::Same)
    );
    let sim = mold_sim::simulate(&plan, &req.model, &req.machine)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(
        sim.fits(),
        "{}: the simulator refuses the plan: {}",
        req.model.id,
        sim.overflows
            .iter()
            .map(|o| o.message.clone())
            .collect::<Vec<_>>()
            .join("; ")
    );
    Ok(())
}

/// Random machines the stress test plans: `PROPTEST_CASES`, else 1,000 (the issue's
/// target; about two minutes on two cores, in debug as in release: the solver's time
/// limits, not the build, set its pace).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000)
}

proptest! {
    // The stress of the issue: 1,000 random machines, each with one model of the
    // catalogue and an objective drawn at random (every model on every machine would
    // take CI several minutes more). A short limit (150 ms a family, the default is 1 s)
    // makes the solver run out of time often, so the fallbacks are exercised too.
    #![proptest_config(ProptestConfig {
        cases: cases(),
        .. ProptestConfig::default()
    })]

    #[test]
    fn random_machines_plan_in_time_and_pass_the_simulator(
        machine in machine(),
        model in prop::sample::select(vec![
            "flux-dev", "flux-schnell", "qwen-image", "sd3.5-large", "z-image-turbo",
            "ltx-video-2b", "ltx-video-13b", "flux-tiny",
        ]),
        memory in prop::bool::weighted(0.3),
    ) {
        let objective = if memory { Objective::Memory } else { Objective::Latency };
        check(machine, model, objective, Duration::from_millis(150))?;
    }
}

/// A machine profile of the repository's `sim/machines/`.
fn shipped(name: &str) -> Machine {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    Machine::load(&root.join("sim/machines").join(format!("{name}.yaml"))).unwrap()
}

/// A machine saved under `tests/data/`.
fn saved(name: &str) -> Machine {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    Machine::load(&dir.join(format!("{name}.yaml"))).unwrap()
}

/// qwen-image on a saved machine of two 8 GiB GPUs over PCIe (resident phases, the
/// default workload and limit), by `objective`.
fn qwen_on(
    name: &str,
    objective: Objective,
) -> (Request, Result<mold_planner::Outcome, PlanError>) {
    let model = mold_models::find("qwen-image").unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, saved(name), w);
    req.objective = objective;
    let r = mold_planner::plan(&req);
    (req, r)
}

#[test]
fn qwen_image_on_two_8gib_gpus_over_pcie_gets_its_best_plan_from_the_mixed_family() {
    // The instances: microlp 0.6 failed on the mixed family ("Singular matrix"),
    // the best of them here, and `mold plan` fell back on tensor parallel (253 s a
    // request instead of 241 s, 2x8gib-pcie-a), or on another family (memory objective,
    // 2x8gib-pcie-c). With the program's time unit no longer set by the components'
    // seconds (`ilp.rs`) and microlp 0.7 (`lp.rs`), each of which alone ends that
    // failure, every family answers, proven.
    for (name, objective) in [
        ("2x8gib-pcie-a", Objective::Latency),
        ("2x8gib-pcie-c", Objective::Memory),
    ] {
        let (req, r) = qwen_on(name, objective);
        let o = r.unwrap();
        for f in &o.families {
            assert!(
                f.proven_optimal && f.method == Method::Solver,
                "{name}: {f:?}"
            );
        }
        assert_eq!(o.plan.solver.status, "optimal", "{name}");
        assert_eq!(mixed_row(&o).status, "optimal", "{name}");
        if objective == Objective::Latency {
            assert_eq!(o.plan.solver.strategy, "mixed", "{name}");
            assert!(
                o.evaluation.request_s < 245.0,
                "{name}: {}",
                o.evaluation.request_s
            );
        }
        check(req.machine, "qwen-image", objective, req.time_limit).unwrap();
    }
}

#[test]
fn where_the_solver_fails_as_it_did_on_qwen_image_over_pcie_the_local_search_answers() {
    // The failure itself, on its instances: microlp 0.6 on the program as it was
    // then failed with "Singular matrix" on the mixed family of qwen-image on
    // 2x8gib-pcie-a and 2x8gib-pcie-c, and `mold plan` lost that family's plan (on -a
    // the best of all: tensor parallel's 253.2 s a request was written instead of
    // 240.9 s). Today's solver proves those instances (the test above), so the failure
    // is injected where it happened. The local search answers the family, near the
    // optimum the solver proves, labelled as not proven optimal.
    let singular = "An unexpected error occurred while running the optimizer: Singular matrix.";
    for (name, objective) in [
        ("2x8gib-pcie-a", Objective::Latency),
        ("2x8gib-pcie-c", Objective::Memory),
    ] {
        let proven = qwen_on(name, objective).1.unwrap();
        let best = mixed_row(&proven).objective_value.unwrap();
        let (req, r) = with_solver_failing(&[Family::Mixed], singular, || qwen_on(name, objective));
        let o = r.unwrap();
        let mixed = mixed_row(&o);
        assert_eq!(mixed.method, Method::LocalSearch, "{name}");
        assert!(!mixed.proven_optimal, "{name}");
        assert!(
            mixed.status.starts_with(
                "best found by local search, not proven optimal (solver failed: \
                 An unexpected error occurred while running the optimizer: Singular matrix."
            ),
            "{name}: {}",
            mixed.status
        );
        let found = mixed.objective_value.unwrap();
        assert!(
            found >= best * (1.0 - 1e-9) && found <= best * 1.01,
            "{name}: {found} vs {best}"
        );
        // Not every family is proven, so neither is the plan.
        assert_eq!(o.plan.solver.status, "feasible", "{name}");
        if objective == Objective::Latency {
            assert_eq!(o.plan.solver.strategy, "mixed", "{name}");
            assert_eq!(
                o.plan.solver.solver,
                "local search, not proven optimal (microlp gave no plan)"
            );
            assert!(o.evaluation.request_s < 245.0, "{name}");
        }
        simulates(&o, &req);
    }
    // Every family failing: `mold plan` still writes the best plan there is, where
    // before it failed as a whole ("the solver failed").
    let (req, r) = with_solver_failing(&Family::ALL, singular, || {
        qwen_on("2x8gib-pcie-a", Objective::Latency)
    });
    let o = r.unwrap();
    assert!(o.families.iter().all(|f| !f.proven_optimal));
    assert_eq!(o.plan.solver.strategy, "mixed");
    assert!(o.evaluation.request_s < 245.0, "{}", o.evaluation.request_s);
    simulates(&o, &req);
}

/// The mixed family's row.
#[test]
fn where_microlp_fails_numerically_the_rescaled_program_answers() {
    // A random machine of the stress test above: flux-dev with the memory objective on a
    // 24 GiB and an 8 GiB GPU without peer links. microlp's dual simplex failed on the
    // split family ("the pivot element … is 2.0e-31"), the instance is too large to
    // enumerate, and the local search found no split plan, so the family had none. The
    // same program with rows and objective scaled to a largest coefficient of 1
    // (`lp.rs`) is solved: proven infeasible.
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, saved("24gib-8gib-no-peer"), w);
    req.objective = Objective::Memory;
    // Long enough for the rescaled program on a slow or busy test machine (its split
    // family took 282 ms of a 150 ms limit on a 2-core box), short of the default.
    req.time_limit = Duration::from_millis(2000);
    let o = mold_planner::plan(&req).unwrap();
    let split = o
        .families
        .iter()
        .find(|f| f.family == Family::Split)
        .unwrap();
    // The family is answered by the solver, proven: it does not fit, as with the latency
    // objective, where microlp never failed (nor does the local search find one).
    assert!(
        split.method == Method::Solver && split.proven_optimal && split.status == "does not fit",
        "{split:?}"
    );
    for f in &o.families {
        assert!(!f.status.contains("solver failed"), "{f:?}");
    }
    simulates(&o, &req);
    check(req.machine, "flux-dev", Objective::Memory, req.time_limit).unwrap();
}

fn mixed_row(o: &mold_planner::Outcome) -> &mold_planner::FamilyResult {
    o.families
        .iter()
        .find(|f| f.family == Family::Mixed)
        .unwrap()
}

/// `o`'s plan, read back from its YAML, passes the simulator on `req`'s machine.
fn simulates(o: &mold_planner::Outcome, req: &Request) {
    let plan = Plan::from_yaml(&o.plan.to_yaml(), "plan.yaml").unwrap();
    let sim = mold_sim::simulate(&plan, &req.model, &req.machine).unwrap();
    assert!(sim.fits(), "{:?}", sim.overflows);
}

#[test]
fn qwen_image_on_two_8gib_gpus_over_pcie_that_nothing_fits_says_so() {
    // The aborted plan: microlp 0.6 failed on the mixed family and `mold plan`
    // failed as a whole with "the solver failed". Nothing fits there: every family is
    // proven so, and the error says what does not fit.
    let (_, r) = qwen_on("2x8gib-pcie-b", Objective::Latency);
    match r {
        Err(PlanError::Infeasible(e)) => assert!(e.contains("transformer needs"), "{e}"),
        other => panic!("{:?}", other.map(|o| o.plan.solver)),
    }
    // Had the mixed family's solver failed as it did, the local search would find no
    // plan either, and proves nothing: the error says so, and why.
    let r = with_solver_failing(&[Family::Mixed], "Singular matrix.", || {
        qwen_on("2x8gib-pcie-b", Objective::Latency).1
    });
    match r {
        Err(e @ PlanError::Solver(_)) => assert_eq!(
            e.to_string(),
            "no plan found, nor a proof that none fits: mixed: solver failed: Singular matrix."
        ),
        other => panic!("{:?}", other.map(|o| o.plan.solver)),
    }
}

#[test]
fn a_budget_filled_to_the_last_megabyte_passes_the_simulator() {
    // The plan for one RTX 4090 streams what does not fit. Give the device exactly what
    // that plan needs (by mold_cost's closed form) plus a little: the simulator also holds
    // the T5 conditioning and the latents (≈ 4.5 MB) beside it, which the planner must
    // leave room for (it streams one block more), or `mold sim` refuses its plan.
    let base = shipped("1x-rtx4090");
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    let o = mold_planner::plan(&Request::new(model.clone(), base.clone(), w.clone())).unwrap();
    let peak = o.evaluation.devices[0].peak;
    for spare in [0u64, 1 << 20, 3 << 20] {
        let mut m = base.clone();
        m.devices[0].budget = ByteSize(peak + m.devices[0].headroom.0 + spare);
        m.devices[0].memory = m.devices[0].budget;
        let req = Request::new(model.clone(), m, w.clone());
        let o = mold_planner::plan(&req).unwrap();
        let sim = mold_sim::simulate(&o.plan, &req.model, &req.machine).unwrap();
        assert!(sim.fits(), "spare {spare}: {}", sim.overflows[0].message);
    }
}

#[test]
fn of_plans_alike_the_one_that_streams_least_is_chosen() {
    // flux-dev on one RTX 4090, one-shot phases (as `mold plan` runs it): streaming 3
    // blocks or 27 costs the same time (the copies hide behind compute). Of such plans
    // the one that streams least comes out: the 3 the GPU cannot hold (microlp 0.7
    // alone returned 27).
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, shipped("1x-rtx4090"), w);
    req.memory_phases = mold_plan::MemoryPhases::OneShot;
    let o = mold_planner::plan(&req).unwrap();
    let streamed: u32 = o
        .families
        .iter()
        .find(|f| f.family == Family::Single)
        .unwrap()
        .streamed_blocks
        .unwrap();
    assert_eq!(streamed, 3);
    assert_eq!(o.plan.solver.status, "optimal");
}

/// `m` with a flux-dev bf16 operation table for its first device's kind (no times:
/// blocks priced as without it), its CUDA libraries' memory `library` where given.
fn with_library_table(m: &Machine, library: Option<u64>) -> Machine {
    let mut t: mold_machine::OpTables = serde_yaml_ng::from_str(&format!(
        "{{model: flux-dev, dtype: bf16, device: {:?}, elementwise_gbps: 1000}}",
        m.devices[0].name
    ))
    .unwrap();
    t.library_bytes = library.map(ByteSize);
    let mut out = m.clone();
    out.set_op_tables(t);
    out
}

#[test]
fn measured_libraries_come_out_of_the_capacity_so_the_planner_streams_more() {
    // One RTX 4090 whose budget is what flux-dev's plan needs plus a MiB, the encoders
    // and the VAE kept on it: the planner fills it. With 200 MiB of CUDA libraries
    // measured in the profile the same budget holds 200 MiB less: the planner streams
    // more of the blocks' bytes, and its plan still fits by the cost model and the
    // simulator, both of which count the libraries; the plan made without them does not.
    let lib = 200 << 20;
    let model = mold_models::find("flux-dev").unwrap();
    let request = |m: &Machine| {
        let mut r = Request::new(model.clone(), m.clone(), model.default_workload.clone());
        r.constraints.host_components = false;
        r
    };
    let table = with_library_table(&shipped("1x-rtx4090"), None);
    let o = mold_planner::plan(&request(&table)).unwrap();
    let mut tight = table;
    let d = &mut tight.devices[0];
    d.budget = ByteSize(o.evaluation.devices[0].peak + d.headroom.0 + (1 << 20));
    d.memory = d.budget;
    let before = mold_planner::plan(&request(&tight)).unwrap();
    assert_eq!(before.evaluation.devices[0].libraries, 0);
    let req = request(&with_library_table(&tight, Some(lib)));
    let after = mold_planner::plan(&req).unwrap();
    let streamed = |o: &mold_planner::Outcome| o.evaluation.streamed_per_step;
    assert!(
        streamed(&after) > streamed(&before),
        "{} bytes streamed a step with the libraries, {} without",
        streamed(&after),
        streamed(&before)
    );
    let d = &after.evaluation.devices[0];
    assert_eq!(d.libraries, lib);
    assert!(d.fits(), "{d:?}");
    assert!(d.peak - lib < before.evaluation.devices[0].peak, "{d:?}");
    let sim = mold_sim::simulate(&after.plan, &req.model, &req.machine).unwrap();
    assert!(sim.fits(), "{}", sim.overflows[0].message);
    let sim = mold_sim::simulate(&before.plan, &req.model, &req.machine).unwrap();
    assert!(!sim.fits());
}

#[test]
fn qwen_image_on_eight_mixed_gpus_without_peer_links_answers_within_the_limit() {
    // The slow instance: qwen-image, eight mixed GPUs, no peer links, memory
    // objective (it ran over two minutes without finishing).
    let mut m = shipped("8x-l40s");
    m.links.peer.clear();
    for (i, d) in m.devices.iter_mut().enumerate() {
        let gib = [24u64, 48, 16, 80, 24, 48, 12, 40][i];
        d.memory = ByteSize(gib * GIB);
        d.budget = ByteSize(gib * GIB - GIB / 2);
        d.bf16_tflops = [150.0, 300.0, 80.0, 700.0, 150.0, 300.0, 60.0, 250.0][i];
    }
    check(
        m,
        "qwen-image",
        Objective::Memory,
        mold_planner::FAMILY_TIME_LIMIT,
    )
    .unwrap();
}

#[test]
fn a_family_whose_solver_gives_up_keeps_its_row_and_the_others_still_count() {
    // No time at all: the solver answers nothing in any family. flux-tiny's instance is
    // small, so the exhaustive enumerator answers each family instead, and says why.
    // (Without sequence parallel: its layouts take the four-device instance past the
    // enumerator's limit.)
    let machine = shipped("cpu-emu-4");
    let model = mold_models::find("flux-tiny").unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, machine, w);
    req.constraints.sp = mold_planner::SpChoice::Off;
    req.time_limit = Duration::from_nanos(1);
    let o = mold_planner::plan(&req).unwrap();
    use mold_planner::Family::{Hybrid, Sequence};
    assert!(o.families.iter().all(|f| match f.family {
        Sequence | Hybrid => f.status.starts_with("off (--sp off"),
        _ => f.method == Method::Exhaustive && f.status.contains("time limit"),
    }));
    assert_eq!(
        o.plan.solver.solver,
        "exhaustive enumeration (microlp failed)"
    );
    let sim = mold_sim::simulate(&o.plan, &req.model, &req.machine).unwrap();
    assert!(sim.fits());
}

#[test]
fn a_large_model_whose_solver_gives_up_gets_a_local_search_plan() {
    // No time at all on an instance too large to enumerate: the local search answers
    // every family that has a plan instead (before it, `mold plan` failed as a whole
    // with "the solver failed"). Its plan fits by the simulator, is labelled not proven
    // optimal, and costs little more than the solver's optimum.
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    let mut req = Request::new(model, shipped("2x-l40s"), w);
    let optimum = mold_planner::plan(&req).unwrap();
    assert_eq!(optimum.plan.solver.status, "optimal");
    req.time_limit = Duration::from_nanos(1);
    let o = mold_planner::plan(&req).unwrap();
    assert_eq!(
        o.plan.solver.solver,
        "local search, not proven optimal (microlp gave no plan)"
    );
    assert_eq!(o.plan.solver.status, "feasible");
    for (f, best) in o.families.iter().zip(&optimum.families) {
        assert_eq!(f.family, best.family);
        match (f.objective_value, best.objective_value) {
            (Some(v), Some(b)) => {
                assert_eq!(f.method, Method::LocalSearch);
                assert!(!f.proven_optimal, "{f:?}");
                assert!(
                    f.status
                        .starts_with("best found by local search, not proven optimal")
                        && f.status.contains("time limit"),
                    "{}",
                    f.status
                );
                assert!(v >= b * (1.0 - 1e-9) && v <= b * 1.05, "{f:?} vs {best:?}");
            }
            // No group of the layout on two GPUs, or none that fits.
            (None, None) => assert_eq!(f.status, best.status),
            _ => panic!("{f:?} vs {best:?}"),
        }
    }
    let sim = mold_sim::simulate(&o.plan, &req.model, &req.machine).unwrap();
    assert!(sim.fits());
}

/// On the measured 2 × H200 profile the planner weighs tensor parallel, sequence
/// parallel, the block split and their mixes for flux-dev: each layout forced on its own
/// (`--tp 2 --sp off`, `--sp 2`, `--tp off --sp off`) costs no less than the pick.
#[test]
fn the_pick_for_two_gpus_is_the_cheapest_layout() {
    use mold_planner::{SpChoice, TpChoice};
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    let req = |tp: TpChoice, sp: SpChoice| {
        let mut r = Request::new(model.clone(), shipped("2x-h200-measured"), w.clone());
        r.constraints.tp = tp;
        r.constraints.sp = sp;
        // Force the transformer over both GPUs, as the benchmarks compare them.
        r.constraints.pins.insert(
            "transformer".into(),
            vec![DeviceId::Cuda(0), DeviceId::Cuda(1)],
        );
        r
    };
    let pick = mold_planner::plan(&req(TpChoice::Auto, SpChoice::Auto)).unwrap();
    let forced = [
        ("tensor", req(TpChoice::Degree(2), SpChoice::Off)),
        ("sequence", req(TpChoice::Off, SpChoice::Degree(2))),
        ("split", req(TpChoice::Off, SpChoice::Off)),
    ];
    for (name, r) in forced {
        let o = mold_planner::plan(&r).unwrap();
        assert!(
            pick.evaluation.request_s <= o.evaluation.request_s * (1.0 + 1e-9),
            "{name}: {} beats the pick {}",
            o.evaluation.request_s,
            pick.evaluation.request_s
        );
    }
    // On the tables measured on that box, with the all-to-all's messages and the own piece
    // written in place: sequence parallel over every block. The box's own steps
    // (BENCHMARKS.md, 2026-11-28) put it at 76.1–77.6 ms, SP2 double + TP2 single at
    // 76.2–76.4 and TP2 at 80.6–81.2.
    assert_eq!(pick.plan.solver.strategy, "sequence");
    let t = pick.plan.transformer().unwrap();
    assert!(t.parts.iter().all(|p| (p.tp, p.sp) == (1, 2)));
}

/// `--sp 2` with `--tp 2` asks for hybrid groups of four.
#[test]
fn hybrid_when_both_degrees_are_fixed() {
    use mold_planner::{SpChoice, TpChoice};
    let model = mold_models::find("flux-dev").unwrap();
    let w = model.default_workload.clone();
    let mut r = Request::new(model, shipped("4x-h200-measured"), w);
    r.constraints.tp = TpChoice::Degree(2);
    r.constraints.sp = SpChoice::Degree(2);
    let o = mold_planner::plan(&r).unwrap();
    let t = o.plan.transformer().unwrap();
    assert!(t.parts.iter().any(|p| (p.tp, p.sp) == (2, 2)), "{t:?}");
    assert!(t.parts.iter().all(|p| p.devices.len() == 1 || p.sp == 2));
    let sim = mold_sim::simulate(&o.plan, &r.model, &r.machine).unwrap();
    assert!(sim.fits());
}

/// On two nodes of 8 × H100 the planner keeps every parallel group inside one node
/// (the network between them is slower than NVLink) and answers within its limits.
#[test]
fn two_h100_nodes_keep_parallel_groups_inside_a_node() {
    let m = shipped("2x8-h100-ib");
    for model in ["flux-dev", "qwen-image"] {
        check(
            m.clone(),
            model,
            Objective::Latency,
            mold_planner::FAMILY_TIME_LIMIT,
        )
        .unwrap();
        let spec = mold_models::find(model).unwrap();
        let w = spec.default_workload.clone();
        let o = mold_planner::plan(&Request::new(spec, m.clone(), w)).unwrap();
        let t = o.plan.transformer().unwrap();
        assert!(
            t.parts.iter().any(|p| p.devices.len() > 1),
            "{model}: {t:?}"
        );
        for p in &t.parts {
            assert!(!m.spans_nodes(&p.devices), "{model}: {:?}", p.devices);
        }
    }
}

/// Groups across nodes are candidates, priced over the network: on two nodes of two
/// L40S (whose own PCIe link is slow: 15 GB/s all-reduce) flux-dev runs sequence
/// parallel over all four GPUs across 100 Gb/s Ethernet, and keeps its parallel groups
/// inside a node over 10 Gb/s.
#[test]
fn a_group_crosses_nodes_only_when_the_network_makes_it_faster() {
    let fast = shipped("2x2-l40s-eth");
    let mut slow = fast.clone();
    let net = slow.links.inter_node.as_mut().unwrap();
    net.gbps = 1.0;
    net.latency_us = 50.0;
    let spec = mold_models::find("flux-dev").unwrap();
    let w = spec.default_workload.clone();
    let plan = |m: &Machine| {
        mold_planner::plan(&Request::new(spec.clone(), m.clone(), w.clone())).unwrap()
    };
    let (o_slow, o_fast) = (plan(&slow), plan(&fast));
    let crosses = |o: &mold_planner::Outcome, m: &Machine| {
        o.plan
            .transformer()
            .unwrap()
            .parts
            .iter()
            .any(|p| m.spans_nodes(&p.devices))
    };
    let t = o_slow.plan.transformer().unwrap();
    assert!(t.parts.iter().any(|p| p.devices.len() == 2), "{t:?}");
    assert!(!crosses(&o_slow, &slow), "{t:?}");
    assert!(crosses(&o_fast, &fast), "{:?}", o_fast.plan.transformer());
    assert!(o_fast.evaluation.request_s < o_slow.evaluation.request_s);
    // Each is the cheaper by the cost model: the other's plan, priced on this machine,
    // costs no less.
    let on = |o: &mold_planner::Outcome, m: &Machine| {
        let mut p = o.plan.clone();
        p.machine = m.identity();
        mold_cost::evaluate(&p, &spec, m).request_s
    };
    assert!(on(&o_fast, &slow) > o_slow.evaluation.request_s);
    assert!(on(&o_slow, &fast) > o_fast.evaluation.request_s);
}
