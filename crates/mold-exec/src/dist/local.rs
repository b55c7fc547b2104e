//! Which plan devices this process runs and how it opens them ([`LocalDevices`]),
//! resolved at the CLI edge from the plan's devices, the machine profile's nodes, the
//! launch and how many GPUs the process sees ([`Visible`]).
//!
//! # The rule
//!
//! - **Nodes.** The nodes that hold the transformer's devices (machine profile,
//!   `node:`) get the same number of processes each, numbered node by node as torchrun
//!   and Slurm number them: with `k` processes per node, process `p` is on the
//!   `p / k`-th of those nodes and is the `p % k`-th process there (its local rank, which
//!   `LOCAL_RANK` / `SLURM_LOCALID` must repeat when set). A process never owns devices of
//!   two nodes.
//! - **Shares.** A node's devices, sorted, are cut into `k` contiguous shares as equal as
//!   possible (the first ones one larger); local rank `r` runs share `r`.
//! - **Ordinals.** A process that sees exactly as many GPUs as its share holds
//!   (`CUDA_VISIBLE_DEVICES`, Slurm's `--gpus-per-task`) opens them as `cuda:0, cuda:1, …`
//!   in share order ([`Ordinals::Share`]). Otherwise it sees its whole node and opens
//!   each device at its place among its node's devices in the machine profile: the node's
//!   first GPU is `cuda:0`, so the plan's `cuda:9` on a node that starts at `cuda:8` is
//!   `cuda:1` ([`Ordinals::Node`]); with several processes per node, local rank `r` thus
//!   opens its own GPUs of the node, not `cuda:0`. When the process's GPU count is known,
//!   a device past it is refused.
//!
//! Emulated devices follow the same rule (they all run on the CPU; only their names
//! change).

use super::{Launch, Ownership};
use crate::error::{ExecError, Result};
use mold_machine::Machine;
use mold_plan::DeviceId;

fn launch_err(m: String) -> ExecError {
    ExecError::Launch(m)
}

/// How many GPUs this process sees, when known, and where that is from (for messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Visible {
    pub count: usize,
    /// E.g. `CUDA_VISIBLE_DEVICES=2,3`.
    pub source: String,
}

impl Visible {
    /// From `CUDA_VISIBLE_DEVICES` (the CLI passes the environment): the number of
    /// entries, when set. `None` when unset (every GPU of the node is visible).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Option<Visible> {
        let v = get("CUDA_VISIBLE_DEVICES")?;
        let count = v.split(',').filter(|s| !s.trim().is_empty()).count();
        Some(Visible {
            count,
            source: format!("CUDA_VISIBLE_DEVICES={v}"),
        })
    }
}

/// How a process numbers the devices it opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ordinals {
    /// It sees only its own GPUs: its share, in order, as `cuda:0, cuda:1, …`.
    Share,
    /// It sees its node's GPUs: each device at its place on its node.
    Node,
}

impl std::fmt::Display for Ordinals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Ordinals::Share => "its own devices only, numbered from 0",
            Ordinals::Node => "its node's devices, numbered from the node's first",
        })
    }
}

/// This process's place in a multi-process run: every process's devices
/// ([`Ownership`]), and the plan devices this one runs with the ids it opens them as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalDevices {
    own: Ownership,
    rank: usize,
    /// The machine profile's node this process is on.
    node: u32,
    /// This process's index among its node's processes, and how many there are.
    local_rank: usize,
    per_node: usize,
    ordinals: Ordinals,
    /// (plan device, local device), in share order.
    map: Vec<(DeviceId, DeviceId)>,
}

