use super::*;
use mold_plan::{
    BlockRange, ComponentPlan, ComponentRole, MachineIdentity, Part, Plan, Residency, SolverRecord,
};

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

/// Four devices in one NVLink domain, for sequence-parallel and hybrid layouts.
fn machine4() -> Machine {
    let text = MACHINE
        .replace(
            "links:",
            "- {id: cuda:2, name: G, memory: 8GiB, budget: 8GiB, headroom: 1GiB, bf16_tflops: 10, f32_tflops: 10, mem_bandwidth_gbps: 1000}\n- {id: cuda:3, name: G, memory: 8GiB, budget: 8GiB, headroom: 1GiB, bf16_tflops: 10, f32_tflops: 10, mem_bandwidth_gbps: 1000}\nlinks:",
        )
        .replace("[cuda:0, cuda:1]", "[cuda:0, cuda:1, cuda:2, cuda:3]");
    Machine::from_yaml(&text, "unit4").unwrap()
}

/// A part on `devs` laid out as `sp` groups of `tp` devices.
fn layout_part(blocks: &[(&str, u32, u32)], devs: &[u32], tp: u32, sp: u32) -> Part {
    Part {
        tp,
        sp,
        ..part(blocks, devs, false)
    }
}

fn part(blocks: &[(&str, u32, u32)], devs: &[u32], streamed: bool) -> Part {
    Part {
        blocks: blocks
            .iter()
            .map(|(k, a, b)| BlockRange::new(k, *a, *b))
            .collect(),
        devices: devs.iter().map(|d| DeviceId::Cuda(*d)).collect(),
        tp: devs.len() as u32,
        sp: 1,
        residency: if streamed {
            Residency::Streamed
        } else {
            Residency::Resident
        },
        stream_buffers: if streamed { Some(2) } else { None },
    }
}

pub fn tiny_plan(parts: Vec<Part>) -> (Plan, ModelSpec) {
    tiny_plan_on(parts, &machine())
}

fn tiny_plan_on(parts: Vec<Part>, m: &Machine) -> (Plan, ModelSpec) {
    let (mut plan, mut model) = plan_on("flux-tiny", parts, m);
    // The hand computations price every step's own modulation;
    // `modulation_ahead_is_read_once_a_window` prices it computed ahead.
    model.transformer.modulation_ahead = false;
    if let Some(t) = plan
        .components
        .iter_mut()
        .find(|c| c.role == ComponentRole::Transformer)
    {
        t.dtype = DType::F32;
    }
    (plan, model)
}

