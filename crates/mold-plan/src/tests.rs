use super::*;

pub(crate) const SAMPLE: &str = r#"
version: 1
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
    let e = Plan::from_yaml(&SAMPLE.replace("version: 1", "version: 2"), "p.yaml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("version 2") && e.contains("regenerate"), "{e}");
    let e = Plan::from_yaml(&SAMPLE.replace("version: 1\n", ""), "p.yaml")
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
