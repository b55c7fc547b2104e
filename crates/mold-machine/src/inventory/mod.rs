//! This box's GPUs as the CUDA driver reports them (`mold devices`), the machine profile
//! built from them (`mold devices --save`, `mold plan --machine local`), and calibration
//! (`mold devices --save … --calibrate`).
//!
//! The data types, budgets, profile building and the applying of measurements are plain
//! code, tested on any build. Querying ([`query()`]) and measuring ([`calibrate()`]) need the
//! `cuda` feature: each device is queried in its own (primary) context, so its free
//! memory is its own; peer access comes from `cuDeviceCanAccessPeer`, and the link
//! between two devices from `cuDeviceGetP2PAttribute`: its performance rank, and whether
//! native atomics work across it. NVML is not used (it would be one more native library
//! to build and load); NVLink is **inferred**: CUDA supports native peer atomics over
//! NVLink but not over PCIe, so a pair with peer access and native atomics is counted as
//! NVLink, any other pair with peer access as PCIe.
//!
//! This file holds the types, the budgets and the links between devices; `profile`
//! builds a machine profile from them, `table` prints `mold devices`, `diff` compares
//! this box with a plan's machine, `calibrate` applies measurements, `date` dates
//! profiles, and `cuda` (the `cuda` feature) queries and measures through the driver.

mod calibrate;
#[cfg(feature = "cuda")]
mod cuda;
mod date;
mod diff;
pub mod host_read;
mod profile;
mod table;
#[cfg(test)]
mod tests;

pub use calibrate::{
    allreduce_bus_gbps, allreduce_group_sizes, apply_measurements, AllreduceMeasurement,
    DeviceMeasurement, Measurements, PeerCopy,
};
pub use date::today;
pub use diff::differences_from_plan;

use crate::LinkKind;
use mold_plan::{ByteSize, DeviceId, GIB};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
    fn estimated_bf16_tflops(&self) -> f64 {
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
    fn estimated_bandwidth_gbps(&self) -> f64 {
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
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Host memory and CPU count of this box (Linux `/proc/meminfo`; elsewhere unknown).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the driver query's
fn host_facts() -> (Option<ByteSize>, Option<u32>) {
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
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the driver query's
fn format_uuid(bytes: &[u8; 16]) -> String {
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
