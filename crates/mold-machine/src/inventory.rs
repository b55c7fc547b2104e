//! This box's GPUs as the CUDA driver reports them (`mold devices`), the machine profile
//! built from them (`mold devices --save`, `mold plan --machine local`), and calibration
//! (`mold devices --save … --calibrate`).
//!
//! The data types, budgets, profile building and the applying of measurements are plain
//! code, tested on any build. Querying ([`query`]) and measuring ([`calibrate`]) need the
//! `cuda` feature: each device is queried in its own (primary) context, so its free
//! memory is its own; peer access comes from `cuDeviceCanAccessPeer`, and the link
//! between two devices from `cuDeviceGetP2PAttribute`: its performance rank, and whether
//! native atomics work across it. NVML is not used (it would be one more native library
//! to build and load); NVLink is **inferred**: CUDA supports native peer atomics over
//! NVLink but not over PCIe, so a pair with peer access and native atomics is counted as
//! NVLink, any other pair with peer access as PCIe.

use crate::{Calibration, Collective, Device, Host, LinkKind, Links, Machine, PeerDomain};
use mold_plan::{ByteSize, DeviceId, GIB, MIB};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Whether this build can query GPUs.
pub const CUDA: bool = cfg!(feature = "cuda");

#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("this build of mold has no CUDA")]
    NoCuda,
    #[error("the CUDA driver: {0}")]
    Cuda(String),
    #[error("the CUDA driver reports no GPU")]
    NoDevices,
    #[error("{0}")]
    Budget(String),
    #[error("calibration: {0}")]
    Calibration(String),
}

/// The GPUs of this box and the links between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Inventory {
    /// `cuDriverGetVersion`, e.g. `13.0`.
    #[serde(default)]
    pub driver_version: Option<String>,
    pub devices: Vec<GpuInfo>,
    /// One entry per ordered pair of distinct devices.
    #[serde(default)]
    pub peers: Vec<PeerInfo>,
    #[serde(default)]
    pub host_memory: Option<ByteSize>,
    #[serde(default)]
    pub host_cpus: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub ordinal: u32,
    pub name: String,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi writes it.
    pub uuid: String,
    pub total: ByteSize,
    /// Free memory as seen from this device's own context (other processes' use and
    /// mold's own context already taken).
    pub free: ByteSize,
    /// `9.0`
    pub compute_capability: String,
    /// `0000:18:00.0`
    pub pci_bus: String,
    pub multiprocessors: u32,
    #[serde(default)]
    pub clock_mhz: Option<u32>,
    #[serde(default)]
    pub memory_clock_mhz: Option<u32>,
    #[serde(default)]
    pub memory_bus_bits: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub from: u32,
    pub to: u32,
    /// `cuDeviceCanAccessPeer`
    pub access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (lower is faster), when access.
    #[serde(default)]
    pub performance_rank: Option<i32>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: NVLink (see the module docs).
    #[serde(default)]
    pub native_atomics: bool,
}

/// One device's budget: `min(cap, free) − headroom` is what a plan may fill.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceBudget {
    pub device: DeviceId,
    pub free: ByteSize,
    pub cap: Option<ByteSize>,
    /// `min(cap, free)`: the profile's `budget`.
    pub budget: ByteSize,
    pub headroom: ByteSize,
    /// `budget − headroom`, i.e. `min(cap, free) − headroom`.
    pub usable: ByteSize,
}

/// What a profile built from the inventory needs besides the inventory.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileOptions {
    pub name: String,
    /// Kept free on every device.
    pub headroom: ByteSize,
    /// Budget caps (`--max-vram`).
    pub caps: BTreeMap<DeviceId, ByteSize>,
    /// `YYYY-MM-DD`
    pub date: String,
    pub mold_version: String,
}

impl GpuInfo {
    pub fn id(&self) -> DeviceId {
        DeviceId::Cuda(self.ordinal)
    }

