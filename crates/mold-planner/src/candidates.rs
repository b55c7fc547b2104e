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

use crate::problem::Problem;
use mold_cost::Group;

/// Candidate groups: singles first, then parallel groups by size, each size's layouts
/// tensor parallel first.
pub(crate) fn candidate_groups(p: &Problem) -> Vec<Group> {
    let devs = &p.allowed;
    let mut out: Vec<Group> = devs.iter().map(|d| Group::single(d.clone())).collect();
    for d in 2..=devs.len() {
        for (tp, sp) in p.layouts(d) {
            out.extend(devs.chunks_exact(d).map(|c| Group::new(c.to_vec(), tp, sp)));
        }
    }
    out
}
