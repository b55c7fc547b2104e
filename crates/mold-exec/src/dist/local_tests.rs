//! [`LocalDevices::resolve`]: shares per node, ordinals, and the launches it refuses.

use super::*;
use crate::dist::Launcher;
use proptest::prelude::*;

/// A machine of `sizes[n]` devices of `kind` on node n, numbered machine-wide.
fn machine(kind: &str, sizes: &[usize]) -> Machine {
    let mut y = String::from(
        "name: t\ncalibration: {source: spec-sheet}\n\
         host: {memory: 64GiB, pinned_limit: 32GiB, tflops: 1.0, mem_bandwidth_gbps: 50}\n\
         devices:\n",
    );
    let mut i = 0;
    for (node, &n) in sizes.iter().enumerate() {
        for _ in 0..n {
            y += &format!(
                "- {{id: {kind}:{i}, name: G, memory: 24GiB, budget: 23GiB, bf16_tflops: 100, \
                 mem_bandwidth_gbps: 1000, node: {node}}}\n"
            );
            i += 1;
        }
    }
    y += "links:\n  host_pinned_gbps: 25\n  host_pageable_gbps: 10\n";
    if sizes.len() > 1 {
        y += "  inter_node: {kind: infiniband, gbps: 50, latency_us: 5}\n";
    }
    Machine::from_yaml(&y, "t.yaml").unwrap()
}

fn launch(rank: usize, world: usize, local_rank: Option<usize>) -> Launch {
    Launch {
        rank,
        world,
        master: "h:1".into(),
        local_rank,
        launcher: if local_rank.is_some() {
            Launcher::Torchrun
        } else {
            Launcher::Mold
        },
    }
}

fn ids(s: &str) -> Vec<DeviceId> {
    s.split_whitespace().map(|d| d.parse().unwrap()).collect()
}

fn cuda(r: std::ops::Range<u32>) -> Vec<DeviceId> {
    r.map(DeviceId::Cuda).collect()
}

fn visible(n: usize) -> Visible {
    Visible {
        count: n,
        source: format!("CUDA_VISIBLE_DEVICES with {n} entries"),
    }
}

