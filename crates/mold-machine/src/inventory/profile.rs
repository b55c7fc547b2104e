//! A machine profile of this box from its inventory: budgets, estimated throughput, and
//! peer domains from the links between devices.

use super::{round1, Inventory, InventoryError, ProfileOptions};
use crate::{Calibration, Collective, Device, Host, LinkKind, Links, Machine, PeerDomain};
use mold_plan::{ByteSize, DeviceId, GIB, MIB};

impl Inventory {
    /// Groups of devices that all reach each other: NVLink cliques and peer-access
    /// cliques; a connected set that is not a clique gives one domain per pair.
    pub(super) fn peer_domains(&self) -> Vec<PeerDomain> {
        let cc_major = |o: u32| self.device(o).map(|d| d.cc().0).unwrap_or(0);
        let mut out: Vec<PeerDomain> = Vec::new();
        for nvlink_only in [true, false] {
            let edge = |a: u32, b: u32| match self.link(a, b) {
                Some(LinkKind::Nvlink) => true,
                Some(LinkKind::Pcie) => !nvlink_only,
                None => false,
            };
            let ords: Vec<u32> = self.devices.iter().map(|d| d.ordinal).collect();
            let mut seen = vec![false; ords.len()];
            for start in 0..ords.len() {
                if seen[start] {
                    continue;
                }
                // Connected component by depth-first search.
                let mut comp = vec![start];
                seen[start] = true;
                let mut i = 0;
                while i < comp.len() {
                    let a = ords[comp[i]];
                    for (j, &b) in ords.iter().enumerate() {
                        if !seen[j] && edge(a, b) {
                            seen[j] = true;
                            comp.push(j);
                        }
                    }
                    i += 1;
                }
                if comp.len() < 2 {
                    continue;
                }
                comp.sort();
                let members: Vec<u32> = comp.iter().map(|&k| ords[k]).collect();
                let clique = members
                    .iter()
                    .all(|&a| members.iter().all(|&b| a == b || edge(a, b)));
                let sets: Vec<Vec<u32>> = if clique {
                    vec![members.clone()]
                } else {
                    let mut v = Vec::new();
                    for (x, &a) in members.iter().enumerate() {
                        for &b in &members[x + 1..] {
                            if edge(a, b) {
                                v.push(vec![a, b]);
                            }
                        }
                    }
                    v
                };
                for set in sets {
                    let nvlink = set.iter().all(|&a| {
                        set.iter()
                            .all(|&b| a == b || self.link(a, b) == Some(LinkKind::Nvlink))
                    });
                    let kind = if nvlink {
                        LinkKind::Nvlink
                    } else {
                        LinkKind::Pcie
                    };
                    let arch = set.iter().map(|&o| cc_major(o)).min().unwrap_or(0);
                    let (gbps, allreduce) = estimated_link(kind, arch);
                    let devices: Vec<DeviceId> = set.iter().map(|&o| DeviceId::Cuda(o)).collect();
                    if out.iter().any(|p| p.devices == devices) {
                        continue;
                    }
                    out.push(PeerDomain {
                        devices,
                        kind,
                        gbps,
                        allreduce,
                    });
                }
            }
        }
        out
    }