/// `model` with its components on cuda:0 and the transformer's `parts`, in its default
/// dtypes.
fn plan_on(model: &str, parts: Vec<Part>, m: &Machine) -> (Plan, ModelSpec) {
    let model = mold_models::find(model).unwrap();
    let mut components: Vec<ComponentPlan> = model
        .components
        .iter()
        .map(|c| ComponentPlan {
            name: c.name.clone(),
            role: c.role,
            dtype: c.default_dtype,
            attention: None,
            parts: vec![part(&[], &[0], false)],
        })
        .collect();
    components.push(ComponentPlan {
        name: "transformer".into(),
        role: ComponentRole::Transformer,
        dtype: model.transformer.default_dtype,
        attention: None,
        parts,
    });
    let plan = Plan {
        version: mold_plan::PLAN_VERSION,
        model: mold_plan::ModelRef {
            id: model.id.clone(),
            checkpoint: None,
        },
        workload: model.default_workload.clone(),
        cfg: None,
        memory_phases: Default::default(),
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
    // Each block: max(FLOPs / 10 TFLOP/s, weights / 1000 GB/s) + element-wise bytes /
    // 1000 GB/s; no collectives, no hand-off.
    let mut want = 0.0;
    for k in &model.transformer.kinds {
        let f = k.flops(t, 1, 1) / 10e12;
        let w = k.weight_bytes(DType::F32, 1) as f64 / 1000e9;
        // Per token: 7h per sub-block (norm + modulation, bias + gate + residual) and
        // 12h + 2·mlp (q/k/v bias and preparation, MLP activation), f32.
        let per_token = 7 * k.hidden * k.allreduces as u64 + 12 * k.hidden + 2 * k.mlp_hidden;
        let ew = ((t.img + t.txt) * per_token * 4) as f64 / 1000e9;
        want += k.count as f64 * (f.max(w) + ew);
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

/// FLUX computes its blocks' modulation ahead, one window of steps at once
/// (`mold_models::modulation_windows`): a step reads the per-sample weights once per
/// window over the steps, gathers their outputs once a window under TP, and every device
/// holds the window's outputs.
#[test]
fn modulation_ahead_is_read_once_a_window() {
    let parts = || vec![part(&[("double", 0, 2), ("single", 0, 3)], &[0, 1], false)];
    let m = machine();
    let (plan, off) = tiny_plan(parts());
    let mut on = off.clone();
    on.transformer.modulation_ahead = true;
    let mut w = plan.workload.clone();
    // 20 steps: windows of 16 and 4.
    w.steps = 20;
    assert_eq!(mold_models::modulation_windows(20), [16, 4]);
    let g = Group::tensor(vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]);
    let t = on.tokens(&w);
    let collective = |bytes: u64| 10e-6 + 2.0 * 0.5 * bytes as f64 / 50e9;
    for k in &on.transformer.kinds {
        let a = Ctx::new(&on, &m, &w).block(k, &g, DType::F32);
        let b = Ctx::new(&off, &m, &w).block(k, &g, DType::F32);
        // Compute: FLOPs / 10 TFLOP/s against the weights read at 1000 GB/s, the
        // per-sample half-weights read in 2 windows of 20 steps.
        let f = (k.flop_parts(t).token_linear / 2.0
            + k.flop_parts(t).attention / 2.0
            + k.flop_parts(t).per_sample / 2.0
            + k.flop_parts(t).replicated)
            / 10e12;
        let per_sample = (4 * k.per_sample_params / 2) as f64;
        let reads = k.weight_bytes(DType::F32, 2) as f64 - per_sample * (1.0 - 2.0 / 20.0);
        let ew = b.compute_s - (k.weight_bytes(DType::F32, 2) as f64 / 1000e9).max(f);
        assert!(
            (a.compute_s - ((reads / 1000e9).max(f) + ew)).abs() < 1e-15,
            "{}: {} vs {}",
            k.name,
            a.compute_s,
            (reads / 1000e9).max(f) + ew
        );
        // (Fewer bytes read: no slower, faster where the weights set the pace.)
        assert!(a.compute_s <= b.compute_s, "{}", k.name);
        // The all-gather of 16 then 4 steps' outputs, a twentieth each a step.
        let out = k.per_sample_bytes(1, 4);
        let gathers = (collective(16 * out) + collective(4 * out)) / 20.0;
        let ar = k.allreduces as f64 * collective((t.img + t.txt) * k.hidden * 4);
        assert!((a.allreduce_s - (ar + gathers)).abs() < 1e-15, "{}", k.name);
        assert!(
            (b.allreduce_s - (ar + collective(out))).abs() < 1e-15,
            "{}",
            k.name
        );
        // Held: every block's outputs for 16 steps, f32.
        let held: u64 = on
            .transformer
            .kinds
            .iter()
            .map(|k| k.count as u64 * 16 * k.per_sample_bytes(1, 4))
            .sum();
        assert_eq!(a.activation_bytes, b.activation_bytes + held, "{}", k.name);
    }
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
    let bc = ctx.block(single, &Group::single(DeviceId::Cuda(0)), DType::F32);
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

/// Sequence parallel over two devices: each rank runs the per-token linears on half the
/// tokens and attention on half the heads over the whole sequence, holds every weight,
/// and pays two all-to-alls per block (less what the single block's MLP products hide)
/// and one all-gather at the end of the part.
#[test]
fn sequence_parallel_is_hand_computable() {
    let m = machine();
    let (plan, model) = tiny_plan(vec![layout_part(
        &[("double", 0, 2), ("single", 0, 3)],
        &[0, 1],
        1,
        2,
    )]);
    validate(&plan, &model, &m).unwrap();
    let e = evaluate(&plan, &model, &m);
    let t = model.tokens(&plan.workload);
    let all = t.img + t.txt;
    let local = all.div_ceil(2);
    let link = |bytes: f64| 10e-6 + bytes / 50e9;
    let mut want = 0.0;
    for k in &model.transformer.kinds {
        let f = k.flop_parts(t);
        let flops = f.token_linear * local as f64 / all as f64
            + f.attention / 2.0
            + f.per_sample
            + f.replicated;
        let w = k.weight_bytes(DType::F32, 1) as f64 / 1000e9;
        let per_token = 7 * k.hidden * k.allreduces as u64 + 12 * k.hidden + 2 * k.mlp_hidden;
        let ew = (local * per_token * 4) as f64 / 1000e9;
        // q/k/v stacked (3 shards) then the output (1), each sending the half of this
        // rank's (tokens/2 × hidden) shards it does not keep; the copy (the output's
        // pieces joined) moves 2 shards through memory at 1000 GB/s.
        let shard = (local * k.hidden * 4) as f64;
        // The single block's MLP products run beside its all-to-alls (one peer domain):
        // each all-to-all costs only what its product does not hide.
        let beside = crate::ops::beside_all_to_alls(k, t, 1, 1, 2).map(|g| {
            g.map(|g| {
                let flops = 2.0 * (g.m * g.n * g.k) as f64;
                (flops / 10e12).max((g.n * g.k * 4) as f64 / 1000e9)
            })
        });
        assert_eq!(beside.is_some(), k.name == "single", "{}", k.name);
        let [b0, b1] = beside.unwrap_or([0.0, 0.0]);
        let a2a = (link(3.0 * shard / 2.0) - b0).max(0.0)
            + (link(shard / 2.0) - b1).max(0.0)
            + 2.0 * shard / 1000e9;
        want += k.count as f64 * ((flops / 10e12).max(w) + ew + a2a);
        assert_eq!(
            Ctx::new(&model, &m, &plan.workload)
                .block(
                    k,
                    &Group::of(&plan.transformer().unwrap().parts[0]),
                    DType::F32
                )
                .allreduce_s,
            0.0,
            "no all-reduce without tensor parallel"
        );
    }
    let gather = link((all * 64 * 4) as f64 / 2.0);
    assert!(
        (e.gather_s - gather).abs() < 1e-15,
        "{} vs {gather}",
        e.gather_s
    );
    want += gather;
    assert!((e.step_s - want).abs() < 1e-12, "{} vs {want}", e.step_s);
    // Every rank holds all the weights (and the stem).
    let comps: u64 = model
        .components
        .iter()
        .map(|c| c.weight_bytes(c.default_dtype))
        .sum();
    let w = model.transformer.weight_bytes(DType::F32);
    assert_eq!(e.devices[0].weights, w + comps);
    assert_eq!(e.devices[1].weights, w);
    // Activations on half the tokens: less than one device's.
    let (one, _) = tiny_plan(vec![part(
        &[("double", 0, 2), ("single", 0, 3)],
        &[1],
        false,
    )]);
    let e1 = evaluate(&one, &model, &m);
    assert!(e.devices[1].activation < e1.devices[1].activation);
}

/// Hybrid SP2 × TP2 on four devices: weights halved (tensor parallel), tokens halved
/// (sequence parallel); the all-reduces run in each tensor-parallel pair over its token
/// shard, the all-to-alls in each sequence-parallel pair over its head shard.
#[test]
fn hybrid_layout_combines_both() {
    let m = machine4();
    let blocks = [("double", 0, 2), ("single", 0, 3)];
    let (hybrid, model) = tiny_plan_on(vec![layout_part(&blocks, &[0, 1, 2, 3], 2, 2)], &m);
    let (tp4, _) = tiny_plan_on(vec![layout_part(&blocks, &[0, 1, 2, 3], 4, 1)], &m);
    let (sp4, _) = tiny_plan_on(vec![layout_part(&blocks, &[0, 1, 2, 3], 1, 4)], &m);
    let (tp2, _) = tiny_plan_on(vec![layout_part(&blocks, &[0, 1], 2, 1)], &m);
    for p in [&hybrid, &tp4, &sp4, &tp2] {
        validate(p, &model, &m).unwrap();
    }
    let ctx = Ctx::new(&model, &m, &hybrid.workload);
    let t = model.tokens(&hybrid.workload);
    let local = (t.img + t.txt).div_ceil(2);
    let g = Group::of(&hybrid.transformer().unwrap().parts[0]);
    assert_eq!(g.tp_groups()[1], [DeviceId::Cuda(2), DeviceId::Cuda(3)]);
    assert_eq!(g.sp_groups()[1], [DeviceId::Cuda(1), DeviceId::Cuda(3)]);
    let (_, double) = model.transformer.kind("double").unwrap();
    let bc = ctx.block(double, &g, DType::F32);
    let link = |bytes: f64, n: f64| 10e-6 + bytes / 50e9 * n;
    // Two all-reduces of the token shard's hidden state between 2 ranks, plus the
    // modulation all-gather (12h outputs).
    let want_ar = 2.0 * link((local * 64 * 4) as f64, 1.0) + link((12 * 64 * 4) as f64, 1.0);
    assert!(
        (bc.allreduce_s - want_ar).abs() < 1e-15,
        "{} vs {want_ar}",
        bc.allreduce_s
    );
    // The stacked q/k/v (3 shards of (tokens/2) × (hidden/2)) and the output (1), half
    // of each sent, and 2 shards of copies at 1000 GB/s.
    let shard = (local * 32 * 4) as f64;
    let want_a2a = link(3.0 * shard / 2.0, 1.0) + link(shard / 2.0, 1.0) + 2.0 * shard / 1000e9;
    assert!(
        (bc.alltoall_s - want_a2a).abs() < 1e-15,
        "{} vs {want_a2a}",
        bc.alltoall_s
    );
    let ev = |p: &Plan| evaluate(p, &model, &m);
    let (h, t4, s4, t2) = (ev(&hybrid), ev(&tp4), ev(&sp4), ev(&tp2));
    // Weights per rank follow tp alone.
    assert_eq!(h.devices[3].weights, t2.devices[1].weights);
    assert!(h.devices[3].weights > t4.devices[3].weights);
    assert!(h.devices[3].weights < s4.devices[3].weights);
    // Element-wise work on the hidden state is replicated under TP, split under SP.
    let ew = |local: u64| Ctx::elementwise_bytes(double, local, 1, 4);
    let all = t.img + t.txt;
    assert!(ew(all.div_ceil(4)) < ew(local));
    assert!(ew(local) < ew(all));
    // Only layouts with SP pay all-to-alls and the all-gather.
    assert_eq!((t4.parts[0].alltoall_s, t4.gather_s), (0.0, 0.0));
    assert!(h.gather_s > 0.0 && s4.parts[0].alltoall_s > 0.0);
}

/// The heads must divide over tp × sp; the tokens need not.
#[test]
fn layouts_must_divide_the_heads() {
    let m = machine4();
    let blocks = [("double", 0, 2), ("single", 0, 3)];
    let (p, model) = tiny_plan_on(vec![layout_part(&blocks, &[0, 1, 2], 1, 3)], &m);
    let e = validate(&p, &model, &m).unwrap_err().to_string();
    assert!(
        e.contains("parts[0].sp: tp 1 × sp 3 = 3 does not divide the 4 attention heads"),
        "{e}"
    );
    // Tokens that do not divide over sp are fine: the busiest rank takes ⌈tokens/sp⌉.
    let mut odd = tiny_plan_on(vec![layout_part(&blocks, &[0, 1, 2, 3], 1, 4)], &m).0;
    odd.workload.width = 48; // 3 × 3 latent patches: 9 image tokens + text
    odd.workload.height = 48;
    validate(&odd, &model, &m).unwrap();
    let t = model.tokens(&odd.workload);
    assert_ne!((t.img + t.txt) % 4, 0, "the test wants uneven tokens");
    assert!(evaluate(&odd, &model, &m).step_s > 0.0);
}

proptest::proptest! {
    /// Whatever the layout and size: weights per rank depend on tp alone; one rank's
    /// per-token linear and attention FLOPs times tp·sp cover the whole block (the split
    /// loses no work, and rounding tokens up only adds); with sp = 1 the compute is
    /// exactly the tensor-parallel figure.
    #[test]
    fn layouts_conserve_work(side in 1u32..=8, tp_log in 0u32..=2, sp_log in 0u32..=2) {
        let m = machine4();
        let (tp, sp) = (1u32 << tp_log, 1u32 << sp_log);
        proptest::prop_assume!(tp * sp <= 4);
        let blocks = [("double", 0, 2), ("single", 0, 3)];
        let devs: Vec<u32> = (0..tp * sp).collect();
        let (mut plan, model) = tiny_plan_on(vec![layout_part(&blocks, &devs, tp, sp)], &m);
        plan.workload.width = 16 * side;
        validate(&plan, &model, &m).unwrap();
        let ctx = Ctx::new(&model, &m, &plan.workload);
        let g = Group::of(&plan.transformer().unwrap().parts[0]);
        for k in &model.transformer.kinds {
            let bc = ctx.block(k, &g, DType::F32);
            let tensor = ctx.block(k, &Group::tensor(g.devices[..tp as usize].to_vec()), DType::F32);
            proptest::prop_assert_eq!(bc.weight_bytes, tensor.weight_bytes);
            if sp == 1 {
                proptest::prop_assert_eq!(bc, tensor);
            } else {
                proptest::prop_assert!(bc.compute_s < tensor.compute_s);
                proptest::prop_assert!(bc.activation_bytes <= tensor.activation_bytes);
                proptest::prop_assert!(bc.alltoall_s > 0.0);
            }
        }
        let ev = evaluate(&plan, &model, &m);
        proptest::prop_assert!(ev.step_s.is_finite() && ev.step_s > 0.0);
        proptest::prop_assert_eq!(ev.gather_s > 0.0, sp > 1);
    }
}

/// `machine4` as two nodes of two devices: NVLink inside each, a slow network between.
fn two_nodes() -> Machine {
    let mut m = machine4();
    m.devices[2].node = 1;
    m.devices[3].node = 1;
    let one = m.links.peer[0].clone();
    m.links.peer = vec![one.clone(), one];
    m.links.peer[0].devices = vec![DeviceId::Cuda(0), DeviceId::Cuda(1)];
    m.links.peer[1].devices = vec![DeviceId::Cuda(2), DeviceId::Cuda(3)];
    m.links.inter_node = Some(mold_machine::InterNode {
        kind: mold_machine::NetworkKind::Ethernet,
        gbps: 5.0,
        latency_us: 40.0,
    });
    Machine::from_yaml(&m.to_yaml(), "nodes").unwrap()
}

/// Collectives and hand-offs across nodes are priced over the network (latency +
/// bytes / bandwidth); inside a node over its peer domain, as on one node.
#[test]
fn groups_across_nodes_pay_the_network() {
    let m = two_nodes();
    let blocks = [("double", 0, 2), ("single", 0, 3)];
    let eval = |parts: Vec<Part>| {
        let (plan, model) = tiny_plan_on(parts, &m);
        validate(&plan, &model, &m).unwrap();
        (evaluate(&plan, &model, &m), model, plan)
    };
    let (inside, model, plan) = eval(vec![layout_part(&blocks, &[0, 1], 2, 1)]);
    let (across, ..) = eval(vec![layout_part(&blocks, &[1, 2], 2, 1)]);
    let t = model.tokens(&plan.workload);
    let ar = |lat: f64, gbps: f64, bytes: u64| lat + bytes as f64 / (gbps * 1e9);
    let hidden = (t.img + t.txt) * 64 * 4;
    let want = |lat: f64, gbps: f64| {
        2.0 * (2.0 * ar(lat, gbps, hidden) + ar(lat, gbps, 12 * 64 * 4))
            + 3.0 * (ar(lat, gbps, hidden) + ar(lat, gbps, 3 * 64 * 4))
    };
    assert!((inside.parts[0].allreduce_s - want(10e-6, 50.0)).abs() < 1e-12);
    assert!((across.parts[0].allreduce_s - want(40e-6, 5.0)).abs() < 1e-12);
    assert!(across.step_s > inside.step_s);
    // Hybrid over both nodes: the tensor-parallel pairs stay inside a node, the
    // sequence-parallel pairs (cuda:0+cuda:2, cuda:1+cuda:3) cross it.
    let (hybrid, ..) = eval(vec![layout_part(&blocks, &[0, 1, 2, 3], 2, 2)]);
    let (one_node, model1) =
        tiny_plan_on(vec![layout_part(&blocks, &[0, 1, 2, 3], 2, 2)], &machine4());
    let hybrid_one_node = evaluate(&one_node, &model1, &machine4());
    let local = (t.img + t.txt).div_ceil(2);
    assert!(
        (hybrid.parts[0].allreduce_s - hybrid_one_node.parts[0].allreduce_s).abs() < 1e-15,
        "the all-reduces stay on NVLink"
    );
    let shard = (local * 32 * 4) as f64;
    // Two all-to-alls per block (q/k/v stacked: 3 shards; the output: 1), half of each
    // sent over the network, and the copy (2 shards); five blocks.
    let a2a = 5.0
        * ((40e-6 + 3.0 * shard / 2.0 / 5e9) + (40e-6 + shard / 2.0 / 5e9) + 2.0 * shard / 1000e9);
    assert!(
        (hybrid.parts[0].alltoall_s - a2a).abs() < 1e-12,
        "{} vs {a2a}",
        hybrid.parts[0].alltoall_s
    );
    assert!(hybrid.gather_s > hybrid_one_node.gather_s);
    // A hand-off: priced over the slowest path, here the network with its latency.
    let (split, ..) = eval(vec![
        part(&[("double", 0, 2)], &[0], false),
        part(&[("single", 0, 3)], &[2], false),
    ]);
    let bytes = Ctx::new(&model, &m, &plan.workload).handoff_bytes(DType::F32);
    assert!((split.handoff_s - ar(40e-6, 5.0, bytes)).abs() < 1e-15);
}

/// With `replicas:`, every replica is validated on its own devices and must fit there.
#[test]
fn every_replica_is_validated_and_must_fit() {
    let blocks = [("double", 0, 2), ("single", 0, 3)];
    let (mut plan, model) = tiny_plan_on(vec![part(&blocks, &[0], false)], &machine());
    let r = |to: u32| mold_plan::Replica::from([(DeviceId::Cuda(0), DeviceId::Cuda(to))]);
    let refusal = |plan: &Plan, m: &Machine| validate(plan, &model, m).unwrap_err().to_string();
    plan.replicas = Some(vec![r(0), r(1)]);
    validate(&plan, &model, &machine()).unwrap();
    plan.replicas = Some(vec![r(0), r(7)]);
    let e = refusal(&plan, &machine());
    assert!(
        e.starts_with("replicas[1]: components[0].parts[0].devices: cuda:7 is not a device"),
        "{e}"
    );
    plan.replicas = Some(vec![r(1), r(1)]);
    let e = refusal(&plan, &machine());
    assert!(
        e.starts_with("replicas[1]: cuda:1 is used by replicas[0] too"),
        "{e}"
    );
    // cuda:1 with no room: the second replica does not fit.
    let small = Machine::from_yaml(
        &MACHINE.replacen(
            "{id: cuda:1, name: G, memory: 8GiB, budget: 8GiB, headroom: 1GiB",
            "{id: cuda:1, name: G, memory: 8GiB, budget: 2MiB, headroom: 1MiB",
            1,
        ),
        "small",
    )
    .unwrap();
    plan.replicas = Some(vec![r(0), r(1)]);
    let e = refusal(&plan, &small);
    assert!(e.starts_with("replicas[1]: does not fit on cuda:1"), "{e}");
    assert!(!e.contains('\n'), "{e}");
}

mod cfg;
mod libraries;
mod load;

/// Calibration measures every layout the planner may pick on the box, three GPUs of four
/// included (FLUX's 24 heads split 3 ways), and the collectives of every group size.
#[test]
fn calibration_covers_three_of_four_gpus() {
    let model = mold_models::find("flux-dev").unwrap();
    let req = crate::ops::ShapeRequest::default_for(&model, 4, vec![2, 3, 4]);
    for l in [(1, 1), (2, 1), (3, 1), (4, 1), (1, 3), (2, 2), (1, 4)] {
        assert!(
            req.layouts.contains(&l),
            "{l:?} missing from {:?}",
            req.layouts
        );
    }
    let shapes = crate::ops::calibration_shapes(&model, DType::Bf16, &req);
    for n in [2u32, 3, 4] {
        assert!(
            shapes.collectives.iter().any(|c| c.1 == n),
            "no collective over {n}"
        );
    }
    // The products of a TP3 double block are among the measured shapes.
    let kind = &model.transformer.kinds[0];
    let ops = crate::ops::block_ops(
        kind,
        mold_models::Tokens {
            img: 4096,
            txt: 512,
        },
        1,
        3,
        1,
        2,
    )
    .unwrap();
    for g in &ops.gemms {
        assert!(
            shapes.gemm.iter().any(|m| m.n == g.n && m.k == g.k),
            "TP3 product n={} k={} not measured",
            g.n,
            g.k
        );
    }
}

/// Under tensor parallelism the q/k/v preparation runs on the rank's share of the heads;
/// the passes over the hidden state stay whole: per sub-block the fused norm with its
/// modulation (read once, written once) and the bias + gate + residual (two read, one
/// written), as the calibration counts the same kernels' bytes.
#[test]
fn tensor_parallel_divides_only_the_qkv_preparation() {
    let model = mold_models::find("flux-dev").unwrap();
    let kind = &model.transformer.kinds[0];
    let h = kind.hidden;
    let ew = |tp: u64| crate::ops::elementwise_bytes(kind, 1, 1, 1, tp);
    assert_eq!(ew(1) - ew(2), 3 * h);
    assert_eq!(ew(1) - ew(3), 4 * h);
    assert_eq!(ew(2), (2 + 3) * h * kind.allreduces as u64 + 3 * h);
    assert_eq!(crate::ops::HIDDEN_PASSES_PER_SUB_BLOCK, 2 + 3);
}

/// The VAE in row bands: each band's device holds the decoder's weights and its band's share
/// of the activations; the decode is priced from a band's share of the image plus the
/// exchanges; a part that is not `sp` bands of distinct GPUs is refused in words.
#[test]
fn a_vae_in_row_bands_is_priced_and_held_per_band() {
    let m = machine4();
    let body = vec![part(&[("double", 0, 2), ("single", 0, 3)], &[0], false)];
    let (one, model) = tiny_plan_on(body.clone(), &m);
    let mut banded = one.clone();
    let vae = banded
        .components
        .iter_mut()
        .find(|c| c.role == ComponentRole::Vae)
        .unwrap();
    vae.parts[0] = Part {
        sp: 4,
        tp: 1,
        ..part(&[], &[0, 1, 2, 3], false)
    };
    validate(&banded, &model, &m).unwrap();
    let (e1, e4) = (evaluate(&one, &model, &m), evaluate(&banded, &model, &m));
    let spec = model.component("vae").unwrap();
    let ctx = Ctx::new(&model, &m, &one.workload);
    let ids: Vec<DeviceId> = (0..4).map(DeviceId::Cuda).collect();
    let t1 = ctx.component_s(spec, &ids[0], spec.default_dtype);
    let t4 = ctx.decode_bands_s(spec, &ids, spec.default_dtype);
    assert!((e4.decode_s - t4).abs() < 1e-12 && (e1.decode_s - t1).abs() < 1e-12);
    // Hand-computed: a quarter of the FLOPs on one device, 22 exchanges of 5 row copies and
    // 4 bands' host time, the gathered attention input over three links.
    let w = &one.workload;
    let flops = spec.flops(&model, w) / 4.0;
    let band = ctx.device_time(
        &ids[0],
        flops,
        spec.weight_bytes(spec.default_dtype),
        spec.default_dtype,
    );
    let act = spec.default_dtype.activation_bytes();
    let row = m.transfer_s(&ids[0], &ids[1], w.width as u64 * 128 * act);
    let latent = (w.width as u64 / 8) * (w.height as u64 / 8);
    let gather = m.transfer_s(&ids[0], &ids[1], latent * 512 * act / 4);
    let want = band + 22.0 * (5.0 * row + 4.0 * BAND_EXCHANGE_HOST_S) + 3.0 * gather;
    assert!((t4 - want).abs() < 1e-12, "{t4} vs {want}");
    // Weights on every band's device, a quarter of the activations.
    let vae_w = spec.weight_bytes(spec.default_dtype);
    let a = ctx.component_activation(spec, spec.default_dtype);
    for d in &e4.devices[1..] {
        assert!(d.peak >= vae_w + a.div_ceil(4), "{d:?}");
    }
    assert_eq!(e1.devices[1].peak, 0);
    // Refusals name the part and the fix.
    let bad = |edit: &dyn Fn(&mut Part)| {
        let mut p = banded.clone();
        let c = p
            .components
            .iter_mut()
            .find(|c| c.role == ComponentRole::Vae)
            .unwrap();
        edit(&mut c.parts[0]);
        validate(&p, &model, &m).unwrap_err().to_string()
    };
    assert!(bad(&|p| p.sp = 2).contains("set `sp: 4`"));
    assert!(bad(&|p| p.tp = 2).contains("no `tp`"));
    assert!(bad(&|p| p.devices[3] = DeviceId::Cuda(0)).contains("names a device twice"));
    assert!(bad(&|p| p.devices[3] = DeviceId::Host).contains("GPUs only"));
    // An encoder never spreads.
    let mut p = one.clone();
    let t5 = p
        .components
        .iter_mut()
        .find(|c| c.role == ComponentRole::Encoder)
        .unwrap();
    t5.parts[0] = Part {
        sp: 2,
        tp: 1,
        ..part(&[], &[0, 1], false)
    };
    let e = validate(&p, &model, &m).unwrap_err().to_string();
    assert!(e.contains("runs whole on one device"), "{e}");
}

/// A block held in FP8 on a GPU charges at least the window of bf16 rows its load quantizes
/// there (`crate::load::FP8_STAGING_WINDOW_BYTES`), above flux-tiny's own few-kB activations; the
/// same block in bf16, or in FP8 on emulated devices (read on the host), does not.
#[test]
fn fp8_blocks_on_gpus_hold_the_quantizing_window() {
    let (plan, model) = tiny_plan(vec![]);
    let m = machine();
    let emulated = Machine::from_yaml(&MACHINE.replace("cuda:", "emu:"), "emu").unwrap();
    let w = plan.workload.clone();
    let gpu = Group::tensor(vec![DeviceId::Cuda(0)]);
    let emu = Group::tensor(vec![DeviceId::Emu(0)]);
    for k in &model.transformer.kinds {
        let ctx = Ctx::new(&model, &m, &w);
        let on_emu = Ctx::new(&model, &emulated, &w);
        let bf16 = ctx.block(k, &gpu, DType::Bf16).activation_bytes;
        assert!(
            bf16 < crate::load::FP8_STAGING_WINDOW_BYTES,
            "{}: {bf16}",
            k.name
        );
        assert_eq!(
            ctx.block(k, &gpu, DType::Fp8).activation_bytes,
            crate::load::FP8_STAGING_WINDOW_BYTES,
            "{}",
            k.name
        );
        assert!(
            on_emu.block(k, &emu, DType::Fp8).activation_bytes
                < crate::load::FP8_STAGING_WINDOW_BYTES
        );
    }
}
