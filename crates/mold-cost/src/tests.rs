use super::*;
use mold_plan::{BlockRange, ComponentPlan, MachineIdentity, Part, SolverRecord};

pub const MACHINE: &str = r#"
name: unit
calibration: {source: spec-sheet}
host: {memory: 64GiB, pinned_limit: 1GiB, tflops: 1.0, mem_bandwidth_gbps: 50}
devices:
- {id: cuda:0, name: G, memory: 8GiB, budget: 8GiB, headroom: 1GiB, bf16_tflops: 10, f32_tflops: 10, mem_bandwidth_gbps: 1000}
- {id: cuda:1, name: G, memory: 8GiB, budget: 8GiB, headroom: 1GiB, bf16_tflops: 10, f32_tflops: 10, mem_bandwidth_gbps: 1000}
links:
  host_pinned_gbps: 1
  host_pageable_gbps: 0.5
  peer:
  - {devices: [cuda:0, cuda:1], kind: nvlink, gbps: 100, allreduce: {latency_us: 10, gbps: 50}}
"#;

fn machine() -> Machine {
    Machine::from_yaml(MACHINE, "unit").unwrap()
}

fn part(blocks: &[(&str, u32, u32)], devs: &[u32], streamed: bool) -> Part {
    Part {
        blocks: blocks
            .iter()
            .map(|(k, a, b)| BlockRange::new(k, *a, *b))
            .collect(),
        devices: devs.iter().map(|d| DeviceId::Cuda(*d)).collect(),
        residency: if streamed {
            Residency::Streamed
        } else {
            Residency::Resident
        },
        stream_buffers: if streamed { Some(2) } else { None },
    }
}

pub fn tiny_plan(parts: Vec<Part>) -> (Plan, ModelSpec) {
    let model = mold_models::find("flux-tiny").unwrap();
    let m = machine();
    let mut components: Vec<ComponentPlan> = model
        .components
        .iter()
        .map(|c| ComponentPlan {
            name: c.name.clone(),
            role: c.role,
            dtype: c.default_dtype,
            parts: vec![part(&[], &[0], false)],
        })
        .collect();
    components.push(ComponentPlan {
        name: "transformer".into(),
        role: ComponentRole::Transformer,
        dtype: DType::F32,
        parts,
    });
    let plan = Plan {
        version: 1,
        model: mold_plan::ModelRef {
            id: model.id.clone(),
            checkpoint: None,
        },
        workload: model.default_workload.clone(),
        machine: MachineIdentity {
            name: m.name.clone(),
            fingerprint: m.fingerprint(),
            devices: vec![],
        },
        components,
        predicted: Evaluation::default_prediction(),
        solver: SolverRecord {
            solver: "hand".into(),
            status: "n/a".into(),
            objective: "latency".into(),
            objective_value: 0.0,
            strategy: "hand".into(),
            solve_time_ms: 0.0,
        },
    };
    (plan, model)
}

#[test]
fn resident_chain_is_hand_computable() {
    let (plan, model) = tiny_plan(vec![part(
        &[("double", 0, 2), ("single", 0, 3)],
        &[0],
        false,
    )]);
    let m = machine();
    validate(&plan, &model, &m).unwrap();
    let e = evaluate(&plan, &model, &m);
    let t = model.tokens(&plan.workload);
    // Each block: max(FLOPs / 10 TFLOP/s, weights / 1000 GB/s); no collectives, no hand-off.
    let mut want = 0.0;
    for k in &model.transformer.kinds {
        let f = k.flops(t, 1, 1) / 10e12;
        let w = k.weight_bytes(DType::F32, 1) as f64 / 1000e9;
        want += k.count as f64 * f.max(w);
    }
    assert!((e.step_s - want).abs() < 1e-12, "{} vs {want}", e.step_s);
    assert_eq!(e.denoise_s, e.step_s * 4.0);
    assert_eq!(e.handoff_s, 0.0);
    let w: u64 = model.transformer.weight_bytes(DType::F32);
    let comps: u64 = model
        .components
        .iter()
        .map(|c| c.weight_bytes(c.default_dtype))
        .sum();
    assert_eq!(e.devices[0].weights, w + comps);
    assert_eq!(e.devices[1].peak, 0);
}

#[test]
fn streaming_is_max_of_copy_and_compute_plus_fill() {
    let (plan, model) = tiny_plan(vec![
        part(&[("double", 0, 2)], &[0], false),
        part(&[("single", 0, 3)], &[0], true),
    ]);
    let m = machine();
    validate(&plan, &model, &m).unwrap();
    let e = evaluate(&plan, &model, &m);
    let ctx = Ctx::new(&model, &m, &plan.workload);
    let (_, single) = model.transformer.kind("single").unwrap();
    let bc = ctx.block(single, &[DeviceId::Cuda(0)], DType::F32);
    // host_pinned_gbps = 1 GB/s: copy is the bottleneck.
    assert!(bc.copy_s > bc.compute_s);
    let want = 3.0 * bc.copy_s.max(bc.compute_s) + bc.copy_s.min(bc.compute_s);
    assert!((e.parts[1].total_s + e.fill_s - want).abs() < 1e-12);
    assert_eq!(e.devices[0].buffers, 2 * bc.weight_bytes);
    assert_eq!(e.host_pinned, 3 * bc.weight_bytes);
}

