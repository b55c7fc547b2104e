//! The device groups the integer program may give blocks to.
//!
//! Every allowed device alone, and parallel groups that are aligned runs of consecutive
//! allowed devices ([0,1], [2,3], … for size 2; [0..4], [4..8] for 4) of each permitted
//! size, once per permitted layout (`tp × sp`: tensor parallel, sequence parallel or
//! both, `problem::layouts`). The restriction is deliberate: every subset of each degree
//! would make the program grow as C(n, d) groups (70 of degree 4 on eight GPUs, each
//! with its own variables), while aligned runs give n + n/2 + n/4 + …; and machine
//! profiles list devices in topology order (NVLink pairs, PCIe switches), so the aligned
//! runs are the groups a person would form. `--devices` picks which devices the runs are
//! cut from. The exhaustive enumerator (`brute.rs`) checks the program against every
//! subset as well.
//!
//! On a machine of several nodes the runs are cut from each node's devices first (a
//! node of 8 gives [0..4], [4..8] whatever the node before it holds), then from all
//! the allowed devices, so groups that cross nodes are candidates too: the cost model
//! prices their collectives over the network between nodes, and the program takes them
//! only where that is faster. On one node both cuts are the same.

use crate::problem::Problem;
use mold_cost::Group;

/// Candidate groups: singles first, then parallel groups by size, each size's layouts
/// tensor parallel first; within a layout, each node's runs, then the runs across nodes.
pub(crate) fn candidate_groups(p: &Problem) -> Vec<Group> {
    let devs = &p.allowed;
    let machine = &p.req.machine;
    let mut nodes: Vec<Vec<mold_plan::DeviceId>> = Vec::new();
    for d in devs {
        let n = machine.node_of(d);
        match nodes.iter_mut().find(|g| machine.node_of(&g[0]) == n) {
            Some(g) => g.push(d.clone()),
            None => nodes.push(vec![d.clone()]),
        }
    }
    let mut out: Vec<Group> = devs.iter().map(|d| Group::single(d.clone())).collect();
    for d in 2..=devs.len() {
        for (tp, sp) in p.layouts(d) {
            let runs = nodes
                .iter()
                .flat_map(|n| n.chunks_exact(d))
                .chain(devs.chunks_exact(d));
            for c in runs {
                let g = Group::new(c.to_vec(), tp, sp);
                if !out.contains(&g) {
                    out.push(g);
                }
            }
        }
    }
    out
}