    fn cc(&self) -> (u32, u32) {
        let mut it = self
            .compute_capability
            .split('.')
            .map(|p| p.parse::<u32>().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    }

    /// Reachable dense bf16 TFLOP/s, estimated from SMs × clock × the architecture's
    /// tensor-core rate × 0.75 (an uncalibrated profile; `--calibrate` measures it).
    pub fn estimated_bf16_tflops(&self) -> f64 {
        let (major, minor) = self.cc();
        let geforce = self.name.contains("GeForce") || self.name.contains("TITAN");
        // Dense bf16 FLOPs per clock per SM (f32 accumulate).
        let per_sm = match (major, minor) {
            (m, _) if m >= 10 => 8192.0,
            (9, _) => 4096.0,
            (8, 0) => 2048.0,
            (8, _) if geforce => 512.0,
            (8, _) => 1024.0,
            (7, _) => 512.0,
            _ => 256.0,
        };
        let clock = self.clock_mhz.unwrap_or(1500) as f64 * 1e6;
        (self.multiprocessors.max(1) as f64 * clock * per_sm * 0.75 / 1e12).max(0.1)
    }

    /// Memory bandwidth (GB/s) from the memory clock and bus width (double data rate),
    /// or a guess when the driver does not say.
    pub fn estimated_bandwidth_gbps(&self) -> f64 {
        match (self.memory_clock_mhz, self.memory_bus_bits) {
            (Some(c), Some(b)) if c > 0 && b > 0 => 2.0 * c as f64 * 1e6 * b as f64 / 8.0 / 1e9,
            _ => 500.0,
        }
    }
}

impl Inventory {
    pub fn device(&self, ordinal: u32) -> Option<&GpuInfo> {
        self.devices.iter().find(|d| d.ordinal == ordinal)
    }

    pub fn device_list(&self) -> String {
        self.devices
            .iter()
            .map(|d| d.id().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn peer(&self, from: u32, to: u32) -> Option<&PeerInfo> {
        self.peers.iter().find(|p| p.from == from && p.to == to)
    }

    /// How `a` and `b` reach each other directly, if they do: peer access both ways;
    /// NVLink when native atomics work across the pair.
    pub fn link(&self, a: u32, b: u32) -> Option<LinkKind> {
        let (ab, ba) = (self.peer(a, b)?, self.peer(b, a)?);
        if !(ab.access && ba.access) {
            return None;
        }
        Some(if ab.native_atomics || ba.native_atomics {
            LinkKind::Nvlink
        } else {
            LinkKind::Pcie
        })
    }

    /// Per-device budgets: `min(cap, free)`, of which `headroom` stays free. Caps must name
    /// devices of this box.
    pub fn budgets(
        &self,
        headroom: ByteSize,
        caps: &BTreeMap<DeviceId, ByteSize>,
    ) -> Result<Vec<DeviceBudget>, InventoryError> {
        for d in caps.keys() {
            if !self.devices.iter().any(|g| &g.id() == d) {
                return Err(InventoryError::Budget(format!(
                    "max_vram: {d} is not a device of this box (it has {})",
                    self.device_list()
                )));
            }
        }
        Ok(self
            .devices
            .iter()
            .map(|g| {
                let cap = caps.get(&g.id()).copied();
                let budget = cap.map_or(g.free, |c| c.min(g.free));
                DeviceBudget {
                    device: g.id(),
                    free: g.free,
                    cap,
                    budget,
                    headroom,
                    usable: ByteSize(budget.0.saturating_sub(headroom.0)),
                }
            })
            .collect())
    }

    /// Groups of devices that all reach each other: NVLink cliques and peer-access
    /// cliques; a connected set that is not a clique gives one domain per pair.
    pub fn peer_domains(&self) -> Vec<PeerDomain> {
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
                mem_bandwidth_gbps: round1(g.estimated_bandwidth_gbps()),
                fused_attention: true,
                uuid: Some(g.uuid.clone()),
                pci_bus: Some(g.pci_bus.clone()),
                compute_capability: Some(g.compute_capability.clone()),
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
            },
            devices,
            links: Links {
                host_pinned_gbps: pinned,
                host_pageable_gbps: 10.0,
                peer: self.peer_domains(),
                host_staged_allreduce: Collective {
                    latency_us: 80.0,
                    gbps: 10.0,
                },
            },
        };
        m.validate("this box")
            .map_err(|e| InventoryError::Budget(e.to_string()))?;
        Ok(m)
    }