#[test]
fn tensor_parallel_pays_allreduce() {
    let (plan, model) = tiny_plan(vec![part(
        &[("double", 0, 2), ("single", 0, 3)],
        &[0, 1],
        false,
    )]);
    let m = machine();
    validate(&plan, &model, &m).unwrap();
    let e = evaluate(&plan, &model, &m);
    let t = model.tokens(&plan.workload);
    assert_eq!(plan.workload.effective_batch(), 1);
    // latency + 2(n−1)/n · S / bandwidth
    let collective = |bytes: u64| 10e-6 + 2.0 * 0.5 * bytes as f64 / 50e9;
    let ar = collective((t.img + t.txt) * 64 * 4);
    // Plus one all-gather of the modulation outputs per block: 2 × 6h per double block,
    // 3h per single block (h = 64, f32).
    let gather_double = collective(12 * 64 * 4);
    let gather_single = collective(3 * 64 * 4);
    let want = 2.0 * (2.0 * ar + gather_double) + 3.0 * (ar + gather_single);
    assert!(
        (e.parts[0].allreduce_s - want).abs() < 1e-12,
        "{} vs {want}",
        e.parts[0].allreduce_s
    );
    let comps: u64 = model
        .components
        .iter()
        .map(|c| c.weight_bytes(c.default_dtype))
        .sum();
    assert_eq!(
        e.devices[0].weights - comps,
        e.devices[1].weights,
        "TP shards evenly"
    );
    // Each rank holds the stem, half of every linear (the modulation included) and the
    // norm scales in full.
    let stem = model.transformer.stem_bytes(DType::F32);
    let half: u64 = model
        .transformer
        .kinds
        .iter()
        .map(|k| k.count as u64 * (4 * k.sharded_params() / 2 + 4 * k.replicated_params))
        .sum();
    assert_eq!(e.devices[1].weights, stem + half);
}

#[test]
fn validation_names_the_problem() {
    let m = machine();
    let cases: Vec<(Vec<Part>, &str)> = vec![
        (
            vec![part(&[("double", 0, 2), ("single", 0, 2)], &[0], false)],
            "single 2..3 are not placed",
        ),
        (
            vec![part(&[("double", 0, 2), ("single", 1, 3)], &[0], false)],
            "leaves a gap",
        ),
        (
            vec![
                part(&[("double", 0, 2), ("single", 0, 3)], &[0], false),
                part(&[("single", 2, 3)], &[1], false),
            ],
            "overlaps",
        ),
        (
            vec![part(&[("single", 0, 3), ("double", 0, 2)], &[0], false)],
            "execution order",
        ),
        (
            vec![part(&[("double", 0, 5)], &[0], false)],
            "runs past the last block",
        ),
        (
            vec![part(&[("triple", 0, 2)], &[0], false)],
            "not a block kind",
        ),
        (
            vec![part(
                &[("double", 0, 2), ("single", 0, 3)],
                &[0, 1, 2],
                false,
            )],
            "cuda:2 is not a device",
        ),
    ];
    for (parts, want) in cases {
        let (plan, model) = tiny_plan(parts);
        let e = validate(&plan, &model, &m).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[test]
fn machine_fingerprint_check() {
    let (plan, _) = tiny_plan(vec![part(
        &[("double", 0, 2), ("single", 0, 3)],
        &[0],
        false,
    )]);
    let m = machine();
    assert_eq!(check_machine(&plan, &m, false).unwrap(), MachineCheck::Same);
    let other = m.select(&[DeviceId::Cuda(0)]).unwrap();
    let e = check_machine(&plan, &other, false).unwrap_err().to_string();
    assert!(e.contains("--force"), "{e}");
    assert!(matches!(
        check_machine(&plan, &other, true).unwrap(),
        MachineCheck::Warn(_)
    ));
}

/// A size the model does not support is refused before anything is costed, naming the
/// field and the range; evaluated anyway, its bytes saturate, so it never "fits" by
/// wrapping round to a small number (as an unchecked u64 product would in release).
#[test]
fn huge_workloads_are_refused_and_never_fit() {
    let m = machine();
    let (mut plan, model) = tiny_plan(vec![part(
        &[("double", 0, 2), ("single", 0, 3)],
        &[0],
        false,
    )]);
    assert!(evaluate(&plan, &model, &m).fits());
    for (edit, want) in [
        (
            (|w: &mut Workload| w.width = 1 << 31) as fn(&mut Workload),
            "workload.width: 2147483648 is more than flux-tiny supports: use 16 to 2048",
        ),
        (|w| w.batch = u32::MAX, "workload.batch: 4294967295"),
    ] {
        let mut bad = plan.clone();
        edit(&mut bad.workload);
        let e = validate(&bad, &model, &m).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    // Every byte count at u32::MAX per side and batch: 2^32 · 2^32 · 2^32 · … wraps a
    // u64 many times over; saturated, the device's peak is u64::MAX, far over budget.
    plan.workload.width = u32::MAX;
    plan.workload.height = u32::MAX;
    plan.workload.batch = u32::MAX;
    let e = evaluate(&plan, &model, &m);
    assert!(!e.fits());
    assert_eq!(e.devices[0].peak, u64::MAX);
    assert!(e.devices[0].budget < u64::MAX / 2);
}
