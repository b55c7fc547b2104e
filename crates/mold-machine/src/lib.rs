//! Machine profiles: the devices of a box, their memory and speed, and the links
//! between them and the host. YAML files in `sim/machines/`; `mold devices --save` writes
//! one for the box it runs on. A profile is plain data: valid on any machine.

pub mod inventory;
pub mod ops;

pub use ops::{
    AttentionPoint, CollectiveOp, CollectivePoint, CollectiveTables, ComponentPoint, GemmPoint,
    OpTables,
};

use mold_plan::{ByteSize, DeviceId, DeviceIdentity, MachineIdentity};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("{source_name}: {message}")]
    Parse {
        source_name: String,
        message: String,
    },
    #[error("{source_name}: {field}: {message}")]
    Invalid {
        source_name: String,
        field: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    #[error("{0}")]
    Select(String),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// Where the figures come from, and when.
    pub calibration: Calibration,
    pub host: Host,
    pub devices: Vec<Device>,
    pub links: Links,
    /// Measured operations of models on this machine's devices (`mold devices
    /// --calibrate --model M`): the cost model prices a block from them where they
    /// cover it ([`ops`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<OpTables>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// `spec-sheet`, `figures.md`, or `measured`.
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mold_version: Option<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub notes: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    pub memory: ByteSize,
    /// Most page-locked memory mold may take for streamed weights.
    pub pinned_limit: ByteSize,
    /// CPU throughput for components placed on the host (TFLOP/s, their dtype).
    pub tflops: f64,
    pub mem_bandwidth_gbps: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    pub id: DeviceId,
    pub name: String,
    pub memory: ByteSize,
    /// Memory mold may use on this device by default (total less the CUDA context and
    /// what other processes hold); `--max-vram` caps it further.
    pub budget: ByteSize,
    /// Kept free inside the budget for allocator fragmentation and library workspaces.
    #[serde(default = "default_headroom")]
    pub headroom: ByteSize,
    /// Dense bf16 matrix throughput reached by real kernels (TFLOP/s).
    pub bf16_tflops: f64,
    /// f32 throughput, if different from bf16 (CPU-emulated devices, f32 weights).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f32_tflops: Option<f64>,
    pub mem_bandwidth_gbps: f64,
    /// The fraction of `bf16_tflops` (`f32_tflops` for f32) a model's kernels reach end
    /// to end on this device: the predicted compute time of a resident `mold exec` step
    /// at 1.0 divided by the measured one (BENCHMARKS.md). Absent: 1.0, the
    /// matrix-product rate itself, which under-predicts real steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_efficiency: Option<f64>,
    /// The fraction of `mem_bandwidth_gbps` a model's element-wise passes (norms,
    /// modulation, bias, activation, residual) reach on this device, fitted with
    /// `model_efficiency` from measured steps (BENCHMARKS.md). Absent: 1.0, the copy
    /// bandwidth itself, which under-predicts real steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elementwise_efficiency: Option<f64>,
    /// Whether attention runs fused (no materialised scores).
    #[serde(default = "yes")]
    pub fused_attention: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<String>,
    /// The node (host) the device is in: 0, 1, … without gaps; devices of different
    /// nodes talk over `links.inter_node`. Absent: 0, one node. Device ids are
    /// machine-wide (`cuda:8` may be the first GPU of node 1).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub node: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn default_headroom() -> ByteSize {
    ByteSize(mold_plan::GIB)
}
fn yes() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Links {
    /// Host→device copy from page-locked memory, per device (GB/s), the device otherwise
    /// idle.
    pub host_pinned_gbps: f64,
    /// The same copy while the device computes (GB/s): measured with matrix products
    /// running beside it (`mold devices --calibrate`). A streamed block's copy overlaps
    /// the compute of the blocks before it, and on an H200 ran at 88 % of the idle rate
    /// there. Absent: copies run at `host_pinned_gbps` whatever the device does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_pinned_busy_gbps: Option<f64>,
    /// Host→device copy from ordinary (pageable) memory (GB/s).
    pub host_pageable_gbps: f64,
    /// Groups of devices that reach each other directly (NVLink, PCIe peer-to-peer).
    #[serde(default)]
    pub peer: Vec<PeerDomain>,
    /// All-reduce between devices without peer access, staged through host memory.
    #[serde(default = "default_staged")]
    pub host_staged_allreduce: Collective,
    /// The network between nodes: required when devices are on more than one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_node: Option<InterNode>,
}

