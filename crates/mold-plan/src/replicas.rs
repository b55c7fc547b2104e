//! Replicas: copies of one placement serving requests side by side on disjoint devices.
//!
//! A plan's `replicas:` (version 3) lists one device mapping per replica: every device the
//! placement uses (the host aside: it is shared) to the device that copy runs on. Absent,
//! the plan is one replica, the placement as written.

use crate::{DeviceId, Plan, Replica};
use std::collections::{BTreeMap, BTreeSet};

/// A `replicas:` section that cannot be served: the field at fault and what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ReplicaError {
    pub field: String,
    pub message: String,
}

fn refuse(field: String, message: String) -> ReplicaError {
    ReplicaError { field, message }
}

fn list(devices: &BTreeSet<DeviceId>) -> String {
    devices
        .iter()
        .map(DeviceId::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Plan {
    /// The devices the placement runs on: every part's devices, the host left out.
    pub fn placement_devices(&self) -> BTreeSet<DeviceId> {
        self.components
            .iter()
            .flat_map(|c| &c.parts)
            .flat_map(|p| &p.devices)
            .filter(|d| !d.is_host())
            .cloned()
            .collect()
    }

    /// How many copies of the placement serve requests (1 without `replicas:`).
    pub fn replica_count(&self) -> usize {
        self.replicas.as_ref().map_or(1, Vec::len)
    }

    /// Checks the `replicas:` section: each replica maps every device the placement uses,
    /// and nothing else, to devices of its own (no device twice within a replica, none
    /// shared between replicas, the host left out).
    pub fn check_replicas(&self) -> Result<(), ReplicaError> {
        let Some(replicas) = &self.replicas else {
            return Ok(());
        };
        if replicas.is_empty() {
            return Err(refuse(
                "replicas".into(),
                "empty: remove it (one replica, the placement as written) or list one device mapping per replica".into(),
            ));
        }
        let used = self.placement_devices();
        // Which replica took each target device.
        let mut taken: BTreeMap<&DeviceId, usize> = BTreeMap::new();
        for (ri, r) in replicas.iter().enumerate() {
            let field = format!("replicas[{ri}]");
            let mut targets: BTreeMap<&DeviceId, &DeviceId> = BTreeMap::new();
            for (from, to) in r {
                if from.is_host() || to.is_host() {
                    return Err(refuse(
                        field,
                        format!("`{from}: {to}`: the host is shared by every replica: leave it out of the mapping"),
                    ));
                }
                if !used.contains(from) {
                    return Err(refuse(
                        field,
                        format!(
                            "`{from}: {to}`: the placement does not use {from}: map only the devices it uses ({})",
                            list(&used)
                        ),
                    ));
                }
                if let Some(other) = targets.insert(to, from) {
                    return Err(refuse(
                        field,
                        format!(
                            "{other} and {from} both map to {to}: a replica runs each device's share on a device of its own"
                        ),
                    ));
                }
                if let Some(earlier) = taken.insert(to, ri) {
                    return Err(refuse(
                        field,
                        format!(
                            "{to} is used by replicas[{earlier}] too: replicas run on disjoint devices"
                        ),
                    ));
                }
            }
            if let Some(missing) = used.iter().find(|d| !r.contains_key(*d)) {
                return Err(refuse(
                    field,
                    format!(
                        "{missing} is not mapped: map every device the placement uses ({}), e.g. `{missing}: {missing}`",
                        list(&used)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// One plan per replica: the placement with its devices remapped (recorded device
    /// predictions with them), without `replicas:`. Without `replicas:`, the plan itself.
    pub fn replica_plans(&self) -> Result<Vec<Plan>, ReplicaError> {
        self.check_replicas()?;
        let mut base = self.clone();
        base.replicas = None;
        let Some(replicas) = &self.replicas else {
            return Ok(vec![base]);
        };
        Ok(replicas.iter().map(|r| base.remapped(r)).collect())
    }

    /// The plan with every mapped device replaced (a device the mapping leaves out stays).
    /// Recorded predictions for devices the placement does not use are dropped: they
    /// would collide with the devices moved onto theirs.
    fn remapped(&self, map: &Replica) -> Plan {
        let on = |d: &DeviceId| map.get(d).cloned().unwrap_or_else(|| d.clone());
        let mut p = self.clone();
        for part in p.components.iter_mut().flat_map(|c| c.parts.iter_mut()) {
            for d in part.devices.iter_mut() {
                *d = on(d);
            }
        }
        p.predicted.devices.retain(|d| map.contains_key(&d.device));
        for d in p.predicted.devices.iter_mut() {
            d.device = on(&d.device);
        }
        p
    }
}

/// The replicas that place `devices` (in order) onto `groups` (each as long as `devices`,
/// in the same order): replica `i` maps `devices[j]` to `groups[i][j]`.
pub fn shifted_replicas(devices: &[DeviceId], groups: &[Vec<DeviceId>]) -> Vec<Replica> {
    groups
        .iter()
        .map(|g| devices.iter().cloned().zip(g.iter().cloned()).collect())
        .collect()
}
