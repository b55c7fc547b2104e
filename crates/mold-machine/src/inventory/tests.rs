use super::date::civil_date;
use super::*;
use crate::{Collective, Machine};
use mold_plan::MIB;

pub fn gpu(ordinal: u32, name: &str, total_gib: u64, free_gib: u64, cc: &str) -> GpuInfo {
    GpuInfo {
        ordinal,
        name: name.into(),
        uuid: format_uuid(&[ordinal as u8; 16]),
        total: ByteSize(total_gib * GIB),
        free: ByteSize(free_gib * GIB),
        compute_capability: cc.into(),
        pci_bus: format!("0000:{:02x}:00.0", 0x18 + ordinal),
        multiprocessors: 132,
        clock_mhz: Some(1980),
        memory_clock_mhz: Some(2619),
        memory_bus_bits: Some(5120),
    }
}

fn peer(from: u32, to: u32, access: bool, nv: bool) -> PeerInfo {
    PeerInfo {
        from,
        to,
        access,
        performance_rank: access.then_some(0),
        native_atomics: nv,
    }
}

/// cuda:0–1 NVLink, cuda:2 PCIe peer with both, cuda:3 no peer access.
fn four() -> Inventory {
    let mut peers = Vec::new();
    for a in 0..4u32 {
        for b in 0..4u32 {
            if a == b {
                continue;
            }
            let nv = a < 2 && b < 2;
            let access = a != 3 && b != 3;
            peers.push(peer(a, b, access, nv));
        }
    }
    Inventory {
        driver_version: Some("13.0".into()),
        devices: vec![
            gpu(0, "NVIDIA H100 80GB HBM3", 80, 79, "9.0"),
            // busy with another process
            gpu(1, "NVIDIA H100 80GB HBM3", 80, 30, "9.0"),
            gpu(2, "NVIDIA H100 80GB HBM3", 80, 79, "9.0"),
            gpu(3, "NVIDIA H100 80GB HBM3", 80, 79, "9.0"),
        ],
        peers,
        host_memory: Some(ByteSize(512 * GIB)),
        host_cpus: Some(64),
    }
}

#[test]
fn live_box_is_compared_with_the_plan_machine() {
    use mold_plan::{DeviceIdentity, MachineIdentity};
    let dev = |i: u32, name: &str, gib: u64| DeviceIdentity {
        id: DeviceId::Cuda(i),
        name: name.into(),
        memory: ByteSize(gib * GIB),
    };
    let h100 = "NVIDIA H100 80GB HBM3";
    let mut planned = MachineIdentity {
        name: "4x-h100".into(),
        fingerprint: "x".into(),
        devices: vec![dev(0, h100, 80), dev(1, h100, 80)],
    };
    assert!(differences_from_plan(&four(), &planned).is_empty());
    planned.devices.push(dev(7, h100, 80));
    planned.devices[1] = dev(1, "NVIDIA H200", 141);
    let d = differences_from_plan(&four(), &planned);
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(
        d[0].starts_with("cuda:1: this box has NVIDIA H100"),
        "{d:?}"
    );
    assert!(
        d[1].contains("cuda:7") && d[1].contains("not on this box"),
        "{d:?}"
    );
}

fn opts() -> ProfileOptions {
    ProfileOptions {
        name: "my-box".into(),
        headroom: ByteSize(2 * GIB),
        caps: [(DeviceId::Cuda(0), ByteSize(20 * GIB))].into(),
        date: "2026-01-02".into(),
        mold_version: "0.1.0".into(),
    }
}

#[test]
fn budgets_are_per_device() {
    let inv = four();
    let b = inv.budgets(ByteSize(2 * GIB), &opts().caps).unwrap();
    // capped
    assert_eq!(b[0].budget, ByteSize(20 * GIB));
    assert_eq!(b[0].usable, ByteSize(18 * GIB));
    // busy: its own free memory, nothing summed
    assert_eq!(b[1].budget, ByteSize(30 * GIB));
    assert_eq!(b[1].usable, ByteSize(28 * GIB));
    assert_eq!(b[2].budget, ByteSize(79 * GIB));
    let e = inv
        .budgets(ByteSize(GIB), &[(DeviceId::Cuda(7), ByteSize(GIB))].into())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cuda:7") && e.contains("cuda:0, cuda:1, cuda:2, cuda:3"),
        "{e}"
    );
}

#[test]
fn links_and_domains() {
    let inv = four();
    assert_eq!(inv.link(0, 1), Some(LinkKind::Nvlink));
    assert_eq!(inv.link(0, 2), Some(LinkKind::Pcie));
    assert_eq!(inv.link(0, 3), None);
    let d = inv.peer_domains();
    assert_eq!(d.len(), 2, "{d:?}");
    assert_eq!(d[0].devices, vec![DeviceId::Cuda(0), DeviceId::Cuda(1)]);
    assert_eq!(d[0].kind, LinkKind::Nvlink);
    assert_eq!(
        d[1].devices,
        vec![DeviceId::Cuda(0), DeviceId::Cuda(1), DeviceId::Cuda(2)]
    );
    assert_eq!(d[1].kind, LinkKind::Pcie);
    assert!(d[0].gbps > d[1].gbps);
    let t = inv.table(&inv.budgets(ByteSize(GIB), &BTreeMap::new()).unwrap());
    assert!(t.contains("NV(0)") && t.contains("PCIe(0)"), "{t}");
    assert!(
        t.contains("GPU-01010101-0101-0101-0101-010101010101"),
        "{t}"
    );
}

