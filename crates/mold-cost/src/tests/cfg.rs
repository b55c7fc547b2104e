//! True CFG's two passes a step (serial, parallel, pipelined) and memory by phase.

use super::{machine, MACHINE};
use crate::*;
use mold_plan::{
    BlockRange, CfgMode, CfgPlan, ComponentPlan, ComponentRole, DeviceId, MachineIdentity,
    MemoryPhases, Part, Plan, Residency, SolverRecord,
};

fn part(kind: &str, a: u32, b: u32, dev: u32) -> Part {
    Part {
        blocks: if kind.is_empty() {
            vec![]
        } else {
            vec![BlockRange::new(kind, a, b)]
        },
        devices: vec![DeviceId::Cuda(dev)],
        tp: 1,
        sp: 1,
        residency: Residency::Resident,
        stream_buffers: None,
    }
}

/// `model` with its components on cuda:0 and the transformer's `parts`.
fn plan_of(model: &str, parts: Vec<Part>, m: &Machine, mode: Option<CfgMode>) -> Plan {
    let spec = mold_models::find(model).unwrap();
    let mut components: Vec<ComponentPlan> = spec
        .components
        .iter()
        .map(|c| ComponentPlan {
            name: c.name.clone(),
            role: c.role,
            dtype: c.default_dtype,
            attention: None,
            parts: vec![part("", 0, 0, 0)],
        })
        .collect();
    components.push(ComponentPlan {
        name: "transformer".into(),
        role: ComponentRole::Transformer,
        dtype: spec.transformer.default_dtype,
        attention: None,
        parts,
    });
    Plan {
        version: mold_plan::PLAN_VERSION,
        model: mold_plan::ModelRef {
            id: spec.id.clone(),
            checkpoint: None,
        },
        workload: spec.default_workload.clone(),
        cfg: mode.map(|mode| CfgPlan { mode }),
        memory_phases: MemoryPhases::Resident,
        machine: MachineIdentity {
            name: m.name.clone(),
            fingerprint: m.fingerprint(),
            devices: vec![],
        },
        components,
        replicas: None,
        predicted: Evaluation::default_prediction(),
        solver: SolverRecord {
            solver: "hand".into(),
            status: "n/a".into(),
            objective: "latency".into(),
            objective_value: 0.0,
            strategy: "hand".into(),
            solve_time_ms: 0.0,
        },
    }
}

fn qwen() -> ModelSpec {
    mold_models::find("qwen-image").unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-30)
}

/// A split of qwen-image's 60 blocks, 30 on each of two identical devices.
fn split(mode: Option<CfgMode>) -> Plan {
    let m = machine();
    plan_of(
        "qwen-image",
        vec![part("block", 0, 30, 0), part("block", 30, 60, 1)],
        &m,
        mode,
    )
}

#[test]
fn a_pass_runs_the_workload_batch_and_serial_runs_two() {
    let m = machine();
    let model = qwen();
    let serial = split(Some(CfgMode::Serial));
    validate(&serial, &model, &m).unwrap();
    let e = evaluate(&serial, &model, &m);
    assert_eq!(Ctx::new(&model, &m, &serial.workload).batch, 1);
    assert_eq!(e.cfg, Some(CfgMode::Serial));
    assert!(close(e.step_s, 2.0 * e.pass_s), "{} {}", e.step_s, e.pass_s);
    // Without `cfg`, a cfg_scale runs serially too.
    let absent = split(None);
    assert_eq!(evaluate(&absent, &model, &m).step_s, e.step_s);
    // The pass is the sum of its stages and the hand-off.
    assert_eq!(e.stage_s.len(), 2);
    assert!(close(e.pass_s, e.stage_s[0] + e.stage_s[1] + e.handoff_s));
}

