//! Which [`Comm`] a group gets: [`make_group`] inside one process,
//! [`cross_process_group`] for a group that spans processes.

use super::{AbortSignal, Comm, CommOptions, TcpComm, ThreadComm};
use crate::dist::Mesh;
use crate::error::{ExecError, Result};
use mold_plan::DeviceId;
use std::sync::Arc;

/// Communicators for one tensor-parallel group over `devices` (all in this process),
/// one per rank in order.
///
/// With the `nccl` feature, a group of two or more distinct `cuda:N` devices uses NCCL
/// (`nccl::local_group`: communicators are created once and reused across calls, with
/// `opts.nccl_timeout` as watchdog; `abort`, a multi-process run's signal, stops its ranks
/// when another process fails). Every other group uses [`ThreadComm`] (host-staged,
/// deterministic); with `cuda` but not `nccl`, a CUDA group says so once on stderr.
pub fn make_group(
    devices: &[DeviceId],
    opts: &CommOptions,
    abort: Option<&AbortSignal>,
) -> Vec<Box<dyn Comm>> {
    #[cfg(feature = "nccl")]
    if let Some(ordinals) = distinct_cuda_ordinals(devices) {
        let comms = super::nccl::local_group(&ordinals, opts.nccl_timeout, abort.cloned())
            .into_iter()
            .map(|c| Box::new(c.with_overlap_chunks(opts.overlap_chunks)) as Box<dyn Comm>);
        let per_peer = match opts.large_group_copies {
            _ if ordinals.len() == 2 => false,
            super::LargeGroupCopies::Off => return comms.collect(),
            super::LargeGroupCopies::OneStream => false,
            super::LargeGroupCopies::PerPeer => true,
        };
        if !opts.exchange_beside {
            return comms.collect();
        }
        // All-to-alls by the copy engines, beside the compute (peer access checked at the
        // first exchange; NCCL where it is missing).
        let board = super::copy_engine::Board::new(
            ordinals.len(),
            opts.nccl_timeout,
            opts.trace_exchanges,
            per_peer,
        );
        return comms
            .map(|c| {
                Box::new(super::copy_engine::CopyEngineComm::new(c, board.clone())) as Box<dyn Comm>
            })
            .collect();
    }
    let _ = (opts, abort);
    #[cfg(all(feature = "cuda", not(feature = "nccl")))]
    if devices.len() > 1 && devices.iter().any(|d| matches!(d, DeviceId::Cuda(_))) {
        static WARN: std::sync::Once = std::sync::Once::new();
        WARN.call_once(|| {
            eprintln!(
                "warning: tensor parallelism over CUDA devices without NCCL: all-reduces are \
                 staged through host memory (slow); build with `--features nccl`"
            )
        });
    }
    ThreadComm::group(devices.len())
        .into_iter()
        .map(|c| Box::new(c.with_overlap_chunks(opts.overlap_chunks)) as Box<dyn Comm>)
        .collect()
}

/// The GPU ordinals of a group of two or more distinct `cuda:N` devices, else `None`.
#[cfg(feature = "nccl")]
fn distinct_cuda_ordinals(devices: &[DeviceId]) -> Option<Vec<usize>> {
    if devices.len() < 2 {
        return None;
    }
    let ordinals: Vec<usize> = devices
        .iter()
        .map(|d| match d {
            DeviceId::Cuda(n) => Some(*n as usize),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let mut sorted = ordinals.clone();
    sorted.sort_unstable();
    sorted.dedup();
    (sorted.len() == ordinals.len()).then_some(ordinals)
}

/// This process's communicators of part `part`'s group, which spans processes:
/// `devices` are the group's devices (rank order), `owners[r]` the process that runs rank
/// r, and `local` this process's ranks as (rank index, device as this process opens it,
/// e.g. `cuda:0`), in the order the handles are returned.
///
/// NCCL when every device is a GPU (with the `nccl` feature: the process of rank 0 makes
/// the `ncclUniqueId` and sends it over the mesh; watchdog `mesh.options().nccl_timeout`;
/// the mesh's [`AbortSignal`] stops the ranks when another process fails), else
/// host-staged over the mesh ([`TcpComm`]).
pub fn cross_process_group(
    mesh: &Arc<Mesh>,
    part: usize,
    devices: &[DeviceId],
    owners: &[usize],
    local: &[(usize, DeviceId)],
) -> Result<Vec<Box<dyn Comm>>> {
    if owners.len() != devices.len()
        || owners.iter().any(|p| *p >= mesh.world())
        || local.iter().any(|(r, _)| *r >= devices.len())
    {
        return Err(ExecError::Plan(format!(
            "part {part}: a group of {} device(s) with owners {owners:?} and local ranks {:?} \
             over {} processes is inconsistent",
            devices.len(),
            local.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            mesh.world()
        )));
    }
    #[cfg(feature = "nccl")]
    if devices.iter().all(|x| matches!(x, DeviceId::Cuda(_))) {
        let tag = format!("nccl-id/{part}");
        let me = mesh.rank();
        let id = if owners[0] == me {
            let id = super::nccl::unique_id().map_err(|m| ExecError::Device {
                device: devices[0].to_string(),
                message: m,
            })?;
            let mut sent = Vec::new();
            for &p in owners {
                if p != me && !sent.contains(&p) {
                    mesh.send(p, &tag, &id)?;
                    sent.push(p);
                }
            }
            id
        } else {
            mesh.recv(owners[0], &tag)?
        };
        let mut ranks = Vec::with_capacity(local.len());
        for (r, d) in local {
            match d {
                DeviceId::Cuda(o) => ranks.push((*r, *o as usize)),
                other => {
                    return Err(ExecError::Plan(format!(
                        "part {part}: rank {r} of an all-GPU group opens {other} in this process"
                    )))
                }
            }
        }
        return Ok(super::nccl::spanning_group(
            &id,
            devices.len(),
            &ranks,
            mesh.options().nccl_timeout,
            Some(mesh.abort_signal().clone()),
        )
        .into_iter()
        .map(|c| Box::new(c.with_overlap_chunks(mesh.options().overlap_chunks)) as Box<dyn Comm>)
        .collect());
    }
    Ok(local
        .iter()
        .map(|(r, _)| {
            Box::new(TcpComm::new(
                mesh.clone(),
                format!("p{part}"),
                *r,
                owners.to_vec(),
            )) as Box<dyn Comm>
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_groups_are_thread_groups_in_rank_order() {
        let d = |s: &str| s.parse::<DeviceId>().unwrap();
        let g = make_group(&[d("emu:2"), d("emu:0")], &CommOptions::default(), None);
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].rank(), g[1].rank(), g[1].world_size()), (0, 1, 2));
        assert!(make_group(&[], &CommOptions::default(), None).is_empty());
    }
}