/// The network between the nodes of a machine (InfiniBand, Ethernet/RoCE): what one
/// device reaches on another node, GPU-direct. 400 Gb/s InfiniBand is 50 GB/s.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterNode {
    pub kind: NetworkKind,
    /// Bandwidth between two devices on different nodes (GB/s, bytes).
    pub gbps: f64,
    /// Latency of one message or collective step between nodes (µs).
    pub latency_us: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkKind {
    Infiniband,
    Ethernet,
}

impl NetworkKind {
    pub fn name(self) -> &'static str {
        match self {
            NetworkKind::Infiniband => "InfiniBand",
            NetworkKind::Ethernet => "Ethernet",
        }
    }
}

fn default_staged() -> Collective {
    Collective {
        latency_us: 80.0,
        gbps: 6.0,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Collective {
    pub latency_us: f64,
    /// Bus bandwidth: an all-reduce of S bytes over n ranks takes
    /// latency + 2(n−1)/n · S / gbps.
    pub gbps: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    Nvlink,
    Pcie,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDomain {
    pub devices: Vec<DeviceId>,
    pub kind: LinkKind,
    /// Peer copy bandwidth between two devices of the domain (GB/s).
    pub gbps: f64,
    pub allreduce: Collective,
}

/// How a group of devices talks: through a peer domain, staged through the host, or —
/// a group on more than one node — over the network between nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupLink {
    pub collective: Collective,
    pub staged: bool,
    pub kind: Option<LinkKind>,
    /// The group spans nodes: its collectives cross this network.
    pub network: Option<NetworkKind>,
}

impl Collective {
    /// Seconds for an all-reduce of `bytes` over `n` ranks.
    pub fn allreduce_s(&self, bytes: u64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n = n as f64;
        self.latency_us * 1e-6 + 2.0 * (n - 1.0) / n * bytes as f64 / (self.gbps * 1e9)
    }
}

impl Device {
    /// The throughput a model reaches here: the profile's matrix-product rate for
    /// `dtype` times [`Device::model_efficiency`].
    pub fn tflops(&self, dtype: mold_plan::DType) -> f64 {
        let peak = match dtype {
            mold_plan::DType::F32 => self.f32_tflops.unwrap_or(self.bf16_tflops / 2.0),
            _ => self.bf16_tflops,
        };
        peak * self.model_efficiency.unwrap_or(1.0)
    }
}

impl Machine {
    /// The operation tables of `model` in `dtype` measured on devices named `device`.
    pub fn op_tables(
        &self,
        model: &str,
        dtype: mold_plan::DType,
        device: &str,
    ) -> Option<&OpTables> {
        self.ops
            .iter()
            .find(|t| t.model == model && t.dtype == dtype && t.device == device)
    }

    /// Puts `tables` in place of any table of the same model, dtype and devices.
    pub fn set_op_tables(&mut self, tables: OpTables) {
        self.ops.retain(|t| {
            !(t.model == tables.model && t.dtype == tables.dtype && t.device == tables.device)
        });
        self.ops.push(tables);
    }

    fn validate_ops(&self, source_name: &str) -> Result<(), MachineError> {
        let bad = |field: String, message: String| MachineError::Invalid {
            source_name: source_name.into(),
            field,
            message,
        };
        for (i, t) in self.ops.iter().enumerate() {
            let at = format!("ops[{i}]");
            t.validate(&at).map_err(|(f, m)| bad(f, m))?;
            let same =
                |o: &&OpTables| o.model == t.model && o.dtype == t.dtype && o.device == t.device;
            if self.ops[..i].iter().any(|o| same(&o)) {
                return Err(bad(
                    at,
                    format!(
                        "a second table for {} {} on {}: keep one",
                        t.model,
                        t.dtype.name(),
                        t.device
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn from_yaml(text: &str, source_name: &str) -> Result<Machine, MachineError> {
        let m: Machine =
            mold_plan::from_yaml_with_path(text).map_err(|message| MachineError::Parse {
                source_name: source_name.into(),
                message,
            })?;
        m.validate(source_name)?;
        Ok(m)
    }

    pub fn load(path: &Path) -> Result<Machine, MachineError> {
        let text = std::fs::read_to_string(path).map_err(|e| MachineError::Io {
            path: path.display().to_string(),
            message: format!("cannot read the machine profile: {e}"),
        })?;
        Machine::from_yaml(&text, &path.display().to_string())
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self).expect("a machine always serializes")
    }

    pub fn validate(&self, source_name: &str) -> Result<(), MachineError> {
        let bad = |field: String, message: String| MachineError::Invalid {
            source_name: source_name.into(),
            field,
            message,
        };
        if self.devices.is_empty() {
            return Err(bad(
                "devices".into(),
                "a machine needs at least one device".into(),
            ));
        }
        // Every figure is a finite number: throughput and bandwidth above 0, latency 0 or
        // more. NaN fails every comparison, so it is tested for first.
        let figure = |field: String, v: f64, zero_ok: bool| -> Result<(), MachineError> {
            let cmp = if zero_ok { "≥" } else { ">" };
            let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0));
            if ok {
                Ok(())
            } else {
                Err(bad(
                    field,
                    format!("{v} is not allowed: give a finite number {cmp} 0"),
                ))
            }
        };
        for (i, d) in self.devices.iter().enumerate() {
            let f = format!("devices[{i}]");
            if d.id.is_host() {
                return Err(bad(
                    format!("{f}.id"),
                    "`host` is not a device: describe it under `host:`".into(),
                ));
            }
            if self.devices[..i].iter().any(|o| o.id == d.id) {
                return Err(bad(format!("{f}.id"), format!("{} is listed twice", d.id)));
            }
            if d.budget > d.memory {
                return Err(bad(
                    format!("{f}.budget"),
                    format!(
                        "{} is more than the device's memory {}: lower it",
                        d.budget, d.memory
                    ),
                ));
            }
            if d.headroom >= d.budget {
                return Err(bad(
                    format!("{f}.headroom"),
                    format!(
                        "{} leaves nothing of the budget {}: make it smaller than the budget",
                        d.headroom, d.budget
                    ),
                ));
            }
            figure(format!("{f}.bf16_tflops"), d.bf16_tflops, false)?;
            if let Some(v) = d.f32_tflops {
                figure(format!("{f}.f32_tflops"), v, false)?;
            }
            figure(
                format!("{f}.mem_bandwidth_gbps"),
                d.mem_bandwidth_gbps,
                false,
            )?;
            if let Some(v) = d.model_efficiency {
                if !(v > 0.0 && v <= 1.0) {
                    return Err(bad(
                        format!("{f}.model_efficiency"),
                        format!("{v}: must be in (0, 1]: the measured fraction of bf16_tflops a model reaches (leave it out for 1)"),
                    ));
                }
            }
            if let Some(v) = d.elementwise_efficiency {
                if !(v > 0.0 && v <= 1.0) {
                    return Err(bad(
                        format!("{f}.elementwise_efficiency"),
                        format!("{v}: must be in (0, 1]: the measured fraction of mem_bandwidth_gbps element-wise passes reach (leave it out for 1)"),
                    ));
                }
            }
        }
        let l = &self.links;
        for (name, v, zero_ok) in [
            ("host.tflops", self.host.tflops, false),
            (
                "host.mem_bandwidth_gbps",
                self.host.mem_bandwidth_gbps,
                false,
            ),
            ("links.host_pinned_gbps", l.host_pinned_gbps, false),
            (
                "links.host_pinned_busy_gbps",
                l.host_pinned_busy_gbps.unwrap_or(1.0),
                false,
            ),
            ("links.host_pageable_gbps", l.host_pageable_gbps, false),
            (
                "links.host_staged_allreduce.latency_us",
                l.host_staged_allreduce.latency_us,
                true,
            ),
            (
                "links.host_staged_allreduce.gbps",
                l.host_staged_allreduce.gbps,
                false,
            ),
        ] {
            figure(name.into(), v, zero_ok)?;
        }
        if self.host.pinned_limit > self.host.memory {
            return Err(bad(
                "host.pinned_limit".into(),
                format!(
                    "{} is more than host memory {}: lower it",
                    self.host.pinned_limit, self.host.memory
                ),
            ));
        }
        self.validate_nodes(source_name)?;
        self.validate_ops(source_name)?;
        for (i, p) in l.peer.iter().enumerate() {
            let f = format!("links.peer[{i}]");
            if p.devices.len() < 2 {
                return Err(bad(
                    format!("{f}.devices"),
                    "a peer domain joins at least two devices: name two or more".into(),
                ));
            }
            for (j, d) in p.devices.iter().enumerate() {
                if self.device(d).is_none() {
                    return Err(bad(
                        format!("{f}.devices"),
                        format!(
                            "{d} is not one of this machine's devices ({})",
                            self.device_list()
                        ),
                    ));
                }
                if p.devices[..j].contains(d) {
                    return Err(bad(
                        format!("{f}.devices"),
                        format!("{d} is listed twice: name each device once"),
                    ));
                }
            }
            figure(format!("{f}.gbps"), p.gbps, false)?;
            figure(
                format!("{f}.allreduce.latency_us"),
                p.allreduce.latency_us,
                true,
            )?;
            figure(format!("{f}.allreduce.gbps"), p.allreduce.gbps, false)?;
            if let Some(other) = p
                .devices
                .iter()
                .find(|d| self.node_of(d) != self.node_of(&p.devices[0]))
            {
                return Err(bad(
                    format!("{f}.devices"),
                    format!(
                        "{} is on node {} and {other} on node {}: a peer domain lies within one node (nodes talk over links.inter_node)",
                        p.devices[0],
                        self.node_of(&p.devices[0]),
                        self.node_of(other)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Nodes numbered without gaps, and the network between them when there are several.
    fn validate_nodes(&self, source_name: &str) -> Result<(), MachineError> {
        let bad = |field: String, message: String| MachineError::Invalid {
            source_name: source_name.into(),
            field,
            message,
        };
        for (i, d) in self.devices.iter().enumerate() {
            if let Some(gap) = (0..d.node).find(|n| !self.devices.iter().any(|o| o.node == *n)) {
                return Err(bad(
                    format!("devices[{i}].node"),
                    format!(
                        "{} but no device is on node {gap}: number the nodes 0, 1, … without gaps",
                        d.node
                    ),
                ));
            }
        }
        if let Some(net) = &self.links.inter_node {
            let f = "links.inter_node";
            for (field, v, zero_ok) in [
                ("gbps", net.gbps, false),
                ("latency_us", net.latency_us, true),
            ] {
                let cmp = if zero_ok { "≥" } else { ">" };
                if !(v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0))) {
                    return Err(bad(
                        format!("{f}.{field}"),
                        format!("{v} is not allowed: give a finite number {cmp} 0"),
                    ));
                }
            }
        } else if self.nodes() > 1 {
            return Err(bad(
                "links.inter_node".into(),
                format!(
                    "the devices are on {} nodes: describe the network between them, e.g. `inter_node: {{kind: infiniband, gbps: 50, latency_us: 5}}` (400 Gb/s = 50 GB/s)",
                    self.nodes()
                ),
            ));
        }
        Ok(())
    }

    /// The node `id` is on (0 for the host and for devices not in the machine).
    pub fn node_of(&self, id: &DeviceId) -> u32 {
        self.device(id).map_or(0, |d| d.node)
    }

    /// How many nodes the devices are on.
    pub fn nodes(&self) -> u32 {
        let mut seen: Vec<u32> = self.devices.iter().map(|d| d.node).collect();
        seen.sort_unstable();
        seen.dedup();
        seen.len().max(1) as u32
    }

    /// Whether the devices of `group` are on more than one node.
    pub fn spans_nodes(&self, group: &[DeviceId]) -> bool {
        group.iter().any(|d| {
            group
                .first()
                .is_some_and(|f| self.node_of(d) != self.node_of(f))
        })
    }

    pub fn device(&self, id: &DeviceId) -> Option<&Device> {
        self.devices.iter().find(|d| &d.id == id)
    }

    pub fn device_list(&self) -> String {
        self.devices
            .iter()
            .map(|d| d.id.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// sha256 over each device's name and memory (and node, past node 0), in order: a
    /// plan records the nodes of its devices only through this.
    pub fn fingerprint(&self) -> String {
        self.fingerprint_of(
            &self
                .devices
                .iter()
                .map(|d| d.id.clone())
                .collect::<Vec<_>>(),
        )
    }

    /// [`Machine::fingerprint`] of the devices `ids` only (a plan made with `--devices`
    /// or `--gpus` records the devices it may use).
    pub fn fingerprint_of(&self, ids: &[DeviceId]) -> String {
        let mut h = Sha256::new();
        for d in self.devices.iter().filter(|d| ids.contains(&d.id)) {
            // The node only where it is not 0: one-node profiles keep their fingerprints.
            let node = match d.node {
                0 => String::new(),
                n => format!("|node{n}"),
            };
            h.update(format!("{}|{}|{}{node};", d.id, d.name, d.memory.0).as_bytes());
        }
        let hex = format!("{:x}", h.finalize());
        format!("sha256:{}", &hex[..16])
    }

    pub fn identity(&self) -> MachineIdentity {
        MachineIdentity {
            name: self.name.clone(),
            fingerprint: self.fingerprint(),
            devices: self
                .devices
                .iter()
                .map(|d| DeviceIdentity {
                    id: d.id.clone(),
                    name: d.name.clone(),
                    memory: d.memory,
                })
                .collect(),
        }
    }

    /// The fastest peer domain joining every device of `group`.
    pub fn domain_of(&self, group: &[DeviceId]) -> Option<&PeerDomain> {
        self.links
            .peer
            .iter()
            .filter(|p| group.iter().all(|d| p.devices.contains(d)))
            .max_by(|a, b| a.allreduce.gbps.total_cmp(&b.allreduce.gbps))
    }

    /// How `group` all-reduces: its peer domain, or staged through the host; a group on
    /// several nodes over its slowest link: the network between nodes, or a node's own
    /// share of the group where that is slower (the larger latency, the smaller
    /// bandwidth).
    pub fn group_link(&self, group: &[DeviceId]) -> GroupLink {
        if let (true, Some(net)) = (self.spans_nodes(group), self.links.inter_node) {
            let mut c = Collective {
                latency_us: net.latency_us,
                gbps: net.gbps,
            };
            let mut nodes: Vec<u32> = group.iter().map(|d| self.node_of(d)).collect();
            nodes.sort_unstable();
            nodes.dedup();
            for n in nodes {
                let share: Vec<DeviceId> = group
                    .iter()
                    .filter(|d| self.node_of(d) == n)
                    .cloned()
                    .collect();
                if share.len() > 1 {
                    let inner = self.group_link(&share).collective;
                    c.latency_us = c.latency_us.max(inner.latency_us);
                    c.gbps = c.gbps.min(inner.gbps);
                }
            }
            return GroupLink {
                collective: c,
                staged: false,
                kind: None,
                network: Some(net.kind),
            };
        }
        match self.domain_of(group) {
            Some(p) => GroupLink {
                collective: p.allreduce,
                staged: false,
                kind: Some(p.kind),
                network: None,
            },
            None => GroupLink {
                collective: self.links.host_staged_allreduce,
                staged: true,
                kind: None,
                network: None,
            },
        }
    }

    /// The network between `a` and `b` when they are devices on different nodes.
    pub fn network_between(&self, a: &DeviceId, b: &DeviceId) -> Option<InterNode> {
        if a.is_host() || b.is_host() || self.node_of(a) == self.node_of(b) {
            return None;
        }
        self.links.inter_node
    }

    /// Seconds to copy `bytes` from `a` to `b`: the inter-node latency (devices on
    /// different nodes) plus the bytes over [`Machine::transfer_gbps`].
    pub fn transfer_s(&self, a: &DeviceId, b: &DeviceId, bytes: u64) -> f64 {
        if a == b {
            return 0.0;
        }
        let latency = self
            .network_between(a, b)
            .map_or(0.0, |n| n.latency_us * 1e-6);
        latency + bytes as f64 / (self.transfer_gbps(a, b) * 1e9)
    }

    /// The pinned host→device rate while the device computes, as a share of its idle
    /// rate (`links.host_pinned_busy_gbps / host_pinned_gbps`), at most 1 (a busy rate
    /// measured above the idle one is noise); 1 where the profile has no busy rate.
    pub fn copy_busy_ratio(&self) -> f64 {
        let l = &self.links;
        match l.host_pinned_busy_gbps {
            Some(b) if b > 0.0 && l.host_pinned_gbps > 0.0 => (b / l.host_pinned_gbps).min(1.0),
            _ => 1.0,
        }
    }

    /// Copy bandwidth from device `a` to `b` (GB/s): peer, or through pinned host memory
    /// (device→host then host→device).
    pub fn transfer_gbps(&self, a: &DeviceId, b: &DeviceId) -> f64 {
        if a == b {
            return f64::INFINITY;
        }
        if a.is_host() || b.is_host() {
            return self.links.host_pinned_gbps;
        }
        if let Some(net) = self.network_between(a, b) {
            return net.gbps;
        }
        match self.domain_of(&[a.clone(), b.clone()]) {
            Some(p) => p.gbps,
            None => self.links.host_pinned_gbps / 2.0,
        }
    }

    /// Keeps only the named devices (in the given order), with their links.
    pub fn select(&self, ids: &[DeviceId]) -> Result<Machine, MachineError> {
        let mut m = self.clone();
        m.devices.clear();
        for id in ids {
            let d = self.device(id).ok_or_else(|| {
                MachineError::Select(format!(
                    "--devices: {id} is not a device of machine `{}` (it has {})",
                    self.name,
                    self.device_list()
                ))
            })?;
            if m.devices.iter().any(|x| &x.id == id) {
                return Err(MachineError::Select(format!(
                    "--devices: {id} is named twice"
                )));
            }
            m.devices.push(d.clone());
        }
        for p in m.links.peer.iter_mut() {
            p.devices.retain(|d| ids.contains(d));
        }
        m.links.peer.retain(|p| p.devices.len() >= 2);
        Ok(m)
    }

    /// Lowers a device's budget (`--max-vram cuda:0=20GiB`).
    pub fn cap_budget(&mut self, id: &DeviceId, cap: ByteSize) -> Result<(), MachineError> {
        let list = self.device_list();
        let name = self.name.clone();
        let d = self
            .devices
            .iter_mut()
            .find(|d| &d.id == id)
            .ok_or_else(|| {
                MachineError::Select(format!(
                    "--max-vram: {id} is not a device of machine `{name}` (it has {list})"
                ))
            })?;
        if cap <= d.headroom {
            return Err(MachineError::Select(format!(
                "--max-vram: {id}={cap} leaves nothing once the {} headroom is kept: allow more",
                d.headroom
            )));
        }
        d.budget = d.budget.min(cap);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
            );
        Machine::from_yaml(&full, "t.yaml").unwrap();
        // (text to replace, field named, whether 0 is allowed)
        let cases = [
            ("tflops: 1.0", "host.tflops", false),
            ("mem_bandwidth_gbps: 50", "host.mem_bandwidth_gbps", false),
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
                    e.starts_with(&format!("t.yaml: {field}: "))
                        && e.contains("give a finite number"),
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
}