/// Two micro-batches through two equal stages take three stage times plus two
/// hand-offs (the one each pass makes, and the first stage's, which it waits for before
/// it takes the second micro-batch): 3/4 of the serial step, plus half a hand-off.
#[test]
fn pipelined_two_equal_stages_is_three_quarters_of_serial() {
    let m = machine();
    let model = qwen();
    let serial = evaluate(&split(Some(CfgMode::Serial)), &model, &m);
    let plan = split(Some(CfgMode::Pipelined));
    validate(&plan, &model, &m).unwrap();
    let piped = evaluate(&plan, &model, &m);
    let (t, h) = (piped.stage_s[0], piped.handoff_s);
    assert_eq!(piped.stage_s[0], piped.stage_s[1]);
    assert!(t > h && h > 0.0);
    assert!(close(piped.bottleneck_s, t + h), "{}", piped.bottleneck_s);
    assert!(
        close(piped.step_s, 3.0 * t + 2.0 * h),
        "{} {}",
        piped.step_s,
        3.0 * t + 2.0 * h
    );
    assert!(close(piped.step_s, 0.75 * serial.step_s + 0.5 * h));
    // Streamed weights are copied for each micro-batch: as often as serially.
    assert_eq!(piped.streamed_per_step, serial.streamed_per_step);
    // Unequal stages: the slower one is the bottleneck, (10 + 50) + 50 blocks' time.
    let uneven = plan_of(
        "qwen-image",
        vec![part("block", 0, 10, 0), part("block", 10, 60, 1)],
        &m,
        Some(CfgMode::Pipelined),
    );
    let u = evaluate(&uneven, &model, &m);
    assert!(u.stage_s[1] > u.stage_s[0]);
    assert!(close(
        u.step_s,
        u.stage_s[0] + 2.0 * u.stage_s[1] + u.handoff_s
    ));
}

/// The bottleneck of a pipeline whose stages make their own hand-offs: `t_i + h` for
/// every stage but the last, `t_n` for the last (it hands nothing on). Not the largest
/// of the stages and one hand-off, as if hand-offs ran on a resource of their own.
#[test]
fn pipelined_bottleneck_charges_each_hand_off_to_its_sender() {
    // The formula on its own, with figures where the old `max(t_i, h)` differs.
    assert_eq!(pipelined_bottleneck(&[], 1.0), 0.0);
    assert_eq!(pipelined_bottleneck(&[3.0], 1.0), 3.0);
    // Equal stages: t + h (the old form: t).
    assert_eq!(pipelined_bottleneck(&[2.0, 2.0], 0.5), 2.5);
    // A hand-off slower than every stage: t_1 + h (the old form: h).
    assert_eq!(pipelined_bottleneck(&[1.0, 1.0], 4.0), 5.0);
    // The slowest stage last hands nothing on; first, it does.
    assert_eq!(pipelined_bottleneck(&[1.0, 2.0, 4.0], 0.5), 4.0);
    assert_eq!(pipelined_bottleneck(&[4.0, 2.0, 1.0], 0.5), 4.5);
    // The last stage within a hand-off of an earlier one: the earlier one decides.
    assert_eq!(pipelined_bottleneck(&[2.0, 2.25], 0.5), 2.5);

    // Evaluated plans: qwen-image's 60 blocks over three identical devices.
    let m = super::machine4();
    let model = qwen();
    let three = |cuts: [u32; 2]| {
        let plan = plan_of(
            "qwen-image",
            vec![
                part("block", 0, cuts[0], 0),
                part("block", cuts[0], cuts[1], 1),
                part("block", cuts[1], 60, 2),
            ],
            &m,
            Some(CfgMode::Pipelined),
        );
        validate(&plan, &model, &m).unwrap();
        evaluate(&plan, &model, &m)
    };
    for cuts in [[20, 40], [10, 30], [30, 50], [25, 50]] {
        let e = three(cuts);
        let (t, h) = (&e.stage_s, e.handoff_s / 2.0);
        assert_eq!(t.len(), 3);
        assert!(h > 0.0);
        let want = (t[0] + h).max(t[1] + h).max(t[2]);
        assert!(
            close(e.bottleneck_s, want),
            "{cuts:?}: {} vs {want}",
            e.bottleneck_s
        );
        assert!(close(e.step_s, e.pass_s + want), "{cuts:?}");
        assert!(
            close(e.pass_s, t.iter().sum::<f64>() + e.handoff_s),
            "{cuts:?}"
        );
        // Where an earlier stage is the slowest, its hand-off counts: more than the
        // old `max(t_i, h)`.
        let old = t.iter().cloned().fold(h, f64::max);
        if t[2] < t[0].max(t[1]) + h {
            assert!(
                e.bottleneck_s > old,
                "{cuts:?}: {} vs {old}",
                e.bottleneck_s
            );
        } else {
            assert!(close(e.bottleneck_s, old), "{cuts:?}");
        }
    }
    // Equal stages: a stage and its hand-off; the slowest stage last (10, 20, 30
    // blocks): that stage alone.
    let even = three([20, 40]);
    assert!(close(
        even.bottleneck_s,
        even.stage_s[0] + even.handoff_s / 2.0
    ));
    let rising = three([10, 30]);
    assert!(close(rising.bottleneck_s, rising.stage_s[2]));
}

