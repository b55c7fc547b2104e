use super::*;

pub(crate) const SAMPLE: &str = r#"
version: 5
model:
  id: flux-dev
workload:
  width: 1024
  height: 1024
  steps: 28
  guidance: 3.5
machine:
  name: 2x-l40s
  fingerprint: sha256:00
  devices:
  - id: cuda:0
    name: NVIDIA L40S
    memory: 48GiB
  - id: cuda:1
    name: NVIDIA L40S
    memory: 48GiB
components:
- name: t5
  role: encoder
  dtype: fp16
  parts:
  - devices: [cuda:0]
    residency: resident
- name: transformer
  role: transformer
  dtype: bf16
  parts:
  - blocks: [double 0..19, single 0..5]
    devices: [cuda:0]
    residency: resident
  - blocks: [single 5..38]
    devices: [cuda:1]
    residency: streamed
    stream_buffers: 2
predicted:
  step_time_s: 0.5
  request_time_s: 14.2
  encode_time_s: 0.1
  denoise_time_s: 14.0
  decode_time_s: 0.1
  devices:
  - device: cuda:0
    peak: 30GiB
    budget: 46GiB
    weights: 20GiB
  host_pinned: 4GiB
  streamed_per_step: 4GiB
solver:
  solver: microlp
  status: optimal
  objective: latency
  objective_value: 14.2
  strategy: split
  solve_time_ms: 3.0
"#;

#[test]
fn round_trips() {
    let p = Plan::from_yaml(SAMPLE, "sample.yaml").unwrap();
    assert_eq!(p.workload.frames, 1);
    assert_eq!(
        p.components[1].parts[0].blocks[1],
        BlockRange::new("single", 0, 5)
    );
    let back = Plan::from_yaml(&p.to_yaml(), "again.yaml").unwrap();
    assert_eq!(p, back);
}

#[test]
fn refuses_unknown_fields_naming_them() {
    let bad = SAMPLE.replace(
        "    residency: resident\n- name: transformer",
        "    residency: resident\n    devcies: [cuda:1]\n- name: transformer",
    );
    let e = Plan::from_yaml(&bad, "p.yaml").unwrap_err().to_string();
    assert!(e.contains("devcies"), "{e}");
    assert!(e.contains("p.yaml"), "{e}");
}