    /// The listing `mold devices` prints.
    pub fn table(&self, budgets: &[DeviceBudget]) -> String {
        let mut s = String::new();
        if let Some(v) = &self.driver_version {
            let _ = writeln!(s, "CUDA driver {v}");
        }
        let _ = writeln!(
            s,
            "{:<7} {:<26} {:>10} {:>10} {:>10} {:>10} {:>4}  {:<13} uuid",
            "device", "name", "total", "free", "budget", "usable", "cc", "pci bus"
        );
        for g in &self.devices {
            let b = budgets.iter().find(|b| b.device == g.id());
            let cell = |f: fn(&DeviceBudget) -> ByteSize| {
                b.map(|b| f(b).human()).unwrap_or_else(|| "-".into())
            };
            let _ = writeln!(
                s,
                "{:<7} {:<26} {:>10} {:>10} {:>10} {:>10} {:>4}  {:<13} {}",
                g.id().to_string(),
                g.name,
                g.total.human(),
                g.free.human(),
                cell(|b| b.budget),
                cell(|b| b.usable),
                g.compute_capability,
                g.pci_bus,
                g.uuid
            );
        }
        if let Some(b) = budgets.first() {
            let _ = writeln!(
                s,
                "budget = min(max_vram cap, free); usable = budget - headroom ({})",
                b.headroom
            );
        }
        if self.devices.len() > 1 {
            let _ = writeln!(
                s,
                "\npeer access (NV = NVLink, inferred from native peer atomics; PCIe = \
                 peer-to-peer over PCIe; - = none, copies go through the host); \
                 (r) = performance rank, lower is faster"
            );
            let _ = write!(s, "{:<8}", "");
            for g in &self.devices {
                let _ = write!(s, " {:>9}", g.id().to_string());
            }
            let _ = writeln!(s);
            for a in &self.devices {
                let _ = write!(s, "{:<8}", a.id().to_string());
                for b in &self.devices {
                    let cell = if a.ordinal == b.ordinal {
                        "x".to_string()
                    } else {
                        let rank = self
                            .peer(a.ordinal, b.ordinal)
                            .and_then(|p| p.performance_rank)
                            .map(|r| format!("({r})"))
                            .unwrap_or_default();
                        match self.link(a.ordinal, b.ordinal) {
                            Some(LinkKind::Nvlink) => format!("NV{rank}"),
                            Some(LinkKind::Pcie) => format!("PCIe{rank}"),
                            None => "-".into(),
                        }
                    };
                    let _ = write!(s, " {cell:>9}");
                }
                let _ = writeln!(s);
            }
        }
        s
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
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

/// How the GPUs of this box differ from the ones a plan was made for (its recorded
/// machine): one line per difference, empty when every CUDA device of the plan is here
/// with the same name and total memory. Host devices and emulated devices are ignored.
pub fn differences_from_plan(inv: &Inventory, planned: &mold_plan::MachineIdentity) -> Vec<String> {
    let mut out = Vec::new();
    for d in &planned.devices {
        let DeviceId::Cuda(ord) = d.id else { continue };
        match inv.devices.iter().find(|g| g.ordinal == ord) {
            None => out.push(format!(
                "{}: the plan's {} ({}) is not on this box ({} CUDA device(s) here)",
                d.id,
                d.name,
                d.memory.human(),
                inv.devices.len()
            )),
            Some(g) => {
                // Profiles record total memory rounded to MiB; allow 1 GiB of slack.
                let diff = g.total.0.abs_diff(d.memory.0);
                if g.name != d.name || diff > GIB {
                    out.push(format!(
                        "{}: this box has {} ({}), the plan was made for {} ({})",
                        d.id,
                        g.name,
                        g.total.human(),
                        d.name,
                        d.memory.human()
                    ));
                }
            }
        }
    }
    out
}

/// What `--calibrate` measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Measurements {
    pub devices: Vec<DeviceMeasurement>,
    /// Peer copies between devices with peer access.
    #[serde(default)]
    pub peer_copies: Vec<PeerCopy>,
    /// All-reduce latency and bus bandwidth per group size; `None` when not measured
    /// (builds without NCCL): profiles then keep estimated all-reduce figures and say so.
    #[serde(default)]
    pub allreduce: Option<Vec<AllreduceMeasurement>>,
    /// Why a figure was not measured.
    #[serde(default)]
    pub not_measured: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceMeasurement {
    pub ordinal: u32,
    /// bf16 matrix product, n × n × n.
    pub bf16_tflops: f64,
    pub matmul_n: u32,
    /// Device-to-device copy, read + write.
    pub mem_bandwidth_gbps: f64,
    pub host_pinned_gbps: f64,
    pub host_pageable_gbps: f64,
    /// Bytes per copy.
    pub copy_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerCopy {
    pub from: u32,
    pub to: u32,
    pub gbps: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllreduceMeasurement {
    pub group_size: u32,
    /// Time of one small all-reduce (microseconds).
    pub latency_us: f64,
    /// Bus bandwidth of a large all-reduce ([`allreduce_bus_gbps`]), the figure
    /// [`Collective::gbps`] holds.
    pub gbps: f64,
}

/// Bus bandwidth (GB/s) of an all-reduce of `bytes` over `n` ranks that took `seconds`:
/// `2(n−1)/n · bytes / seconds / 1e9`, the "busbw" of nccl-tests. A ring all-reduce moves
/// `2(n−1)/n · bytes` through each rank's link, so the figure is comparable across group
/// sizes and is what [`Collective::allreduce_s`] divides by. 0 for fewer than two ranks
/// or a non-positive time.
pub fn allreduce_bus_gbps(n: usize, bytes: u64, seconds: f64) -> f64 {
    if n < 2 || seconds <= 0.0 || !seconds.is_finite() {
        return 0.0;
    }
    let n = n as f64;
    2.0 * (n - 1.0) / n * bytes as f64 / seconds / 1e9
}

/// The group sizes calibration measures all-reduce for over `count` devices (the first
/// `size` of them each): 2, 4, 8, … up to `count`, and `count` itself (a peer domain of
/// all the devices) when it is not a power of two. Empty for fewer than two devices.
pub fn allreduce_group_sizes(count: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::successors(Some(2usize), |n| n.checked_mul(2))
        .take_while(|&n| n <= count)
        .collect();
    if count >= 2 && !count.is_power_of_two() {
        v.push(count);
    }
    v
}

/// Writes measured figures into `m` and marks it `calibration: {source: measured, date,
/// mold_version}`; the notes say what was measured and what was not.
pub fn apply_measurements(m: &mut Machine, r: &Measurements, date: &str, mold_version: &str) {
    let mut measured = Vec::new();
    for dm in &r.devices {
        if let Some(d) = m
            .devices
            .iter_mut()
            .find(|d| d.id == DeviceId::Cuda(dm.ordinal))
        {
            d.bf16_tflops = round1(dm.bf16_tflops);
            d.mem_bandwidth_gbps = round1(dm.mem_bandwidth_gbps);
        }
    }
    if !r.devices.is_empty() {
        let n = r.devices[0].matmul_n;
        measured.push(format!(
            "bf16 TFLOP/s ({n}^3 matrix product, candle), memory bandwidth (device-to-device \
             copy, read + write), host->device copies from pinned and pageable memory \
             ({} MiB, each device alone: the minimum is kept)",
            r.devices[0].copy_bytes / MIB
        ));
        let min = |f: fn(&DeviceMeasurement) -> f64| {
            round1(r.devices.iter().map(f).fold(f64::INFINITY, f64::min))
        };
        m.links.host_pinned_gbps = min(|d| d.host_pinned_gbps);
        m.links.host_pageable_gbps = min(|d| d.host_pageable_gbps);
    }
    if !r.peer_copies.is_empty() {
        measured.push("peer copy GB/s (slowest pair of each domain)".into());
    }
    for p in m.links.peer.iter_mut() {
        let within: Vec<f64> = r
            .peer_copies
            .iter()
            .filter(|c| {
                p.devices.contains(&DeviceId::Cuda(c.from))
                    && p.devices.contains(&DeviceId::Cuda(c.to))
            })
            .map(|c| c.gbps)
            .collect();
        if !within.is_empty() {
            p.gbps = round1(within.iter().copied().fold(f64::INFINITY, f64::min));
        }
        if let Some(ar) = &r.allreduce {
            if let Some(a) = ar.iter().find(|a| a.group_size as usize == p.devices.len()) {
                p.allreduce = Collective {
                    latency_us: round1(a.latency_us),
                    gbps: round1(a.gbps),
                };
            }
        }
    }
    let mut not = r.not_measured.clone();
    match &r.allreduce {
        Some(a) if !a.is_empty() => {
            measured.push(format!(
                "NCCL all-reduce latency (small message) and bus bandwidth (large message) \
                 for group sizes {}",
                a.iter()
                    .map(|a| a.group_size.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            not.push("host-staged all-reduce: estimate".into());
        }
        // The caller said why (e.g. NCCL failed, or one GPU).
        _ if not.iter().any(|s| s.starts_with("all-reduce")) => {}
        _ => not.push(
            "all-reduce: not measured (this build has no NCCL: build with --features nccl); \
             the peer domains' and host-staged all-reduce figures are estimates"
                .into(),
        ),
    }
    not.push("host CPU TFLOP/s and memory bandwidth: estimates".into());
    m.calibration = Calibration {
        source: "measured".into(),
        date: Some(date.into()),
        mold_version: Some(mold_version.into()),
        notes: format!(
            "Measured by mold {mold_version} on {date}: {}. Not measured: {}.",
            measured.join("; "),
            not.join("; ")
        ),
    };
}

/// Today's date in UTC, `YYYY-MM-DD`.
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    civil_date(secs / 86_400)
}

/// Days since 1970-01-01 as `YYYY-MM-DD` (Howard Hinnant's `civil_from_days`).
pub fn civil_date(days: u64) -> String {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!("{y:04}-{m:02}-{d:02}")
}

/// Host memory and CPU count of this box (Linux `/proc/meminfo`; elsewhere unknown).
pub fn host_facts() -> (Option<ByteSize>, Option<u32>) {
    let mem = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| ByteSize(kb * 1024 / GIB * GIB).max(ByteSize(GIB)))
    });
    let cpus = std::thread::available_parallelism()
        .ok()
        .map(|n| n.get() as u32);
    (mem, cpus)
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` from the driver's 16 bytes.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let h: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Queries this box's GPUs. Needs the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn query() -> Result<Inventory, InventoryError> {
    Err(InventoryError::NoCuda)
}

/// Measures the devices of `inv`. Needs the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn calibrate(
    _inv: &Inventory,
    _progress: &mut dyn FnMut(&str),
) -> Result<Measurements, InventoryError> {
    Err(InventoryError::NoCuda)
}

#[cfg(feature = "cuda")]
pub use cuda::{calibrate, query};

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::cuda::cudarc::driver::{result, sys, CudaContext, DriverError};
    use std::sync::Arc;
    use std::time::Instant;

    fn err(e: DriverError) -> InventoryError {
        InventoryError::Cuda(e.to_string())
    }

    fn cal(e: impl std::fmt::Display) -> InventoryError {
        InventoryError::Calibration(e.to_string())
    }

    fn attr(ctx: &CudaContext, a: sys::CUdevice_attribute) -> Option<u32> {
        ctx.attribute(a).ok().and_then(|v| u32::try_from(v).ok())
    }

    fn p2p(a: sys::CUdevice, b: sys::CUdevice, what: sys::CUdevice_P2PAttribute) -> Option<i32> {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: both handles come from cuDeviceGet; `v` outlives the call.
        let r = unsafe { sys::cuDeviceGetP2PAttribute(&mut v, what, a, b) };
        r.result().ok().map(|_| v)
    }

    /// Each device in its own primary context: free memory is that device's own.
    pub fn query() -> Result<Inventory, InventoryError> {
        let n = CudaContext::device_count().map_err(err)?;
        if n <= 0 {
            return Err(InventoryError::NoDevices);
        }
        let mut driver: std::ffi::c_int = 0;
        // SAFETY: `driver` outlives the call; the driver is initialised by device_count.
        let driver_version = unsafe { sys::cuDriverGetVersion(&mut driver) }
            .result()
            .ok()
            .map(|_| format!("{}.{}", driver / 1000, (driver % 1000) / 10));
        let mut ctxs: Vec<Arc<CudaContext>> = Vec::new();
        let mut devices = Vec::new();
        use sys::CUdevice_attribute as A;
        for i in 0..n as usize {
            let ctx = CudaContext::new(i).map_err(err)?;
            // Free as this device's own context sees it; total as cuDeviceTotalMem (and
            // nvidia-smi) report it, which is a little more than cuMemGetInfo's total.
            let (free, _) = ctx.mem_get_info().map_err(err)?;
            let total = ctx.total_mem().map_err(err)?;
            let (major, minor) = ctx.compute_capability().map_err(err)?;
            let uuid = ctx.uuid().map_err(err)?;
            let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
            let pci = format!(
                "{:04x}:{:02x}:{:02x}.0",
                attr(&ctx, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID).unwrap_or(0),
                attr(&ctx, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID).unwrap_or(0),
                attr(&ctx, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID).unwrap_or(0)
            );
            devices.push(GpuInfo {
                ordinal: i as u32,
                name: ctx.name().map_err(err)?,
                uuid: format_uuid(&bytes),
                total: ByteSize(total as u64),
                free: ByteSize(free as u64),
                compute_capability: format!("{major}.{minor}"),
                pci_bus: pci,
                multiprocessors: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .unwrap_or(0),
                clock_mhz: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).map(|k| k / 1000),
                memory_clock_mhz: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
                    .map(|k| k / 1000),
                memory_bus_bits: attr(&ctx, A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
            });
            ctxs.push(ctx);
        }
        let mut peers = Vec::new();
        use sys::CUdevice_P2PAttribute as P;
        for a in &ctxs {
            for b in &ctxs {
                if a.ordinal() == b.ordinal() {
                    continue;
                }
                let mut can: std::ffi::c_int = 0;
                // SAFETY: both handles come from cuDeviceGet; `can` outlives the call.
                unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                    .result()
                    .map_err(err)?;
                let access = can != 0;
                peers.push(PeerInfo {
                    from: a.ordinal() as u32,
                    to: b.ordinal() as u32,
                    access,
                    performance_rank: if access {
                        p2p(
                            a.cu_device(),
                            b.cu_device(),
                            P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
                        )
                    } else {
                        None
                    },
                    native_atomics: access
                        && p2p(
                            a.cu_device(),
                            b.cu_device(),
                            P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                        )
                        .unwrap_or(0)
                            != 0,
                });
            }
        }
        let (host_memory, host_cpus) = host_facts();
        Ok(Inventory {
            driver_version,
            devices,
            peers,
            host_memory,
            host_cpus,
        })
    }

    /// Device memory from the raw driver API, freed on drop (in its context).
    struct DevBuf {
        ctx: Arc<CudaContext>,
        ptr: sys::CUdeviceptr,
    }

    impl DevBuf {
        fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevBuf, InventoryError> {
            ctx.bind_to_thread().map_err(err)?;
            // SAFETY: the context is current; the memory is freed once, on drop.
            let ptr = unsafe { result::malloc_sync(bytes) }.map_err(err)?;
            // SAFETY: `ptr` holds `bytes` bytes.
            unsafe { result::memset_d8_sync(ptr, 1, bytes) }.map_err(err)?;
            Ok(DevBuf {
                ctx: ctx.clone(),
                ptr,
            })
        }
    }

    impl Drop for DevBuf {
        fn drop(&mut self) {
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated by malloc_sync in this context, freed only here.
                let _ = unsafe { result::free_sync(self.ptr) };
            }
        }
    }

    /// Page-locked host memory, freed on drop.
    struct Pinned {
        ptr: *mut std::ffi::c_void,
        bytes: usize,
    }

    impl Pinned {
        fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Pinned, InventoryError> {
            ctx.bind_to_thread().map_err(err)?;
            // SAFETY: plain page-locked allocation; freed once, on drop.
            let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(err)?;
            // SAFETY: `ptr` holds `bytes` writable bytes.
            unsafe { std::ptr::write_bytes(ptr as *mut u8, 1, bytes) };
            Ok(Pinned { ptr, bytes })
        }
        fn as_slice(&self) -> &[u8] {
            // SAFETY: `ptr` holds `bytes` initialised bytes for the life of `self`.
            unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes) }
        }
    }

    impl Drop for Pinned {
        fn drop(&mut self) {
            // SAFETY: allocated by malloc_host, freed only here.
            let _ = unsafe { result::free_host(self.ptr) };
        }
    }

    /// Seconds per call of `f`, best of `reps` after one warm-up call.
    fn best_s(
        reps: usize,
        mut f: impl FnMut() -> Result<(), InventoryError>,
    ) -> Result<f64, InventoryError> {
        f()?;
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            f()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    }

    fn matmul_tflops(ordinal: usize, n: usize) -> Result<f64, InventoryError> {
        use candle_core::{DType, Device, Tensor};
        let dev = Device::new_cuda(ordinal).map_err(cal)?;
        let a = Tensor::randn(0f32, 1.0, (n, n), &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .map_err(cal)?;
        let b = Tensor::randn(0f32, 1.0, (n, n), &dev)
            .and_then(|t| t.to_dtype(DType::BF16))
            .map_err(cal)?;
        let iters = 10;
        let s = best_s(3, || {
            for _ in 0..iters {
                let c = a.matmul(&b).map_err(cal)?;
                drop(c);
            }
            dev.synchronize().map_err(cal)
        })?;
        Ok(2.0 * (n as f64).powi(3) * iters as f64 / s / 1e12)
    }

    /// Measures every device of `inv`: bf16 matrix product, device memory bandwidth,
    /// host→device copies (pinned and pageable), peer copies. All-reduce is not measured
    /// here (it needs NCCL); the result says so.
    pub fn calibrate(
        inv: &Inventory,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Measurements, InventoryError> {
        let mut ctxs = BTreeMap::new();
        for g in &inv.devices {
            ctxs.insert(
                g.ordinal,
                CudaContext::new(g.ordinal as usize).map_err(err)?,
            );
        }
        let mut out = Measurements::default();
        let n = 8192usize;
        for g in &inv.devices {
            let ctx = &ctxs[&g.ordinal];
            progress(&format!("{}: bf16 matrix product {n}^3", g.id()));
            let bf16_tflops = matmul_tflops(g.ordinal as usize, n)?;
            // Large copies, but never more than a sixth of what is free.
            let bytes = ((g.free.0 / 6).min(GIB) / MIB * MIB).max(64 * MIB) as usize;
            progress(&format!(
                "{}: copies of {} MiB (device, pinned, pageable)",
                g.id(),
                bytes / MIB as usize
            ));
            let src = DevBuf::new(ctx, bytes)?;
            let dst = DevBuf::new(ctx, bytes)?;
            let dtod = best_s(5, || {
                ctx.bind_to_thread().map_err(err)?;
                // SAFETY: both buffers hold `bytes` bytes in this context.
                unsafe { result::memcpy_dtod_sync(dst.ptr, src.ptr, bytes) }.map_err(err)?;
                ctx.synchronize().map_err(err)
            })?;
            let pinned = Pinned::new(ctx, bytes)?;
            let htod_pinned = best_s(3, || {
                ctx.bind_to_thread().map_err(err)?;
                // SAFETY: `dst` holds `bytes` bytes; the source slice lives through the call.
                unsafe { result::memcpy_htod_sync(dst.ptr, pinned.as_slice()) }.map_err(err)
            })?;
            drop(pinned);
            let pageable = vec![1u8; bytes];
            let htod_pageable = best_s(3, || {
                ctx.bind_to_thread().map_err(err)?;
                // SAFETY: as above.
                unsafe { result::memcpy_htod_sync(dst.ptr, &pageable[..]) }.map_err(err)
            })?;
            out.devices.push(DeviceMeasurement {
                ordinal: g.ordinal,
                bf16_tflops,
                matmul_n: n as u32,
                mem_bandwidth_gbps: 2.0 * bytes as f64 / dtod / 1e9,
                host_pinned_gbps: bytes as f64 / htod_pinned / 1e9,
                host_pageable_gbps: bytes as f64 / htod_pageable / 1e9,
                copy_bytes: bytes as u64,
            });
        }
        for p in inv.peers.iter().filter(|p| p.access) {
            let (a, b) = (&ctxs[&p.from], &ctxs[&p.to]);
            progress(&format!("peer copy cuda:{} -> cuda:{}", p.from, p.to));
            for (x, y) in [(a, b), (b, a)] {
                x.bind_to_thread().map_err(err)?;
                // SAFETY: both are live primary contexts; x is current.
                let r = unsafe { sys::cuCtxEnablePeerAccess(y.cu_ctx(), 0) };
                if r != sys::CUresult::CUDA_SUCCESS
                    && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                {
                    return Err(err(DriverError(r)));
                }
            }
            let free = |o: u32| inv.device(o).map(|g| g.free.0).unwrap_or(0);
            let bytes =
                ((free(p.from).min(free(p.to)) / 6).min(GIB) / MIB * MIB).max(64 * MIB) as usize;
            let src = DevBuf::new(a, bytes)?;
            let dst = DevBuf::new(b, bytes)?;
            let s = best_s(3, || {
                // SAFETY: each buffer holds `bytes` bytes in its own context.
                unsafe { sys::cuMemcpyPeer(dst.ptr, b.cu_ctx(), src.ptr, a.cu_ctx(), bytes) }
                    .result()
                    .map_err(err)?;
                a.synchronize().map_err(err)?;
                b.synchronize().map_err(err)
            })?;
            out.peer_copies.push(PeerCopy {
                from: p.from,
                to: p.to,
                gbps: bytes as f64 / s / 1e9,
            });
        }
        // All-reduce needs NCCL; `apply_measurements` records it as not measured.
        out.allreduce = None;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let before = m.links.peer[0].allreduce;
        apply_measurements(&mut m, &r, "2026-02-03", "0.1.0");
        assert_eq!(m.devices[1].bf16_tflops, 701.0);
        assert_eq!(m.devices[3].mem_bandwidth_gbps, 3000.0);
        assert_eq!(m.links.host_pinned_gbps, 25.0);
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
            ..r2
        };
        apply_measurements(&mut m, &r3, "2026-02-03", "0.1.0");
        let notes = &m.calibration.notes;
        assert!(notes.contains("NCCL failed: boom"), "{notes}");
        assert!(!notes.contains("no NCCL"), "{notes}");
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
    fn allreduce_group_sizes_are_powers_of_two_and_all() {
        assert!(allreduce_group_sizes(0).is_empty());
        assert!(allreduce_group_sizes(1).is_empty());
        assert_eq!(allreduce_group_sizes(2), vec![2]);
        assert_eq!(allreduce_group_sizes(3), vec![2, 3]);
        assert_eq!(allreduce_group_sizes(4), vec![2, 4]);
        assert_eq!(allreduce_group_sizes(6), vec![2, 4, 6]);
        assert_eq!(allreduce_group_sizes(8), vec![2, 4, 8]);
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
}