/// Two replicas at once: one pass, then the unconditional output to replica 0.
#[test]
fn parallel_is_half_of_serial_plus_the_combine() {
    let m = machine();
    let model = qwen();
    let one = |mode| plan_of("qwen-image", vec![part("block", 0, 60, 0)], &m, mode);
    let serial = evaluate(&one(Some(CfgMode::Serial)), &model, &m);
    let mut plan = one(Some(CfgMode::Parallel));
    plan.replicas = Some(mold_plan::shifted_replicas(
        &[DeviceId::Cuda(0)],
        &[vec![DeviceId::Cuda(0)], vec![DeviceId::Cuda(1)]],
    ));
    let e = evaluate(&plan, &model, &m);
    let ctx = Ctx::new(&model, &m, &plan.workload);
    let transfer = m.transfer_s(&DeviceId::Cuda(1), &DeviceId::Cuda(0), ctx.latent_bytes());
    assert!(transfer > 0.0);
    assert_eq!(e.combine_s, transfer);
    assert!(close(e.step_s, serial.step_s / 2.0 + transfer));
    // Each replica holds a transformer; only replica 0 the encoder and the VAE.
    let (d0, d1) = (&e.devices[0], &e.devices[1]);
    assert!(d0.phases.encode > 0 && d0.phases.decode > 0 && d0.phases.denoise > 0);
    assert_eq!((d1.phases.encode, d1.phases.decode), (0, 0));
    assert_eq!(d1.phases.denoise, d0.phases.denoise);
}

#[test]
fn one_shot_peaks_are_the_largest_phase() {
    let m = machine();
    let model = mold_models::find("qwen-image-tiny").unwrap();
    let mut plan = plan_of(
        "qwen-image-tiny",
        vec![part("block", 0, 3, 0)],
        &m,
        Some(CfgMode::Serial),
    );
    let resident = evaluate(&plan, &model, &m);
    plan.memory_phases = MemoryPhases::OneShot;
    let shot = evaluate(&plan, &model, &m);
    let (r, s) = (&resident.devices[0], &shot.devices[0]);
    assert_eq!(r.phases, s.phases);
    assert_eq!(r.peak, r.weights + r.buffers + r.activation);
    assert_eq!(s.peak, s.phases.max());
    assert!(s.peak < r.peak);
    // Encode: the text encoder's weights and activation; decode: the VAE's.
    let ctx = Ctx::new(&model, &m, &plan.workload);
    let enc = model.component("qwen2.5-vl").unwrap();
    let vae = model.component("vae").unwrap();
    assert_eq!(
        s.phases.encode,
        enc.weight_bytes(enc.default_dtype) + ctx.component_activation(enc, enc.default_dtype)
    );
    assert_eq!(
        s.phases.decode,
        vae.weight_bytes(vae.default_dtype) + ctx.component_activation(vae, vae.default_dtype)
    );
    // Every weight it loads, whatever the phases.
    assert_eq!(s.weights, r.weights);
}

#[test]
fn cfg_refusals() {
    let m = machine();
    // A guidance-distilled model with `cfg`.
    let flux = mold_models::find("flux-tiny").unwrap();
    let mut p = plan_of(
        "flux-tiny",
        vec![part("double", 0, 2, 0), part("single", 0, 3, 0)],
        &m,
        Some(CfgMode::Serial),
    );
    p.workload.cfg_scale = Some(4.0);
    let e = validate(&p, &flux, &m).unwrap_err().to_string();
    assert!(
        e.starts_with("cfg: flux-tiny has no true CFG") && !e.contains('\n'),
        "{e}"
    );
    // CFG-parallel whose pair does not fit: qwen-image whole on each 8 GiB device.
    let model = qwen();
    let mut p = plan_of(
        "qwen-image",
        vec![part("block", 0, 60, 0)],
        &m,
        Some(CfgMode::Parallel),
    );
    p.replicas = Some(mold_plan::shifted_replicas(
        &[DeviceId::Cuda(0)],
        &[vec![DeviceId::Cuda(0)], vec![DeviceId::Cuda(1)]],
    ));
    let e = validate(&p, &model, &m).unwrap_err().to_string();
    assert!(
        e.starts_with("cfg.mode: CFG-parallel does not fit on cuda:0"),
        "{e}"
    );
    // Its replicas are checked as placements, naming the replica.
    let big = Machine::from_yaml(
        &MACHINE.replace(
            "memory: 8GiB, budget: 8GiB",
            "memory: 800GiB, budget: 800GiB",
        ),
        "big",
    )
    .unwrap();
    validate(&p, &model, &big).unwrap();
}
