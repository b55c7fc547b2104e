//! `replicas:` (version 3) and the version 2 migration.

use super::SAMPLE;
use crate::*;

/// SAMPLE (a placement on cuda:0 and cuda:1) on a 4-GPU machine, with `replicas` text.
fn with_replicas(replicas: &str) -> String {
    SAMPLE
        .replace(
            "    memory: 48GiB\ncomponents:",
            "    memory: 48GiB\n  - id: cuda:2\n    name: NVIDIA L40S\n    memory: 48GiB\n  - id: cuda:3\n    name: NVIDIA L40S\n    memory: 48GiB\ncomponents:",
        )
        .replace("predicted:\n", &format!("{replicas}predicted:\n"))
}

const TWO: &str =
    "replicas:\n- {cuda:0: cuda:0, cuda:1: cuda:1}\n- {cuda:0: cuda:2, cuda:1: cuda:3}\n";

fn devices_of(p: &Plan) -> Vec<Vec<DeviceId>> {
    p.components
        .iter()
        .flat_map(|c| &c.parts)
        .map(|p| p.devices.clone())
        .collect()
}

#[test]
fn without_replicas_the_plan_is_its_one_replica() {
    let p = Plan::from_yaml(SAMPLE, "p.yaml").unwrap();
    assert_eq!(p.replicas, None);
    assert_eq!(p.replica_count(), 1);
    assert_eq!(p.replica_plans().unwrap(), vec![p.clone()]);
    assert!(!p.to_yaml().contains("replicas"));
}

#[test]
fn replica_plans_remap_every_used_device() {
    let p = Plan::from_yaml(&with_replicas(TWO), "p.yaml").unwrap();
    assert_eq!(p.replica_count(), 2);
    let cuda = DeviceId::Cuda;
    assert_eq!(
        p.placement_devices().into_iter().collect::<Vec<_>>(),
        [cuda(0), cuda(1)]
    );
    let rs = p.replica_plans().unwrap();
    assert_eq!(rs.len(), 2);
    // The first maps every device onto itself: the placement as written.
    let mut base = p.clone();
    base.replicas = None;
    assert_eq!(rs[0], base);
    // The second runs each part on the shifted devices, predictions moved with them.
    assert_eq!(
        devices_of(&rs[1]),
        [vec![cuda(2)], vec![cuda(2)], vec![cuda(3)]]
    );
    assert_eq!(rs[1].predicted.devices[0].device, cuda(2));
    assert!(rs.iter().all(|r| r.replicas.is_none()));
    // Written and read back, the same plan.
    assert_eq!(Plan::from_yaml(&p.to_yaml(), "again.yaml").unwrap(), p);
}

#[test]
fn shifted_replicas_zip_devices_onto_groups() {
    let cuda = DeviceId::Cuda;
    let r = shifted_replicas(
        &[cuda(0), cuda(1)],
        &[vec![cuda(0), cuda(1)], vec![cuda(3), cuda(2)]],
    );
    assert_eq!(r.len(), 2);
    assert_eq!(r[1][&cuda(0)], cuda(3));
    assert_eq!(r[1][&cuda(1)], cuda(2));
}

#[test]
fn bad_replicas_are_refused_naming_the_field() {
    let cases = [
        ("replicas: []\n", "p.yaml: replicas: empty"),
        (
            "replicas:\n- {cuda:0: cuda:2}\n",
            "p.yaml: replicas[0]: cuda:1 is not mapped",
        ),
        (
            "replicas:\n- {cuda:0: cuda:2, cuda:1: cuda:2}\n",
            "p.yaml: replicas[0]: cuda:0 and cuda:1 both map to cuda:2",
        ),
        (
            "replicas:\n- {cuda:0: cuda:0, cuda:1: cuda:1}\n- {cuda:0: cuda:1, cuda:1: cuda:2}\n",
            "p.yaml: replicas[1]: cuda:1 is used by replicas[0] too",
        ),
        (
            "replicas:\n- {cuda:0: cuda:0, cuda:1: cuda:1, cuda:2: cuda:3}\n",
            "p.yaml: replicas[0]: `cuda:2: cuda:3`: the placement does not use cuda:2",
        ),
        (
            "replicas:\n- {cuda:0: host, cuda:1: cuda:1}\n",
            "p.yaml: replicas[0]: `cuda:0: host`: the host is shared",
        ),
        ("replicas:\n- {cuda:0: gpu1}\n", "not a device"),
        ("replicas:\n- [cuda:0]\n", "replicas[0]"),
        // A device mapped twice in one replica: YAML refuses the duplicate key.
        (
            "replicas:\n- {cuda:0: cuda:2, cuda:0: cuda:3, cuda:1: cuda:1}\n",
            "duplicate entry",
        ),
    ];
    for (replicas, want) in cases {
        let e = Plan::from_yaml(&with_replicas(replicas), "p.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{replicas}: {e}");
    }
}

#[test]
fn replica_plans_refuse_a_plan_built_in_code() {
    let mut p = Plan::from_yaml(&with_replicas(TWO), "p.yaml").unwrap();
    p.replicas.as_mut().unwrap()[1].remove(&DeviceId::Cuda(1));
    let e = p.replica_plans().unwrap_err();
    assert_eq!(e.field, "replicas[1]");
    assert!(e
        .to_string()
        .starts_with("replicas[1]: cuda:1 is not mapped"));
}

#[test]
fn version_2_is_migrated_as_one_replica() {
    let v2 = SAMPLE.replace("version: 5", "version: 2");
    let p = Plan::from_yaml(&v2, "v2.yaml").unwrap();
    assert_eq!(p.version, PLAN_VERSION);
    assert_eq!(p.replica_plans().unwrap(), vec![p.clone()]);
    assert_eq!(p, Plan::from_yaml(SAMPLE, "v4.yaml").unwrap());
    // What it writes back is the current version, and reads as the same plan.
    let yaml = p.to_yaml();
    assert!(
        yaml.contains(&format!("version: {PLAN_VERSION}\n")),
        "{yaml}"
    );
    assert_eq!(Plan::from_yaml(&yaml, "v4.yaml").unwrap(), p);
    // A version 2 plan naming a version 3 field is refused, naming it.
    let e = Plan::from_yaml(
        &with_replicas(TWO).replace("version: 5", "version: 2"),
        "v2.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("v2.yaml: replicas: `replicas` is a version 3 field"),
        "{e}"
    );
}

/// The version 3 schema as written: two replicas of a placement on two devices.
#[test]
fn v3_plan_snapshot() {
    let p = Plan::from_yaml(&with_replicas(TWO), "v3.yaml").unwrap();
    insta::assert_snapshot!(p.to_yaml());
}
