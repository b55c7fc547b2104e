//! Machine profiles: the devices of a box, their memory and speed, and the links
//! between them and the host. YAML files in `sim/machines/`; `mold devices --save` writes
//! one for the box it runs on. A profile is plain data: valid on any machine.
//!
//! Here: the profile's types, loading and identity; `validate.rs`: its checks;
//! `links.rs`: nodes, peer domains and what a transfer between devices costs; `ops.rs`:
//! measured operation tables; [`inventory`]: this box's GPUs and their calibration.

pub mod box_cache;
pub mod inventory;
mod links;
pub mod ops;
pub mod shipped;
mod validate;

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
    /// Weights read from a warm page cache into page-locked memory, every core reading
    /// (GB/s): what loading a checkpoint runs at before its upload (`mold devices
    /// --calibrate` measures it). Absent: the cost model's conservative default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_gbps: Option<f64>,
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
mod tests;
