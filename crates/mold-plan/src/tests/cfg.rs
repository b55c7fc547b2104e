//! `cfg` and `memory_phases` (version 4) and the version 3 migration.

use super::SAMPLE;
use crate::*;

/// SAMPLE as a true-CFG workload (a `cfg_scale`, no distilled guidance).
fn with_cfg_scale(text: &str) -> String {
    text.replace("guidance: 3.5", "cfg_scale: 4.0")
}

/// SAMPLE's placement on four devices with two replicas (cuda:0, cuda:1 → cuda:2, cuda:3).
fn two_replicas(text: &str) -> String {
    text.replace(
        "    memory: 48GiB\ncomponents:",
        "    memory: 48GiB\n  - id: cuda:2\n    name: NVIDIA L40S\n    memory: 48GiB\n  - id: cuda:3\n    name: NVIDIA L40S\n    memory: 48GiB\ncomponents:",
    )
    .replace(
        "predicted:\n",
        "replicas:\n- {cuda:0: cuda:0, cuda:1: cuda:1}\n- {cuda:0: cuda:2, cuda:1: cuda:3}\npredicted:\n",
    )
}

fn with_fields(text: &str, fields: &str) -> String {
    text.replacen("machine:\n", &format!("{fields}machine:\n"), 1)
}

#[test]
fn version_3_is_migrated_serial_and_resident() {
    let v3 = with_cfg_scale(&SAMPLE.replace("version: 5", "version: 3"));
    let p = Plan::from_yaml(&v3, "v3.yaml").unwrap();
    assert_eq!(p.version, PLAN_VERSION);
    assert_eq!(
        p.cfg,
        Some(CfgPlan {
            mode: CfgMode::Serial
        })
    );
    assert_eq!(p.memory_phases, MemoryPhases::Resident);
    assert_eq!(p.cfg_mode(), Some(CfgMode::Serial));
    let yaml = p.to_yaml();
    assert!(
        yaml.contains("cfg:\n  mode: serial\nmemory_phases: resident\n"),
        "{yaml}"
    );
    assert_eq!(Plan::from_yaml(&yaml, "v4.yaml").unwrap(), p);
    // Without a cfg_scale: no `cfg`.
    let p = Plan::from_yaml(&SAMPLE.replace("version: 5", "version: 3"), "v3.yaml").unwrap();
    assert_eq!((p.cfg, p.cfg_mode()), (None, None));
    assert_eq!(p.memory_phases, MemoryPhases::Resident);
    // A version 3 plan naming a version 4 field is refused, naming it.
    for (field, text) in [
        ("cfg", "cfg: {mode: serial}\n"),
        ("memory_phases", "memory_phases: one-shot\n"),
    ] {
        let e = Plan::from_yaml(&with_fields(&v3, text), "v3.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("v3.yaml: {field}: `{field}` is a version 4 field")),
            "{e}"
        );
    }
}

#[test]
fn absent_fields_mean_serial_and_resident() {
    let p = Plan::from_yaml(&with_cfg_scale(SAMPLE), "p.yaml").unwrap();
    assert_eq!(p.cfg, None);
    assert_eq!(p.cfg_mode(), Some(CfgMode::Serial));
    assert_eq!(p.memory_phases, MemoryPhases::Resident);
}

#[test]
fn cfg_refusals_name_the_field() {
    let sample = with_cfg_scale(SAMPLE);
    let cases = [
        (
            with_fields(SAMPLE, "cfg: {mode: serial}\n"),
            "p.yaml: cfg: the workload has no cfg_scale",
        ),
        (
            with_fields(&sample, "cfg: {mode: parallel}\n"),
            "p.yaml: cfg.mode: parallel runs the conditional pass on replicas[0] and the unconditional one on replicas[1], and the plan has 1 replica(s)",
        ),
        (
            with_fields(&sample, "cfg: {mode: batched}\n"),
            "unknown variant `batched`",
        ),
        (
            with_fields(&sample, "memory_phases: sometimes\n"),
            "memory_phases: unknown variant `sometimes`",
        ),
        // One stage: both parts' blocks... on one device.
        (
            with_fields(&sample, "cfg: {mode: pipelined}\n")
                .replace("    devices: [cuda:1]\n    residency: streamed", "    devices: [cuda:0]\n    residency: streamed"),
            "p.yaml: cfg.mode: pipelined runs the two passes through the stages of a block split, and the transformer has 1 stage(s)",
        ),
    ];
    for (text, want) in cases {
        let e = Plan::from_yaml(&text, "p.yaml").unwrap_err().to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{e}");
    }
    // Three stages where the first and the last share cuda:0.
    let shared = with_fields(&sample, "cfg: {mode: pipelined}\n").replace(
        "    residency: streamed\n    stream_buffers: 2\n",
        "    residency: resident\n  - blocks: [single 37..38]\n    devices: [cuda:0]\n    residency: resident\n",
    ).replace("[single 5..38]", "[single 5..37]");
    let e = Plan::from_yaml(&shared, "p.yaml").unwrap_err().to_string();
    assert!(
        e.contains("p.yaml: cfg.mode: pipelined needs each stage on devices of its own, and cuda:0 runs stages 1 and 3"),
        "{e}"
    );
}

#[test]
fn stages_are_runs_of_parts_on_one_group() {
    let p = Plan::from_yaml(&with_cfg_scale(SAMPLE), "p.yaml").unwrap();
    assert_eq!(p.stages(), vec![0..1, 1..2]);
    let one = SAMPLE.replace(
        "    devices: [cuda:1]\n    residency: streamed",
        "    devices: [cuda:0]\n    residency: streamed",
    );
    assert_eq!(
        Plan::from_yaml(&one, "p.yaml").unwrap().stages(),
        vec![0..2]
    );
}

#[test]
fn modes_parse_and_print() {
    for m in CfgMode::ALL {
        assert_eq!(m.name().parse::<CfgMode>().unwrap(), m);
    }
    assert!("batched"
        .parse::<CfgMode>()
        .unwrap_err()
        .contains("serial, parallel or pipelined"));
    for m in [MemoryPhases::OneShot, MemoryPhases::Resident] {
        assert_eq!(m.name().parse::<MemoryPhases>().unwrap(), m);
    }
    assert!("x".parse::<MemoryPhases>().is_err());
}

/// The version 4 schema as written: CFG-parallel over two replicas, one-shot phases,
/// and a pipelined split.
#[test]
fn v4_plan_snapshot() {
    let parallel = with_fields(
        &two_replicas(&with_cfg_scale(SAMPLE)),
        "cfg:\n  mode: parallel\nmemory_phases: one-shot\n",
    );
    let p = Plan::from_yaml(&parallel, "v4.yaml").unwrap();
    assert_eq!(p.cfg_mode(), Some(CfgMode::Parallel));
    assert_eq!(p.memory_phases, MemoryPhases::OneShot);
    assert_eq!(Plan::from_yaml(&p.to_yaml(), "again.yaml").unwrap(), p);
    insta::assert_snapshot!("v4_cfg_parallel", p.to_yaml());
    let pipelined = with_fields(&with_cfg_scale(SAMPLE), "cfg: {mode: pipelined}\n");
    let p = Plan::from_yaml(&pipelined, "v4.yaml").unwrap();
    assert_eq!(p.cfg_mode(), Some(CfgMode::Pipelined));
    let yaml = p.to_yaml();
    assert!(
        yaml.contains("cfg:\n  mode: pipelined\nmemory_phases: resident\nmachine:"),
        "{yaml}"
    );
}