#[test]
fn non_clique_gives_pairs() {
    // 0–1 and 1–2 reach each other, 0–2 do not.
    let mut inv = four();
    inv.devices.truncate(3);
    inv.peers = vec![
        peer(0, 1, true, false),
        peer(1, 0, true, false),
        peer(1, 2, true, false),
        peer(2, 1, true, false),
        peer(0, 2, false, false),
        peer(2, 0, false, false),
    ];
    let d = inv.peer_domains();
    assert_eq!(d.len(), 2);
    assert!(d.iter().all(|p| p.devices.len() == 2));
}

#[test]
fn profile_of_this_box_round_trips() {
    let inv = four();
    let m = inv.to_machine(&opts()).unwrap();
    assert_eq!(m.devices[0].budget, ByteSize(20 * GIB));
    assert_eq!(m.devices[0].headroom, ByteSize(2 * GIB));
    assert_eq!(m.devices[1].budget, ByteSize(30 * GIB));
    assert!(m.devices[0].bf16_tflops > 500.0 && m.devices[0].bf16_tflops < 1000.0);
    assert!((m.devices[0].mem_bandwidth_gbps - 3352.3).abs() < 1.0);
    assert_eq!(m.calibration.date.as_deref(), Some("2026-01-02"));
    let back = Machine::from_yaml(&m.to_yaml(), "again").unwrap();
    assert_eq!(back, m);
    let too_much = ProfileOptions {
        headroom: ByteSize(40 * GIB),
        ..opts()
    };
    let e = inv.to_machine(&too_much).unwrap_err().to_string();
    assert!(e.contains("cuda:0") && e.contains("headroom"), "{e}");
}

#[test]
fn measurements_are_applied() {
    let inv = four();
    let mut m = inv.to_machine(&opts()).unwrap();
    let dm = |o, t| DeviceMeasurement {
        ordinal: o,
        bf16_tflops: t,
        matmul_n: 8192,
        mem_bandwidth_gbps: 3000.0,
        host_pinned_gbps: 25.0 + o as f64,
        host_pinned_busy_gbps: Some(22.0 + o as f64),
        host_pageable_gbps: 9.0,
        copy_bytes: GIB,
    };
    let r = Measurements {
        devices: (0..4).map(|o| dm(o, 700.0 + o as f64)).collect(),
        peer_copies: vec![
            PeerCopy {
                from: 0,
                to: 1,
                gbps: 390.0,
            },
            PeerCopy {
                from: 1,
                to: 0,
                gbps: 380.0,
            },
            PeerCopy {
                from: 0,
                to: 2,
                gbps: 21.0,
            },
        ],
        allreduce: None,
        not_measured: vec![],
        host_read_gbps: None,
    };
    // A device that did not measure it leaves the profile without a busy rate.
    let mut partly = r.clone();
    partly.devices[2].host_pinned_busy_gbps = None;
    let mut m2 = inv.to_machine(&opts()).unwrap();
    apply_measurements(&mut m2, &partly, "2026-02-03", "0.1.0");
    assert_eq!(m2.links.host_pinned_busy_gbps, None);
    assert_eq!(m2.copy_busy_ratio(), 1.0);
    let before = m.links.peer[0].allreduce;
    apply_measurements(&mut m, &r, "2026-02-03", "0.1.0");
    assert_eq!(m.devices[1].bf16_tflops, 701.0);
    assert_eq!(m.devices[3].mem_bandwidth_gbps, 3000.0);
    assert_eq!(m.links.host_pinned_gbps, 25.0);
    // The busy rate: the slowest device's, and the ratio the cost model uses.
    assert_eq!(m.links.host_pinned_busy_gbps, Some(22.0));
    assert!((m.copy_busy_ratio() - 22.0 / 25.0).abs() < 1e-12);
    assert!(m.calibration.notes.contains("matrix products running"));
    assert_eq!(m.links.peer[0].gbps, 380.0);
    assert_eq!(m.links.peer[1].gbps, 21.0);
    assert_eq!(m.links.peer[0].allreduce, before);
    assert_eq!(m.calibration.source, "measured");
    assert_eq!(m.calibration.date.as_deref(), Some("2026-02-03"));
    assert_eq!(m.calibration.mold_version.as_deref(), Some("0.1.0"));
    assert!(
        m.calibration.notes.contains("all-reduce: not measured"),
        "{}",
        m.calibration.notes
    );
    let back = Machine::from_yaml(&m.to_yaml(), "again").unwrap();
    assert_eq!(back, m);

    let r2 = Measurements {
        allreduce: Some(vec![AllreduceMeasurement {
            group_size: 2,
            latency_us: 33.2,
            gbps: 311.8,
        }]),
        ..r
    };
    apply_measurements(&mut m, &r2, "2026-02-03", "0.1.0");
    assert_eq!(m.links.peer[0].allreduce.gbps, 311.8);
    assert!(!m.calibration.notes.contains("all-reduce: not measured"));
    assert!(m
        .calibration
        .notes
        .contains("host-staged all-reduce: estimate"));

    // A reason from the caller replaces the no-NCCL note.
    let r3 = Measurements {
        allreduce: None,
        not_measured: vec!["all-reduce: not measured (NCCL failed: boom)".into()],
        host_read_gbps: None,
        ..r2
    };
    apply_measurements(&mut m, &r3, "2026-02-03", "0.1.0");
    let notes = &m.calibration.notes;
    assert!(notes.contains("NCCL failed: boom"), "{notes}");
    assert!(!notes.contains("no NCCL"), "{notes}");
}

