use super::*;

pub const TWO: &str = r#"
name: test-2
calibration: {source: spec-sheet}
host: {memory: 64GiB, pinned_limit: 32GiB, tflops: 1.0, mem_bandwidth_gbps: 50}
devices:
- {id: cuda:0, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000}
- {id: cuda:1, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000}
links:
  host_pinned_gbps: 25
  host_pageable_gbps: 10
  peer:
  - {devices: [cuda:0, cuda:1], kind: nvlink, gbps: 100, allreduce: {latency_us: 10, gbps: 80}}
"#;

#[test]
fn parses_and_links() {
    let m = Machine::from_yaml(TWO, "t.yaml").unwrap();
    let g = m.group_link(&[DeviceId::Cuda(0), DeviceId::Cuda(1)]);
    assert!(!g.staged);
    assert_eq!(
        m.transfer_gbps(&DeviceId::Cuda(0), &DeviceId::Cuda(1)),
        100.0
    );
    let one = m.select(&[DeviceId::Cuda(1)]).unwrap();
    assert!(one.links.peer.is_empty());
    assert!(one.group_link(&[DeviceId::Cuda(1)]).staged);
    assert_ne!(one.fingerprint(), m.fingerprint());
    let back = Machine::from_yaml(&m.to_yaml(), "again").unwrap();
    assert_eq!(back, m);
}

#[test]
fn allreduce_formula() {
    let c = Collective {
        latency_us: 10.0,
        gbps: 100.0,
    };
    // latency + 2(n−1)/n · S / bandwidth
    let s = c.allreduce_s(1_000_000_000, 4);
    assert!((s - (10e-6 + 1.5 * 0.01)).abs() < 1e-12);
    assert_eq!(c.allreduce_s(123, 1), 0.0);
}

#[test]
fn model_efficiency_scales_the_matmul_rate() {
    let m = Machine::from_yaml(TWO, "t.yaml").unwrap();
    assert_eq!(m.devices[0].tflops(mold_plan::DType::Bf16), 100.0);
    let e = TWO.replacen(
        "bf16_tflops: 100, mem",
        "bf16_tflops: 100, model_efficiency: 0.5, mem",
        1,
    );
    let m = Machine::from_yaml(&e, "t.yaml").unwrap();
    assert_eq!(m.devices[0].tflops(mold_plan::DType::Bf16), 50.0);
    assert_eq!(m.devices[0].tflops(mold_plan::DType::F32), 25.0);
}

#[test]
fn errors_name_fields() {
    for (from, to, want) in [
        (
            "budget: 23GiB, bf16",
            "budget: 25GiB, bf16",
            "devices[0].budget",
        ),
        (
            "bf16_tflops: 100, mem",
            "bf16_tflops: -1, mem",
            "devices[0].bf16_tflops",
        ),
        (
            "[cuda:0, cuda:1], kind",
            "[cuda:0, cuda:7], kind",
            "links.peer[0].devices",
        ),
        (
            "pinned_limit: 32GiB",
            "pinned_limit: 32GiB, pinned: 1",
            "unknown field `pinned`",
        ),
        ("{id: cuda:1,", "{id: cuda:0,", "devices[1].id"),
        (
            "bf16_tflops: 100, mem",
            "bf16_tflops: 100, model_efficiency: 1.5, mem",
            "devices[0].model_efficiency",
        ),
    ] {
        let bad = TWO.replacen(from, to, 1);
        assert_ne!(bad, TWO);
        let e = Machine::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.contains(want), "{to}: {e}");
    }
    // The same device twice in a peer domain.
    let bad = TWO.replacen("[cuda:0, cuda:1], kind", "[cuda:0, cuda:0], kind", 1);
    let e = Machine::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
    assert!(
        e.contains("links.peer[0].devices: cuda:0 is listed twice"),
        "{e}"
    );
    let m = Machine::from_yaml(TWO, "t.yaml").unwrap();
    let e = m.select(&[DeviceId::Cuda(3)]).unwrap_err().to_string();
    assert!(e.contains("cuda:3") && e.contains("cuda:0, cuda:1"), "{e}");
}

