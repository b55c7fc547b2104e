//! What `--calibrate` measures, and how the measurements go into a machine profile.

use super::round1;
use crate::{Calibration, Collective, Machine};
use mold_plan::{DeviceId, MIB};
use serde::{Deserialize, Serialize};

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
    /// The host's read rate from a warm page cache, every core reading (GB/s):
    /// [`super::host_read`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_read_gbps: Option<f64>,
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
    /// The pinned copy again, with bf16 matrix products running on the device beside it.
    #[serde(default)]
    pub host_pinned_busy_gbps: Option<f64>,
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

/// The group sizes calibration measures collectives for over `count` devices (the first
/// `size` of them each): every size from 2 to `count`, since the planner may give a
/// tensor- or sequence-parallel group any of them (three GPUs of four). Empty for fewer
/// than two devices.
pub fn allreduce_group_sizes(count: usize) -> Vec<usize> {
    (2..=count).collect()
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
        // Kept only where every device measured it: the slowest, like the idle rate.
        m.links.host_pinned_busy_gbps = r
            .devices
            .iter()
            .map(|d| d.host_pinned_busy_gbps)
            .collect::<Option<Vec<f64>>>()
            .map(|v| round1(v.into_iter().fold(f64::INFINITY, f64::min)));
        if m.links.host_pinned_busy_gbps.is_some() {
            measured.push(
                "the pinned host->device copy again with bf16 matrix products running on the \
                 device (the rate a streamed block's copy gets beside compute)"
                    .into(),
            );
        }
    }
    if !r.peer_copies.is_empty() && !m.links.peer.is_empty() {
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
    // A box whose devices share no peer domain (no peer access between its GPUs, or
    // profiled as such with `mold devices --no-peer`, NCCL kept off the GPU-to-GPU path):
    // its all-reduce is the host-staged one, measured at the smallest group.
    let staged = match &r.allreduce {
        Some(ar) if m.links.peer.is_empty() => ar
            .iter()
            .filter(|a| a.group_size >= 2)
            .min_by_key(|a| a.group_size),
        _ => None,
    };
    if let Some(a) = staged {
        m.links.host_staged_allreduce = Collective {
            latency_us: round1(a.latency_us),
            gbps: round1(a.gbps),
        };
    }
    let mut not = r.not_measured.clone();
    match &r.allreduce {
        Some(a) if !a.is_empty() && staged.is_some() => {
            measured.push(format!(
                "all-reduce without peer access (NCCL through host memory; no peer domains) \
                 for group sizes {}, the host-staged figure from {} devices",
                a.iter()
                    .map(|a| a.group_size.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                staged.map_or(0, |s| s.group_size)
            ));
        }
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
    match r.host_read_gbps.map(round1) {
        Some(g) if g.is_finite() && g > 0.0 => {
            m.host.read_gbps = Some(g);
            measured.push(
                "host read rate from a warm page cache (a scratch file read back by every core, 16 MiB reads)"
                    .into(),
            );
        }
        _ => not
            .push("host read rate: not measured (the cost model's default prices loading)".into()),
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