    /// A machine profile of this box: budgets `min(cap, free)` with `headroom` inside,
    /// throughput estimated from the driver's attributes (see [`GpuInfo`]) until
    /// calibrated.
    pub fn to_machine(&self, o: &ProfileOptions) -> Result<Machine, InventoryError> {
        if self.devices.is_empty() {
            return Err(InventoryError::NoDevices);
        }
        let budgets = self.budgets(o.headroom, &o.caps)?;
        let mut devices = Vec::new();
        for (g, b) in self.devices.iter().zip(&budgets) {
            if b.budget <= o.headroom {
                return Err(InventoryError::Budget(format!(
                    "{}: {} free{} leaves nothing once the {} headroom is kept",
                    g.id(),
                    g.free.human(),
                    b.cap
                        .map(|c| format!(", capped at {c}"))
                        .unwrap_or_default(),
                    o.headroom
                )));
            }
            devices.push(Device {
                id: g.id(),
                name: g.name.clone(),
                memory: ByteSize(g.total.0.div_ceil(MIB) * MIB),
                budget: ByteSize(b.budget.0 / MIB * MIB),
                headroom: o.headroom,
                bf16_tflops: round1(g.estimated_bf16_tflops()),
                f32_tflops: None,
                model_efficiency: None,
                elementwise_efficiency: None,
                mem_bandwidth_gbps: round1(g.estimated_bandwidth_gbps()),
                fused_attention: true,
                uuid: Some(g.uuid.clone()),
                pci_bus: Some(g.pci_bus.clone()),
                compute_capability: Some(g.compute_capability.clone()),
                node: 0,
            });
        }
        let host_memory = self.host_memory.unwrap_or(ByteSize(16 * GIB));
        let cpus = self.host_cpus.unwrap_or(8);
        let newest = self.devices.iter().map(|d| d.cc().0).max().unwrap_or(0);
        // PCIe 5.0 on Hopper-and-later boxes, 4.0 before.
        let pinned = if newest >= 9 { 40.0 } else { 24.0 };
        let names: Vec<String> = {
            let mut v: Vec<String> = Vec::new();
            for d in &self.devices {
                let n = self.devices.iter().filter(|e| e.name == d.name).count();
                let s = format!("{n}x {}", d.name);
                if !v.contains(&s) {
                    v.push(s);
                }
            }
            v
        };
        let m = Machine {
            name: o.name.clone(),
            description: format!(
                "This box as `mold devices` queried it: {}{}.",
                names.join(", "),
                self.driver_version
                    .as_deref()
                    .map(|v| format!(", CUDA driver {v}"))
                    .unwrap_or_default()
            ),
            calibration: Calibration {
                source: "spec-sheet".into(),
                date: Some(o.date.clone()),
                mold_version: Some(o.mold_version.clone()),
                notes: format!(
                    "Queried by mold {}: names, memory, free memory (budget = min(cap, free) \
                     with headroom {} inside), compute capability, PCI bus, peer access \
                     (cuDeviceCanAccessPeer; NVLink inferred from native peer atomics, not \
                     NVML). Not measured: bf16 TFLOP/s estimated as SMs x clock x the \
                     architecture's dense rate x 0.75; memory bandwidth from memory clock \
                     and bus width; host and peer copy and all-reduce figures are typical \
                     values for the link kind. Run `mold devices --save PATH --calibrate` \
                     to measure them.",
                    o.mold_version, o.headroom
                ),
            },
            host: Host {
                memory: host_memory,
                pinned_limit: ByteSize(host_memory.0 / 2),
                tflops: round1((cpus as f64 * 0.04).max(0.1)),
                mem_bandwidth_gbps: 50.0,
                read_gbps: None,
            },
            devices,
            links: Links {
                host_pinned_gbps: pinned,
                host_pinned_busy_gbps: None,
                host_pageable_gbps: 10.0,
                peer: self.peer_domains(),
                host_staged_allreduce: Collective {
                    latency_us: 80.0,
                    gbps: 10.0,
                },
                inter_node: None,
            },
            ops: Vec::new(),
        };
        m.validate("this box")
            .map_err(|e| InventoryError::Budget(e.to_string()))?;
        Ok(m)
    }
}

/// Typical figures for a link kind, until calibrated: (peer copy GB/s, all-reduce).
fn estimated_link(kind: LinkKind, arch_major: u32) -> (f64, Collective) {
    match (kind, arch_major) {
        (LinkKind::Nvlink, m) if m >= 9 => (
            370.0,
            Collective {
                latency_us: 30.0,
                gbps: 300.0,
            },
        ),
        (LinkKind::Nvlink, 8) => (
            200.0,
            Collective {
                latency_us: 30.0,
                gbps: 150.0,
            },
        ),
        (LinkKind::Nvlink, _) => (
            50.0,
            Collective {
                latency_us: 30.0,
                gbps: 40.0,
            },
        ),
        (LinkKind::Pcie, _) => (
            20.0,
            Collective {
                latency_us: 30.0,
                gbps: 15.0,
            },
        ),
    }
}