/// A box profiled without peer domains (`mold devices --no-peer`, or GPUs without peer
/// access): the all-reduce it measured is the host-staged path's, from the smallest group;
/// with peer domains the host-staged figure stays an estimate.
#[test]
fn without_peer_domains_the_measured_all_reduce_is_the_host_staged_one() {
    let inv = four();
    let mut m = inv.to_machine(&opts()).unwrap();
    let estimate = m.links.host_staged_allreduce;
    m.links.peer.clear();
    let r = Measurements {
        devices: vec![],
        peer_copies: vec![],
        allreduce: Some(vec![
            AllreduceMeasurement {
                group_size: 4,
                latency_us: 61.0,
                gbps: 17.5,
            },
            AllreduceMeasurement {
                group_size: 2,
                latency_us: 42.04,
                gbps: 29.13,
            },
        ]),
        not_measured: vec![],
        host_read_gbps: None,
    };
    apply_measurements(&mut m, &r, "2026-02-03", "0.1.0");
    assert_eq!(m.links.host_staged_allreduce.latency_us, 42.0);
    assert_eq!(m.links.host_staged_allreduce.gbps, 29.1);
    assert_ne!(m.links.host_staged_allreduce, estimate);
    let notes = &m.calibration.notes;
    assert!(notes.contains("without peer access"), "{notes}");
    assert!(
        !notes.contains("host-staged all-reduce: estimate"),
        "{notes}"
    );

    let mut with_peers = inv.to_machine(&opts()).unwrap();
    assert!(!with_peers.links.peer.is_empty());
    apply_measurements(&mut with_peers, &r, "2026-02-03", "0.1.0");
    assert_eq!(with_peers.links.host_staged_allreduce, estimate);
}

#[test]
fn allreduce_bus_bandwidth_inverts_the_cost_model() {
    // 2 ranks: busbw = algbw (each rank sends and receives half twice).
    assert_eq!(allreduce_bus_gbps(2, 1_000_000_000, 1.0), 1.0);
    // 8 ranks: 2·7/8.
    assert!((allreduce_bus_gbps(8, 1_000_000_000, 1.0) - 1.75).abs() < 1e-12);
    assert_eq!(allreduce_bus_gbps(1, GIB, 1.0), 0.0);
    assert_eq!(allreduce_bus_gbps(4, GIB, 0.0), 0.0);
    for n in [2, 3, 4, 8] {
        let c = Collective {
            latency_us: 0.0,
            gbps: 311.8,
        };
        let bytes = 256 * MIB;
        let gbps = allreduce_bus_gbps(n, bytes, c.allreduce_s(bytes, n));
        assert!((gbps - 311.8).abs() < 1e-9, "{n}: {gbps}");
    }
}

#[test]
fn allreduce_group_sizes_are_every_size_from_two() {
    assert!(allreduce_group_sizes(0).is_empty());
    assert!(allreduce_group_sizes(1).is_empty());
    assert_eq!(allreduce_group_sizes(2), vec![2]);
    assert_eq!(allreduce_group_sizes(3), vec![2, 3]);
    assert_eq!(allreduce_group_sizes(4), vec![2, 3, 4]);
    assert_eq!(allreduce_group_sizes(6), vec![2, 3, 4, 5, 6]);
}

#[test]
fn dates_and_uuids() {
    assert_eq!(civil_date(0), "1970-01-01");
    assert_eq!(civil_date(19_723), "2024-01-01");
    assert_eq!(civil_date(20_513), "2026-03-01");
    assert_eq!(today().len(), 10);
    let mut b = [0u8; 16];
    b[0] = 0xab;
    b[15] = 0x01;
    assert_eq!(format_uuid(&b), "GPU-ab000000-0000-0000-0000-000000000001");
}

#[test]
fn inventory_json_round_trips() {
    let inv = four();
    let y = serde_yaml_ng::to_string(&inv).unwrap();
    let back: Inventory = serde_yaml_ng::from_str(&y).unwrap();
    assert_eq!(back, inv);
    assert_eq!(CUDA, cfg!(feature = "cuda"));
}