/// Every figure of a profile, NaN, infinite or negative, is refused naming its field;
/// latencies may be 0, rates may not. (NaN passed a `< 0` test once, and the
/// host-staged all-reduce latency was never checked.)
#[test]
fn every_figure_must_be_finite_and_non_negative() {
    let full = TWO
        .replacen(
            "  peer:",
            "  host_staged_allreduce: {latency_us: 80, gbps: 6}\n  peer:",
            1,
        )
        .replacen(
            "  host_pinned_gbps: 25\n",
            "  host_pinned_gbps: 25\n  host_pinned_busy_gbps: 21\n",
            1,
        )
        .replacen(
            "mem_bandwidth_gbps: 50}",
            "mem_bandwidth_gbps: 50, read_gbps: 30}",
            1,
        );
    Machine::from_yaml(&full, "t.yaml").unwrap();
    // (text to replace, field named, whether 0 is allowed)
    let cases = [
        ("tflops: 1.0", "host.tflops", false),
        ("mem_bandwidth_gbps: 50", "host.mem_bandwidth_gbps", false),
        ("read_gbps: 30", "host.read_gbps", false),
        ("bf16_tflops: 100", "devices[0].bf16_tflops", false),
        (
            "mem_bandwidth_gbps: 1000",
            "devices[0].mem_bandwidth_gbps",
            false,
        ),
        ("host_pinned_gbps: 25", "links.host_pinned_gbps", false),
        (
            "host_pinned_busy_gbps: 21",
            "links.host_pinned_busy_gbps",
            false,
        ),
        ("host_pageable_gbps: 10", "links.host_pageable_gbps", false),
        (
            "{latency_us: 80,",
            "links.host_staged_allreduce.latency_us",
            true,
        ),
        ("gbps: 6}", "links.host_staged_allreduce.gbps", false),
        ("gbps: 100,", "links.peer[0].gbps", false),
        (
            "{latency_us: 10,",
            "links.peer[0].allreduce.latency_us",
            true,
        ),
        ("gbps: 80}", "links.peer[0].allreduce.gbps", false),
    ];
    for (from, field, zero_ok) in cases {
        let (key, rest) = from.split_once(": ").unwrap();
        let (_, tail) = rest.split_at(
            rest.find(|c: char| !c.is_ascii_digit() && c != '.')
                .unwrap_or(rest.len()),
        );
        for v in [".nan", ".inf", "-.inf", "-1", "0", "-0.5"] {
            let to = format!("{key}: {v}{tail}");
            let bad = full.replacen(from, &to, 1);
            assert_ne!(bad, full, "{from}");
            let r = Machine::from_yaml(&bad, "t.yaml");
            if v == "0" && zero_ok {
                r.unwrap_or_else(|e| panic!("{to}: {e}"));
                continue;
            }
            let e = r.expect_err(&to).to_string();
            assert!(
                e.starts_with(&format!("t.yaml: {field}: ")) && e.contains("give a finite number"),
                "{to}: {e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
    }
    let f32 = full.replacen(
        "bf16_tflops: 100, mem",
        "bf16_tflops: 100, f32_tflops: .nan, mem",
        1,
    );
    let e = Machine::from_yaml(&f32, "t.yaml").unwrap_err().to_string();
    assert!(e.starts_with("t.yaml: devices[0].f32_tflops: NaN"), "{e}");
    let eff = full.replacen(
        "bf16_tflops: 100, mem",
        "bf16_tflops: 100, model_efficiency: .nan, mem",
        1,
    );
    let e = Machine::from_yaml(&eff, "t.yaml").unwrap_err().to_string();
    assert!(
        e.starts_with("t.yaml: devices[0].model_efficiency: NaN"),
        "{e}"
    );
}

/// Two nodes of two GPUs, NVLink inside each, 400 Gb/s InfiniBand between them.
pub const NODES: &str = r#"
name: test-2x2
calibration: {source: spec-sheet}
host: {memory: 64GiB, pinned_limit: 32GiB, tflops: 1.0, mem_bandwidth_gbps: 50}
devices:
- {id: cuda:0, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000}
- {id: cuda:1, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000}
- {id: cuda:2, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000, node: 1}
- {id: cuda:3, name: GPU A, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, mem_bandwidth_gbps: 1000, node: 1}
links:
  host_pinned_gbps: 25
  host_pageable_gbps: 10
  peer:
  - {devices: [cuda:0, cuda:1], kind: nvlink, gbps: 100, allreduce: {latency_us: 10, gbps: 80}}
  - {devices: [cuda:2, cuda:3], kind: nvlink, gbps: 100, allreduce: {latency_us: 10, gbps: 80}}
  inter_node: {kind: infiniband, gbps: 50, latency_us: 20}
"#;

fn cuda(n: u32) -> DeviceId {
    DeviceId::Cuda(n)
}

#[test]
fn groups_across_nodes_go_over_the_network() {
    let m = Machine::from_yaml(NODES, "n.yaml").unwrap();
    assert_eq!(m.nodes(), 2);
    assert_eq!(m.node_of(&cuda(2)), 1);
    // Inside a node: its NVLink domain.
    let inside = m.group_link(&[cuda(2), cuda(3)]);
    assert_eq!(
        (inside.kind, inside.network),
        (Some(LinkKind::Nvlink), None)
    );
    assert_eq!(inside.collective.gbps, 80.0);
    // Across: the slowest link, the network's bandwidth and latency.
    for g in [vec![cuda(1), cuda(2)], (0..4).map(cuda).collect()] {
        let l = m.group_link(&g);
        assert_eq!(l.network, Some(NetworkKind::Infiniband), "{g:?}");
        assert!(!l.staged);
        assert_eq!(l.collective.gbps, 50.0);
        assert_eq!(l.collective.latency_us, 20.0);
    }
    // A node's own share slower than the network sets the pace.
    let slow = NODES.replacen(
        "allreduce: {latency_us: 10, gbps: 80}}\n  inter",
        "allreduce: {latency_us: 30, gbps: 40}}\n  inter",
        1,
    );
    assert_ne!(slow, NODES);
    let m2 = Machine::from_yaml(&slow, "n.yaml").unwrap();
    let l = m2.group_link(&(0..4).map(cuda).collect::<Vec<_>>());
    assert_eq!((l.collective.gbps, l.collective.latency_us), (40.0, 30.0));
    // Copies: peer inside a node, the network (with its latency) across.
    assert_eq!(m.transfer_gbps(&cuda(0), &cuda(1)), 100.0);
    assert_eq!(m.transfer_gbps(&cuda(1), &cuda(2)), 50.0);
    assert_eq!(m.transfer_s(&cuda(0), &cuda(1), 1_000_000_000), 0.01);
    assert!((m.transfer_s(&cuda(1), &cuda(2), 1_000_000_000) - (20e-6 + 0.02)).abs() < 1e-12);
    assert_eq!(m.transfer_s(&cuda(1), &cuda(1), 5), 0.0);
    // The nodes are part of the identity; one-node profiles keep theirs.
    let flat = NODES.replace(", node: 1}", "}");
    let flat = Machine::from_yaml(
        &flat.replace(
            "  inter_node: {kind: infiniband, gbps: 50, latency_us: 20}\n",
            "",
        ),
        "f.yaml",
    );
    let flat = flat.unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(flat.fingerprint(), m.fingerprint());
    assert_eq!(Machine::from_yaml(&m.to_yaml(), "again").unwrap(), m);
    assert!(!Machine::from_yaml(TWO, "t.yaml")
        .unwrap()
        .to_yaml()
        .contains("node"));
}

#[test]
fn node_errors_name_fields() {
    for (from, to, want) in [
        (
            "  inter_node: {kind: infiniband, gbps: 50, latency_us: 20}\n",
            "",
            "n.yaml: links.inter_node: the devices are on 2 nodes: describe the network",
        ),
        (
            "gbps: 50, latency_us: 20}",
            "gbps: 0, latency_us: 20}",
            "n.yaml: links.inter_node.gbps: 0 is not allowed",
        ),
        (
            "gbps: 50, latency_us: 20}",
            "gbps: .nan, latency_us: 20}",
            "n.yaml: links.inter_node.gbps: NaN is not allowed",
        ),
        (
            "gbps: 50, latency_us: 20}",
            "gbps: 50, latency_us: -1}",
            "n.yaml: links.inter_node.latency_us: -1 is not allowed",
        ),
        (
            "{kind: infiniband,",
            "{kind: carrier-pigeon,",
            "unknown variant `carrier-pigeon`",
        ),
        (
            "mem_bandwidth_gbps: 1000, node: 1}\n- {id: cuda:3",
            "mem_bandwidth_gbps: 1000, node: 3}\n- {id: cuda:3",
            "n.yaml: devices[2].node: 3 but no device is on node 2",
        ),
        (
            "[cuda:2, cuda:3], kind",
            "[cuda:1, cuda:2], kind",
            "n.yaml: links.peer[1].devices: cuda:1 is on node 0 and cuda:2 on node 1: a peer domain lies within one node",
        ),
    ] {
        let bad = NODES.replacen(from, to, 1);
        assert_ne!(bad, NODES, "{from}");
        let e = Machine::from_yaml(&bad, "n.yaml").unwrap_err().to_string();
        assert!(e.contains(want), "{to}: {e}");
        assert!(!e.contains('\n'), "{e}");
    }
    // The two devices of node 1 moved to node 2 leave a gap at 1: the first named.
    let gap = NODES.replace(", node: 1}", ", node: 2}");
    let e = Machine::from_yaml(&gap, "n.yaml").unwrap_err().to_string();
    assert!(
        e.contains("devices[2].node: 2 but no device is on node 1"),
        "{e}"
    );
}
