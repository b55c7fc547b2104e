//! Where devices are and how they are joined: nodes, peer domains, the link of a group
//! or a pair, and what a transfer between two devices costs.

use crate::{Collective, GroupLink, InterNode, Machine, PeerDomain};
use mold_plan::DeviceId;

impl Machine {
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
}
