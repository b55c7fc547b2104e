//! Machine profiles: the devices of a box, their memory and speed, and the links
//! between them and the host. YAML files in `sim/machines/`; `mold devices --save` writes
//! one for the box it runs on. A profile is plain data: valid on any machine.

pub mod inventory;

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
    /// Host→device copy from page-locked memory, per device (GB/s).
    pub host_pinned_gbps: f64,
    /// Host→device copy from ordinary (pageable) memory (GB/s).
    pub host_pageable_gbps: f64,
    /// Groups of devices that reach each other directly (NVLink, PCIe peer-to-peer).
    #[serde(default)]
    pub peer: Vec<PeerDomain>,
    /// All-reduce between devices without peer access, staged through host memory.
    #[serde(default = "default_staged")]
    pub host_staged_allreduce: Collective,
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

/// How a group of devices talks: through a peer domain or staged through the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupLink {
    pub collective: Collective,
    pub staged: bool,
    pub kind: Option<LinkKind>,
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
        }
        Ok(())
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

    /// sha256 over each device's name and memory, in order.
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
            h.update(format!("{}|{}|{};", d.id, d.name, d.memory.0).as_bytes());
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

    /// How `group` all-reduces: its peer domain, or staged through the host.
    pub fn group_link(&self, group: &[DeviceId]) -> GroupLink {
        match self.domain_of(group) {
            Some(p) => GroupLink {
                collective: p.allreduce,
                staged: false,
                kind: Some(p.kind),
            },
            None => GroupLink {
                collective: self.links.host_staged_allreduce,
                staged: true,
                kind: None,
            },
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
        let full = TWO.replacen(
            "  peer:",
            "  host_staged_allreduce: {latency_us: 80, gbps: 6}\n  peer:",
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
}
