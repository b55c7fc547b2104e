//! The CUDA libraries' measured device memory (`library_bytes` of a profile's operation
//! table) in every predicted peak: on each device the plan uses, in every phase.

use super::{machine, part, tiny_plan, MACHINE};
use crate::*;
use mold_plan::{MemoryPhases, MIB};

/// `MACHINE` with a flux-tiny table in `dtype` for its devices (`G`), with
/// `library_bytes: LIBRARY` where given.
fn with_table(dtype: &str, library: Option<&str>) -> Machine {
    let extra = library.map_or(String::new(), |l| format!(", library_bytes: {l}"));
    let yaml = format!(
        "{MACHINE}ops:\n- {{model: flux-tiny, dtype: {dtype}, device: G, elementwise_gbps: 1000{extra}}}\n"
    );
    Machine::from_yaml(&yaml, "unit").unwrap()
}

const LIB: u64 = 200 * MIB;

/// Each device's memory under `plan` on `m`, the plan validated first.
fn uses(plan: &mold_plan::Plan, m: &Machine) -> Vec<DeviceUse> {
    let model = mold_models::find("flux-tiny").unwrap();
    validate(plan, &model, m).unwrap();
    evaluate(plan, &model, m).devices
}

#[test]
fn library_bytes_raise_each_used_devices_peak_by_exactly_that() {
    let plain = machine();
    let table = with_table("f32", None);
    let lib = with_table("f32", Some("200MiB"));
    for phases in [MemoryPhases::Resident, MemoryPhases::OneShot] {
        // Everything on cuda:0; cuda:1 unused.
        let (mut plan, _) = tiny_plan(vec![part(
            &[("double", 0, 2), ("single", 0, 3)],
            &[0],
            false,
        )]);
        plan.memory_phases = phases;
        let before = uses(&plan, &plain);
        // A table without the field changes nothing (older profiles price as before).
        assert_eq!(uses(&plan, &table), before, "{phases:?}");
        let after = uses(&plan, &lib);
        let (b, a) = (&before[0], &after[0]);
        assert!(b.peak > 0);
        assert_eq!(a.peak, b.peak + LIB, "{phases:?}");
        assert_eq!(a.libraries, LIB);
        assert_eq!(b.libraries, 0);
        assert_eq!(a.phases.encode, b.phases.encode + LIB);
        assert_eq!(a.phases.denoise, b.phases.denoise + LIB);
        assert_eq!(a.phases.decode, b.phases.decode + LIB);
        assert_eq!(
            (a.weights, a.buffers, a.activation),
            (b.weights, b.buffers, b.activation)
        );
        // The unused device holds nothing, libraries included.
        assert_eq!((after[1].peak, after[1].libraries), (0, 0), "{phases:?}");
        assert_eq!(after[1].phases, PhasePeaks::default());
    }
    // A split over both devices (components on cuda:0): both hold the libraries.
    let (plan, _) = tiny_plan(vec![
        part(&[("double", 0, 2)], &[0], false),
        part(&[("single", 0, 3)], &[1], false),
    ]);
    let before = uses(&plan, &plain);
    let after = uses(&plan, &lib);
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(a.peak, b.peak + LIB, "{}", a.device);
        assert_eq!(a.libraries, LIB);
    }
    // A table of another dtype than the transformer's does not apply.
    assert_eq!(uses(&plan, &with_table("bf16", Some("200MiB"))), before);
    // The plan's prediction carries it (rounded up to MiB, as every peak).
    let model = mold_models::find("flux-tiny").unwrap();
    let p0 = evaluate(&plan, &model, &plain).prediction();
    let p1 = evaluate(&plan, &model, &lib).prediction();
    assert_eq!(p1.devices[0].peak.0, p0.devices[0].peak.0 + LIB);
}

/// The per-device figure the simulator and the planner share: 0 where the plan puts
/// nothing.
#[test]
fn plan_libraries_names_the_devices_the_plan_uses() {
    let lib = with_table("f32", Some("200MiB"));
    let (plan, model) = tiny_plan(vec![part(
        &[("double", 0, 2), ("single", 0, 3)],
        &[1],
        false,
    )]);
    let ctx = Ctx::new(&model, &lib, &plan.workload);
    // The components on cuda:0, the transformer on cuda:1: both.
    assert_eq!(plan_libraries(&plan, &ctx), vec![LIB, LIB]);
    assert_eq!(
        ctx.library_bytes(&mold_plan::DeviceId::Host, mold_plan::DType::F32),
        0
    );
    let plain = machine();
    let ctx = Ctx::new(&model, &plain, &plan.workload);
    assert_eq!(plan_libraries(&plan, &ctx), vec![0, 0]);
}