#[test]
fn version_messages() {
    for v in [0, 6] {
        let e = Plan::from_yaml(
            &SAMPLE.replace("version: 5", &format!("version: {v}")),
            "p.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!("version {v}")) && e.contains("regenerate") && !e.contains('\n'),
            "{e}"
        );
    }
    let e = Plan::from_yaml(&SAMPLE.replace("version: 5\n", ""), "p.yaml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("version") && e.contains("missing"), "{e}");
}

#[test]
fn structural_errors_name_the_field() {
    let cases = [
        (
            "stream_buffers: 2",
            "stream_buffers: 1",
            "components[1].parts[1].stream_buffers",
        ),
        (
            "[single 5..38]",
            "[single 38..5]",
            "components[1].parts[1].blocks[0]",
        ),
        (
            "[double 0..19, single 0..5]",
            "[double 0..19 single]",
            "not a block range",
        ),
        ("devices: [cuda:1]", "devices: [gpu1]", "not a device"),
        (
            "role: transformer\n  dtype: bf16",
            "role: transformer\n  dtype: fp8",
            "components[1].parts[1].residency: streamed, but FP8 weights are held resident",
        ),
        (
            "devices: [cuda:1]",
            "devices: []",
            "components[1].parts[1].devices",
        ),
        (
            "memory: 48GiB\n  - id: cuda:1",
            "memory: lots\n  - id: cuda:1",
            "not a size",
        ),
        ("width: 1024", "width: 0", "p.yaml: workload.width: 0"),
        ("steps: 28", "steps: 0", "p.yaml: workload.steps: 0"),
        (
            "devices: [cuda:1]",
            "devices: [cuda:1, cuda:0]",
            "components[1].parts[1]: tp 1 × sp 1 = 1 but 2 device(s)",
        ),
        (
            "devices: [cuda:1]",
            "devices: [cuda:1]\n    tp: 2",
            "components[1].parts[1]: tp 2 × sp 1 = 2 but 1 device(s)",
        ),
        (
            "devices: [cuda:1]",
            "devices: [cuda:1]\n    sp: 0",
            "components[1].parts[1].sp: 0",
        ),
        (
            "devices: [cuda:1]",
            "devices: [cuda:1]\n    tp: 0",
            "components[1].parts[1].tp: 0",
        ),
        (
            "  - devices: [cuda:0]\n    residency: resident\n- name: transformer",
            "  - devices: [cuda:0, cuda:1]\n    sp: 2\n    residency: resident\n- name: transformer",
            "components[0].parts[0].sp: 2: sequence parallelism is for transformer parts (and a VAE's row bands) only",
        ),
        (
            "devices: [cuda:1]",
            "devices: [cuda:1, host]\n    sp: 2",
            "components[1].parts[1].devices: the host cannot be part of a parallel group",
        ),
        (
            "guidance: 3.5",
            "guidance: .nan",
            "p.yaml: workload.guidance: NaN",
        ),
        (
            "guidance: 3.5",
            "guidance: -1",
            "p.yaml: workload.guidance: -1",
        ),
        (
            "step_time_s: 0.5",
            "step_time_s: .inf",
            "p.yaml: predicted.step_time_s: inf",
        ),
        (
            "request_time_s: 14.2",
            "request_time_s: -14.2",
            "p.yaml: predicted.request_time_s: -14.2",
        ),
        (
            "solve_time_ms: 3.0",
            "solve_time_ms: .nan",
            "p.yaml: solver.solve_time_ms: NaN",
        ),
        (
            "- name: t5",
            "- name: \"t\\n5\"\n  role: encoder\n  dtype: fp16\n  parts: []\n- name: t5",
            "components[0].parts",
        ),
    ];
    for (from, to, want) in cases {
        let bad = SAMPLE.replacen(from, to, 1);
        assert_ne!(bad, SAMPLE, "{from}");
        let e = Plan::from_yaml(&bad, "p.yaml").unwrap_err().to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{to}: {e}");
    }
}

#[test]
fn dtype_bytes() {
    assert_eq!(DType::Bf16.weight_bytes(10), 20);
    assert_eq!(DType::Q8.weight_bytes(32), 34);
    assert_eq!(DType::Q4.weight_bytes(64), 36);
    assert_eq!("BF16".parse::<DType>().unwrap(), DType::Bf16);
}

/// A version 1 plan: a part's devices were one tensor-parallel group.
const V1: &str = r#"
version: 1
model:
  id: flux-dev
workload:
  width: 1024
  height: 1024
  steps: 28
machine:
  name: 2x-h200
  fingerprint: sha256:00
  devices:
  - id: cuda:0
    name: NVIDIA H200
    memory: 140GiB
  - id: cuda:1
    name: NVIDIA H200
    memory: 140GiB
components:
- name: t5
  role: encoder
  dtype: bf16
  parts:
  - devices: [cuda:0]
    residency: resident
- name: transformer
  role: transformer
  dtype: bf16
  parts:
  - blocks: [double 0..19, single 0..38]
    devices: [cuda:0, cuda:1]
    residency: resident
predicted:
  step_time_s: 0.1
  request_time_s: 3.0
  encode_time_s: 0.1
  denoise_time_s: 2.8
  decode_time_s: 0.1
  devices: []
  host_pinned: 0B
  streamed_per_step: 0B
solver:
  solver: microlp
  status: optimal
  objective: latency
  objective_value: 3.0
  strategy: tp2
  solve_time_ms: 1.0
"#;

#[test]
fn version_1_is_migrated_to_tensor_parallel_parts() {
    let p = Plan::from_yaml(V1, "v1.yaml").unwrap();
    assert_eq!(p.version, PLAN_VERSION);
    let t = &p.transformer().unwrap().parts[0];
    assert_eq!((t.tp, t.sp, t.devices.len()), (2, 1, 2));
    let e = &p.components[0].parts[0];
    assert_eq!((e.tp, e.sp), (1, 1));
    // What it writes back is the current version, and reads as the same plan.
    let yaml = p.to_yaml();
    assert!(
        yaml.contains(&format!("version: {PLAN_VERSION}\n")) && yaml.contains("tp: 2"),
        "{yaml}"
    );
    assert_eq!(Plan::from_yaml(&yaml, "v3.yaml").unwrap(), p);
    // Without migration the same text, read as version 2, is refused: 2 devices, tp 1.
    let e = Plan::from_yaml(&V1.replace("version: 1", "version: 2"), "p.yaml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("components[1].parts[0]: tp 1 × sp 1 = 1 but 2"),
        "{e}"
    );
    // A version 1 part naming a version 2 field is refused, naming it.
    let e = Plan::from_yaml(
        &V1.replace(
            "devices: [cuda:0, cuda:1]",
            "devices: [cuda:0, cuda:1]\n    sp: 2",
        ),
        "v1.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("v1.yaml: components[1].parts[0].sp: `sp` is a version 2 field"),
        "{e}"
    );
}

#[test]
fn device_order_gives_sp_and_tp_ranks() {
    let p = Part {
        blocks: vec![BlockRange::new("double", 0, 19)],
        devices: (0..4).map(DeviceId::Cuda).collect(),
        tp: 2,
        sp: 2,
        residency: Residency::Resident,
        stream_buffers: None,
    };
    let ranks: Vec<(u32, u32)> = (0..4).map(|i| (p.sp_rank(i), p.tp_rank(i))).collect();
    assert_eq!(ranks, [(0, 0), (0, 1), (1, 0), (1, 1)]);
    assert_eq!(p.tp_group(1), [DeviceId::Cuda(2), DeviceId::Cuda(3)]);
    assert_eq!(p.sp_group(1), [DeviceId::Cuda(1), DeviceId::Cuda(3)]);
    assert_eq!(p.degree(), 4);
}

/// A part's parallel layout as written: an SP part and a hybrid SP × TP part (tp and sp
/// are written only when above 1).
#[test]
fn tp_sp_plan_snapshot() {
    let yaml = SAMPLE
        .replace(
            "  - blocks: [double 0..19, single 0..5]\n    devices: [cuda:0]\n",
            "  - blocks: [double 0..19, single 0..5]\n    devices: [cuda:0, cuda:1]\n    sp: 2\n",
        )
        .replace(
            "  - blocks: [single 5..38]\n    devices: [cuda:1]\n    residency: streamed\n    stream_buffers: 2\n",
            "  - blocks: [single 5..38]\n    devices: [cuda:0, cuda:1, cuda:2, cuda:3]\n    tp: 2\n    sp: 2\n    residency: resident\n",
        )
        .replace(
            "    memory: 48GiB\ncomponents:",
            "    memory: 48GiB\n  - id: cuda:2\n    name: NVIDIA L40S\n    memory: 48GiB\n  - id: cuda:3\n    name: NVIDIA L40S\n    memory: 48GiB\ncomponents:",
        );
    let p = Plan::from_yaml(&yaml, "tp-sp.yaml").unwrap();
    let t = &p.transformer().unwrap().parts;
    assert_eq!((t[0].tp, t[0].sp, t[1].tp, t[1].sp), (1, 2, 2, 2));
    assert_eq!(Plan::from_yaml(&p.to_yaml(), "again.yaml").unwrap(), p);
    insta::assert_snapshot!(p.to_yaml());
}

mod attention;
mod cfg;
mod replicas;