/// (plan device, local device) as text.
fn mapping(l: &LocalDevices) -> String {
    l.devices()
        .iter()
        .map(|(p, x)| format!("{p}>{x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn one_node_cuts_contiguous_shares_as_before() {
    let m = machine("emu", &[5]);
    let devs = ids("emu:3 emu:0 emu:2 emu:1 emu:4 emu:0");
    let l0 = LocalDevices::resolve(&devs, &m, &launch(0, 2, None), None).unwrap();
    let l1 = LocalDevices::resolve(&devs, &m, &launch(1, 2, None), None).unwrap();
    assert_eq!(l0.ownership(), l1.ownership());
    assert_eq!(l0.ownership().share(0), ids("emu:0 emu:1 emu:2").as_slice());
    assert_eq!(mapping(&l1), "emu:3>emu:3 emu:4>emu:4");
    assert_eq!(l1.ownership().owner(&"emu:3".parse().unwrap()), Some(1));
    assert_eq!((l1.node(), l1.local_rank()), (0, (1, 2)));
    assert_eq!(l0.local_id(&"emu:4".parse().unwrap()), None);
}

#[test]
fn one_process_per_node_opens_the_node_from_its_first_gpu() {
    let m = machine("cuda", &[8, 8]);
    let l = LocalDevices::resolve(&cuda(0..16), &m, &launch(1, 2, None), None).unwrap();
    assert_eq!(l.node(), 1);
    assert_eq!(l.ordinals(), Ordinals::Node);
    assert_eq!(
        mapping(&l),
        "cuda:8>cuda:0 cuda:9>cuda:1 cuda:10>cuda:2 cuda:11>cuda:3 cuda:12>cuda:4 \
         cuda:13>cuda:5 cuda:14>cuda:6 cuda:15>cuda:7"
    );
    // Uneven nodes: 4 GPUs of node 0 and 8 of node 1 are not cut 6 + 6 across the nodes.
    let devs: Vec<DeviceId> = cuda(4..8).into_iter().chain(cuda(8..16)).collect();
    let l0 = LocalDevices::resolve(&devs, &m, &launch(0, 2, None), None).unwrap();
    assert_eq!(
        mapping(&l0),
        "cuda:4>cuda:4 cuda:5>cuda:5 cuda:6>cuda:6 cuda:7>cuda:7"
    );
    assert_eq!(l0.ownership().share(1), cuda(8..16).as_slice());
}

#[test]
fn several_processes_per_node_take_their_local_ranks_gpus() {
    let m = machine("cuda", &[8, 8]);
    // torchrun --nnodes 2 --nproc-per-node 2: process 3 is local rank 1 of node 1.
    let l = LocalDevices::resolve(&cuda(0..16), &m, &launch(3, 4, Some(1)), None).unwrap();
    assert_eq!((l.node(), l.local_rank()), (1, (1, 2)));
    assert_eq!(
        mapping(&l),
        "cuda:12>cuda:4 cuda:13>cuda:5 cuda:14>cuda:6 cuda:15>cuda:7"
    );
    // Seeing its whole node (8 GPUs) changes nothing; seeing exactly its own 4 GPUs
    // (Slurm's --gpus-per-task) numbers them from 0.
    let all = LocalDevices::resolve(&cuda(0..16), &m, &launch(3, 4, Some(1)), Some(&visible(8)));
    assert_eq!(all.unwrap(), l);
    let own =
        LocalDevices::resolve(&cuda(0..16), &m, &launch(3, 4, Some(1)), Some(&visible(4))).unwrap();
    assert_eq!(own.ordinals(), Ordinals::Share);
    assert_eq!(
        mapping(&own),
        "cuda:12>cuda:0 cuda:13>cuda:1 cuda:14>cuda:2 cuda:15>cuda:3"
    );
}

#[test]
fn inconsistent_launches_are_refused_in_one_line() {
    let m = machine("cuda", &[8, 8]);
    let err = |devs: &[DeviceId], l: Launch, v: Option<Visible>| {
        let e = LocalDevices::resolve(devs, &m, &l, v.as_ref())
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n'), "{e}");
        e
    };
    let all = cuda(0..16);
    let e = err(&all, launch(0, 3, None), None);
    assert!(
        e.contains("MOLD_WORLD_SIZE=3") && e.contains("cannot own devices of two nodes"),
        "{e}"
    );
    assert!(e.contains("node 1: cuda:8, cuda:9"), "{e}");
    let e = err(&all, launch(1, 2, Some(1)), None);
    assert!(
        e.contains("LOCAL_RANK=1, but process 1 of 2 is process 0 of its node"),
        "{e}"
    );
    let e = err(&all, launch(1, 2, None), Some(visible(3)));
    assert!(
        e.contains("cuda:11 opens as cuda:3") && e.contains("shows it 3 GPU(s)"),
        "{e}"
    );
    let e = err(&cuda(0..4), launch(0, 8, None), None);
    assert!(e.contains("start at most one process per device"), "{e}");
    let two = [DeviceId::Cuda(0), DeviceId::Cuda(9)];
    let e = err(&two, launch(0, 4, None), None);
    assert!(e.contains("on node 0 (cuda:0)"), "{e}");
}

proptest! {
    /// Every plan device has one owner; every process owns one node's devices, a
    /// contiguous run of them, opened under distinct ids that its node has.
    #[test]
    fn shares_stay_inside_nodes(
        sizes in prop::collection::vec(1usize..6, 1..4),
        pick in prop::collection::vec(any::<bool>(), 24),
        per in 1usize..4,
        local_known in any::<bool>(),
    ) {
        let m = machine("cuda", &sizes);
        let total: usize = sizes.iter().sum();
        let mut devs: Vec<DeviceId> =
            (0..total).filter(|i| pick[*i]).map(|i| DeviceId::Cuda(i as u32)).collect();
        if devs.is_empty() {
            devs.push(DeviceId::Cuda(0));
        }
        let nodes: std::collections::BTreeSet<u32> = devs.iter().map(|d| m.node_of(d)).collect();
        let world = per * nodes.len();
        let results: Vec<Result<LocalDevices>> = (0..world)
            .map(|p| {
                let lr = local_known.then_some(p % per);
                LocalDevices::resolve(&devs, &m, &launch(p, world, lr), None)
            })
            .collect();
        let fits = nodes.iter().all(|n| devs.iter().filter(|d| m.node_of(d) == *n).count() >= per);
        prop_assert_eq!(results.iter().all(|r| r.is_ok()), fits);
        if !fits {
            return Ok(());
        }
        let ls: Vec<LocalDevices> = results.into_iter().map(|r| r.unwrap()).collect();
        for d in &devs {
            let owners: Vec<usize> = (0..world)
                .filter(|p| ls[*p].local_id(d).is_some())
                .collect();
            prop_assert_eq!(owners.len(), 1);
            prop_assert_eq!(ls[0].ownership().owner(d), Some(owners[0]));
        }
        for (p, l) in ls.iter().enumerate() {
            prop_assert_eq!(l.ownership(), ls[0].ownership());
            let share = l.ownership().share(p);
            prop_assert!(!share.is_empty());
            prop_assert!(share.iter().all(|d| m.node_of(d) == l.node()));
            let on_node: Vec<&DeviceId> =
                devs.iter().filter(|d| m.node_of(d) == l.node()).collect();
            let at = on_node.iter().position(|d| **d == share[0]).unwrap();
            prop_assert!(share.iter().zip(&on_node[at..]).all(|(a, b)| a == *b));
            let local: std::collections::BTreeSet<DeviceId> =
                l.devices().iter().map(|(_, x)| x.clone()).collect();
            prop_assert_eq!(local.len(), share.len());
            let node_size = sizes[l.node() as usize] as u32;
            prop_assert!(local.iter().all(|x| x.ordinal().unwrap() < node_size));
        }
    }
}