/// `cuda:0, cuda:1` for messages.
fn list(ds: &[DeviceId]) -> String {
    ds.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The machine's nodes, from the lowest, with their plan devices (sorted), skipping
/// nodes without any: `(node, devices)`.
fn plan_nodes(devices: &[DeviceId], machine: &Machine) -> Vec<(u32, Vec<DeviceId>)> {
    let mut ds = devices.to_vec();
    ds.sort();
    ds.dedup();
    let mut nodes: Vec<(u32, Vec<DeviceId>)> = Vec::new();
    for d in ds {
        let n = machine.node_of(&d);
        match nodes.iter_mut().find(|(m, _)| *m == n) {
            Some((_, v)) => v.push(d),
            None => nodes.push((n, vec![d])),
        }
    }
    nodes.sort_by_key(|(n, _)| *n);
    nodes
}

/// `d`'s place among the devices of its kind on node `node`: the machine profile's and
/// the plan's (`plan_node`), sorted.
fn node_ordinal(d: &DeviceId, node: u32, machine: &Machine, plan_node: &[DeviceId]) -> u32 {
    let same_kind = |x: &DeviceId| std::mem::discriminant(x) == std::mem::discriminant(d);
    let mut on_node: Vec<DeviceId> = machine
        .devices
        .iter()
        .filter(|m| m.node == node)
        .map(|m| m.id.clone())
        .chain(plan_node.iter().cloned())
        .filter(same_kind)
        .collect();
    on_node.sort();
    on_node.dedup();
    on_node.iter().position(|x| x == d).unwrap_or(0) as u32
}

fn with_ordinal(d: &DeviceId, k: u32) -> DeviceId {
    match d {
        DeviceId::Cuda(_) => DeviceId::Cuda(k),
        DeviceId::Emu(_) => DeviceId::Emu(k),
        DeviceId::Host => DeviceId::Host,
    }
}

impl LocalDevices {
    /// Resolves this process's devices (the rule in the module docs) for a run of the
    /// transformer on `devices` (any order, repeats allowed) over `launch.world`
    /// processes. Refuses, in one line: fewer processes than nodes or a count that the
    /// nodes do not share evenly (a process would own devices of two nodes), a node with
    /// fewer devices than processes, a local rank from the launcher that the numbering
    /// contradicts, and a device this process cannot see (`visible`).
    pub fn resolve(
        devices: &[DeviceId],
        machine: &Machine,
        launch: &Launch,
        visible: Option<&Visible>,
    ) -> Result<LocalDevices> {
        let world = launch.world;
        let wvar = launch.world_var();
        let nodes = plan_nodes(devices, machine);
        let n = nodes.len();
        let per_node_list = || {
            nodes
                .iter()
                .map(|(k, ds)| format!("node {k}: {}", list(ds)))
                .collect::<Vec<_>>()
                .join("; ")
        };
        if n == 0 {
            return Err(launch_err(
                "the plan's transformer runs on no device: nothing for the processes to run".into(),
            ));
        }
        if world < n || !world.is_multiple_of(n) {
            return Err(launch_err(format!(
                "{wvar}={world}, but the plan's transformer runs on {n} nodes ({}) and a \
                 process cannot own devices of two nodes: start the same number of \
                 processes on every node ({n}, {}, …)",
                per_node_list(),
                2 * n
            )));
        }
        let per_node = world / n;
        if let Some((node, ds)) = nodes.iter().find(|(_, ds)| ds.len() < per_node) {
            let only = if n == 1 {
                String::new()
            } else {
                format!(" on node {node}")
            };
            return Err(launch_err(format!(
                "{wvar}={world} puts {per_node} process(es) on each of {n} node(s), but the \
                 plan's transformer runs on {} device(s){only} ({}): start at most one \
                 process per device",
                ds.len(),
                list(ds)
            )));
        }
        let (node_idx, local_rank) = (launch.rank / per_node, launch.rank % per_node);
        if let Some(lr) = launch.local_rank {
            if lr != local_rank {
                let var = launch.launcher.vars().2.unwrap_or("the local rank");
                return Err(launch_err(format!(
                    "{var}={lr}, but process {} of {world} is process {local_rank} of its \
                     node: the plan's transformer runs on {n} node(s) with {per_node} \
                     process(es) each, numbered node by node; start {per_node} process(es) \
                     per node (torchrun --nproc-per-node {per_node}, srun \
                     --ntasks-per-node {per_node}, block distribution)",
                    launch.rank
                )));
            }
        }
        let mut shares = Vec::with_capacity(world);
        for (_, ds) in &nodes {
            let (base, extra) = (ds.len() / per_node, ds.len() % per_node);
            let mut it = ds.iter().cloned();
            for r in 0..per_node {
                shares.push(it.by_ref().take(base + usize::from(r < extra)).collect());
            }
        }
        let own = Ownership::from_shares(shares);
        let (node, node_devices) = &nodes[node_idx];
        let share = own.share(launch.rank).to_vec();
        let gpus = share
            .iter()
            .filter(|d| matches!(d, DeviceId::Cuda(_)))
            .count();
        let ordinals = match visible {
            Some(v) if gpus > 0 && v.count == gpus => Ordinals::Share,
            _ => Ordinals::Node,
        };
        let map: Vec<(DeviceId, DeviceId)> = share
            .iter()
            .map(|d| {
                let k = match ordinals {
                    Ordinals::Share => share
                        .iter()
                        .filter(|x| std::mem::discriminant(*x) == std::mem::discriminant(d))
                        .position(|x| x == d)
                        .unwrap_or(0) as u32,
                    Ordinals::Node => node_ordinal(d, *node, machine, node_devices),
                };
                (d.clone(), with_ordinal(d, k))
            })
            .collect();
        if let Some(v) = visible {
            let past = map
                .iter()
                .find(|(_, l)| matches!(l, DeviceId::Cuda(k) if *k as usize >= v.count));
            if let Some((d, l)) = past {
                return Err(launch_err(format!(
                    "process {} runs {} on node {node} ({d} opens as {l}, its place on the \
                     node), but {} shows it {} GPU(s): let each process see its node's GPUs \
                     (unset CUDA_VISIBLE_DEVICES) or exactly its own {gpus}",
                    launch.rank,
                    list(&share),
                    v.source,
                    v.count
                )));
            }
        }
        Ok(LocalDevices {
            own,
            rank: launch.rank,
            node: *node,
            local_rank,
            per_node,
            ordinals,
            map,
        })
    }

    /// Every process's devices.
    pub fn ownership(&self) -> &Ownership {
        &self.own
    }

    /// This process.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes.
    pub fn world(&self) -> usize {
        self.own.world()
    }

    /// The machine profile's node this process is on.
    pub fn node(&self) -> u32 {
        self.node
    }

    /// This process's index among its node's processes, and how many there are.
    pub fn local_rank(&self) -> (usize, usize) {
        (self.local_rank, self.per_node)
    }

    /// How device ids were numbered.
    pub fn ordinals(&self) -> Ordinals {
        self.ordinals
    }

    /// (plan device, as this process opens it), in share order.
    pub fn devices(&self) -> &[(DeviceId, DeviceId)] {
        &self.map
    }

    /// How this process opens plan device `d`; `None` when another process runs it.
    pub fn local_id(&self, d: &DeviceId) -> Option<DeviceId> {
        self.map
            .iter()
            .find(|(p, _)| p == d)
            .map(|(_, l)| l.clone())
    }
}

#[cfg(test)]
#[path = "local_tests.rs"]
mod tests;
