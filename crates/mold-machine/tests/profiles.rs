//! The machine profiles shipped in `sim/machines/` all load, and say what they should.

use mold_machine::{LinkKind, Machine, NetworkKind};
use mold_plan::DeviceId;
use std::collections::BTreeMap;
use std::path::PathBuf;

const EXPECTED: [&str; 11] = [
    "1x-rtx4090",
    "2x-rtx4090",
    "2x-l40s",
    "rtx3090+rtx4060ti",
    "2x-h200",
    "4x-h100",
    "8x-h100",
    "8x-l40s",
    "cpu-emu-4",
    "2x8-h100-ib",
    "2x2-l40s-eth",
];

fn machines_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../sim/machines")
}

/// Every `*.yaml` in `sim/machines/`, by file stem.
fn load_all() -> BTreeMap<String, Machine> {
    let dir = machines_dir();
    let mut out = BTreeMap::new();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let stem = path.file_stem().unwrap().to_str().unwrap().to_string();
        let m = Machine::load(&path).unwrap_or_else(|e| panic!("{e}"));
        out.insert(stem, m);
    }
    out
}

fn cuda(n: u32) -> DeviceId {
    DeviceId::Cuda(n)
}

#[test]
fn every_profile_loads_and_is_named_after_its_file() {
    let all = load_all();
    for name in EXPECTED {
        assert!(
            all.contains_key(name),
            "sim/machines/{name}.yaml is missing"
        );
    }
    for (stem, m) in &all {
        assert_eq!(
            &m.name, stem,
            "{stem}.yaml: `name` differs from the file name"
        );
        assert!(!m.description.is_empty(), "{stem}.yaml: no description");
        assert!(
            ["spec-sheet", "figures.md", "measured"].contains(&m.calibration.source.as_str()),
            "{stem}.yaml: calibration.source {}",
            m.calibration.source
        );
        assert!(
            m.calibration.date.is_some(),
            "{stem}.yaml: no calibration date"
        );
        assert!(
            !m.calibration.notes.is_empty(),
            "{stem}.yaml: no calibration notes"
        );
        for d in &m.devices {
            if let DeviceId::Cuda(_) = d.id {
                assert!(
                    d.budget < d.memory,
                    "{stem}.yaml: {}: budget leaves no CUDA context",
                    d.id
                );
                assert!(
                    d.fused_attention,
                    "{stem}.yaml: {}: GPUs run fused attention",
                    d.id
                );
                assert!(
                    d.compute_capability.is_some(),
                    "{stem}.yaml: {}: no compute_capability",
                    d.id
                );
            }
        }
    }
}

#[test]
fn geforce_pair_has_no_peer_access() {
    let all = load_all();
    let m = &all["2x-rtx4090"];
    assert!(m.links.peer.is_empty());
    let g = m.group_link(&[cuda(0), cuda(1)]);
    assert!(g.staged);
    assert_eq!(g.kind, None);
}

#[test]
fn h100_8_is_one_nvlink_domain() {
    let all = load_all();
    let m = &all["8x-h100"];
    assert_eq!(m.devices.len(), 8);
    assert_eq!(m.links.peer.len(), 1);
    let p = &m.links.peer[0];
    assert_eq!(p.kind, LinkKind::Nvlink);
    assert_eq!(p.devices, (0..8).map(cuda).collect::<Vec<_>>());
    let g = m.group_link(&(0..8).map(cuda).collect::<Vec<_>>());
    assert!(!g.staged);
    assert_eq!(g.kind, Some(LinkKind::Nvlink));
}

#[test]
fn mixed_desktop_has_two_speeds() {
    let all = load_all();
    let m = &all["rtx3090+rtx4060ti"];
    let (a, b) = (m.device(&cuda(0)).unwrap(), m.device(&cuda(1)).unwrap());
    assert_ne!(a.name, b.name);
    assert!(a.bf16_tflops > b.bf16_tflops);
    assert!(a.mem_bandwidth_gbps > b.mem_bandwidth_gbps);
    assert!(m.links.peer.is_empty());
    assert!(m.group_link(&[cuda(0), cuda(1)]).staged);
}

#[test]
fn l40s_8_prefers_the_switch_domain() {
    let all = load_all();
    let m = &all["8x-l40s"];
    let within = m.group_link(&[cuda(0), cuda(3)]);
    let across = m.group_link(&[cuda(0), cuda(4)]);
    assert!(!within.staged && !across.staged);
    assert!(within.collective.gbps > across.collective.gbps);
    assert!(m.transfer_gbps(&cuda(4), &cuda(7)) > m.transfer_gbps(&cuda(3), &cuda(4)));
}

#[test]
fn h200_allreduce_fit_reproduces_figures_md() {
    let all = load_all();
    let m = &all["2x-h200"];
    assert_eq!(m.calibration.source, "figures.md");
    let c = m.group_link(&[cuda(0), cuda(1)]).collective;
    // figures.md: 27 MB (4608 × 3072 × 2 B) in 124 µs, 256 MiB in 894 µs.
    for (bytes, us) in [(4608u64 * 3072 * 2, 124.0), (256u64 << 20, 894.0)] {
        let got = c.allreduce_s(bytes, 2) * 1e6;
        assert!(
            (got - us).abs() / us < 0.01,
            "{bytes} B: {got:.1} µs, figures.md says {us} µs"
        );
    }
}

#[test]
fn emulated_box_is_all_emu() {
    let all = load_all();
    let m = &all["cpu-emu-4"];
    assert_eq!(
        m.devices.iter().map(|d| d.id.clone()).collect::<Vec<_>>(),
        (0..4).map(DeviceId::Emu).collect::<Vec<_>>()
    );
    assert!(m
        .devices
        .iter()
        .all(|d| !d.fused_attention && d.headroom.0 == 64 << 20));
}

/// The multi-node profiles: NVLink (PCIe) inside each node, the network between them;
/// every profile without `node:` is one node.
#[test]
fn multi_node_profiles_link_nodes_over_the_network() {
    let all = load_all();
    for (name, nodes) in all.iter().map(|(n, m)| (n, m.nodes())) {
        let want = if name.starts_with("2x8-") || name.starts_with("2x2-") {
            2
        } else {
            1
        };
        assert_eq!(nodes, want, "{name}.yaml");
    }
    let m = &all["2x8-h100-ib"];
    assert_eq!(m.devices.len(), 16);
    let node = |n: u32| (8 * n..8 * n + 8).map(cuda).collect::<Vec<_>>();
    for n in 0..2 {
        assert!(node(n).iter().all(|d| m.node_of(d) == n));
        let g = m.group_link(&node(n));
        assert_eq!((g.kind, g.network), (Some(LinkKind::Nvlink), None));
    }
    let net = m.links.inter_node.unwrap();
    assert_eq!((net.kind, net.gbps), (NetworkKind::Infiniband, 50.0));
    let across = m.group_link(&[cuda(7), cuda(8)]);
    assert_eq!(across.network, Some(NetworkKind::Infiniband));
    assert!(across.collective.gbps < m.group_link(&node(0)).collective.gbps);
    assert_eq!(m.transfer_gbps(&cuda(7), &cuda(8)), 50.0);
    let m = &all["2x2-l40s-eth"];
    assert_eq!(m.links.inter_node.unwrap().kind, NetworkKind::Ethernet);
    assert_eq!(m.group_link(&[cuda(0), cuda(1)]).kind, Some(LinkKind::Pcie));
    assert!(m.group_link(&[cuda(1), cuda(2)]).network.is_some());
}
