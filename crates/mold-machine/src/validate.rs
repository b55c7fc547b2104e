//! A profile's checks: every figure finite and in range, every link, peer domain, node
//! and operation table consistent with the devices, each refusal naming its field.

use crate::{Machine, MachineError, OpTables};

impl Machine {
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
            ("host.read_gbps", self.host.read_gbps.unwrap_or(1.0), false),
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
}
